"""Kernels on plain (unquantized) tensors for the runtime: the one-row float GEMV of batch-1 decode (``gemv``) and
the fused per-layer operations (``norm_rope``: residual add + RMSNorm, rotary embedding, KV store, SiLU gate;
``norm_quant``: the norm and the SiLU gate fused with W4A8's per-token int8 quantizer)."""

# the GEMV itself stays ``dense.gemv.gemv``: re-exported here, the function would hide the module of the same name
from quantkit.kernels.dense.gemv import gemv_reference, use_gemv
from quantkit.kernels.dense.norm_quant import (
    add_rms_norm_quant,
    add_rms_norm_quant_reference,
    silu_mul_quant,
    silu_mul_quant_reference,
)
from quantkit.kernels.dense.norm_rope import (
    add_rms_norm,
    add_rms_norm_reference,
    rotary_,
    rotary_reference_,
    rotary_store_,
    silu_mul,
    silu_mul_reference,
)

__all__ = [
    "add_rms_norm",
    "add_rms_norm_quant",
    "add_rms_norm_quant_reference",
    "add_rms_norm_reference",
    "gemv_reference",
    "rotary_",
    "rotary_reference_",
    "rotary_store_",
    "silu_mul",
    "silu_mul_quant",
    "silu_mul_quant_reference",
    "silu_mul_reference",
    "use_gemv",
]
