"""Replace the float linears of a (meta-device) model by empty quantized modules, by name."""

from __future__ import annotations

from torch import nn

from quantkit.errors import QuantkitError
from quantkit.models.arch import arch_for
from quantkit.models.experts import split_all_fused_experts
from quantkit.nn.factory import empty_quantized_linear
from quantkit.quant.scheme import QuantScheme


def swap_in_quantized_modules(model: nn.Module, schemes: dict[str, QuantScheme], split_experts: bool) -> None:
    if split_experts:
        arch = arch_for(model)
        split_all_fused_experts(model, model.get_submodule(arch.layers), arch.fused_experts, materialize=False)
    for name, scheme in schemes.items():
        try:
            old = model.get_submodule(name)
        except AttributeError:
            raise QuantkitError(f"checkpoint names a quantized module {name} that this model does not have") from None
        if not isinstance(old, nn.Linear):
            raise QuantkitError(f"checkpoint quantized module {name} is a {type(old).__name__}, expected Linear")
        dtype = old.weight.dtype
        new = empty_quantized_linear(
            old.in_features, old.out_features, scheme, bias=old.bias is not None, dtype=dtype, device=old.weight.device
        )
        model.set_submodule(name, new)
