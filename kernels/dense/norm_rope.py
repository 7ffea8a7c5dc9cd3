"""The runtime's small per-layer operations, one launch each: residual add + RMSNorm, rotary embedding of q and k,
and SiLU-gated product.

At batch 1 a decode step of an 8B model was ~40 launches per layer in PyTorch (counted from the modules), most
of them element-wise pieces of RMSNorm (~7 launches) and rotary embeddings (~6 per tensor); inside a CUDA graph
each still costs a few microseconds. With these kernels (and fused q/k/v, gate/up GEMMs) batch-1 bf16 decode on
the H200 went from 50% to 72% of the bandwidth roofline. These kernels do the same
arithmetic as the PyTorch modules of ``quantkit.runtime.model``:

- ``add_rms_norm(x, weight, eps, residual)``: ``h = x + residual`` (rounded to x's dtype, as the PyTorch add), then
  ``y = weight * (h_fp32 * rsqrt(mean(h_fp32^2) + eps)).to(dtype)``; returns (y, h). Without ``residual``, h = x.
  One program per row; rows up to ``MAX_HIDDEN`` elements are held in registers.
- ``rotary_(q, k, cos, sin)``: in place, ``x * cos + rotate_half(x) * sin`` with rotate_half(x) = [-x2, x1] (the
  NeoX / Llama convention) for every head of q [T, Hq, D] and k [T, Hkv, D]; cos, sin [T, D] in x's dtype. Computed
  in fp32 and rounded once (PyTorch rounds after each product and the sum: results can differ by an ulp). One
  launch for both when k's heads follow q's in memory (the fused q/k/v projection's output), else one each: a
  batch-1 decode step of an 8B model spent 68 us in 64 rotary launches.
- ``rotary_store_(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)``: ``rotary_`` of q and k, and the rotated k
  and v written into the paged KV cache at ``slot_mapping`` (``attention.paged.store_kv``'s layout and rule: slot -1
  stores nothing), in one launch when q, k and v are the fused q/k/v projection's split views; returns False (doing
  nothing) otherwise, and the caller rotates and stores separately. Saves the KV store's launch of every layer.
- ``silu_mul(g, u)``: ``silu(g) * u`` computed in fp32, rounded once.

Tuned on: nothing (launch-bound sizes; one warp group per row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_HIDDEN = 16384


def add_rms_norm_reference(x, weight, eps: float, residual=None):
    """transformers' RMSNorm (fp32 statistics, normalised value rounded to x's dtype, then the weight) of x + residual;
    the runtime's CPU path."""
    h = x if residual is None else residual + x
    f = h.float()
    y = weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return y, h


def rotary_reference_(q, k, cos, sin) -> None:
    for x in (q, k):
        half = x.shape[-1] // 2
        c, s = cos[:, None, :].float(), sin[:, None, :].float()
        f = x.float()
        x.copy_(f * c + torch.cat((-f[..., half:], f[..., :half]), dim=-1) * s)


def silu_mul_reference(g, u):
    return (torch.nn.functional.silu(g.float()) * u.float()).to(g.dtype)


@triton.jit
def add_rms_norm_row(x_ptr, r_ptr, w_ptr, h_ptr, row, n, stride_x, stride_r, eps, offs, mask,
                     HAS_RESIDUAL: tl.constexpr):  # fmt: skip
    """Row ``row`` of ``add_rms_norm`` (offs: the whole row, masked past n): stores h = x + residual
    (HAS_RESIDUAL) and returns y in x's dtype. ``norm_quant`` quantizes the same y."""
    h = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        h = (h.to(tl.float32) + tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)).to(h.dtype)
        tl.store(h_ptr + row * n + offs, h, mask=mask)
    f = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(f * f, axis=0) / n + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    return (w.to(tl.float32) * (f * rstd).to(h.dtype).to(tl.float32)).to(h.dtype)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, n, stride_x, stride_r, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    y = add_rms_norm_row(x_ptr, r_ptr, w_ptr, h_ptr, row, n, stride_x, stride_r, eps, offs, mask, HAS_RESIDUAL)
    tl.store(y_ptr + row * n + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def norm_launch(n: int) -> tuple[int, int]:
    """(block, num_warps) of a norm program over a row of n elements: the whole row, a warp per 512 elements (1-8).
    ``norm_quant`` launches its norm so too: the same reduction, the same bits."""
    block = triton.next_power_of_2(n)
    return block, max(1, min(8, block // 512))


def add_rms_norm(x, weight, eps: float, residual=None, num_warps: int | None = None):
    """x [T, n] (and residual [T, n]) -> (y [T, n], h [T, n]) with h = x + residual (or x itself).
    ``num_warps``: overrides the launch's warps (probes)."""
    if x.dim() != 2 or x.stride(1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} (rows contiguous), weight {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    t, n = x.shape
    if n > MAX_HIDDEN:
        raise ValueError(f"add_rms_norm: rows of at most {MAX_HIDDEN} elements, got {n}")
    y = torch.empty((t, n), dtype=x.dtype, device=x.device)
    h = x if residual is None else torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t:
        block, warps = norm_launch(n)
        _add_rms_norm_kernel[(t,)](
            x,
            x if residual is None else residual,
            weight,
            y,
            h,
            n,
            x.stride(0),
            x.stride(0) if residual is None else residual.stride(0),
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=num_warps or warps,
        )
    return y, h


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, n_heads, stride_t, stride_h, stride_c, HALF: tl.constexpr, BLOCK_H: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    hmask = heads[:, None] < n_heads
    c1 = tl.load(cos_ptr + t * stride_c + d).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * stride_c + HALF + d).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * stride_c + d).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * stride_c + HALF + d).to(tl.float32)[None, :]
    p1 = x_ptr + t * stride_t + heads[:, None] * stride_h + d[None, :]
    x1 = tl.load(p1, mask=hmask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=hmask, other=0.0)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(p1, (f1 * c1 - f2 * s1).to(x1.dtype), mask=hmask)
    tl.store(p1 + HALF, (f2 * c2 + f1 * s2).to(x1.dtype), mask=hmask)


def rotary_(q, k, cos, sin) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by cos, sin [T, D] (D even, a power of two)."""
    for x in (q, k):
        t, _, d = x.shape
        if x.stride(2) != 1 or cos.shape != (t, d) or sin.shape != (t, d) or d % 2 or d & (d - 1):
            raise ValueError(f"rotary_: x {tuple(x.shape)}, cos {tuple(cos.shape)} (D a power of two, last dim dense)")
    if cos.stride() != sin.stride() or cos.stride(1) != 1:
        raise ValueError("rotary_: cos and sin must share strides with a dense last dim")
    for x in _rotary_operands(q, k):
        t, heads, d = x.shape
        if t == 0:
            continue
        block_h = min(16, triton.next_power_of_2(heads))
        _rotary_kernel[(t, triton.cdiv(heads, block_h))](
            x, cos, sin, heads, x.stride(0), x.stride(1), cos.stride(0), HALF=d // 2, BLOCK_H=block_h
        )


def _one_buffer(*tensors) -> bool:
    """Whether the tensors are views of one allocation: tensors allocated apart may still lie next to each other
    (Qwen3's q/k norms return new tensors that the caching allocator often places back to back), and a view
    spanning both would reach past its storage."""
    return len({x.untyped_storage().data_ptr() for x in tensors}) == 1


def _rotary_operands(q, k) -> tuple:
    """(q, k), or one [T, Hq + Hkv, D] view of both when k's heads follow q's in memory with the same strides (the
    fused q/k/v projection's output): one launch instead of two."""
    follows = k.data_ptr() == q.data_ptr() + q.shape[1] * q.stride(1) * q.element_size() and _one_buffer(q, k)
    same_rows = q.shape[0] == k.shape[0] and (q.shape[0] == 1 or q.stride(0) == k.stride(0))  # one row: any stride
    if q.dtype == k.dtype and q.stride()[1:] == k.stride()[1:] and same_rows and follows:
        return (q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride()),)
    return q, k


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _rotary_store_kernel(
    x_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, n_q, n_kv, stride_t, stride_h, stride_c,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Heads [0, n_q) of a token's row are q, [n_q, n_q + n_kv) k, then n_kv of v: q and k rotated in place, k and
    v also stored into cache slot ``slot_ptr[t]`` (a contiguous [slots, n_kv, 2 * HALF] view of each cache)."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    n_heads = n_q + 2 * n_kv
    valid = heads < n_heads
    rot = (heads < n_q + n_kv)[:, None]
    c1 = tl.load(cos_ptr + t * stride_c + d).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * stride_c + HALF + d).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * stride_c + d).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * stride_c + HALF + d).to(tl.float32)[None, :]
    p1 = x_ptr + t * stride_t + heads[:, None] * stride_h + d[None, :]
    x1 = tl.load(p1, mask=valid[:, None], other=0.0)
    x2 = tl.load(p1 + HALF, mask=valid[:, None], other=0.0)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    y1 = tl.where(rot, (f1 * c1 - f2 * s1).to(x1.dtype), x1)
    y2 = tl.where(rot, (f2 * c2 + f1 * s2).to(x1.dtype), x2)
    tl.store(p1, y1, mask=(valid[:, None] & rot))
    tl.store(p1 + HALF, y2, mask=(valid[:, None] & rot))
    slot = tl.load(slot_ptr + t).to(tl.int64)
    is_k = (heads >= n_q) & (heads < n_q + n_kv)
    is_v = (heads >= n_q + n_kv) & valid
    kvh = tl.where(is_k, heads - n_q, heads - n_q - n_kv)
    row = slot * n_kv * 2 * HALF + kvh[:, None] * 2 * HALF + d[None, :]
    stored = (heads * 0 + slot) >= 0  # as a block: the interpreter rejects a scalar condition in a mask
    k_mask = (is_k & stored)[:, None]
    v_mask = (is_v & stored)[:, None]
    tl.store(k_cache_ptr + row, y1.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
    tl.store(k_cache_ptr + row + HALF, y2.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
    tl.store(v_cache_ptr + row, y1.to(v_cache_ptr.dtype.element_ty), mask=v_mask)
    tl.store(v_cache_ptr + row + HALF, y2.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


def rotary_store_(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, block_h: int | None = None,
                  num_warps: int = 4) -> bool:  # fmt: skip
    """``rotary_(q, k, cos, sin)`` and ``attention.paged.store_kv(k, v, k_cache, v_cache, slot_mapping)`` in one
    launch, when q [T, Hq, D], k and v [T, Hkv, D] are consecutive heads of one buffer with equal strides (the fused
    q/k/v projection's output) and the caches [blocks, page, Hkv, D] are contiguous; returns False, having done
    nothing, when they are not."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    if v.shape != k.shape or k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"rotary_store_: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != (hkv, d) or slot_mapping.shape != (t,):
        raise ValueError(f"rotary_store_: caches {tuple(k_cache.shape)} / slot_mapping do not match k")
    if cos.shape != (t, d) or sin.shape != (t, d) or cos.stride() != sin.stride() or cos.stride(1) != 1:
        raise ValueError("rotary_store_: cos and sin must be [T, D] with shared strides and a dense last dim")
    if d % 2 or d & (d - 1):
        raise ValueError(f"rotary_store_: head dim {d} must be a power of two")
    step = q.stride(1) * q.element_size()
    consecutive = (
        k.data_ptr() == q.data_ptr() + hq * step
        and v.data_ptr() == k.data_ptr() + hkv * step
        and q.stride()[1:] == k.stride()[1:] == v.stride()[1:]
        and q.stride(2) == 1
        and q.stride(1) == d
        and (t == 1 or q.stride(0) == k.stride(0) == v.stride(0))  # one row: any row stride
        and q.dtype == k.dtype == v.dtype
        and _one_buffer(q, k, v)
    )
    if not (consecutive and k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    if t:
        heads = hq + 2 * hkv
        block_h = block_h or min(16, triton.next_power_of_2(heads))
        _rotary_store_kernel[(t, triton.cdiv(heads, block_h))](
            q, cos, sin, k_cache, v_cache, slot_mapping, hq, hkv, q.stride(0), q.stride(1), cos.stride(0),
            HALF=d // 2, BLOCK_H=block_h, num_warps=num_warps,
        )  # fmt: skip
    return True


@triton.jit
def silu_mul_row(g_row, u_row, offs, mask):
    """silu(g) * u at ``offs`` of one row (g_row, u_row: its starts), computed in fp32 and rounded once to g's dtype.
    ``norm_quant`` quantizes the same values."""
    g = tl.load(g_row + offs, mask=mask, other=0.0)
    u = tl.load(u_row + offs, mask=mask, other=0.0).to(tl.float32)
    f = g.to(tl.float32)
    return (f / (1.0 + tl.exp(-f)) * u).to(g.dtype)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, stride_g, stride_u, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + row * n + offs, silu_mul_row(g_ptr + row * stride_g, u_ptr + row * stride_u, offs, mask),
             mask=mask)  # fmt: skip


def silu_mul(g, u, block: int | None = None, num_warps: int = 4):
    """silu(g) * u for g, u [T, n] -> [T, n]. ``block`` (columns per program), ``num_warps``: launch overrides."""
    if g.shape != u.shape or g.dim() != 2 or g.stride(1) != 1 or u.stride(1) != 1:
        raise ValueError(f"silu_mul: g {tuple(g.shape)} and u {tuple(u.shape)} must be equal 2-D, rows dense")
    t, n = g.shape
    out = torch.empty((t, n), dtype=g.dtype, device=g.device)
    if t and n:
        block = block or min(2048, triton.next_power_of_2(n))
        _silu_mul_kernel[(t, triton.cdiv(n, block))](
            g, u, out, n, g.stride(0), u.stride(0), BLOCK=block, num_warps=num_warps
        )
    return out
