"""The runtime's mixture-of-experts feed-forward block (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3) in plain PyTorch.

A router (one linear, softmax in fp32, top-k, the top-k weights renormalised where the family does; DeepSeek-V3: sigmoid
scores, chosen by score + ``e_score_correction_bias`` within the ``topk_group`` best of ``n_group`` expert groups,
weighted by the plain scores times ``routed_scaling_factor``) picks ``num_experts_per_tok`` experts per token; the
token-expert pairs are sorted by expert, each expert that received tokens runs once on its contiguous slice, and the
weighted outputs are summed back into token order with one ``index_add_`` (fp32 accumulation). At batch 1 only the
chosen experts run. Qwen2-MoE adds a shared expert scaled by a sigmoid gate, DeepSeek-V3 ungated shared experts (one MLP
``n_shared_experts`` times as wide as an expert) and keeps its first ``first_k_dense_replace`` layers dense. Experts are
ordinary SiLU-gated MLPs made by the runtime's linear factory, named as transformers and quantkit checkpoints name them
(``mlp.experts.{e}.gate_proj``, ...), so float and quantized experts load alike.

The host reads the per-expert token counts (one device-to-host copy per layer), so a step with MoE layers cannot be
captured in a CUDA graph: such models run decode steps eagerly until a fused MoE kernel replaces this loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

MLPFactory = Callable[..., nn.Module]  # mlp(name prefix, inter=intermediate size) -> SiLU-gated MLP


@dataclass(frozen=True)
class MoESpec:
    """What a family's MoE block reads from its config: ``num_experts`` / ``intermediate`` name the config fields of
    the routed expert count and each expert's width; ``norm_topk``: renormalise the top-k weights to sum to 1
    (True: always, as Mixtral; None: as ``config.norm_topk_prob`` says, as Qwen2/3-MoE); ``shared_expert``: a shared
    expert of ``config.shared_expert_intermediate_size`` with a sigmoid gate (Qwen2-MoE); ``grouped_sigmoid``:
    DeepSeek-V3's router and its ungated ``shared_experts``."""

    num_experts: str = "num_experts"
    intermediate: str = "moe_intermediate_size"
    norm_topk: bool | None = None
    shared_expert: bool = False
    grouped_sigmoid: bool = False


def is_sparse_layer(config, i: int) -> bool:
    """Whether layer ``i`` of an MoE config has routed experts (Qwen's ``mlp_only_layers`` / ``decoder_sparse_step``
    leave some layers dense, DeepSeek's ``first_k_dense_replace`` the first ones; Mixtral has none of them)."""
    if i < (getattr(config, "first_k_dense_replace", None) or 0):
        return False
    if i in (getattr(config, "mlp_only_layers", None) or []):
        return False
    return (i + 1) % (getattr(config, "decoder_sparse_step", None) or 1) == 0


class SparseMoE(nn.Module):
    """``forward(x [T, hidden]) -> [T, hidden]``. Module names equal transformers': ``gate`` (the router, [E, hidden]),
    ``experts.{e}``, ``shared_expert``, ``shared_expert_gate``; DeepSeek-V3: ``gate`` fp32 with its
    ``gate.e_score_correction_bias`` [E] fp32, ``shared_experts``."""

    def __init__(self, config, spec: MoESpec, prefix: str, mlp: MLPFactory, linear, dtype):
        super().__init__()
        num_experts = getattr(config, spec.num_experts)
        self.top_k = config.num_experts_per_tok
        self.norm_topk = bool(config.norm_topk_prob) if spec.norm_topk is None else spec.norm_topk
        self.grouped_sigmoid = spec.grouped_sigmoid
        gate_dtype = torch.float32 if spec.grouped_sigmoid else dtype  # transformers keeps DeepSeek's router in fp32
        self.gate = nn.Linear(config.hidden_size, num_experts, bias=False, dtype=gate_dtype)
        inter = getattr(config, spec.intermediate)
        self.experts = nn.ModuleList(mlp(f"{prefix}.experts.{e}", inter=inter) for e in range(num_experts))
        self.shared_expert = self.shared_expert_gate = self.shared_experts = None
        if spec.shared_expert:
            self.shared_expert = mlp(f"{prefix}.shared_expert", inter=config.shared_expert_intermediate_size)
            self.shared_expert_gate = linear(f"{prefix}.shared_expert_gate", config.hidden_size, 1, False)
        if spec.grouped_sigmoid:
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
            self.n_group, self.topk_group = config.n_group, config.topk_group
            self.routed_scaling_factor = config.routed_scaling_factor
            self.shared_experts = mlp(f"{prefix}.shared_experts", inter=inter * config.n_shared_experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights fp32 [T, k], expert ids int64 [T, k]) of each token's top-k experts."""
        if self.grouped_sigmoid:
            return self.route_grouped(x)
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def route_grouped(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's router, step for step as transformers' ``DeepseekV3TopkRouter``: a group's score is the sum
        of its two best biased scores; experts outside the ``topk_group`` best groups are masked."""
        scores = torch.sigmoid(F.linear(x.float(), self.gate.weight.float()))  # [T, E]
        choice = scores + self.gate.e_score_correction_bias
        groups = choice.view(-1, self.n_group, choice.shape[-1] // self.n_group)  # [T, G, E / G]
        group_idx = torch.topk(groups.topk(2, dim=-1)[0].sum(dim=-1), k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros(groups.shape[:2], dtype=torch.bool, device=x.device).scatter_(1, group_idx, True)
        choice = choice.masked_fill(~group_mask[:, :, None].expand_as(groups).reshape(choice.shape), float("-inf"))
        chosen = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        pair_expert = chosen.flatten()  # [T * k] token-expert pairs, token-major
        order = torch.argsort(pair_expert, stable=True)  # pairs grouped by expert, tokens ascending within a group
        token = order // self.top_k  # [T * k] the token of each sorted pair
        counts = torch.bincount(pair_expert, minlength=len(self.experts)).tolist()  # the one host sync
        xs = x[token]  # [T * k, hidden], each expert's tokens contiguous
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                ys[start : start + n] = self.experts[e](xs[start : start + n])
                start += n
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        out.index_add_(0, token, ys.float() * weights.flatten()[order, None])
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x).float())
            out += gate * self.shared_expert(x).float()
        if self.shared_experts is not None:
            out += self.shared_experts(x).float()
        return out.to(x.dtype)


def experts_by_name(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Expert tensors under the runtime's names (others unchanged): Mixtral's on-disk names
    (``block_sparse_moe.experts.{e}.w1/w3/w2``: gate, up, down) and transformers 5's fused in-memory experts
    (``mlp.experts.gate_up_proj`` [E, 2I, hidden], ``mlp.experts.down_proj`` [E, hidden, I]) become per-expert
    ``mlp.experts.{e}.{gate,up,down}_proj.weight``. Fused tensors are split into views, not copied."""
    renamed = {}
    for name, t in tensors.items():
        if ".block_sparse_moe." in name:
            name = name.replace(".block_sparse_moe.", ".mlp.")
            prefix, dot, rest = name.partition(".experts.")
            if dot:
                expert, _, tail = rest.partition(".")
                name = f"{prefix}.experts.{expert}.{MIXTRAL_PROJECTIONS.get(tail, tail)}"
        if name.endswith(".experts.gate_up_proj") and t.dim() == 3:
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                renamed[f"{name.removesuffix('gate_up_proj')}{e}.gate_proj.weight"] = t[e, :inter]
                renamed[f"{name.removesuffix('gate_up_proj')}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith(".experts.down_proj") and t.dim() == 3:
            for e in range(t.shape[0]):
                renamed[f"{name.removesuffix('down_proj')}{e}.down_proj.weight"] = t[e]
        else:
            renamed[name] = t
    return renamed


MIXTRAL_PROJECTIONS = {"w1.weight": "gate_proj.weight", "w3.weight": "up_proj.weight", "w2.weight": "down_proj.weight"}
