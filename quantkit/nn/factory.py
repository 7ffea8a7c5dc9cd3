"""Build the quantized module that stores a quantized weight (by scheme), and list a model's quantized modules."""

from __future__ import annotations

import torch
from torch import nn

from quantkit.nn.qlinear import QuantLinear
from quantkit.quant.scheme import QuantScheme
from quantkit.quant.tensor import QuantizedWeight


def quantized_module_types() -> tuple[type, ...]:
    from quantkit.nn.progressive import ProgressiveW4A8Linear
    from quantkit.nn.w4a8 import W4A8Linear
    from quantkit.nn.w8a8 import W8A8Linear

    return (QuantLinear, W4A8Linear, ProgressiveW4A8Linear, W8A8Linear)


def make_quantized_linear(
    qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype, input_scale: torch.Tensor | None = None
) -> nn.Module:
    if qw.scheme.weight_only:
        return QuantLinear.from_quantized(qw, bias, dtype)
    if qw.scheme.progressive:
        from quantkit.nn.progressive import ProgressiveW4A8Linear

        return ProgressiveW4A8Linear.from_quantized(qw, bias, dtype)
    if qw.scheme.w4a8:
        from quantkit.nn.w4a8 import W4A8Linear

        return W4A8Linear.from_quantized(qw, bias, dtype)
    from quantkit.nn.w8a8 import W8A8Linear

    return W8A8Linear.from_quantized(qw, bias, dtype, input_scale)


def empty_quantized_linear(
    in_features: int, out_features: int, scheme: QuantScheme, bias: bool, dtype: torch.dtype, device=None
) -> nn.Module:
    """A module with the right buffers for ``scheme``, to be filled by ``load_state_dict``."""
    if scheme.weight_only:
        return QuantLinear(in_features, out_features, scheme, bias=bias, dtype=dtype, device=device)
    if scheme.progressive:
        from quantkit.nn.progressive import ProgressiveW4A8Linear

        return ProgressiveW4A8Linear(in_features, out_features, scheme, bias=bias, dtype=dtype, device=device)
    if scheme.w4a8:
        from quantkit.nn.w4a8 import W4A8Linear

        return W4A8Linear(in_features, out_features, scheme, bias=bias, dtype=dtype, device=device)
    from quantkit.nn.w8a8 import W8A8Linear

    return W8A8Linear(in_features, out_features, scheme, bias=bias, dtype=dtype, device=device)


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    types = quantized_module_types()
    return {name: m for name, m in model.named_modules() if isinstance(m, types)}
