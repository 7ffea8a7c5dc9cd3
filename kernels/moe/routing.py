"""Routing of the fused MoE layer: each token's top-k experts and weights, then the token-expert pairs grouped by
expert and padded to whole blocks of rows, both on the device without a host sync (a decode step stays capturable).

What it computes
    ``route(logits [T, E], top_k, ...) -> (weights fp32 [T, k], ids int32 [T, k])``, experts listed best first.
    - ``score="softmax"`` (Mixtral, Qwen2-MoE, Qwen3-MoE): p = softmax(logits) in fp32; the k largest p; divided by
      their sum when ``renormalize`` (Mixtral always, Qwen per ``norm_topk_prob``); times ``scaling`` (1 for them).
    - ``score="sigmoid"`` (DeepSeek-V3): s = sigmoid(logits) in fp32. Experts are chosen by the biased score
      b = s + ``bias`` (``e_score_correction_bias``), group-limited: the E experts form ``n_group`` equal groups of
      consecutive ids, the ``topk_group`` groups with the largest sum of their two largest b are kept, and the k
      largest b among the kept groups' experts are chosen. Their weights are the unbiased s, divided by
      (sum + 1e-20) when ``renormalize``, times ``scaling`` (``routed_scaling_factor``). As transformers'
      DeepseekV3TopkRouter.
    Tie rule: among equal scores (or group scores) the lower expert (group) index wins. transformers leaves ties to
    ``torch.topk``, whose order among equal values is unspecified; everything else is its arithmetic.
    ``align(ids [T, k], E, BLOCK_M) -> (sorted_pairs int32 [NB * BLOCK_M], block_expert int32 [NB])``: pair
    p = t * k + j (token t's j-th expert) sorted by expert, ascending p within an expert, each expert's run padded
    to a multiple of BLOCK_M rows with the sentinel P = T * k; ``block_expert[b]`` is the expert of rows
    b * BLOCK_M .. + BLOCK_M, -1 for blocks past the last run. NB = cdiv(P, BLOCK_M) + min(E, P) bounds the
    blocks of every routing (each non-empty expert pads at most one block), so the shapes depend on T only.

How
    ``_route_kernel``: one program per BLOCK_T tokens holds their [BLOCK_T, E] scores in registers and runs k
    rounds of "max, lowest index attaining it, mask it out" (the group step: two such rounds per group, then
    topk_group rounds over the group scores). ``_align_kernel``: one program; counts per expert from one-hot
    compares of CHUNK pairs at a time, run starts from a cumulative sum of the padded counts, block experts by
    comparing each block's first row with the run ends, then each pair's slot = its run's start + the pairs of its
    expert before it (a cumulative sum over the chunk's one-hot rows). It is serial over chunks, so above
    ``ALIGN_KERNEL_MAX_PAIRS`` pairs (prefill, large decode batches) ``align`` runs ``align_reference`` on the
    device instead: a stable sort and a scatter, a dozen launches and no host sync either; both give the same bits.
    ``route_and_align``: where one ``_route_kernel`` program holds every token (up to 16), it stores the ids, waits
    at a CTA barrier and runs ``_align_kernel``'s body itself: a decode step's routing is one launch, not two.

Limits: E <= 1024; sigmoid routing needs E divisible by n_group with at least two experts per group. Hardware: the
kernels are small and untuned (first choices); they run once per MoE layer per step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quantkit.kernels._device import interpreting

SCORES = ("softmax", "sigmoid")
MAX_EXPERTS = 1024
# Above this many pairs the sort path's dozen launches should beat one program walking the pairs serially (a first
# guess from counting loop trips, not timed yet: bench_moe.py's routing column shows both sides of it).
ALIGN_KERNEL_MAX_PAIRS = 1024
# route_and_align's one program runs 4 warps. One warp was timed against it (H100, bench_moe.py, 2026-12-07): no
# faster on Qwen3-30B-A3B at M = 1 (10.7 against 10.9 us), slower at M = 16 (69.8 against 16.4 us) and on
# Mixtral-8x7B at M = 1 (9.9 against 7.4 us); and in two GPU test cases its outputs were not the 4-warp launch's
# (not diagnosed: the alignment reads ids that other threads of the program stored). Dropped.
DENOMINATOR_EPS = 1e-20  # DeepSeek-V3's renormalisation: weights / (sum + 1e-20)


def max_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """NB: an upper bound on the padded blocks of any routing of ``pairs`` token-expert pairs."""
    return triton.cdiv(pairs, block_m) + min(num_experts, pairs)


# ----------------------------------------------------------------------------------------------------------------
# Reference (plain PyTorch): defines the numerics and the tie rule the kernels reproduce.
# ----------------------------------------------------------------------------------------------------------------


def _topk_lowest_first(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row, ties broken towards the lower index (a stable descending sort)."""
    values, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], idx[..., :k]


def route_reference(
    logits: torch.Tensor,
    top_k: int,
    score: str = "softmax",
    renormalize: bool = True,
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], expert ids int32 [T, k]) of each token, best first (see the module docstring)."""
    logits = logits.float()
    if score == "softmax":
        probs = torch.softmax(logits, dim=-1)
        weights, ids = _topk_lowest_first(probs, top_k)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * scaling, ids.int()
    t, e = logits.shape
    s = logits.sigmoid()
    choice = s + bias.float() if bias is not None else s
    group_scores = _topk_lowest_first(choice.view(t, n_group, e // n_group), 2)[0].sum(dim=-1)  # [T, n_group]
    kept = _topk_lowest_first(group_scores, topk_group)[1]  # [T, topk_group]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    expert_mask = group_mask.repeat_interleave(e // n_group, dim=1)  # [T, E]
    ids = _topk_lowest_first(choice.masked_fill(~expert_mask, float("-inf")), top_k)[1]
    weights = s.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + DENOMINATOR_EPS)
    return weights * scaling, ids.int()


def align_reference(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs int32 [NB * BLOCK_M], block_expert int32 [NB]) of ``align``; fixed shapes, no host sync."""
    flat = ids.reshape(-1).long()
    p = flat.numel()
    nb = max_blocks(p, num_experts, block_m)
    dev = flat.device
    order = torch.sort(flat, stable=True).indices  # pairs grouped by expert, ascending within each
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    run_end = torch.cumsum(padded, 0)  # [E]
    run_start = run_end - padded
    first = torch.cumsum(counts, 0) - counts  # each expert's first position in ``order``
    sorted_e = flat[order]
    slot = run_start[sorted_e] + torch.arange(p, device=dev) - first[sorted_e]
    sorted_pairs = torch.full((nb * block_m,), p, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, slot, order.int())
    rows = torch.arange(nb, device=dev) * block_m
    expert = torch.searchsorted(run_end, rows, right=True)  # the run holding each block's first row
    block_expert = torch.where(rows < run_end[-1], expert, -1).int()
    return sorted_pairs, block_expert


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _pick(scores, cols, E_PAD: tl.constexpr):
    """(max of each row, the lowest column attaining it) of scores [R, C]."""
    best = tl.max(scores, axis=1)
    idx = tl.min(tl.where(scores == best[:, None], cols[None, :], E_PAD), axis=1)
    return best, idx


@triton.jit
def _route_kernel(
    # pointers
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, sorted_ptr, block_expert_ptr,
    # sizes
    T, E, scaling, NB,
    # strides
    stride_lt,
    # meta-parameters
    TOP_K: tl.constexpr, SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_T: tl.constexpr, E_PAD: tl.constexpr,
    K_PAD: tl.constexpr, G_PAD: tl.constexpr, ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    t_mask = offs_t < T
    c_mask = cols < E
    x = tl.load(logits_ptr + offs_t[:, None] * stride_lt + cols[None, :], mask=t_mask[:, None] & c_mask[None, :],
                other=0.0).to(tl.float32)  # fmt: skip
    neg_inf = float("-inf")
    if SIGMOID:
        s = tl.sigmoid(x)
        choice = s
        if HAS_BIAS:
            choice = s + tl.load(bias_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)[None, :]
        choice = tl.where(c_mask[None, :], choice, neg_inf)
        if N_GROUP > 1:
            size = E // N_GROUP
            gcol = cols // size
            gids = tl.arange(0, G_PAD)
            group_scores = tl.full((BLOCK_T, G_PAD), neg_inf, tl.float32)
            for g in tl.static_range(N_GROUP):
                in_g = tl.where((gcol == g)[None, :], choice, neg_inf)
                first, idx = _pick(in_g, cols, E_PAD)
                second = tl.max(tl.where(cols[None, :] == idx[:, None], neg_inf, in_g), axis=1)
                group_scores = tl.where((gids == g)[None, :], (first + second)[:, None], group_scores)
            keep = tl.zeros((BLOCK_T, E_PAD), tl.int1)
            for _ in tl.static_range(TOPK_GROUP):
                _, gsel = _pick(group_scores, gids, G_PAD)
                keep = keep | (gcol[None, :] == gsel[:, None])
                group_scores = tl.where(gids[None, :] == gsel[:, None], neg_inf, group_scores)
            choice = tl.where(keep, choice, neg_inf)
    else:
        x = tl.where(c_mask[None, :], x, neg_inf)
        ex = tl.exp(x - tl.max(x, axis=1)[:, None])
        s = ex / tl.sum(ex, axis=1)[:, None]
        choice = tl.where(c_mask[None, :], s, neg_inf)
    kcols = tl.arange(0, K_PAD)
    w_acc = tl.zeros((BLOCK_T, K_PAD), tl.float32)
    id_acc = tl.zeros((BLOCK_T, K_PAD), tl.int32)
    for j in tl.static_range(TOP_K):
        _, idx = _pick(choice, cols, E_PAD)
        hit = cols[None, :] == idx[:, None]
        w = tl.sum(tl.where(hit, s, 0.0), axis=1)
        choice = tl.where(hit, neg_inf, choice)
        w_acc = tl.where((kcols == j)[None, :], w[:, None], w_acc)
        id_acc = tl.where((kcols == j)[None, :], idx[:, None], id_acc)
    if RENORMALIZE:
        total = tl.sum(w_acc, axis=1)  # the padding columns hold 0
        if SIGMOID:
            total += 1e-20
        w_acc = w_acc / total[:, None]
    w_acc = w_acc * scaling
    out = offs_t[:, None] * TOP_K + kcols[None, :]
    o_mask = t_mask[:, None] & (kcols < TOP_K)[None, :]
    tl.store(weights_ptr + out, w_acc, mask=o_mask)
    tl.store(ids_ptr + out, id_acc, mask=o_mask)
    if ALIGN:  # one program holds every token: align the ids it just stored (a CTA barrier makes them visible)
        tl.debug_barrier()
        _align_pairs(ids_ptr, sorted_ptr, block_expert_ptr, T * TOP_K, NB, BLOCK_M, E_PAD, CHUNK)


@triton.jit
def _align_kernel(
    # pointers
    ids_ptr, sorted_ptr, block_expert_ptr,
    # sizes
    P, NB,
    # meta-parameters
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    _align_pairs(ids_ptr, sorted_ptr, block_expert_ptr, P, NB, BLOCK_M, E_PAD, CHUNK)


@triton.jit
def _align_pairs(ids_ptr, sorted_ptr, block_expert_ptr, P, NB, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                 CHUNK: tl.constexpr):  # fmt: skip
    """The whole alignment of P pairs in the calling program (``_align_kernel``; ``_route_kernel`` with ALIGN)."""
    experts = tl.arange(0, E_PAD)
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros((E_PAD,), tl.int32)
    for p0 in range(0, P, CHUNK):  # pairs per expert; E_PAD marks lanes past P (it matches no expert)
        e = tl.load(ids_ptr + p0 + offs, mask=p0 + offs < P, other=E_PAD)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_end = tl.cumsum(padded, axis=0)
    run_start = run_end - padded
    used = tl.sum(padded, axis=0)
    for b0 in range(0, NB, CHUNK):  # a block's expert: the number of runs ending at or before its first row
        b = b0 + offs
        row = b * BLOCK_M
        expert = tl.sum((run_end[None, :] <= row[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(row < used, expert, -1), mask=b < NB)
    for r0 in range(0, NB * BLOCK_M, CHUNK):
        tl.store(sorted_ptr + r0 + offs, tl.full((CHUNK,), 0, tl.int32) + P, mask=r0 + offs < NB * BLOCK_M)
    tl.debug_barrier()  # the padding is written before the pairs land on their slots
    seen = tl.zeros((E_PAD,), tl.int32)
    for p0 in range(0, P, CHUNK):
        e = tl.load(ids_ptr + p0 + offs, mask=p0 + offs < P, other=E_PAD)
        onehot = (e[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
        before = tl.cumsum(onehot, axis=0) - onehot  # earlier pairs of this chunk with the same expert
        slot = tl.sum(onehot * (before + (run_start + seen)[None, :]), axis=1)
        tl.store(sorted_ptr + slot, p0 + offs, mask=p0 + offs < P)
        seen += tl.sum(onehot, axis=0)


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _on_device(t: torch.Tensor) -> bool:
    return t.is_cuda or interpreting()


def _check_route(logits, top_k, score, bias, n_group, topk_group) -> None:
    _require(score in SCORES, f"score must be one of {SCORES}, got {score!r}")
    _require(logits.dim() == 2 and logits.is_floating_point(), f"logits must be float [T, E], got {logits.shape}")
    e = logits.shape[1]
    _require(0 < top_k <= e <= MAX_EXPERTS, f"need 0 < top_k ({top_k}) <= E ({e}) <= {MAX_EXPERTS}")
    _require(logits.stride(1) == 1, "logits must be contiguous along E")
    _require(_on_device(logits), "logits must be a CUDA tensor (or set TRITON_INTERPRET=1)")
    if score == "sigmoid":
        _require(n_group >= 1 and e % n_group == 0 and (n_group == 1 or e // n_group >= 2),
                 f"E ({e}) must split into n_group ({n_group}) groups of two experts or more")  # fmt: skip
        _require(1 <= topk_group <= n_group, f"need 1 <= topk_group ({topk_group}) <= n_group ({n_group})")
        _require(top_k <= topk_group * (e // n_group), f"top_k ({top_k}) exceeds the kept groups' experts")
        _require(bias is None or (bias.shape == (e,) and bias.device == logits.device), f"bias must be [{e}]")


def _tokens_per_program(t: int, e: int) -> int:
    return max(1, min(16, 4096 // triton.next_power_of_2(e), triton.next_power_of_2(t)))


def _align_chunk(num_experts: int) -> int:
    return max(16, min(256, 8192 // triton.next_power_of_2(num_experts)))


def route(
    logits: torch.Tensor,
    top_k: int,
    score: str = "softmax",
    renormalize: bool = True,
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``route_reference`` in one launch: (weights fp32 [T, k], ids int32 [T, k])."""
    _check_route(logits, top_k, score, bias, n_group, topk_group)
    weights, ids = _empty_routing(logits, top_k)
    if logits.shape[0]:
        _launch_route(logits, top_k, score, renormalize, bias, n_group, topk_group, scaling, weights, ids)
    return weights, ids


def route_and_align(
    logits: torch.Tensor,
    top_k: int,
    block_m: int,
    score: str = "softmax",
    renormalize: bool = True,
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights, ids) of ``route`` and (sorted_pairs, block_expert) of ``align(ids, E, block_m)``: one launch where
    one program routes every token (up to 16 tokens; fewer above 256 experts) and the pairs stay within
    ``ALIGN_KERNEL_MAX_PAIRS``, else ``route`` then ``align``. The same bits either way."""
    _check_route(logits, top_k, score, bias, n_group, topk_group)
    _require(block_m > 0 and block_m & (block_m - 1) == 0, f"block_m must be a power of two, got {block_m}")
    t, e = logits.shape
    p = t * top_k
    if t == 0 or t > _tokens_per_program(t, e) or p > ALIGN_KERNEL_MAX_PAIRS:
        weights, ids = route(logits, top_k, score, renormalize, bias, n_group, topk_group, scaling)
        return weights, ids, *align(ids, e, block_m)
    weights, ids = _empty_routing(logits, top_k)
    nb = max_blocks(p, e, block_m)
    sorted_pairs = torch.empty(nb * block_m, dtype=torch.int32, device=logits.device)
    block_expert = torch.empty(nb, dtype=torch.int32, device=logits.device)
    _launch_route(logits, top_k, score, renormalize, bias, n_group, topk_group, scaling, weights, ids,
                  (sorted_pairs, block_expert, block_m))  # fmt: skip
    return weights, ids, sorted_pairs, block_expert


def _empty_routing(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = logits.shape[0]
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    return weights, torch.empty(t, top_k, dtype=torch.int32, device=logits.device)


def _launch_route(logits, top_k, score, renormalize, bias, n_group, topk_group, scaling, weights, ids,
                  aligned=None) -> None:  # fmt: skip
    """``_route_kernel`` over every token; ``aligned`` (sorted_pairs, block_expert, block_m): one program that
    aligns the pairs too."""
    t, e = logits.shape
    e_pad = triton.next_power_of_2(e)
    block_t = _tokens_per_program(t, e)
    sigmoid = score == "sigmoid"
    bias = bias if sigmoid else None
    groups = n_group if sigmoid else 1
    sorted_pairs, block_expert, block_m = aligned or (ids, ids, 1)
    _route_kernel[(triton.cdiv(t, block_t),)](
        logits, bias if bias is not None else logits, weights, ids, sorted_pairs, block_expert, t, e, float(scaling),
        block_expert.numel() if aligned else 0, logits.stride(0),
        TOP_K=top_k, SIGMOID=sigmoid, RENORMALIZE=renormalize, HAS_BIAS=bias is not None,
        N_GROUP=groups, TOPK_GROUP=topk_group if groups > 1 else 1, BLOCK_T=block_t, E_PAD=e_pad,
        K_PAD=triton.next_power_of_2(top_k), G_PAD=triton.next_power_of_2(groups), ALIGN=aligned is not None,
        BLOCK_M=block_m, CHUNK=_align_chunk(e), num_warps=4,
    )  # fmt: skip


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``align_reference``'s (sorted_pairs, block_expert): one kernel up to ``ALIGN_KERNEL_MAX_PAIRS`` pairs, the
    reference's device ops above (same bits)."""
    _require(ids.dtype in (torch.int32, torch.int64), f"ids must be int32 or int64, got {ids.dtype}")
    _require(0 < num_experts <= MAX_EXPERTS, f"num_experts must be 1..{MAX_EXPERTS}, got {num_experts}")
    _require(block_m > 0 and block_m & (block_m - 1) == 0, f"block_m must be a power of two, got {block_m}")
    p = ids.numel()
    if p > ALIGN_KERNEL_MAX_PAIRS or not _on_device(ids) or p == 0:
        return align_reference(ids, num_experts, block_m)
    nb = max_blocks(p, num_experts, block_m)
    flat = ids.reshape(-1).contiguous()
    sorted_pairs = torch.empty(nb * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(nb, dtype=torch.int32, device=ids.device)
    _align_kernel[(1,)](flat, sorted_pairs, block_expert, p, nb, BLOCK_M=block_m,
                        E_PAD=triton.next_power_of_2(num_experts), CHUNK=_align_chunk(num_experts),
                        num_warps=8)  # fmt: skip
    return sorted_pairs, block_expert
