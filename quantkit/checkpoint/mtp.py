"""Multi-token-prediction (MTP) layers, which transformers does not build: carried over from the source checkpoint.

DeepSeek-V3 stores its MTP module after the last decoder layer, as ``model.layers.{num_hidden_layers + i}.*`` (one
per ``num_nextn_predict_layers``): the norms ``enorm`` and ``hnorm``, the projection ``eh_proj`` [H, 2H], a whole
decoder layer (attention, experts) and a ``shared_head`` (norm and output head). transformers' DeepseekV3ForCausalLM
has no module for it and drops those tensors on load, so a quantized model would lose them; quantkit reads them
from the source folder instead (detected by name: a ``model.layers.{i}`` with i >= num_hidden_layers) and writes
them into the checkpoint, and from there into every export, as the recipe's ``mtp`` says:

- ``keep`` (default): every MTP tensor copied bit for bit;
- ``quantize``: each 2-D float ``*_proj.weight`` of the MTP layers round-to-nearest with the recipe's scheme, stored
  in quantkit's layouts (the other tensors copied as they are).

``quantization_config.mtp`` records ``layers``, ``mode``, ``tensors`` (how many) and, quantized, ``modules`` (name ->
scheme name, the scheme under ``schemes``). A quantized checkpoint's loader leaves them where they are, unused.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from quantkit.algorithms.rtn import rtn
from quantkit.checkpoint.read import StoredTensors, tensor_headers
from quantkit.errors import QuantkitError
from quantkit.nn.factory import make_quantized_linear
from quantkit.quant.scheme import QuantScheme

MTP_MODES = ("keep", "quantize")
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def mtp_layers(config: dict, names) -> list[str]:
    """The prefixes ``model.layers.{i}`` of ``names`` past the config's ``num_hidden_layers``, in order."""
    n = config.get("num_hidden_layers")
    if isinstance(n, bool) or not isinstance(n, int):
        return []
    found = {int(m[1]) for m in map(LAYER.match, names) if m and int(m[1]) >= n}
    return [f"model.layers.{i}" for i in sorted(found)]


def split_mtp(config: dict, tensors: dict[str, torch.Tensor]) -> tuple[list[str], dict[str, torch.Tensor]]:
    """(MTP layer prefixes, their tensors), the latter taken out of ``tensors``."""
    layers = mtp_layers(config, tensors)
    heads = tuple(p + "." for p in layers)
    return layers, {k: tensors.pop(k) for k in [k for k in tensors if k.startswith(heads)]}


def source_mtp(folder: str | Path | None) -> tuple[list[str], dict[str, torch.Tensor]]:
    """The MTP layers of the float checkpoint in ``folder`` and their tensors (read one by one); none when ``folder``
    is not a checkpoint folder."""
    import json

    if folder is None or not Path(folder).is_dir() or not any(Path(folder).glob("*.safetensors")):
        return [], {}
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return [], {}
    layers = mtp_layers(config, tensor_headers(folder))
    if not layers:
        return [], {}
    stored = StoredTensors(folder)
    heads = tuple(p + "." for p in layers)
    return layers, {k: stored[k] for k in stored if k.startswith(heads)}


def quantize_mtp(tensors: dict[str, torch.Tensor], scheme: QuantScheme) -> dict[str, str]:
    """In place: every 2-D float ``*_proj.weight`` of ``tensors`` replaced by the buffers of its quantized module
    (round-to-nearest with ``scheme``); returns {module name: scheme name}."""
    from quantkit.nn.w8a8 import W8A8Linear

    if not scheme.weight_only and not scheme.act_dynamic:
        raise QuantkitError("MTP layers cannot take static activation scales (no calibration reaches them): "
                            "keep them (recipe mtp: keep) or use dynamic activations")  # fmt: skip
    modules = {}
    for key in sorted(k for k in tensors if k.endswith("_proj.weight")):
        w = tensors[key]
        if w.dim() != 2 or not w.is_floating_point() or w.element_size() < 2:
            continue  # 3-D fused experts and already quantized (fp8) weights stay as they are
        name = key.removesuffix(".weight")
        bias = tensors.pop(f"{name}.bias", None)
        if scheme.packed:
            module = make_quantized_linear(rtn(w, scheme), bias, w.dtype)
        else:
            linear = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, dtype=w.dtype)
            with torch.no_grad():
                linear.weight.copy_(w)
                if bias is not None:
                    linear.bias.copy_(bias)
            module = W8A8Linear.from_float(linear, scheme)
        del tensors[key]
        tensors.update({f"{name}.{k}": v.contiguous() for k, v in module.state_dict().items()})
        modules[name] = scheme.name
    return modules


def mtp_config(layers: list[str], mode: str, tensors: dict, modules: dict[str, str] | None = None) -> dict:
    """The ``quantization_config.mtp`` entry."""
    out = {"layers": layers, "mode": mode, "tensors": len(tensors)}
    if modules:
        out["modules"] = modules
    return out


def mtp_schemes(qc: dict) -> dict[str, QuantScheme]:
    """{MTP module name: its scheme} of a quantkit checkpoint whose MTP layers were quantized, else {}."""
    mtp = qc.get("mtp") or {}
    schemes = qc.get("schemes") or {}
    try:
        return {
            name: QuantScheme.from_dict(schemes[s], f"scheme {s}") for name, s in (mtp.get("modules") or {}).items()
        }
    except (KeyError, TypeError, AttributeError) as exc:
        raise QuantkitError(f"malformed quantization_config.mtp (missing or bad {exc})") from None
