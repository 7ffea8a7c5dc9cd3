"""Prefill attention over a paged KV cache: FlashAttention-2 tiling with an online softmax (Dao, 2023).

Computes causal ``softmax(q k^T * scale) v`` for a batch of variable-length query chunks packed along the token axis,
each attending to its sequence's whole context in the paged cache: the cached prefix (earlier chunks of a chunked
prefill, or blocks shared with another sequence) followed by the chunk itself. The caller writes the chunk's K/V into
the cache first (``store_kv`` in ``paged_attention``), so one kernel serves first prefills, chunked prefills and
prefix-cache hits alike. Optional sliding window: query at position p sees keys p - window + 1 .. p.

Layouts (T packed query tokens, N sequences, Hq / Hkv heads, GQA group G = Hq / Hkv, D head dim, P page size):

- ``q`` [T, Hq, D]; ``out`` [T, Hq, D] in q's dtype.
- ``k_cache``, ``v_cache`` [num_blocks, P, Hkv, D]; ``block_tables`` int32 [N, max_pages].
- ``cu_seqlens_q`` int32 [N + 1]: chunk n owns rows ``cu[n] .. cu[n+1]-1`` of q.
- ``context_lens`` int32 [N]: tokens in the cache for sequence n after the chunk was written (prefix + chunk), so the
  chunk's queries sit at positions ``context_len - chunk_len .. context_len - 1``.

One program per (BLOCK_M query rows, sequence, query head). Key tiles wholly left of the diagonal skip masking
(the EVEN fast path); the rest are masked. Accumulation is fp32, exponentials in base 2. Limits: D <= 256.
Tuned on: nothing yet (defaults picked for H200, bf16, D = 128; benchmarks/bench_attention.py sweeps them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quantkit.kernels.paged_attention import LOG2E, dot_precision, gather_context


def flash_prefill_reference(
    q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale: float, window: int = 0
) -> torch.Tensor:
    """q [T, Hq, D] -> out [T, Hq, D]; fp32 math, output in q's dtype."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    cu = cu_seqlens_q.tolist()
    for n, kv_len in enumerate(context_lens.tolist()):
        q_len = cu[n + 1] - cu[n]
        if q_len == 0:
            continue
        k = gather_context(k_cache, block_tables[n], 0, kv_len).float().repeat_interleave(group, dim=1)
        v = gather_context(v_cache, block_tables[n], 0, kv_len).float().repeat_interleave(group, dim=1)
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
        k_pos = torch.arange(kv_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if window > 0:
            allowed &= k_pos > q_pos - window
        scores = torch.einsum("thd,lhd->htl", q[cu[n] : cu[n + 1]].float(), k) * scale
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[cu[n] : cu[n + 1]] = torch.einsum("htl,lhd->thd", probs, v).to(q.dtype)
    return out


@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    n,
    q_pos,
    kv_len,
    window,
    table,
    k_base,
    v_base,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    offs_d,
    d_mask,
    qk_scale,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One key tile of the online softmax; returns the updated (m_i, l_i, acc)."""
    pos = n + tl.arange(0, BLOCK_N)
    if MASKED:
        n_mask = pos < kv_len
        page = tl.load(table + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        page = tl.load(table + pos // PAGE).to(tl.int64)
        kv_mask = d_mask[None, :]
    row = pos % PAGE
    k = tl.load(
        k_base + page[:, None] * stride_kb + row[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0
    )
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
    if MASKED:
        allowed = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        allowed &= (window <= 0) | (pos[None, :] > q_pos[:, None] - window)
        qk = tl.where(allowed, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at zero weight
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        v_base + page[:, None] * stride_vb + row[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0
    )
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["window"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_seqlens_ptr,
    context_lens_ptr,
    out_ptr,
    qk_scale,  # softmax scale * log2(e)
    window,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32 rounding), "tf32" (ignored) for 16-bit ones
):
    m_block = tl.program_id(0)
    seq = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    kv_len = tl.load(context_lens_ptr + seq)
    first = kv_len - q_len + m_block * BLOCK_M  # position of this tile's first query

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_pos = kv_len - q_len + offs_m
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    kvh = h // GROUP
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kvh * stride_kh
    v_base = v_cache_ptr + kvh * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(first + BLOCK_M, kv_len)  # causal: no key beyond the tile's last query
    lo = tl.where(window > 0, tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N, 0)
    full_end = tl.where(window > 0, lo, (first + 1) // BLOCK_N * BLOCK_N)  # tiles before it need no mask
    for n in range(lo, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, n, q_pos, kv_len, window, table, k_base, v_base,
            stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_mask, qk_scale,
            PAGE, BLOCK_N, False, PRECISION,
        )  # fmt: skip
    for n in range(full_end, hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, n, q_pos, kv_len, window, table, k_base, v_base,
            stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_mask, qk_scale,
            PAGE, BLOCK_N, True, PRECISION,
        )  # fmt: skip
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def flash_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_q_len: int,
    scale: float,
    window: int = 0,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 3,
) -> torch.Tensor:
    """Causal attention of packed query chunks against the paged cache (see the module docstring for layouts).

    ``max_q_len`` is a host-side upper bound on the chunk lengths (it sizes the grid).
    """
    t, hq, d = q.shape
    _, page, hkv, d_cache = k_cache.shape
    n_seq = context_lens.shape[0]
    if v_cache.shape != k_cache.shape or d_cache != d:
        raise ValueError(f"flash_prefill: q {tuple(q.shape)} and caches {tuple(k_cache.shape)} disagree")
    if hq % hkv != 0:
        raise ValueError(f"flash_prefill: {hq} query heads are not a multiple of {hkv} kv heads")
    if d > 256:
        raise ValueError(f"flash_prefill: head dim {d} > 256 is not supported")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("flash_prefill: the head dimension must be contiguous in q and the caches")
    if any(x.dtype != torch.int32 for x in (block_tables, cu_seqlens_q, context_lens)):
        raise ValueError("flash_prefill: block_tables, cu_seqlens_q and context_lens must be int32")
    if cu_seqlens_q.shape != (n_seq + 1,) or block_tables.shape[0] != n_seq:
        raise ValueError(f"flash_prefill: cu_seqlens_q must be [{n_seq + 1}] and block_tables [{n_seq}, pages]")
    out = torch.empty_like(q)
    if t == 0 or n_seq == 0:
        return out
    on_cpu = q.device.type == "cpu"  # Triton's interpreter: small tiles run much faster there
    block_m = block_m or (16 if on_cpu else 128)
    block_n = block_n or (16 if on_cpu else 64)
    grid = (triton.cdiv(max_q_len, block_m), n_seq, hq)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        out,
        scale * LOG2E,
        window,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=d,
        BLOCK_D=triton.next_power_of_2(d),
        GROUP=hq // hkv,
        PAGE=page,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PRECISION=dot_precision(q.dtype),
        num_warps=num_warps or (4 if block_m <= 64 else 8),
        num_stages=num_stages,
    )
    return out
