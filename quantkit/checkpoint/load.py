"""Load a quantkit checkpoint, checking that it is one and that every tensor arrived."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from quantkit.checkpoint.config import module_schemes
from quantkit.errors import QuantkitError


def read_quantization_config(folder: Path) -> dict:
    from quantkit.models.loading import read_config

    if not (folder / "config.json").is_file():
        raise QuantkitError(f"{folder} is not a checkpoint folder (no config.json)")
    qc = read_config(folder).get("quantization_config")
    if not isinstance(qc, dict):
        raise QuantkitError(f"{folder} is not quantized (config.json has no quantization_config)")
    module_schemes(qc)  # validates
    return qc


def load_quantized(path: str | os.PathLike, dtype: torch.dtype | None = None, device: str = "cpu"):
    """The quantized model in ``path`` (an ``AutoModelForCausalLM`` with quantized linears), in eval mode.

    ``dtype`` applies to the float parts (embeddings, norms, biases); default: the dtype it was saved in.
    """
    from transformers import AutoModelForCausalLM

    from quantkit.checkpoint.hf import register
    from quantkit.nn.factory import quantized_modules

    register()
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise QuantkitError(f"checkpoint not found: {folder}")
    qc = read_quantization_config(folder)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype or "auto", device_map=device, output_loading_info=True
        )
    except QuantkitError:
        raise
    except Exception as exc:  # safetensors / json / shape errors from a damaged folder
        raise QuantkitError(f"cannot load {folder}: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    missing = sorted(info.get("missing_keys", []))
    if missing or info.get("mismatched_keys"):
        what = missing or [str(m) for m in info["mismatched_keys"]]
        raise QuantkitError(f"corrupt checkpoint {folder}: {len(what)} tensors missing or mismatched, e.g. {what[0]}")
    found = quantized_modules(model)
    absent = sorted(set(qc["modules"]) - set(found))
    if absent:
        raise QuantkitError(f"checkpoint {folder}: quantized module {absent[0]} was not restored")
    model.eval()
    return model
