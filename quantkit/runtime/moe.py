"""The runtime's mixture-of-experts feed-forward block (Mixtral, Qwen2-MoE, Qwen3-MoE) in plain PyTorch.

A router (one linear, softmax in fp32, top-k, the top-k weights renormalised where the family does) picks
``num_experts_per_tok`` experts per token; the token-expert pairs are sorted by expert, each expert that received
tokens runs once on its contiguous slice, and the weighted outputs are summed back into token order with one
``index_add_`` (fp32 accumulation). At batch 1 only the chosen experts run. Qwen2-MoE adds a shared expert scaled by
a sigmoid gate. Experts are ordinary SiLU-gated MLPs made by the runtime's linear factory, named as transformers and
quantkit checkpoints name them (``mlp.experts.{e}.gate_proj``, ...), so float and quantized experts load alike.

The host reads the per-expert token counts (one device-to-host copy per layer), so a step with MoE layers cannot be
captured in a CUDA graph: such models run decode steps eagerly until a fused MoE kernel replaces this loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

MLPFactory = Callable[..., nn.Module]  # mlp(name prefix, inter=intermediate size) -> SiLU-gated MLP


@dataclass(frozen=True)
class MoESpec:
    """What a family's MoE block reads from its config: ``num_experts`` / ``intermediate`` name the config fields of
    the routed expert count and each expert's width; ``norm_topk``: renormalise the top-k weights to sum to 1
    (True: always, as Mixtral; None: as ``config.norm_topk_prob`` says, as Qwen2/3-MoE); ``shared_expert``: a shared
    expert of ``config.shared_expert_intermediate_size`` with a sigmoid gate (Qwen2-MoE)."""

    num_experts: str = "num_experts"
    intermediate: str = "moe_intermediate_size"
    norm_topk: bool | None = None
    shared_expert: bool = False


def is_sparse_layer(config, i: int) -> bool:
    """Whether layer ``i`` of an MoE config has routed experts (Qwen's ``mlp_only_layers`` / ``decoder_sparse_step``
    leave some layers dense; Mixtral has neither)."""
    if i in (getattr(config, "mlp_only_layers", None) or []):
        return False
    return (i + 1) % (getattr(config, "decoder_sparse_step", None) or 1) == 0


class SparseMoE(nn.Module):
    """``forward(x [T, hidden]) -> [T, hidden]``. Module names equal transformers': ``gate`` (the router, [E, hidden]),
    ``experts.{e}``, ``shared_expert``, ``shared_expert_gate``."""

    def __init__(self, config, spec: MoESpec, prefix: str, mlp: MLPFactory, linear, dtype):
        super().__init__()
        num_experts = getattr(config, spec.num_experts)
        self.top_k = config.num_experts_per_tok
        self.norm_topk = bool(config.norm_topk_prob) if spec.norm_topk is None else spec.norm_topk
        self.gate = nn.Linear(config.hidden_size, num_experts, bias=False, dtype=dtype)
        inter = getattr(config, spec.intermediate)
        self.experts = nn.ModuleList(mlp(f"{prefix}.experts.{e}", inter=inter) for e in range(num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if spec.shared_expert:
            self.shared_expert = mlp(f"{prefix}.shared_expert", inter=config.shared_expert_intermediate_size)
            self.shared_expert_gate = linear(f"{prefix}.shared_expert_gate", config.hidden_size, 1, False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights fp32 [T, k], expert ids int64 [T, k]) of each token's top-k experts, highest first."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

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
