"""Load a quantkit checkpoint, checking that it is one and that every tensor arrived."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from quantkit.checkpoint.compressed import load_compressed_tensors
from quantkit.checkpoint.hf import register
from quantkit.checkpoint.read import (
    SAFETENSORS_DTYPES,
    check_quantized_tensors,
    check_shapes,
    check_stored_shapes,
    read_quantization_config,
    read_tensors,
    tensor_headers,
)
from quantkit.errors import QuantkitError, one_line
from quantkit.models.loading import load_model, loading, read_config
from quantkit.nn.factory import quantized_modules

__all__ = [  # the readers lived here before checkpoint/read.py; their old import path keeps working
    "SAFETENSORS_DTYPES",
    "check_quantized_tensors",
    "check_shapes",
    "check_stored_shapes",
    "load_any",
    "load_quantized",
    "read_quantization_config",
    "read_tensors",
]


def load_quantized(path: str | os.PathLike, dtype: torch.dtype | None = None, device: str = "cpu"):
    """The quantized model in ``path`` (an ``AutoModelForCausalLM`` with quantized linears), in eval mode.

    ``dtype`` applies to the float parts (embeddings, norms, biases); default: the dtype it was saved in.
    """
    from transformers import AutoModelForCausalLM

    register()
    if not isinstance(path, str | os.PathLike):
        raise QuantkitError(f"load_quantized needs a checkpoint folder's path, got {type(path).__name__}")
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
        raise QuantkitError(f"cannot load {folder}: {type(exc).__name__}: {one_line(exc)}") from None
    missing = sorted(info.get("missing_keys", []))
    if missing or info.get("mismatched_keys"):
        what = missing or [str(m) for m in info["mismatched_keys"]]
        raise QuantkitError(f"corrupt checkpoint {folder}: {len(what)} tensors missing or mismatched, e.g. {what[0]}")
    found = quantized_modules(model)
    absent = sorted(set(qc["modules"]) - set(found))
    if absent:
        raise QuantkitError(f"checkpoint {folder}: quantized module {absent[0]} was not restored")
    if not getattr(getattr(model, "hf_quantizer", None), "checked_tensors", False) and not any(
        b.is_meta for b in model.buffers()
    ):  # the hook checks them after loading; this covers a transformers that does not call it that way
        stored = {name: dtype for name, (_, dtype) in tensor_headers(folder).items()}
        check_quantized_tensors(folder, model, stored)
    model.eval()
    return model


def load_any(spec: str | os.PathLike, dtype: torch.dtype, device: str):
    """(model, tokenizer) for a quantkit or compressed-tensors checkpoint, or a float model spec (what
    :func:`quantkit.load_model` takes): what ``quantkit eval`` compares."""
    from transformers import AutoTokenizer

    path = Path(spec).expanduser()
    qc = read_config(path).get("quantization_config") if (path / "config.json").is_file() else None
    if qc is None:
        model, tokenizer, _ = load_model(spec, dtype=dtype, device=device)
        return model, tokenizer
    if isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors":  # e.g. quantkit export's output
        model = load_compressed_tensors(path, dtype, device)
    else:
        model = load_quantized(path, dtype=dtype, device=device)
    with loading(f"the tokenizer of {path}"):
        return model, AutoTokenizer.from_pretrained(path)
