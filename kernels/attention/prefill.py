"""Prefill attention over a paged KV cache: FlashAttention-2 tiling with an online softmax (Dao, 2023).

Computes causal ``softmax(q k^T * scale) v`` for a batch of variable-length query chunks packed along the token axis,
each attending to its sequence's whole context: the cached prefix (earlier chunks of a chunked prefill, or blocks
shared with another sequence), read through the block table, followed by the chunk itself, read from the packed
``k`` / ``v`` of the step (contiguous rows, no indirection). The cache slots of the chunk are never read, so the
caller may store the chunk's K/V before or after. Optional sliding window: query at position p sees keys
p - window + 1 .. p.

Optional tree mask (draft trees of speculative decoding, verified in one pass): ``tree_mask`` int64 [T], one word
per packed query row. Query i of a chunk sees every prefix key and chunk key j <= i whose bit j is set in its word
(bit j: the chunk token at index j is an ancestor of i, or i itself); chunk keys j >= 64 follow causality alone.
A word of -1 (``CAUSAL_ROW``) is the plain causal chain, so trees, chains and single decodes mix in one launch.
Limits: a tree holds at most 64 tokens, in topological order (parents first; ``tree_mask.py`` builds the words);
no sliding window with a tree mask. The caller writes each tree token's K/V to its own slot and gives it the rotary
position prefix + depth; the kernel only masks. Without a tree mask it is compiled without the mask (``TREE``).
The runtime verifies draft trees through it (``quantkit.runtime.speculative.tree_draft``).

Layouts (T packed query tokens, N sequences, Hq / Hkv heads, GQA group G = Hq / Hkv, D head dim, P page size):

- ``q`` [T, Hq, D], ``k`` / ``v`` [T, Hkv, D] (rows may be strided); ``out`` [T, Hq, D] in q's dtype.
- ``k_cache``, ``v_cache`` [num_blocks, P, Hkv, D]; ``block_tables`` int32 [N, max_pages].
- ``cu_seqlens_q`` int32 [N + 1]: chunk n owns rows ``cu[n] .. cu[n+1]-1`` of q, k and v.
- ``context_lens`` int32 [N]: prefix + chunk tokens of sequence n, so the chunk's queries sit at positions
  ``context_len - chunk_len .. context_len - 1`` and the prefix is ``0 .. context_len - chunk_len - 1``.

One program per (query head, BLOCK_M query rows, sequence), launched sequence by sequence (grid z), and within a
sequence the last query tiles (the most keys) first: the programs in flight at any time share one or two
sequences' K/V, which then stay in L2 (Nsight Compute at 1k x 16: 87% L2 hits against 57% when every sequence's
tiles ran together; 5% faster under the profiler, 7-13% in bench_attention.py's two side-by-side runs).
Key tiles that no query of the tile sees are skipped; wholly visible tiles load and compute without any mask, and
only the (at most BLOCK_M / BLOCK_N + 1) tiles on the diagonal, the prefix's last partial tile and sliding-window
tiles are masked. Scores stay in log2 units (exp2, the scale folded into the exponent's FMA); fp32 accumulation.
Where ``tma_compatible`` (power-of-two D, heads contiguous in a row, 16-byte aligned rows: the usual slices of a
fused qkv output), q and the chunk's K/V tiles come through TMA descriptors over the [T, H * D] rows; the prefix
always takes pointer loads through the block table (Hopper's TMA cannot gather rows).
Limits: D <= 256. Launch configuration by the longest chunk (``PREFILL_CONFIGS``); launches whose chunks all start
at position 0 (``has_prefix=False``, which the runtime knows on the host) compile without the block-table loops.
Measured on the H200, bf16, D = 128, GQA 4 (bench_attention.py, five runs): 82.1-84.6% of SDPA's TFLOP/s at L = 1k x 16,
84.1-88.2% at 2k x 8 and 87.0-93.4% at 4k x 4 (SDPA's own rate 436-468 / 491-513 / 528-568 TFLOP/s); the same tiles in
the earlier grid order ran 73.6-78.5% / 79.0-81.7% / 81.9-86.8% in two of those runs (74-81% / 76-83% / 80-89% over ten
runs before).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quantkit.kernels._device import dot_precision
from quantkit.kernels.attention.paged import LOG2E, gather_context
from quantkit.kernels.attention.tree_mask import tree_mask_dense
from triton.tools.tensor_descriptor import TensorDescriptor


def flash_prefill_reference(
    q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale: float, window: int = 0,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """q [T, Hq, D], chunk k / v [T, Hkv, D], prefix in the caches -> out [T, Hq, D]; fp32 math, q's dtype.
    ``tree_mask`` int64 [T] (module docstring): chunk keys also need their bit in the query's word."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    cu = cu_seqlens_q.tolist()
    for n, kv_len in enumerate(context_lens.tolist()):
        rows = slice(cu[n], cu[n + 1])
        q_len = cu[n + 1] - cu[n]
        if q_len == 0:
            continue
        prefix = kv_len - q_len
        keys = torch.cat([gather_context(k_cache, block_tables[n], 0, prefix), k[rows].to(k_cache.dtype)])
        values = torch.cat([gather_context(v_cache, block_tables[n], 0, prefix), v[rows].to(v_cache.dtype)])
        keys = keys.float().repeat_interleave(group, dim=1)
        values = values.float().repeat_interleave(group, dim=1)
        q_pos = torch.arange(prefix, kv_len, device=q.device)[:, None]
        k_pos = torch.arange(kv_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if window > 0:
            allowed &= k_pos > q_pos - window
        if tree_mask is not None:
            allowed[:, prefix:] &= tree_mask_dense(tree_mask[rows], q_len)
        scores = torch.einsum("thd,lhd->htl", q[rows].float(), keys) * scale
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[rows] = torch.einsum("htl,lhd->thd", probs, values).to(q.dtype)
    return out


LAZY_RESCALE = False  # measured slower on the H200 (see _softmax_step)
RESCALE_MARGIN = tl.constexpr(8.0)  # log2 units: p <= 256 between rescales


@triton.jit
def _softmax_step(q, k, v, m_i, l_i, acc, qk_scale, allowed, MASKED: tl.constexpr, PRECISION: tl.constexpr,
                  LAZY: tl.constexpr):  # fmt: skip
    """One key tile of the online softmax, scores in log2 units (``qk_scale`` = scale * log2 e, applied in the
    exponent's FMA); returns the updated (m_i, l_i, acc). Unmasked tiles skip every ``where``.

    LAZY: keep the running maximum m_i (the exponent's reference) until some row's maximum grows past it by more
    than ``RESCALE_MARGIN`` (log2 units), and only then rescale acc and l_i, once for the whole tile. Exact: every
    p, l_i and acc term of a row shares that row's reference, and the final acc / l_i cancels it; between
    rescales p <= 2**RESCALE_MARGIN (far inside fp32 and bf16 range). Saves BLOCK_M x D multiplies per tile
    (the acc * alpha below), but the block-wide vote (a cross-warp reduction and a branch per tile) cost more on
    the H200: 3-13% slower, so ``LAZY_RESCALE`` is off.
    """
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
    if MASKED:
        qk = tl.where(allowed, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if LAZY:
        # a row with nothing visible before (m_i = -inf) and something now counts; one still with nothing does not
        if tl.max(tl.where(m_new > m_i + RESCALE_MARGIN, 1, 0), 0) > 0:
            alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
            l_i = l_i * alpha
            acc = acc * alpha[:, None]
            m_i = m_new
        if MASKED:
            m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
        else:
            m_use = m_i
        p = tl.exp2(qk * qk_scale - m_use[:, None])
        l_i = l_i + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc=acc, input_precision=PRECISION)
        return m_i, l_i, acc
    else:
        if MASKED:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: zero weight
        else:
            m_use = m_new
        p = tl.exp2(qk * qk_scale - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None], input_precision=PRECISION)
        return m_new, l_i, acc


@triton.jit
def _load(ptrs, mask, USE_MASK: tl.constexpr):
    if USE_MASK:
        x = tl.load(ptrs, mask=mask, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _paged_tile(cache, table, pos, offs_d, stride_b, stride_s, n_mask, d_mask, PAGE: tl.constexpr,
                MASK_N: tl.constexpr, MASK_D: tl.constexpr):  # fmt: skip
    """K or V rows at context positions ``pos`` [BLOCK_N] of one kv head, read through the block table."""
    if MASK_N:
        page = tl.load(table + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
        ptrs = cache + page[:, None] * stride_b + (pos % PAGE)[:, None] * stride_s + offs_d[None, :]
        x = tl.load(ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    else:
        page = tl.load(table + pos // PAGE).to(tl.int64)
        ptrs = cache + page[:, None] * stride_b + (pos % PAGE)[:, None] * stride_s + offs_d[None, :]
        x = _load(ptrs, d_mask[None, :], MASK_D)
    return x


@triton.jit
def _tree_allowed(words, idx):
    """[BLOCK_M, BLOCK_N]: bit ``idx`` (chunk key index) of each query row's ancestor word; keys from 64 on pass."""
    bit = (words[:, None] >> tl.minimum(idx, 63).to(tl.int64)[None, :]) & 1
    return (bit != 0) | (idx[None, :] >= 64)


@triton.jit(
    do_not_specialize=["window"],
    do_not_specialize_on_alignment=["block_tables_ptr", "cu_seqlens_ptr", "context_lens_ptr", "tree_mask_ptr"],
)
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_seqlens_ptr,
    context_lens_ptr,
    tree_mask_ptr,  # int64 [T] ancestor words (TREE), else unused
    out_ptr,
    q_desc,  # TMA descriptors over q [T, Hq * D], k and v [T, Hkv * D] (USE_TMA), else unused
    k_desc,
    v_desc,
    qk_scale,  # softmax scale * log2(e)
    window,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kb,
    stride_ks,
    stride_kch,
    stride_vb,
    stride_vs,
    stride_vch,
    stride_bt,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASK_D: tl.constexpr,  # HEAD_DIM < BLOCK_D (else full tiles load without any mask)
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32 rounding), "tf32" (ignored) for 16-bit ones
    USE_TMA: tl.constexpr,  # q and the chunk's K/V tiles through the TMA unit (BLOCK_D == HEAD_DIM)
    HAS_WINDOW: tl.constexpr,  # window > 0: a sliding window (its length stays a run-time value)
    LAZY: tl.constexpr,  # rescale acc only when a row maximum grows by more than RESCALE_MARGIN (_softmax_step)
    HAS_PREFIX: tl.constexpr,  # some chunk has cached context before it (else the block-table loops are not compiled)
    TREE: tl.constexpr,  # chunk keys also need their bit in the query row's tree-mask word (no window)
):
    h = tl.program_id(0)
    m_block = tl.num_programs(1) - 1 - tl.program_id(1)  # the longest (last) query tiles start first
    seq = tl.program_id(2)  # slowest: one sequence's programs run together, its K/V in L2
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    prefix = tl.load(context_lens_ptr + seq) - q_len  # context tokens before the chunk (in the cache only)
    m_lo = m_block * BLOCK_M  # chunk index of this tile's first query

    offs_m = m_lo + tl.arange(0, BLOCK_M)  # query index within the chunk
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    if USE_TMA:  # rows past the chunk are another sequence's (or TMA's zero fill): their outputs are not stored
        q = q_desc.load([q_start + m_lo, h * HEAD_DIM])
    else:
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
            mask=m_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
    kvh = h // GROUP
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # keys a query at chunk index i sees: j <= i, and j > i - window with a window (j, i: chunk indices; the prefix
    # has negative ones). Tiles that no query of this tile sees are skipped; wholly visible tiles are not masked.
    lo = tl.where(window > 0, tl.maximum(m_lo - window + 1, -prefix), -prefix)  # first visible key

    # 1. the cached prefix, through the block table (every prefix key precedes every query of the chunk); not
    # compiled for launches whose chunks all start at position 0 (first prefills)
    if HAS_PREFIX:
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        k_base = k_cache_ptr + kvh * stride_kch
        v_base = v_cache_ptr + kvh * stride_vch
        p_lo = (lo + prefix) // BLOCK_N * BLOCK_N  # context positions from here on
        p_full = tl.where(window > 0, p_lo, prefix // BLOCK_N * BLOCK_N)
        for n in range(p_lo, p_full, BLOCK_N):
            pos = n + offs_n
            n_mask = pos < prefix
            k = _paged_tile(k_base, table, pos, offs_d, stride_kb, stride_ks, n_mask, d_mask, PAGE, False, MASK_D)
            v = _paged_tile(v_base, table, pos, offs_d, stride_vb, stride_vs, n_mask, d_mask, PAGE, False, MASK_D)
            m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc, qk_scale, None, False, PRECISION, LAZY)
        for n in range(p_full, prefix, BLOCK_N):
            pos = n + offs_n
            n_mask = pos < prefix
            k = _paged_tile(k_base, table, pos, offs_d, stride_kb, stride_ks, n_mask, d_mask, PAGE, True, MASK_D)
            v = _paged_tile(v_base, table, pos, offs_d, stride_vb, stride_vs, n_mask, d_mask, PAGE, True, MASK_D)
            allowed = n_mask[None, :]
            if HAS_WINDOW:
                allowed &= pos[None, :] - prefix > offs_m[:, None] - window
            m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc, qk_scale, allowed, True, PRECISION, LAZY)

    # 2. the chunk itself, from the packed k / v: full tiles left of the diagonal, then the masked diagonal ones
    k_rows = k_ptr + kvh * stride_kh + offs_d[None, :]
    v_rows = v_ptr + kvh * stride_vh + offs_d[None, :]
    c_lo = tl.maximum(lo, 0) // BLOCK_N * BLOCK_N
    c_full = tl.where(window > 0, c_lo, (m_lo + 1) // BLOCK_N * BLOCK_N)  # last key of a full tile <= m_lo
    c_hi = tl.minimum(m_lo + BLOCK_M, q_len)
    if TREE:  # full tiles among the first 64 chunk keys are masked by the words (pointer loads: short trees)
        words = tl.load(tree_mask_ptr + rows, mask=m_mask, other=-1)
        c_tree = tl.minimum(c_full, (64 + BLOCK_N - 1) // BLOCK_N * BLOCK_N)
        for j in range(c_lo, c_tree, BLOCK_N):
            idx = j + offs_n
            t = (q_start + idx).to(tl.int64)[:, None]
            k = _load(k_rows + t * stride_kt, d_mask[None, :], MASK_D)
            v = _load(v_rows + t * stride_vt, d_mask[None, :], MASK_D)
            allowed = _tree_allowed(words, idx)
            m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc, qk_scale, allowed, True, PRECISION, LAZY)
        c_lo = tl.maximum(c_lo, c_tree)
    for j in range(c_lo, c_full, BLOCK_N):
        if USE_TMA:
            k = k_desc.load([q_start + j, kvh * HEAD_DIM])
            v = v_desc.load([q_start + j, kvh * HEAD_DIM])
        else:
            t = (q_start + j + offs_n).to(tl.int64)[:, None]
            k = _load(k_rows + t * stride_kt, d_mask[None, :], MASK_D)
            v = _load(v_rows + t * stride_vt, d_mask[None, :], MASK_D)
        m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc, qk_scale, None, False, PRECISION, LAZY)
    for j in range(c_full, c_hi, BLOCK_N):
        idx = j + offs_n
        n_mask = idx < q_len
        if USE_TMA:  # key rows past the chunk get no weight (causal), and hold finite values (no 0 * inf)
            k = k_desc.load([q_start + j, kvh * HEAD_DIM])
            v = v_desc.load([q_start + j, kvh * HEAD_DIM])
        else:
            t = (q_start + idx).to(tl.int64)[:, None]
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_rows + t * stride_kt, mask=kv_mask, other=0.0)
            v = tl.load(v_rows + t * stride_vt, mask=kv_mask, other=0.0)
        # causality alone also hides the keys past the chunk from every query of it (idx <= query < q_len); the
        # tile's rows past the chunk compute garbage that is never stored
        allowed = idx[None, :] <= offs_m[:, None]
        if HAS_WINDOW:
            allowed &= idx[None, :] > offs_m[:, None] - window
        if TREE:
            allowed &= _tree_allowed(words, idx)
        m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc, qk_scale, allowed, True, PRECISION, LAZY)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def flash_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
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
    num_stages: int | None = None,
    use_tma: bool | None = None,
    lazy_rescale: bool | None = None,
    has_prefix: bool = True,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed query chunks against their cached prefix and themselves (see the module
    docstring for layouts). ``max_q_len`` is a host-side upper bound on the chunk lengths (it sizes the grid).
    ``use_tma``: read q and the chunk's K/V through TMA descriptors; None = whenever ``tma_compatible``.
    ``lazy_rescale``: see ``_softmax_step``; None = ``LAZY_RESCALE``.
    ``has_prefix=False`` promises that every chunk starts at position 0 (each context length equals its chunk's
    length, as in first prefills): the kernel is then compiled without the block-table loops over cached context
    (216 instead of 255 registers at 128 x 128 x 8 warps, Triton 3.6 sm_90: benchmarks/sass_prefill.py). A chunk
    with a cached prefix under that promise would attend to its own tokens only, so callers pass it only when they
    know it from the host.
    ``tree_mask``: int64 [T] ancestor words, one per query row (module docstring; ``CAUSAL_ROW`` for chain rows)."""
    t, hq, d = q.shape
    _, page, hkv, d_cache = k_cache.shape
    n_seq = context_lens.shape[0]
    if v_cache.shape != k_cache.shape or d_cache != d:
        raise ValueError(f"flash_prefill: q {tuple(q.shape)} and caches {tuple(k_cache.shape)} disagree")
    if k.shape != (t, hkv, d) or v.shape != k.shape:
        raise ValueError(f"flash_prefill: k {tuple(k.shape)} and v {tuple(v.shape)} must be [{t}, {hkv}, {d}]")
    if hq % hkv != 0:
        raise ValueError(f"flash_prefill: {hq} query heads are not a multiple of {hkv} kv heads")
    if d > 256:
        raise ValueError(f"flash_prefill: head dim {d} > 256 is not supported")
    if any(x.stride(2) != 1 for x in (q, k, v)) or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("flash_prefill: the head dimension must be contiguous in q, k, v and the caches")
    if any(x.dtype != torch.int32 for x in (block_tables, cu_seqlens_q, context_lens)):
        raise ValueError("flash_prefill: block_tables, cu_seqlens_q and context_lens must be int32")
    if cu_seqlens_q.shape != (n_seq + 1,) or block_tables.shape[0] != n_seq:
        raise ValueError(f"flash_prefill: cu_seqlens_q must be [{n_seq + 1}] and block_tables [{n_seq}, pages]")
    if tree_mask is not None and (tree_mask.dtype != torch.int64 or tree_mask.shape != (t,) or window > 0):
        raise ValueError(f"flash_prefill: tree_mask must be int64 [{t}] (one word per query row), without a window")
    out = torch.empty_like(q)
    if t == 0 or n_seq == 0:
        return out
    on_cpu = q.device.type == "cpu"  # Triton's interpreter: small tiles run much faster there
    default = prefill_config(max_q_len, on_cpu)
    block_m, block_n = block_m or default[0], block_n or default[1]
    num_warps = num_warps or (default[2] if (block_m, block_n) == default[:2] else 4 if block_m <= 64 else 8)
    num_stages = num_stages or default[3]
    block_d = triton.next_power_of_2(d)
    grid = (hq, triton.cdiv(max_q_len, block_m), n_seq)
    compatible = tma_compatible(q, k, v)
    if use_tma and not compatible:
        raise ValueError("flash_prefill: use_tma needs a power-of-two head dim, heads contiguous in each row and "
                         "16-byte aligned rows in q, k and v")  # fmt: skip
    use_tma = compatible if use_tma is None else use_tma
    descs = (q, k, v)
    if use_tma:
        descs = (_rows_descriptor(q, block_m), _rows_descriptor(k, block_n), _rows_descriptor(v, block_n))
    _prefill_kernel[grid](
        q,
        k,
        v,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        context_lens if tree_mask is None else tree_mask,
        out,
        *descs,
        scale * LOG2E,
        window,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=d,
        BLOCK_D=block_d,
        MASK_D=block_d != d,
        GROUP=hq // hkv,
        PAGE=page,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PRECISION=dot_precision(q.dtype),
        USE_TMA=use_tma,
        HAS_WINDOW=window > 0,
        LAZY=LAZY_RESCALE if lazy_rescale is None else lazy_rescale,
        HAS_PREFIX=has_prefix,
        TREE=tree_mask is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


# (block_m, block_n, num_warps, num_stages) by the longest chunk of the launch, from benchmarks/bench_attention.py's
# sweeps on the H200 (bf16, D = 128, GQA 4, TMA on): chunks of
# up to 1024 queries want small tiles (64 x 64: one masked tile on the diagonal, two CTAs per SM at 158 registers
# and 113 KB of shared memory without the prefix loops), longer ones the widest MMA tiles (2k x 8: 78-82% of SDPA
# against 76-81% for 64 x 64; with the sequence-major grid, five runs: 428-438 against 426-433 TFLOP/s,
# a tie, and at 1k x 16 64 x 64 366-388 against 342-346 for 128 x 128)
PREFILL_CONFIGS = ((1024, (64, 64, 4, 3)), (2**31, (128, 128, 8, 3)))
INTERPRETER_CONFIG = (16, 16, 4, 1)  # Triton's interpreter: small tiles run much faster there


def prefill_config(max_q_len: int, on_cpu: bool = False) -> tuple[int, int, int, int]:
    """The committed launch configuration for chunks of at most ``max_q_len`` queries."""
    if on_cpu:
        return INTERPRETER_CONFIG
    return next(cfg for longest, cfg in PREFILL_CONFIGS if max_q_len <= longest)


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """[T, H, D] tensors that TMA can tile as [T, H * D] rows: D a power of two >= 16 bytes, heads contiguous
    within a row, 16-byte aligned base and row stride."""
    size = tensors[0].element_size()
    return all(
        t.shape[2] == triton.next_power_of_2(t.shape[2])
        and t.shape[2] * size >= 16
        and t.stride(2) == 1
        and t.stride(1) == t.shape[2]
        and t.data_ptr() % 16 == 0
        and (t.stride(0) * size) % 16 == 0
        for t in tensors
    )


def _rows_descriptor(t: torch.Tensor, block_rows: int) -> TensorDescriptor:
    """TMA descriptor over a [T, H, D] tensor seen as [T, H * D]; tiles of [block_rows, D] (one head)."""
    rows, heads, d = t.shape
    return TensorDescriptor(t, [rows, heads * d], [t.stride(0), 1], [block_rows, d])
