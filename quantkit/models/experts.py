"""Mixture-of-experts blocks with one ``nn.Linear`` per expert projection.

transformers 5 stores the experts of Mixtral / Qwen2-MoE / Qwen3-MoE as two 3-D parameters
(``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]). Quantization treats experts as ordinary linears with
their own statistics, so :func:`split_fused_experts` replaces such a module with :class:`LinearExperts`, which
computes the same function (same routing contract: ``forward(hidden_states, top_k_index, top_k_weights)``)
from ``experts.{e}.gate_proj / up_proj / down_proj``.

While its layer is calibrated, ``LinearExperts.calibration`` may say per expert which tokens its linears' statistics
see (``EXPERT_MODES``): ``routed`` (the tokens the router sends it), ``all`` (every token, llm-compressor's "all
experts" calibration: the expert runs on all of them and the output keeps only the routed rows, so the layer's
output and the tokens the next layers see are those of the true routing) or ``unobserved`` (its routed tokens run
past the hooks: no statistics, so the stages quantize it without data, i.e. round-to-nearest).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

import torch
from torch import nn

from quantkit.errors import QuantkitError


class ExpertMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act_fn: nn.Module, device=None, dtype=None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, device=device, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, device=device, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, device=device, dtype=dtype)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def forward_unobserved(self, x: torch.Tensor) -> torch.Tensor:
        """The same function with the linears' own ``forward``: their hooks (statistics) do not see ``x``."""
        return self.down_proj.forward(self.act_fn(self.gate_proj.forward(x)) * self.up_proj.forward(x))


EXPERT_MODES = ("routed", "all", "unobserved")
PER_EXPERT = re.compile(r"\.experts\.\d+\.")  # a tensor name of one linear per expert, as checkpoints store them
STATISTICS = ("routed", "all")
BELOW_MIN = ("all", "rtn")


@dataclass(frozen=True)
class ExpertCalibration:
    """Which tokens the statistics of MoE experts come from (a recipe's ``experts`` mapping).

    - ``statistics``: ``routed`` (default: the tokens the router sends each expert) or ``all`` (every expert sees
      every calibration token for its statistics; the layer's output keeps the true routing).
    - ``min_tokens``: an expert routed fewer calibration tokens than this (counted per layer on its calibration
      inputs before the layer is quantized) follows ``below_min``: ``all`` (statistics from every token) or ``rtn``
      (no statistics: round-to-nearest). Every expert's count and the rule applied are in the quantization report.
    """

    statistics: str = "routed"
    min_tokens: int = 0
    below_min: str = "all"

    def __post_init__(self) -> None:
        if self.statistics not in STATISTICS:
            raise QuantkitError(f"experts statistics must be one of {STATISTICS}, got {self.statistics!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise QuantkitError(f"experts min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.below_min not in BELOW_MIN:
            raise QuantkitError(f"experts below_min must be one of {BELOW_MIN}, got {self.below_min!r}")

    def mode(self, routed_tokens: int) -> str:
        """The EXPERT_MODES entry for an expert that was routed ``routed_tokens`` calibration tokens."""
        if self.statistics == "all" or (routed_tokens < self.min_tokens and self.below_min == "all"):
            return "all"
        return "unobserved" if routed_tokens < self.min_tokens else "routed"

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class LinearExperts(nn.ModuleList):
    """A list of :class:`ExpertMLP`, callable like the fused experts module it replaces."""

    calibration: list[str] | None = None  # per expert, one of EXPERT_MODES, while the layer is calibrated

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self):
            token_idx, slot = torch.where(top_k_index == e)
            mode = self.calibration[e] if self.calibration else "routed"
            if mode == "all":  # statistics from every token; the output keeps the routed rows
                y = expert(hidden_states)[token_idx]
            elif token_idx.numel() == 0:
                continue
            elif mode == "unobserved":
                y = expert.forward_unobserved(hidden_states[token_idx])
            else:
                y = expert(hidden_states[token_idx])
            y = y * top_k_weights[token_idx, slot, None]
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
