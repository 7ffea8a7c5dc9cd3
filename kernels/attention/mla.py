"""Multi-head latent attention (MLA, DeepSeek-V2/V3) decode over a paged cache of latent rows, absorbed form.

Layouts (B sequences, H heads, R = kv_lora_rank, P = qk_rope_head_dim, page size S):

- ``latent_cache`` [num_blocks, S, 1, R + P]: per token the normalised compressed KV c (first R values) and the
  rotated key k_pe shared by every head (last P values); pages as in ``paged`` (block tables, int32).
- ``q_lat`` [B, H, R]: each head's q_nope taken through kv_b_proj's key rows (W_UK^T q_nope); ``q_pe`` [B, H, P].
- ``store_latent`` writes a step's latent rows into their slots (-1: padding, skipped).
- output ``o_lat`` [B, H, R] = sum_j softmax_j(scale * (q_lat . c_j + q_pe . k_pe_j)) c_j, still to go through
  kv_b_proj's value rows (W_UV) per head; empty contexts give zeros.

All H heads read the same latent rows, so each program takes one sequence, ``BLOCK_H`` heads and one split of the
context, and a tile of latent rows serves every head of the program (two tensor-core products per tile: [BLOCK_H,
R] x [R, BLOCK_N] plus the rope part, then [BLOCK_H, BLOCK_N] x [BLOCK_N, R]); a second kernel merges the splits
by their log-sum-exps (flash-decoding). With 128 heads every head tile reads the context again; making the head
tiles of one sequence and split neighbours in the grid (so that all but the first read the rows from L2) measured
no faster on the H100 (14.8% of copy bandwidth, 14.7% in an earlier run without it). Accumulation is fp32; q
is cast to the cache's dtype for the products.
Limits: R and P up to 512 and 64 as DeepSeek-V3's (any size under the registers' budget works; powers of two are
padded with masks otherwise). Tuned on: nothing yet (interpreter-tested against ``mla_decode_reference``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quantkit.kernels._device import dot_precision
from quantkit.kernels.attention.paged import LOG2E, default_num_splits, gather_context, merge_splits


def store_latent_reference(latent, latent_cache, slot_mapping) -> None:
    """latent rows [T, R + P] -> ``latent_cache`` rows at ``slot_mapping`` [T] (slot -1: skipped)."""
    keep = slot_mapping >= 0
    rows = latent_cache.view(-1, latent_cache.shape[-1])
    rows.index_copy_(0, slot_mapping[keep].long(), latent[keep].to(latent_cache.dtype))


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _store_latent_kernel(x_ptr, cache_ptr, slot_ptr, width, stride_xt, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < width
    x = tl.load(x_ptr + t * stride_xt + offs, mask=mask)
    tl.store(cache_ptr + slot * width + offs, x.to(cache_ptr.dtype.element_ty), mask=mask)


def store_latent(latent: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``store_latent_reference`` in one launch, with no host synchronisation (the reference's masked indexing
    waits for the device)."""
    t, width = latent.shape
    if latent_cache.shape[2:] != (1, width) or not latent_cache.is_contiguous() or latent.stride(1) != 1:
        raise ValueError(f"store_latent: rows {tuple(latent.shape)} and cache {tuple(latent_cache.shape)} disagree "
                         "(or are not contiguous)")  # fmt: skip
    if slot_mapping.shape != (t,):
        raise ValueError(f"store_latent: slot_mapping must be [{t}], got {tuple(slot_mapping.shape)}")
    if t:
        _store_latent_kernel[(t,)](
            latent, latent_cache, slot_mapping, width, latent.stride(0), BLOCK=triton.next_power_of_2(width)
        )


def mla_decode_reference(q_lat, q_pe, latent_cache, block_tables, context_lens, scale: float) -> torch.Tensor:
    """q_lat [B, H, R], q_pe [B, H, P], latent_cache [blocks, S, 1, R + P] -> o_lat [B, H, R]; fp32 math, q_lat's
    dtype; zero rows where the context is empty."""
    rank = q_lat.shape[-1]
    out = torch.zeros_like(q_lat)
    for b, ctx in enumerate(context_lens.tolist()):
        if ctx == 0:
            continue
        rows = gather_context(latent_cache, block_tables[b], 0, ctx)[:, 0].float()  # [L, R + P]
        c, k_pe = rows[:, :rank], rows[:, rank:]
        scores = (q_lat[b].float() @ c.T + q_pe[b].float() @ k_pe.T) * scale  # [H, L]
        out[b] = (scores.softmax(-1) @ c).to(q_lat.dtype)
    return out


@triton.jit
def _mla_split_kernel(
    q_ptr,  # q_lat [B, H, R]
    qp_ptr,  # q_pe [B, H, P]
    cache_ptr,  # [blocks, S, 1, R + P]
    block_tables_ptr,
    context_lens_ptr,
    o_part_ptr,  # fp32 [B, H, splits, R]
    lse_part_ptr,  # fp32 [B, H, splits]
    qk_scale,  # scale * log2(e)
    H,
    stride_qb,
    stride_qh,
    stride_pb,
    stride_ph,
    stride_cb,
    stride_cs,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(ctx, BLOCK_N), NUM_SPLITS) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(ctx, lo + per_split)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    h_mask, r_mask, p_mask = heads < H, offs_r < RANK, offs_p < ROPE
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_r[None, :],
        mask=h_mask[:, None] & r_mask[None, :],
        other=0.0,
    )
    qp = tl.load(
        qp_ptr + b * stride_pb + heads[:, None] * stride_ph + offs_p[None, :],
        mask=h_mask[:, None] & p_mask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    for n in range(lo, hi, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)
        n_mask = pos < hi
        page = tl.load(table + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
        row_ptr = cache_ptr + page * stride_cb + (pos % PAGE) * stride_cs  # [BLOCK_N]
        c = tl.load(row_ptr[:, None] + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        k_pe = tl.load(row_ptr[:, None] + RANK + offs_p[None, :], mask=n_mask[:, None] & p_mask[None, :], other=0.0)
        qk = tl.dot(q, tl.trans(c), input_precision=PRECISION)
        qk = tl.dot(qp, tl.trans(k_pe), qk, input_precision=PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N], log2 units
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o_ptrs = o_part_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_r[None, :]
    tl.store(o_ptrs, acc / l_safe[:, None], mask=h_mask[:, None] & r_mask[None, :])
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))  # empty split: weight 0 when merged
    tl.store(lse_part_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


def mla_decode(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    max_context: int | None = None,
    block_h: int = 16,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Absorbed MLA decode (module docstring) -> o_lat [B, H, R] in the cache's dtype. ``num_splits`` fixed by the
    caller keeps the launch shape static (CUDA graphs); otherwise it is chosen from ``max_context`` (a host bound on
    ``context_lens``; the block-table width times the page size if omitted)."""
    bsz, heads, rank = q_lat.shape
    _, page, one, width = latent_cache.shape
    rope = width - rank
    if one != 1 or rope < 1 or q_pe.shape != (bsz, heads, rope):
        raise ValueError(
            f"mla_decode: q_lat {tuple(q_lat.shape)}, q_pe {tuple(q_pe.shape)} and latent cache "
            f"{tuple(latent_cache.shape)} disagree (cache rows hold R + P values: R from q_lat, P from q_pe)"
        )
    if latent_cache.stride(3) != 1:
        raise ValueError("mla_decode: the latent cache's rows must be contiguous")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("mla_decode: block_tables and context_lens must be int32")
    if block_tables.shape[0] != bsz or context_lens.shape != (bsz,):
        raise ValueError(f"mla_decode: block_tables {tuple(block_tables.shape)} / context_lens do not match B={bsz}")
    q_lat = q_lat.to(latent_cache.dtype).contiguous()
    q_pe = q_pe.to(latent_cache.dtype).contiguous()
    out = torch.empty_like(q_lat)
    if bsz == 0:
        return out
    block_n = block_n or (16 if q_lat.device.type == "cpu" else 32)
    if num_splits is None:
        max_context = max_context if max_context is not None else block_tables.shape[1] * page
        num_splits = default_num_splits(bsz, triton.cdiv(heads, block_h), max_context, block_n=block_n)
    o_part = torch.empty(bsz, heads, num_splits, rank, device=q_lat.device, dtype=torch.float32)
    lse_part = torch.empty(bsz, heads, num_splits, device=q_lat.device, dtype=torch.float32)
    block_r = triton.next_power_of_2(rank)
    _mla_split_kernel[(bsz, triton.cdiv(heads, block_h), num_splits)](
        q_lat,
        q_pe,
        latent_cache,
        block_tables,
        context_lens,
        o_part,
        lse_part,
        scale * LOG2E,
        heads,
        q_lat.stride(0),
        q_lat.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        latent_cache.stride(0),
        latent_cache.stride(1),
        block_tables.stride(0),
        *o_part.stride()[:3],
        *lse_part.stride()[:2],
        RANK=rank,
        ROPE=rope,
        BLOCK_R=max(16, block_r),
        BLOCK_P=max(16, triton.next_power_of_2(rope)),
        BLOCK_H=block_h,
        PAGE=page,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        PRECISION=dot_precision(q_lat.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return merge_splits(o_part, lse_part, out, rank, max(16, block_r), num_splits)
