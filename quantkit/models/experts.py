"""Mixture-of-experts blocks with one ``nn.Linear`` per expert projection.

transformers 5 stores the experts of Mixtral / Qwen2-MoE / Qwen3-MoE as two 3-D parameters
(``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]). Quantization treats experts as ordinary linears with
their own statistics, so :func:`split_fused_experts` replaces such a module with :class:`LinearExperts`, which
computes the same function (same routing contract: ``forward(hidden_states, top_k_index, top_k_weights)``)
from ``experts.{e}.gate_proj / up_proj / down_proj``.
"""

from __future__ import annotations

import torch
from torch import nn


class ExpertMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act_fn: nn.Module, device=None, dtype=None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, device=device, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, device=device, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, device=device, dtype=dtype)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LinearExperts(nn.ModuleList):
    """A list of :class:`ExpertMLP`, callable like the fused experts module it replaces."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self):
            token_idx, slot = torch.where(top_k_index == e)
            if token_idx.numel() == 0:
                continue
            y = expert(hidden_states[token_idx]) * top_k_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


def is_fused_experts(module: nn.Module) -> bool:
    return (
        isinstance(getattr(module, "gate_up_proj", None), nn.Parameter)
        and getattr(module, "down_proj", None) is not None
    )


def split_fused_experts(fused: nn.Module, materialize: bool = True) -> LinearExperts:
    """Build the per-expert equivalent of a fused experts module (weights copied unless ``materialize=False``)."""
    n_experts, two_i, hidden = fused.gate_up_proj.shape
    inter = two_i // 2
    device = None if materialize else "meta"
    dtype = fused.gate_up_proj.dtype
    experts = LinearExperts(
        ExpertMLP(hidden, inter, fused.act_fn, device=device or fused.gate_up_proj.device, dtype=dtype)
        for _ in range(n_experts)
    )
    if materialize:
        with torch.no_grad():
            for e, expert in enumerate(experts):
                gate, up = fused.gate_up_proj[e].chunk(2, dim=0)  # [2I, H] -> gate [I, H], up [I, H]
                expert.gate_proj.weight.copy_(gate)
                expert.up_proj.weight.copy_(up)
                expert.down_proj.weight.copy_(fused.down_proj[e])
    return experts


def split_all_fused_experts(model: nn.Module, layers: nn.ModuleList, path: str, materialize: bool = True) -> int:
    """Replace ``layer.<path>`` by :class:`LinearExperts` in every layer where it is fused; returns how many."""
    parent_path, _, attr = path.rpartition(".")
    count = 0
    for layer in layers:
        parent = layer.get_submodule(parent_path) if parent_path else layer
        fused = getattr(parent, attr, None)
        if fused is not None and is_fused_experts(fused):
            setattr(parent, attr, split_fused_experts(fused, materialize))
            count += 1
    return count
