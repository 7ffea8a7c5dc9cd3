"""Load a compressed-tensors checkpoint (vLLM's format; e.g. the output of ``quantkit export``) for evaluation,
through transformers and the compressed-tensors package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from quantkit.errors import QuantkitError, UnsupportedCheckpointError
from quantkit.models.experts import PER_EXPERT
from quantkit.models.loading import loading, read_config


def load_compressed_tensors(path: Path, dtype: torch.dtype, device: str):
    """The model in the compressed-tensors checkpoint ``path``, in eval mode.

    Raises :class:`UnsupportedCheckpointError` where the installed reader cannot load a well-formed checkpoint:
    transformers 5.25 with compressed-tensors 0.20.1 allocates packed zero points (asymmetric pack-quantized
    layers) unpacked, so their stored shapes mismatch; ``quantkit import`` reads them instead."""
    from transformers import AutoModelForCausalLM

    if importlib.util.find_spec("compressed_tensors") is None:
        raise QuantkitError(f"{path} is a compressed-tensors checkpoint: pip install compressed-tensors to read it")
    with loading(str(path)):  # mismatched shapes are listed in info, not raised, so that they can be told apart
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, device_map=device, output_loading_info=True, ignore_mismatched_sizes=True
        )
    mismatched = [str(m) for m in info.get("mismatched_keys", [])]
    if mismatched and packed_zero_points(path):
        import compressed_tensors
        import transformers

        raise UnsupportedCheckpointError(
            f"cannot load {path}: transformers {transformers.__version__} with compressed-tensors "
            f"{compressed_tensors.__version__} cannot load pack-quantized layers with zero points (asymmetric); "
            f"evaluate the output of 'quantkit import {path} --out DIR' instead"
        )
    if any(PER_EXPERT.search(k) for k in info.get("unexpected_keys", [])):
        import transformers

        raise UnsupportedCheckpointError(
            f"cannot load {path}: transformers {transformers.__version__} holds this model's experts fused and "
            "does not read its per-expert quantized layers; evaluate the output of "
            f"'quantkit import {path} --out DIR' instead"
        )
    bad = sorted(info.get("missing_keys", [])) + mismatched
    if bad:
        raise QuantkitError(f"cannot load {path}: {len(bad)} tensors missing or mismatched, e.g. {bad[0]}")
    return model.eval()


def packed_zero_points(path: Path) -> bool:
    """Whether a compressed-tensors config declares pack-quantized weights with zero points."""
    qc = read_config(path).get("quantization_config") or {}
    groups = qc.get("config_groups") if isinstance(qc, dict) else None
    if not isinstance(groups, dict):
        return False
    return any(
        isinstance(g, dict)
        and (g.get("format") or qc.get("format")) == "pack-quantized"
        and isinstance(g.get("weights"), dict)
        and g["weights"].get("symmetric") is False
        for g in groups.values()
    )
