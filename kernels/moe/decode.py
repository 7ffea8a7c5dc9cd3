"""Decode path of the fused MoE experts: a few tokens per expert (batch 1 to ~16 tokens), CUDA-core GEMV programs.

What it computes
    The layer of ``experts.py`` (``fused_moe_reference`` defines it) for float and W4A16 experts, same layouts:
    gu = x @ W13.T, a = silu(g) * u, o = (a @ W2.T) * weight, y = sum over k of o, fp32 accumulation. ``experts.py``
    calls ``decode_experts`` from ``fused_moe`` where ``configs.layer_config`` picks this path and sums o itself.

How
    The pairs are aligned to blocks of BLOCK_M = 1-4 rows of one expert (``routing.align``, as the tile path with a
    smaller block): at batch 1 every block is one (token, expert) pair. The grid is [NB blocks, N tiles, K splits],
    NB an upper bound from T alone (no host sync, capturable); blocks past the last run exit before any load, so
    only the chosen experts' weights are read, each word once per block. A program's rows are gathered through the
    sorted pair ids, and the row pointers go to the dense W4A16 gemv's own helpers (``gemv.load_tile``,
    ``gemv.mac_tile``): threads only along N, one 16-byte load of four packed words per thread and word row, codes
    unpacked exactly in registers through the fp32 magic-number pattern, the zero folded out of the inner loop
    (4-bit), one FFMA per code and row, the group's scale applied once per K tile and column in fp32 (W is never
    rounded to 16 bits: not bit-equal to the reference, as exact or more). At one row per program a barrier after
    each K tile's loads (``HOIST``) makes ptxas issue all of the tile's word loads before its arithmetic (offline
    sm_90 compiles, Triton 3.6: 167 registers, no spills; without it the down projection's program issued each word
    row's load just before its use, 96 registers): a split is one to a few K tiles, so its loads had better all be
    in flight. Two and four rows take 167-168 and 254 registers without it (with it, two rows spill); 8-bit codes
    (twice the words per tile) take 254 with it, so it is on by default for 4-bit codes at one row only.
    Float experts ([E, N, K], K contiguous) take [BLOCK_N, BLOCK_K] tiles with 16 bytes per thread along K,
    products accumulated elementwise in fp32 and summed over K once at the end (BLOCK_M x rows per warp = 8: 64
    fp32 sums per thread; 117-154 registers, each tile's loads issued first by ptxas itself). Gate/up run in one launch
    and one pass over K: a tile's first BLOCK_N / 2 rows are gate rows of W13, the rest the matching up rows.
    K is split over grid axis 2 until ``configs.DECODE_WARPS_PER_SM`` warps per SM run (at batch 1 Qwen3-30B-A3B
    has only 8 experts x 768 gate/up row pairs): split programs store fp32 partials [S, P, N]. Gate/up fixes them up
    in the same launch, as the dense gemv's ``epilogue.finish_tile`` does: each program counts itself in on its
    tile's semaphore (``ExpertWeights.locks``, reset after use) and the last to arrive adds the S partials in split
    order (deterministic: the same bits on every run), rounds g and u to x's dtype (as the reference) and stores
    silu(g) * u; ``_glu_splits_kernel`` does it in a launch of its own where the tiles outnumber the semaphores.
    Unsplit gate/up applies SiLU-and-multiply in its epilogue. The down projection always leaves fp32 partials:
    ``experts.py``'s ``_sum_k_kernel`` loads an element's S partials at once, adds them in one fixed tree,
    multiplies by the routing weight, rounds o to x's dtype and sums over k in order. Act-order W4A16 experts
    gather the rows' columns through each expert's perm first (two gathers). A layer is route_and_align, gate/up,
    down and the sum: four launches.

Limits: float and W4A16 experts; one stream at a time per ExpertWeights (its semaphores); BLOCK_M at most
``configs.DECODE_MAX_ROWS`` (a row costs one FMA per weight); int32 offsets within an expert and within x, a and the
partials; the interpreter computes bf16 in fp32 and rounds by hand (``EMULATE_BF16``). Not yet timed on a GPU
(``benchmarks/bench_moe.py`` times it against the tile path in the same run); split rule and threshold are first
choices (``configs.DECODE_MAX_TOKENS``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quantkit.kernels._device import interpreting, num_sms
from quantkit.kernels.moe.configs import decode_plan
from quantkit.kernels.w4a16.epilogue import to_act
from quantkit.kernels.w4a16.gemv import MAGIC_F32, load_tile, mac_tile

FLOAT, W4A16 = 0, 1


@triton.jit
def _project(x_rows, w_base, z_base, s_base, offs_n, N, K, group_size, t_begin, t_end, magic, sixteen,
             stride_wk, stride_wn, stride_zg, stride_zn, stride_sg, stride_sn,
             FORMAT: tl.constexpr, BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FOLD: tl.constexpr, X_VEC: tl.constexpr,
             HOIST: tl.constexpr = False):  # fmt: skip
    """fp32 [BLOCK_M, BLOCK_N]: rows x_rows (pointers [BLOCK_M]) times columns offs_n (< N) of one expert's W, over
    K tiles t_begin .. t_end. HOIST: a barrier between a tile's loads and its arithmetic (see the header)."""
    if FORMAT == 1:  # the dense W4A16 gemv's tile: row pointers as x, no row stride
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for t in tl.range(t_begin, t_end, num_stages=1):
            words, scales, zeros = load_tile(w_base, z_base, s_base, t, offs_n, N, K, group_size, stride_wk,
                                             stride_wn, stride_zg, stride_zn, stride_sg, stride_sn, BITS, BLOCK_K,
                                             EVEN_K)  # fmt: skip
            if HOIST:
                tl.debug_barrier()
            acc = mac_tile(acc, words, scales, zeros, x_rows, t, 0, BLOCK_M, K, 0, 1, magic, sixteen, BITS,
                           BLOCK_K, EVEN_K, FOLD, X_VEC)  # fmt: skip
    else:  # float [N, K] rows: products kept per K position, summed across the threads once
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for t in tl.range(t_begin, t_end):
            kk = t * BLOCK_K + offs_k
            k_mask = kk < K
            w = tl.load(w_base + offs_n[:, None] * stride_wn + kk[None, :] * stride_wk,
                        mask=n_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_first")  # fmt: skip
            x = tl.load(x_rows[:, None] + kk[None, :], mask=k_mask[None, :], other=0.0)
            acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        acc = tl.sum(acc3, axis=2)
    return acc


@triton.jit(do_not_specialize=["P", "group_size", "tiles_per_split", "magic", "sixteen"])
def _moe_gemv_kernel(
    # pointers
    a_ptr, w_ptr, z_ptr, s_ptr, part_ptr, act_ptr, pairs_ptr, block_expert_ptr, lock_ptr,
    # sizes: N columns of the output (gate/up: of a = silu(g) * u; W13 has 2N rows), K inputs, P pairs
    N, K, P, group_size, tiles_per_split, a_div,
    # w4a16: the gemv's magic constants as run-time values (kept in registers)
    magic, sixteen,
    # strides
    stride_am, stride_we, stride_wk, stride_wn, stride_ze, stride_zg, stride_zn, stride_se, stride_sg, stride_sn,
    stride_ps, stride_pm, stride_om,
    # meta-parameters
    FORMAT: tl.constexpr, BITS: tl.constexpr, GLU: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FOLD: tl.constexpr, X_VEC: tl.constexpr,
    EMULATE_BF16: tl.constexpr, HOIST: tl.constexpr, FIXUP: tl.constexpr, UNROLL: tl.constexpr,
):  # fmt: skip
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:  # past the last run: no weight read
        return
    pairs = tl.load(pairs_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < P
    x_rows = a_ptr + tl.where(valid, pairs // a_div, 0) * stride_am  # padding rows read row 0, stored nowhere
    if GLU:  # the first half of the tile: gate rows n0 + j of W13, the second half: the up rows N + n0 + j
        HALF: tl.constexpr = BLOCK_N // 2
        col = tl.arange(0, BLOCK_N)
        offs_c = tl.program_id(1) * HALF + col % HALF  # the column of a = silu(g) * u that both halves feed
        offs_n = offs_c + (col // HALF) * N
        n_lim = 2 * N
    else:
        offs_c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_n = offs_c
        n_lim = N
    t_begin = tl.program_id(2) * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, tl.cdiv(K, BLOCK_K))
    e64 = expert.to(tl.int64)
    acc = _project(x_rows, w_ptr + e64 * stride_we, z_ptr + e64 * stride_ze, s_ptr + e64 * stride_se, offs_n, n_lim,
                   K, group_size, t_begin, t_end, magic, sixteen, stride_wk, stride_wn, stride_zg, stride_zn,
                   stride_sg, stride_sn, FORMAT, BITS, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, FOLD, X_VEC,
                   HOIST)  # fmt: skip
    if PARTIAL:  # fp32 partials [S, P, N] (gate/up: [S, P, 2N], the row of gu)
        offs_p = pairs[:, None] * stride_pm + offs_n[None, :]
        mask = valid[:, None] & (offs_c < N)[None, :]
        tl.store(part_ptr + tl.program_id(2) * stride_ps + offs_p, acc, mask=mask)
        if FIXUP:  # gate/up: the tile's last split to arrive adds all of them in split order, then SiLU
            tl.debug_barrier()  # this CTA's partial stores happen before its release below
            lock = lock_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            arrived = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
            splits = tl.num_programs(2)
            if arrived == splits - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s0 in range(0, splits, UNROLL):  # UNROLL partials in flight per round
                    for j in tl.static_range(UNROLL):
                        in_split = offs_p * 0 + s0 + j < splits
                        total += tl.load(part_ptr + (s0 + j) * stride_ps + offs_p, mask=mask & in_split, other=0.0,
                                         cache_modifier=".cg")  # fmt: skip
                tl.atomic_xchg(lock, 0)  # ready for the next launch
                _silu_store(total, act_ptr, pairs, valid, N, stride_om, BLOCK_M, BLOCK_N, EMULATE_BF16)
    else:  # gate/up in one split
        _silu_store(acc, act_ptr, pairs, valid, N, stride_om, BLOCK_M, BLOCK_N, EMULATE_BF16)


@triton.jit
def _silu_store(gu, act_ptr, pairs, valid, N, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                EMULATE_BF16: tl.constexpr):  # fmt: skip
    """a[pairs, n0 + j] = silu(g) * u of a gate/up tile [BLOCK_M, BLOCK_N] (gate columns, then the matching up
    columns): g and u rounded to a's dtype, the product in fp32, rounded once."""
    ACT: tl.constexpr = act_ptr.dtype.element_ty
    gu = to_act(gu, ACT, EMULATE_BF16).to(tl.float32)
    g, u = tl.split(tl.permute(tl.reshape(gu, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
    offs_a = tl.program_id(1) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(act_ptr + pairs[:, None] * stride_om + offs_a[None, :], to_act(g / (1.0 + tl.exp(-g)) * u, ACT,
             EMULATE_BF16), mask=valid[:, None] & (offs_a < N)[None, :])  # fmt: skip


@triton.jit
def _glu_splits_kernel(part_ptr, act_ptr, N, splits, stride_ps, stride_pm, stride_om, SPLITS_PAD: tl.constexpr,
                       BLOCK: tl.constexpr, EMULATE_BF16: tl.constexpr):  # fmt: skip
    """a[p] = silu(g) * u of gate/up's split partials: g and u summed over the splits (all loaded at once, one fixed
    reduction tree: the same bits on every run), rounded to a's dtype, the product in fp32 rounded once."""
    p = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    offs_s = tl.arange(0, SPLITS_PAD)
    mask = (offs_s < splits)[:, None] & (offs < N)[None, :]
    rows = part_ptr + offs_s[:, None] * stride_ps + p * stride_pm + offs[None, :]
    g = tl.sum(tl.load(rows, mask=mask, other=0.0), axis=0)
    u = tl.sum(tl.load(rows + N, mask=mask, other=0.0), axis=0)
    ACT: tl.constexpr = act_ptr.dtype.element_ty
    g = to_act(g, ACT, EMULATE_BF16).to(tl.float32)
    u = to_act(u, ACT, EMULATE_BF16).to(tl.float32)
    tl.store(act_ptr + p * stride_om + offs, to_act(g / (1.0 + tl.exp(-g)) * u, ACT, EMULATE_BF16), mask=offs < N)


def _project_launch(a, w, out, pairs, block_expert, p, a_div, glu, cfg, blocks) -> tuple[int, torch.Tensor]:
    """One decode launch of projection ``w`` over rows of ``a``. glu: silu(g) * u into ``out`` [P, N / 2] (where K
    is split, through fp32 partials: fixed up in the launch, or summed by ``_glu_splits_kernel`` where the tiles
    outnumber ``w.locks`` or the config says FIXUP 0); else fp32 partials [S, P, N]. Returns (S, partials or
    ``out``)."""
    n = w.out_features // 2 if glu else w.out_features  # columns of the output
    k = w.in_features
    bm = cfg["BLOCK_M"]
    bn, bk, warps, per_split, splits = decode_plan(cfg, w.fmt, w.out_features, k, w.group_size, blocks,
                                                   a.element_size(), num_sms(a.device))  # fmt: skip
    partial = splits > 1 or not glu
    if partial and splits * p * w.out_features >= 2**31:  # the operand check bounds one split's rows, not S of them
        raise ValueError(f"{splits} K splits of {p} pairs x {w.out_features} fp32 partials pass 2**31 elements "
                         "(32-bit offsets): fewer tokens or SPLIT_K")  # fmt: skip
    part = torch.empty(splits, p, 2 * n if glu else n, dtype=torch.float32, device=a.device) if partial else out
    out = out if glu else part
    n_tiles = triton.cdiv(n, bn // 2) if glu else triton.cdiv(n, bn)
    # gate/up split: fixed up in place where the tiles have semaphores, else summed by _glu_splits_kernel
    fixup = glu and partial and bool(cfg.get("FIXUP", 1)) and block_expert.numel() * n_tiles <= w.locks.numel()
    quant = w.fmt == "w4a16"
    z = w.qzeros if quant else w.weight
    s = w.scales if quant else w.weight
    if quant:  # qweight [E, K / pf, N]
        wst = (w.weight.stride(0), w.weight.stride(1), w.weight.stride(2))
    else:  # [E, N, K]
        wst = (w.weight.stride(0), w.weight.stride(2), w.weight.stride(1))
    fold = quant and w.bits == 4
    hoist = quant and bool(cfg.get("HOIST", bm == 1 and w.bits == 4))
    aligned = a.data_ptr() % 8 == 0 and a.stride(0) % 4 == 0
    grid = (block_expert.numel(), n_tiles, splits)
    _moe_gemv_kernel[grid](
        a, w.weight, z, s, part, out, pairs, block_expert, w.locks,
        n, k, p, (w.group_size or 2**30) if quant else 0, per_split, a_div, MAGIC_F32, 16,
        a.stride(0), *wst, z.stride(0), z.stride(1), z.stride(2), s.stride(0), s.stride(1), s.stride(2),
        part.stride(0), part.stride(1), out.stride(0),
        FORMAT=W4A16 if quant else FLOAT, BITS=w.bits, GLU=glu, PARTIAL=partial, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0, FOLD=fold, X_VEC=fold and k % bk == 0 and aligned,
        EMULATE_BF16=interpreting() and a.dtype == torch.bfloat16, HOIST=hoist, FIXUP=fixup,
        UNROLL=min(8, triton.next_power_of_2(splits)), num_warps=warps, num_stages=1,
    )  # fmt: skip
    if glu and partial and not fixup:
        pad = triton.next_power_of_2(splits)
        block = min(max(32, 1024 // pad), triton.next_power_of_2(n))  # 8 partials of g and of u per thread
        _glu_splits_kernel[(p, triton.cdiv(n, block))](
            part, out, n, splits, part.stride(0), part.stride(1), out.stride(0), SPLITS_PAD=pad, BLOCK=block,
            EMULATE_BF16=interpreting() and out.dtype == torch.bfloat16, num_warps=4,
        )  # fmt: skip
    return splits, part


def decode_experts(x, w13, w2, ids, pairs, block_expert, cfg) -> tuple[torch.Tensor, int]:
    """The down projection's fp32 partial sums [S, T * k, H], unweighted, and S: the layer's routed experts on the
    decode path. ``x`` [T, H] and the experts checked by ``experts.check_operands``; ``pairs`` and ``block_expert``
    from ``align(ids, E, cfg["BLOCK_M"])``."""
    t, k = ids.shape
    p = t * k
    blocks = min(triton.cdiv(p, cfg["BLOCK_M"]), w13.num_experts)  # blocks expected to hold rows
    flat = ids.reshape(-1).long()
    a_div = k
    if w13.perm is not None:  # act-order: row p reads x[p // k] in expert ids[p]'s channel order
        x, a_div = x.repeat_interleave(k, dim=0).gather(1, w13.perm[flat]), 1
    act = torch.empty(p, w2.in_features, dtype=x.dtype, device=x.device)  # silu(g) * u of every pair
    _project_launch(x, w13, act, pairs, block_expert, p, a_div, True, cfg, blocks)
    if w2.perm is not None:
        act = act.gather(1, w2.perm[flat])
    splits, part = _project_launch(act, w2, None, pairs, block_expert, p, 1, False, cfg, blocks)
    return part, splits
