"""Paged KV cache: storing new keys/values into it, and decode attention over block tables (flash-decoding).

Layouts (T tokens, B sequences, Hq query heads, Hkv kv heads, GQA group G = Hq / Hkv, D head dim, P page size):

- ``k_cache``, ``v_cache`` [num_blocks, P, Hkv, D]: page ``b`` holds tokens ``b*P .. b*P + P - 1`` of whichever
  sequence owns it; slot ``s`` is page ``s // P``, row ``s % P`` (vLLM's PagedAttention, SOSP 2023).
- ``slot_mapping`` int [T]: where token t's K/V go; ``-1`` skips the token (padding rows of a CUDA graph).
- ``block_tables`` int32 [B, max_pages]: page ids of each sequence, in order; ``context_lens`` int32 [B].

Decode attention computes, for one query per sequence, ``softmax(q k^T * scale) v`` over the sequence's context
(optionally only the last ``window`` positions, for sliding-window layers). Each program takes one sequence, one kv
head (all G query heads that share it, so K/V are read once) and one split of the context; a second kernel merges
the splits with their log-sum-exps (flash-decoding, Dao et al. 2023). Splits keep the 132 SMs busy when
batch x Hkv is small and contexts are long. Accumulation is fp32. Limits: D <= 256; G <= 64.
Tuned on: nothing yet (defaults picked for H200, bf16, D = 128; benchmarks/bench_attention.py sweeps them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quantkit.kernels._device import dot_precision

LOG2E = 1.4426950408889634


def store_kv_reference(k, v, k_cache, v_cache, slot_mapping) -> None:
    """k, v [T, Hkv, D] -> k_cache/v_cache rows at ``slot_mapping`` (rows with slot -1 are skipped)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep].to(v_cache.dtype))


def gather_context(cache, block_table, start: int, end: int) -> torch.Tensor:
    """Rows ``start .. end-1`` of one sequence from a paged cache -> [end - start, Hkv, D]."""
    page = cache.shape[1]
    pos = torch.arange(start, end, device=cache.device)
    return cache[block_table[pos // page].long(), pos % page]


def paged_decode_reference(q, k_cache, v_cache, block_tables, context_lens, scale: float, window: int = 0):
    """q [B, Hq, D] -> out [B, Hq, D]; fp32 math, output in q's dtype. Zero rows where the context is empty."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for b, ctx in enumerate(context_lens.tolist()):
        start = max(0, ctx - window) if window > 0 else 0
        if ctx == 0:
            continue
        k = gather_context(k_cache, block_tables[b], start, ctx).float().repeat_interleave(group, dim=1)
        v = gather_context(v_cache, block_tables[b], start, ctx).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * scale  # [Hq, L]
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out


# The step's metadata (slot mapping, context lengths, block-table rows; also in prefill.py) are slices of one
# packed buffer whose offsets move with the step's row count: not specializing on their 16-byte alignment keeps one
# compiled kernel for every step instead of one per alignment pattern, so a timed run never meets a new pattern and
# compiles inside it.
@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    n_elems,  # Hkv * D
    stride_kt,
    stride_vt,
    stride_cache_slot,  # elements between consecutive slots of the cache (Hkv * D when contiguous)
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    for start in range(0, n_elems, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_elems
        k = tl.load(k_ptr + t * stride_kt + offs, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
        tl.store(k_cache_ptr + slot * stride_cache_slot + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + slot * stride_cache_slot + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write k, v [T, Hkv, D] into the paged cache at ``slot_mapping`` [T] (in place)."""
    t, hkv, d = k.shape
    if v.shape != k.shape or k_cache.shape != v_cache.shape or k_cache.shape[2:] != (hkv, d):
        raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(k_cache.shape)} disagree")
    if slot_mapping.shape != (t,):
        raise ValueError(f"store_kv: slot_mapping must be [{t}], got {tuple(slot_mapping.shape)}")
    if not (k.stride(2) == 1 and k.stride(1) == d and v.stride(2) == 1 and v.stride(1) == d):
        raise ValueError("store_kv: each token's [Hkv, D] slice of k and v must be contiguous")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv: the caches must be contiguous")
    if t == 0:
        return
    n = hkv * d
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping, n, k.stride(0), v.stride(0), n, BLOCK=min(1024, triton.next_power_of_2(n))
    )


@triton.jit(do_not_specialize=["window"], do_not_specialize_on_alignment=["block_tables_ptr", "context_lens_ptr"])
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    o_part_ptr,
    lse_part_ptr,
    qk_scale,  # softmax scale * log2(e)
    window,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32 rounding), "tf32" (ignored) for 16-bit ones
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b)
    start = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    split_len = tl.cdiv(tl.cdiv(ctx - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = start + split * split_len
    hi = tl.minimum(lo + split_len, ctx)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_h
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    for n in range(lo, hi, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)
        n_mask = pos < hi
        page = tl.load(table + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
        row = pos % PAGE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_cache_ptr + page[:, None] * stride_kb + row[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N], log2 units
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + page[:, None] * stride_vb + row[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o_ptrs = o_part_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(o_ptrs, acc / l_safe[:, None], mask=h_mask[:, None] & d_mask[None, :])
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))  # empty split: -inf, weight 0 when merged
    tl.store(lse_part_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


@triton.jit
def _decode_merge_kernel(
    o_part_ptr,
    lse_part_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(lse_part_ptr + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # [BLOCK_S]
    o = tl.load(
        o_part_ptr + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    denom = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + b * stride_outb + h * stride_outh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


# Only long contexts at batch <= 4 (8 kv heads) reach the cap. H200, bf16, 8 kv heads, batch 1 at 32k context:
# 64 splits of 512 keys ran at 78% of copy bandwidth against 63% for 32 splits (256 programs: too few loads in
# flight); batch 8 at 8k stays at its 17 splits (86%; 64 splits: 79%) (bench_attention.py)
MAX_SPLITS = 64


def default_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int = 132, block_n: int = 64) -> int:
    """Enough splits for ~8 programs per SM, so that the last, partial wave of programs costs little (at batch 64
    x 8 kv heads one split gives 512 programs: 1.3 waves of ~3 resident per SM, i.e. a 35% idle tail), but no
    split shorter than 4 tiles; at most ``MAX_SPLITS``."""
    want = triton.cdiv(8 * num_sms, max(1, batch * num_kv_heads))
    return max(1, min(MAX_SPLITS, want, triton.cdiv(max_context, 4 * block_n)))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    num_splits: int | None = None,
    max_context: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """One query per sequence against its paged context: q [B, Hq, D] -> out [B, Hq, D] (q's dtype).

    ``num_splits`` fixed by the caller keeps the launch shape static (CUDA graphs); otherwise it is chosen from
    ``max_context`` (a host-side bound on ``context_lens``; the block-table width times the page size if omitted).
    """
    bsz, hq, d = q.shape
    _, page, hkv, d_cache = k_cache.shape
    if v_cache.shape != k_cache.shape or d_cache != d:
        raise ValueError(f"paged_decode: q {tuple(q.shape)} and caches {tuple(k_cache.shape)} disagree")
    if hq % hkv != 0:
        raise ValueError(f"paged_decode: {hq} query heads are not a multiple of {hkv} kv heads")
    if d > 256 or hq // hkv > 64:
        raise ValueError(f"paged_decode: head dim {d} > 256 or GQA group {hq // hkv} > 64 is not supported")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("paged_decode: the head dimension must be contiguous in q and the caches")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("paged_decode: block_tables and context_lens must be int32")
    if block_tables.shape[0] != bsz or context_lens.shape != (bsz,):
        raise ValueError(f"paged_decode: block_tables {tuple(block_tables.shape)} / context_lens do not match B={bsz}")
    block_n = block_n or (16 if q.device.type == "cpu" else 64)
    if num_splits is None:
        max_context = max_context if max_context is not None else block_tables.shape[1] * page
        num_splits = default_num_splits(bsz, hkv, max_context, block_n=block_n)
    out = torch.empty_like(q)
    if bsz == 0:
        return out
    o_part = torch.empty(bsz, hq, num_splits, d, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(bsz, hq, num_splits, device=q.device, dtype=torch.float32)
    group = hq // hkv
    block_d = triton.next_power_of_2(d)
    _decode_split_kernel[(bsz, hkv, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        o_part,
        lse_part,
        scale * LOG2E,
        window,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        *o_part.stride()[:3],
        *lse_part.stride()[:2],
        HEAD_DIM=d,
        BLOCK_D=block_d,
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        PAGE=page,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        PRECISION=dot_precision(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return merge_splits(o_part, lse_part, out, d, block_d, num_splits)


def merge_splits(o_part, lse_part, out, width: int, block: int, num_splits: int) -> torch.Tensor:
    """out [B, H, width] = the splits' partial outputs o_part [B, H, splits, width] weighted by their base-2
    log-sum-exps lse_part [B, H, splits] (an empty split's -inf weighs 0); ``block`` >= width, a power of two."""
    bsz, heads = out.shape[:2]
    _decode_merge_kernel[(bsz, heads)](
        o_part,
        lse_part,
        out,
        *o_part.stride()[:3],
        *lse_part.stride()[:2],
        out.stride(0),
        out.stride(1),
        HEAD_DIM=width,
        BLOCK_D=block,
        NUM_SPLITS=num_splits,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
    )
    return out
