"""Write a quantized model as a self-describing safetensors folder, atomically."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from quantkit.checkpoint.config import FORMAT_VERSION, QUANT_METHOD, layout_of
from quantkit.checkpoint.smoothing import outlier_markdown, outlier_rows
from quantkit.errors import QuantkitError
from quantkit.nn.factory import quantized_modules
from quantkit.quant.packing import LAYOUT_VERSIONS

SMOOTHING_HEADER = (
    "Activation outlier ratio (largest / median per-channel abs-max of each smoothing group's input, over all\n"
    "calibration tokens) before and after smoothing, and the migration strength alpha used.\n\n"
)

SHARD_BYTES = 4 << 30
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def versions() -> dict[str, str]:
    import transformers

    from quantkit import __version__

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


def _write_shards(tensors: dict[str, torch.Tensor], folder: Path, shard_bytes: int) -> None:
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
        save_file(shards[0], str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / INDEX_NAME).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )


def save_quantized(
    model: nn.Module,
    out_dir: str | os.PathLike,
    tokenizer=None,
    overwrite: bool = False,
    shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Write safetensors, config.json (with ``quantization_config``), tokenizer, recipe and per-layer report.

    The folder appears atomically: everything is written next to it and renamed into place; an existing folder
    is refused unless ``overwrite``.
    """
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and not overwrite:
        raise QuantkitError(f"output directory {out} already exists (use --overwrite to replace it)")
    qc = quantization_config(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        config = model.config.to_dict()
        config["quantization_config"] = qc
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        _write_shards(_tensors_to_save(model), tmp, shard_bytes)
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
        (tmp / "quant_report.json").write_text(json.dumps(report, indent=1) + "\n")
        smoothing = outlier_rows(result.layers)
        if smoothing:  # what smoothing did to the activation outliers, readable without tools
            (tmp / "smoothing.md").write_text(SMOOTHING_HEADER + outlier_markdown(smoothing))
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
