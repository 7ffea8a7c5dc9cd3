"""The ``quantization_config`` a quantkit checkpoint carries in its config.json.

{
  "quant_method": "quantkit",
  "format_version": 1,
  "schemes": {"w4a16-g128-sym": {"bits": 4, "group_size": 128, "sym": true, ...}},
  "modules": {"model.layers.0.self_attn.q_proj": "w4a16-g128-sym", ...},   # scheme of each quantized linear
  "layouts": {"gptq_v2": 1},            # layout name -> version, for every layout present
  "module_layouts": {"w4a16-g128-sym": "gptq_v2"},
  "split_experts": false,               # MoE experts stored as one linear per expert projection
  "recipe": {...}, "calibration": {...}, # what produced it (methods, parameters, calibration fingerprint)
  "versions": {"quantkit": "...", "torch": "...", "transformers": "..."}
}
"""

from __future__ import annotations

from quantkit.errors import QuantkitError
from quantkit.quant.packing import LAYOUT_VERSIONS, Layout
from quantkit.quant.scheme import QuantScheme

QUANT_METHOD = "quantkit"
FORMAT_VERSION = 1


def layout_of(scheme: QuantScheme) -> Layout:
    if scheme.progressive:
        return Layout.PROGRESSIVE_W4A8
    if scheme.packed:  # W*A16 and W4A8: the activations' format is in the scheme, not the layout
        return Layout.GPTQ_V2
    if scheme.block_size is not None:
        return Layout.FP8_BLOCK
    return Layout.FP8_ROWMAJOR if scheme.fmt == "fp8" else Layout.INT8_ROWMAJOR


def module_schemes(qc: dict) -> dict[str, QuantScheme]:
    """Parse and check the per-module schemes of a quantization_config dict."""
    if qc.get("quant_method") != QUANT_METHOD:
        raise QuantkitError(f"not a quantkit checkpoint (quant_method={qc.get('quant_method')!r})")
    version = qc.get("format_version")
    if version != FORMAT_VERSION:
        raise QuantkitError(
            f"quantkit checkpoint format {version} is not supported (this quantkit reads {FORMAT_VERSION})"
        )
    try:
        schemes = {name: QuantScheme.from_dict(d, f"scheme {name}") for name, d in qc["schemes"].items()}
        for name, layout in qc["module_layouts"].items():
            expected = layout_of(schemes[name])
            if layout != expected.value or qc["layouts"].get(layout) != LAYOUT_VERSIONS[expected]:
                raise QuantkitError(f"checkpoint layout {layout} v{qc['layouts'].get(layout)} is not readable here")
        return {module: schemes[s] for module, s in qc["modules"].items()}
    except (KeyError, TypeError, AttributeError) as exc:
        raise QuantkitError(f"malformed quantkit quantization_config (missing or bad {exc})") from None
