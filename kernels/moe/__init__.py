"""Fused mixture-of-experts layer (Mixtral, Qwen2/3-MoE, DeepSeek-V3): routing, expert grouping and grouped GEMMs.

``routing.py``: ``route`` (softmax top-k with renormalisation; DeepSeek-V3's sigmoid, correction bias and
group-limited top-k) and ``align`` (pairs sorted by expert, padded to blocks, on the device without a host sync).
``experts.py``: ``ExpertWeights`` (float, W4A16 or block-fp8 experts stacked on a leading axis) and ``fused_moe``
(gate/up in one launch, SiLU-and-multiply, down with the routing weight, the sum back to token order).
Each module's plain PyTorch ``*_reference`` defines its numerics.
"""

from quantkit.kernels.moe.experts import ExpertWeights, check_operands, fused_moe, fused_moe_reference, moe_config
from quantkit.kernels.moe.routing import align, align_reference, max_blocks, route, route_reference

__all__ = [
    "ExpertWeights",
    "align",
    "align_reference",
    "check_operands",
    "fused_moe",
    "fused_moe_reference",
    "max_blocks",
    "moe_config",
    "route",
    "route_reference",
]
