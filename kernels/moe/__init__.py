"""Fused mixture-of-experts layer (Mixtral, Qwen2/3-MoE, DeepSeek-V3): routing, expert grouping and grouped GEMMs.

``routing.py``: ``route`` (softmax top-k with renormalisation; DeepSeek-V3's sigmoid, correction bias and
group-limited top-k), ``align`` (pairs sorted by expert, padded to blocks, on the device without a host sync) and
``route_and_align`` (both in one launch for a few tokens).
``experts.py``: ``ExpertWeights`` (float, W4A16 or block-fp8 experts stacked on a leading axis), ``fused_moe``
(gate/up in one launch, SiLU-and-multiply, down with the routing weight, the sum back to token order) and
``routed_moe`` (from router logits: route_and_align, then fused_moe). ``decode.py``: the decode path of float and
W4A16 experts for a few tokens per expert (GEMV programs on the W4A16 gemv's helpers). ``configs.py``: the tile
configs (``moe_config``: a tuned table per format and layer shape, else per-format defaults), the decode path's
(``decode_config``) and which path a layer takes (``layer_config``: by tokens, ``DECODE_MAX_TOKENS``).
Each module's plain PyTorch ``*_reference`` defines its numerics.
"""

from quantkit.kernels.moe.configs import decode_config, layer_config, moe_config
from quantkit.kernels.moe.experts import ExpertWeights, check_operands, fused_moe, fused_moe_reference, routed_moe
from quantkit.kernels.moe.routing import align, align_reference, max_blocks, route, route_and_align, route_reference

__all__ = [
    "ExpertWeights",
    "align",
    "align_reference",
    "check_operands",
    "decode_config",
    "fused_moe",
    "fused_moe_reference",
    "layer_config",
    "max_blocks",
    "moe_config",
    "route",
    "route_and_align",
    "route_reference",
    "routed_moe",
]
