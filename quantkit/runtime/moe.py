"""The runtime's mixture-of-experts feed-forward block (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3).

A router (one linear, softmax in fp32, top-k, the top-k weights renormalised where the family does; DeepSeek-V3: sigmoid
scores, chosen by score + ``e_score_correction_bias`` within the ``topk_group`` best of ``n_group`` expert groups,
weighted by the plain scores times ``routed_scaling_factor``) picks ``num_experts_per_tok`` experts per token
(``quantkit.kernels.moe.route_reference``: transformers' arithmetic, ties to the lower expert index). Qwen2-MoE adds a
shared expert scaled by a sigmoid gate, DeepSeek-V3 ungated shared experts (one MLP ``n_shared_experts`` times as wide
as an expert) and keeps its first ``first_k_dense_replace`` layers dense. Experts are ordinary SiLU-gated MLPs made by
the runtime's linear factory, named as transformers and quantkit checkpoints name them (``mlp.experts.{e}.gate_proj``,
...), so float and quantized experts load alike.

Two paths, one numerics contract (fp32 routing weights, weighted expert outputs summed in fp32):
- the loop (CPU, and the reference): token-expert pairs sorted by expert, each expert that received tokens runs once
  on its contiguous slice, the weighted outputs summed back with one ``index_add_``. The host reads the per-expert
  token counts, so it cannot be captured in a CUDA graph.
- fused (CUDA, after ``stack_experts`` at load time): the experts' weights stacked once per layer (float, W4A16
  with or without act-order, block fp8), then ``quantkit.kernels.moe.routed_moe``: routing and the pairs' alignment to
  expert blocks on the device (one launch for a decode step's few tokens), one grouped GEMM launch per projection.
  No host sync: decode steps are captured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.kernels._device import interpreting
from quantkit.kernels.moe import ExpertWeights, route_reference, routed_moe

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
        self.dtype = dtype
        self.fused: tuple[ExpertWeights, ExpertWeights] | None = None  # set by stack_experts
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

    def routing_args(self) -> dict:
        """The family's arguments of ``kernels.moe.route`` / ``route_reference``."""
        if not self.grouped_sigmoid:
            return {"score": "softmax", "renormalize": self.norm_topk}
        return {"score": "sigmoid", "renormalize": self.norm_topk, "bias": self.gate.e_score_correction_bias,
                "n_group": self.n_group, "topk_group": self.topk_group,
                "scaling": self.routed_scaling_factor}  # fmt: skip

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[T, E]: in the model dtype (Mixtral, Qwen), in fp32 for DeepSeek-V3 (as transformers)."""
        return F.linear(x.float(), self.gate.weight.float()) if self.grouped_sigmoid else self.gate(x)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights fp32 [T, k], expert ids int64 [T, k]) of each token's top-k experts, best first."""
        weights, ids = route_reference(self.router_logits(x), self.top_k, **self.routing_args())
        return weights, ids.long()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            logits = self.router_logits(x)  # routing and alignment in one launch for a few tokens (a decode step)
            out = routed_moe(x, logits, *self.fused, self.top_k, out_dtype=torch.float32, **self.routing_args())
            return self.add_shared(x, out)
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
        return self.add_shared(x, out)

    def add_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The routed experts' fp32 sum ``out`` [T, hidden] plus the shared expert(s), in x's dtype."""
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x).float())
            out += gate * self.shared_expert(x).float()
        if self.shared_experts is not None:
            out += self.shared_experts(x).float()
        return out.to(x.dtype)

    def stack_experts(self) -> bool:
        """Stack the experts' weights for the fused kernels (gate and up side by side) and drop the per-expert
        modules; returns whether the block now runs fused. Declined (False, nothing changed) off CUDA (unless
        Triton's interpreter runs), for experts of mixed or unserved kinds (per-channel W8A8, W4A8, biases,
        W4A16 layers the W4A16 kernel layout cannot hold) and for 4-bit experts of fp32 models."""
        if self.fused is not None:
            return True
        if not (self.gate.weight.is_cuda or interpreting()) or not len(self.experts):
            return False
        self.fused = stacked_weights(list(self.experts), self.dtype)
        if self.fused is not None:
            self.experts = nn.ModuleList()  # the stacked copies replace them
        return self.fused is not None


def stacked_weights(experts: list[nn.Module], dtype: torch.dtype) -> tuple[ExpertWeights, ExpertWeights] | None:
    """(gate/up [E, 2I, H], down [E, H, I]) of SiLU-gated MLPs in a format of ``kernels.moe``, or None."""
    from quantkit.nn.dispatch import kernel_weight
    from quantkit.nn.qlinear import QuantLinear
    from quantkit.nn.w8a8 import W8A8Linear

    parts = [(m.gate_proj, m.up_proj, m.down_proj) for m in experts]
    if any(p is None for ps in parts for p in ps):  # already fused per expert
        return None
    kind = type(parts[0][0])
    if any(type(p) is not kind or p.bias is not None for ps in parts for p in ps):
        return None
    if issubclass(kind, nn.Linear):
        w13 = ExpertWeights.from_float([torch.cat([g.weight, u.weight]) for g, u, _ in parts])
        return w13, ExpertWeights.from_float([d.weight for _, _, d in parts])
    if kind is QuantLinear and dtype in (torch.float16, torch.bfloat16):
        try:
            gate_up = [kernel_weight(QuantLinear.concat([g, u])) for g, u, _ in parts]
        except ValueError:  # act-order gate and up with different permutations (not from one Hessian)
            return None
        down = [kernel_weight(d) for _, _, d in parts]
        if any(w is None for w in gate_up + down):
            return None
        return ExpertWeights.from_w4a16(gate_up), ExpertWeights.from_w4a16(down)
    first = parts[0][0]
    if kind is W8A8Linear and first.block and first.fmt == "fp8" and first.input_scale is None:
        if first.out_features % first.block or first.execution.value != "integer":
            return None
        gu = [(torch.cat([g.weight, u.weight]), torch.cat([g.weight_scale, u.weight_scale])) for g, u, _ in parts]
        w13 = ExpertWeights.from_fp8_block([w for w, _ in gu], [s for _, s in gu], first.block)
        down = [d for _, _, d in parts]
        return w13, ExpertWeights.from_fp8_block([d.weight for d in down], [d.weight_scale for d in down], first.block)
    return None


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
