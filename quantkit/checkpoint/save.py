"""Write a quantized model as a self-describing safetensors folder, atomically."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn

from quantkit import checks
from quantkit._version import __version__
from quantkit.checkpoint.config import FORMAT_VERSION, QUANT_METHOD, layout_of
from quantkit.checkpoint.smoothing import outlier_markdown, outlier_rows
from quantkit.checks import flag, integer
from quantkit.errors import GateFailedError, QuantkitError
from quantkit.nn.factory import quantized_modules
from quantkit.quant.packing import LAYOUT_VERSIONS

SMOOTHING_HEADER = (
    "Activation outlier ratio (largest / median per-channel abs-max of each smoothing group's input, over all\n"
    "calibration tokens) before and after smoothing, and the migration strength alpha used.\n\n"
)

SHARD_BYTES = 4 << 30
EXPORT_FORMATS = ("compressed-tensors", "gptq", "awq", "fp8")  # quant_method of the formats checkpoint/export.py writes
EXPORT_MARK = "quantkit_export"  # config.json key of a folder quantkit exported (what --overwrite may replace)
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def versions() -> dict[str, str]:
    import transformers

    return {"quantkit": __version__, "torch": torch.__version__, "transformers": transformers.__version__}


def quantization_config(model: nn.Module) -> dict:
    result = getattr(model, "quantkit", None)
    modules = quantized_modules(model)
    if result is None or not modules:
        raise QuantkitError("the model has not been quantized by quantkit (run quantkit.quantize first)")
    schemes = {m.scheme.name: m.scheme for m in modules.values()}
    layouts = {name: layout_of(s) for name, s in schemes.items()}
    from quantkit.models.arch import arch_for
    from quantkit.models.experts import LinearExperts

    return {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "schemes": {name: s.to_dict() for name, s in schemes.items()},
        "module_layouts": {name: lay.value for name, lay in layouts.items()},
        "layouts": {lay.value: LAYOUT_VERSIONS[lay] for lay in set(layouts.values())},
        "modules": {name: m.scheme.name for name, m in modules.items()},
        "split_experts": any(isinstance(m, LinearExperts) for m in model.modules()),
        "architecture": arch_for(model).name,
        "recipe": result.recipe.to_dict(),
        "calibration": result.calibration,
        "source_model": result.source_model,
        "versions": versions(),
        "determinism": determinism(result.device),
    }


def determinism(device: str) -> dict:
    """What can make a run on ``device`` give other numbers than another run of the same inputs: the device and its
    GPU, the CUDA build, TF32 matmuls and torch's deterministic-algorithms switch (a CPU run is reproducible bit for
    bit on the same machine and versions)."""
    on_gpu = device.startswith("cuda") and torch.cuda.is_available()
    return {
        "device": device,
        "gpu": torch.cuda.get_device_name(torch.device(device)) if on_gpu else None,
        "cuda": torch.version.cuda if on_gpu else None,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32 if on_gpu else None,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32 if on_gpu else None,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }


def _tensors_to_save(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict without tied copies (HF re-ties them on load) and with no two names sharing storage."""
    state = model.state_dict()
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    for target in tied:
        state.pop(target, None)
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        t = t.detach().to("cpu")
        out[name] = t.clone().contiguous() if key in seen else t.contiguous()
        seen.add(key)
    return out


def os_error(exc: BaseException) -> OSError | None:
    """``exc`` as the OSError it is: itself, or one that a Rust library (safetensors, tokenizers) raised as a plain
    exception whose message ends in "(os error 28)"; None for anything else."""
    if isinstance(exc, OSError):
        return exc
    code = re.search(r"\(os error (\d+)\)", str(exc)) if isinstance(exc, Exception) else None
    return OSError(int(code.group(1)), os.strerror(int(code.group(1)))) if code else None


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' ``save_file``, whose write errors (a full disk) are OSErrors here, as every other write error
    is, so that callers clean up and name them in one line."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as exc:
        raise os_error(exc) or OSError(str(exc)) from None


SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def stream_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write CPU ``tensors`` as a safetensors file straight from their memory, one write per tensor.

    safetensors' ``save_file`` first copies every tensor into one bytes object while it holds the GIL; a writer on a
    background thread (the resume state's) would stall the thread that drives the GPU for as long as that copy
    takes. Here each tensor's bytes go to the file as a view, and the GIL is free while the kernel writes them.
    """
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))


def write_shards(tensors: dict[str, torch.Tensor], folder: Path, shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        write_safetensors(shards[0], folder / WEIGHTS_NAME, metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(shard, folder / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / INDEX_NAME).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )


def _is_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` holds a quantkit checkpoint or one that quantkit exported (never another tool's)."""
    from quantkit.models.loading import read_config

    try:
        config = read_config(folder)
    except QuantkitError:
        return False
    qc = config.get("quantization_config")
    return isinstance(qc, dict) and (qc.get("quant_method") == QUANT_METHOD or EXPORT_MARK in config)


def check_output(out_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """The resolved output folder, once it is known that a checkpoint can be written there: an existing path is
    refused unless ``overwrite`` and it is an empty folder or a quantkit checkpoint (never the working directory
    or one above it); the nearest existing ancestor must be a writable folder. Creates nothing, so that bad
    output paths fail before any quantization work."""
    if not isinstance(out_dir, str | os.PathLike):
        raise QuantkitError(f"the output must be a folder's path, got {type(out_dir).__name__}")
    flag("overwrite", overwrite)  # "no" would read as true and replace a folder
    out = Path(out_dir).expanduser().resolve()
    if out.exists():
        if not out.is_dir():
            raise QuantkitError(f"output path {out} exists and is not a folder")
        if not overwrite:
            raise QuantkitError(f"output directory {out} already exists (use --overwrite to replace it)")
        if Path.cwd().resolve().is_relative_to(out):
            raise QuantkitError(f"refusing to replace {out}: it is the working directory or one above it")
        if any(out.iterdir()) and not _is_checkpoint(out):
            raise QuantkitError(f"refusing to replace {out}: not a quantkit checkpoint (remove it first)")
    ancestor = out.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise QuantkitError(f"cannot write {out}: {ancestor} is not a writable folder")
    return out


def check_apart(out: Path, source: str | os.PathLike) -> None:
    """Refuse an output folder that is the folder being read, lies inside it or holds it: replacing it would
    destroy the input, and writing into it would change what a later run reads."""
    src = Path(source).expanduser().resolve()
    if out == src or out.is_relative_to(src) or src.is_relative_to(out):
        raise QuantkitError(f"the output {out} must lie outside {src}, the folder being read, and not hold it")


def _missing_parents(folder: Path) -> list[Path]:
    """The ancestors of ``folder`` that do not exist yet, innermost first."""
    missing = []
    parent = folder.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    return missing


def _readable(folder: Path) -> None:
    """Give the folder and its files the modes the umask allows (``mkdtemp`` makes the folder private)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        f.chmod((0o777 if f.is_dir() else 0o666) & ~umask)


@contextlib.contextmanager
def atomic_folder(out: Path) -> Iterator[Path]:
    """A temporary folder next to ``out`` to write into; renamed into place when the block ends without error
    (replacing what ``check_output`` allowed to be replaced), removed with the parent folders it created
    otherwise. An OSError becomes a one-line QuantkitError."""
    created = _missing_parents(out)
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        yield tmp
        _readable(tmp)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for parent in created:  # innermost first; only the ones this call made, and only if still empty
            if parent.is_dir() and not any(parent.iterdir()):
                parent.rmdir()
        error = os_error(exc)  # the tokenizer's writer raises a full disk as a plain Exception
        if error is not None:
            raise QuantkitError(f"cannot write checkpoint {out}: {error.strerror or error}") from exc
        raise


def _mtp_tensors(model: nn.Module, qc: dict) -> dict[str, torch.Tensor]:
    """The source checkpoint's MTP layers (``checkpoint/mtp.py``), kept or quantized as the recipe says; ``qc``
    gains their ``mtp`` entry (and the scheme of quantized ones). The source is the folder the caller recorded
    (``QuantizeResult.source_model``), else the one transformers loaded the model from."""
    from quantkit.checkpoint.mtp import mtp_config, quantize_mtp, source_mtp

    result = model.quantkit
    layers, tensors = source_mtp(result.source_model or getattr(model.config, "_name_or_path", None))
    if not layers:
        return {}
    mode = result.recipe.mtp
    modules = None
    if mode == "quantize":
        scheme = next(s.scheme for s in reversed(result.recipe.stages) if s.scheme is not None)
        modules = quantize_mtp(tensors, scheme)
        qc["schemes"].setdefault(scheme.name, scheme.to_dict())
        qc["module_layouts"].setdefault(scheme.name, layout_of(scheme).value)
        qc["layouts"].setdefault(layout_of(scheme).value, LAYOUT_VERSIONS[layout_of(scheme)])
    qc["mtp"] = mtp_config(layers, mode, tensors, modules)
    return tensors


def save_quantized(
    model: nn.Module,
    out_dir: str | os.PathLike,
    tokenizer=None,
    overwrite: bool = False,
    shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Write safetensors, config.json (with ``quantization_config``), tokenizer, recipe and per-layer report.

    The folder appears atomically: everything is written next to it and renamed into place; an existing path is
    refused unless ``overwrite`` and it is an empty folder or a quantkit checkpoint (``check_output``). A failure
    leaves nothing behind, the parent folders it created included. A model that missed its recipe's quality gate is
    written to ``OUT.rejected`` instead (replacing an earlier one), and :class:`GateFailedError` names the figures.
    """
    if not isinstance(model, nn.Module):
        raise QuantkitError(f"save_quantized needs the quantized torch.nn.Module, got {type(model).__name__}")
    integer("shard_bytes", shard_bytes, low=1)
    checks.tokenizer(tokenizer, needs="save_pretrained")
    out = check_output(out_dir, overwrite)
    qc = quantization_config(model)
    tensors = _tensors_to_save(model)
    mtp = _mtp_tensors(model, qc)
    tensors.update(mtp)
    gate = model.quantkit.gate
    rejected = gate is not None and not gate["passed"]
    if rejected:  # never at the destination, where a pipeline would ship it
        out = check_output(out.with_name(out.name + ".rejected"), overwrite=True)
    with atomic_folder(out) as tmp:
        config = model.config.to_dict()
        config["quantization_config"] = qc
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        write_shards(tensors, tmp, shard_bytes)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        result = model.quantkit
        (tmp / "recipe.yaml").write_text(result.recipe.to_yaml())
        report = {
            "seconds": result.seconds,
            "device": result.device,
            "peak_device_bytes": result.peak_device_bytes,
            "layers": result.layers,
        }
        if result.gate is not None:
            report["gate"] = result.gate
        (tmp / "quant_report.json").write_text(json.dumps(report, indent=1) + "\n")
        smoothing = outlier_rows(result.layers)
        if smoothing:  # what smoothing did to the activation outliers, readable without tools
            (tmp / "smoothing.md").write_text(SMOOTHING_HEADER + outlier_markdown(smoothing))
    if result.state is not None:  # the run is complete and written: nothing to resume
        result.state.clear()
    if rejected:
        raise GateFailedError(f"quality gate failed ({'; '.join(gate['failures'])}): the checkpoint is at {out}")
    return out
