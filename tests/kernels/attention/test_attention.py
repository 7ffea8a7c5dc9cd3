"""Triton attention kernels against float64 attention (Triton's interpreter on CPU; real kernels on CUDA).

Rule (flash-attn's): on fresh random fp16 inputs the kernel's error against a float64 reference is at most twice
PyTorch's own fp16 error (plain softmax(q k^T) v in fp16) plus a few fp16 ulps of the output. Every cache slot
that no sequence owns holds NaN, so reading one (or a padded block-table entry) poisons the output.
"""

import pytest
import torch
from quantkit.kernels.attention.mla import mla_decode, mla_decode_reference, store_latent
from quantkit.kernels.attention.paged import (
    MAX_SPLITS,
    default_num_splits,
    gather_context,
    paged_decode,
    paged_decode_reference,
    store_kv,
)
from quantkit.kernels.attention.prefill import flash_prefill, flash_prefill_reference, tma_compatible
from quantkit.kernels.attention.tree_mask import CAUSAL_ROW, pack_tree_masks, tree_mask_words

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float16


def paged_cache(context_lens, page: int, hkv: int, d: int, gen, spare_blocks: int = 3, dtype=DTYPE):
    """Random K/V for each sequence scattered over shuffled pages; unowned slots are NaN; int32 block tables."""
    pages = [-(-n // page) for n in context_lens]
    num_blocks = sum(pages) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)
    k_cache = torch.full((num_blocks, page, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    width = max(max(pages), 1) + 1  # one padding column
    tables = torch.zeros(len(context_lens), width, dtype=torch.int32)
    at = 0
    for i, (n, np_) in enumerate(zip(context_lens, pages, strict=True)):
        tables[i, :np_] = order[at : at + np_]
        at += np_
        slots = tables[i, torch.arange(n) // page].long() * page + torch.arange(n) % page
        k_cache.view(-1, hkv, d)[slots] = torch.randn(n, hkv, d, generator=gen).to(dtype)
        v_cache.view(-1, hkv, d)[slots] = torch.randn(n, hkv, d, generator=gen).to(dtype)
    return k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE)


def plain_attention(q, k, v, scale, allowed, dtype):
    """softmax(q k^T * scale) v in ``dtype``; q [M, H, D], k/v [L, H, D], allowed [M, L]."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    s = torch.einsum("mhd,lhd->hml", q, k) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hml,lhd->mhd", s.softmax(-1), v)


def check_close(out, q, k, v, q_pos, kv_len, scale, window):
    """Compare rows ``out`` (queries at positions ``q_pos``) of one sequence, whose keys / values are ``k`` / ``v``
    [kv_len, Hkv, D], against float64 and fp16 torch."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    kp = torch.arange(kv_len, device=q.device)[None, :]
    q_pos = q_pos.to(q.device)
    allowed = kp <= q_pos[:, None]
    if window:
        allowed &= kp > q_pos[:, None] - window
    ref64 = plain_attention(q, k, v, scale, allowed, torch.float64)
    torch_err = (plain_attention(q, k, v, scale, allowed, torch.float32).to(DTYPE).double() - ref64).abs().max()
    err = (out.double() - ref64).abs().max()
    assert torch.isfinite(out).all()
    assert err <= 2 * torch_err + 2e-3, f"kernel error {err:.2e} vs torch fp16 error {torch_err:.2e}"


def test_store_kv_writes_exactly_the_mapped_slots():
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.zeros(6, 8, 2, 32, dtype=DTYPE, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(7, 2, 32, generator=gen).to(DTYPE).to(DEVICE)
    v = torch.randn(7, 2, 32, generator=gen).to(DTYPE).to(DEVICE)
    slots = torch.tensor([3, -1, 17, 47, 8, -1, 0], device=DEVICE)
    store_kv(k, v, k_cache, v_cache, slots)
    keep = slots >= 0
    assert torch.equal(k_cache.view(-1, 2, 32)[slots[keep]], k[keep])
    assert torch.equal(v_cache.view(-1, 2, 32)[slots[keep]], v[keep])
    assert int((k_cache.view(-1, 2, 32).abs().sum((1, 2)) > 0).sum()) == int(keep.sum())


DECODE_CASES = [  # (page, kv heads, group, head dim, splits, window)
    (16, 2, 1, 32, 1, 0),
    (16, 1, 4, 64, 3, 0),
    (8, 2, 3, 48, 2, 0),
    (16, 2, 2, 32, 4, 9),
]


@pytest.mark.parametrize("page,hkv,group,d,splits,window", DECODE_CASES)
def test_paged_decode(page, hkv, group, d, splits, window):
    gen = torch.Generator().manual_seed(page + hkv + group + d + splits + window)
    lens = [int(x) for x in torch.randint(1, 90, (4,), generator=gen)]
    lens[0] = 1
    k_cache, v_cache, tables = paged_cache(lens, page, hkv, d, gen)
    q = torch.randn(len(lens), hkv * group, d, generator=gen).to(DTYPE).to(DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = d**-0.5
    out = paged_decode(q, k_cache, v_cache, tables, ctx, scale, window=window, num_splits=splits)
    for b, n in enumerate(lens):
        k, v = gather_context(k_cache, tables[b], 0, n), gather_context(v_cache, tables[b], 0, n)
        check_close(out[b : b + 1], q[b : b + 1], k, v, torch.tensor([n - 1]), n, scale, window)
    ref = paged_decode_reference(q, k_cache, v_cache, tables, ctx, scale, window)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=0)


MLA_CASES = [  # (page, heads, kv_lora_rank R, rope dims P, splits): heads past a 16-head tile, R not a power of two
    (16, 16, 32, 8, 1),
    (8, 20, 48, 16, 3),
    (16, 4, 64, 8, 4),
]


@pytest.mark.parametrize("page,heads,rank,rope,splits", MLA_CASES)
def test_mla_decode(page, heads, rank, rope, splits):
    """Absorbed MLA decode over paged latent rows (NaN in every slot no sequence owns) against float64 and against
    ``mla_decode_reference``; an empty context gives zeros."""
    gen = torch.Generator().manual_seed(page + heads + rank + rope + splits)
    lens = [1, *(int(x) for x in torch.randint(2, 90, (3,), generator=gen)), 0]
    cache, _, tables = paged_cache(lens, page, 1, rank + rope, gen)
    q_lat = torch.randn(len(lens), heads, rank, generator=gen).to(DTYPE).to(DEVICE)
    q_pe = torch.randn(len(lens), heads, rope, generator=gen).to(DTYPE).to(DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = (rank // 2 + rope) ** -0.5
    out = mla_decode(q_lat, q_pe, cache, tables, ctx, scale, num_splits=splits)
    assert out.dtype == DTYPE and torch.equal(out[-1], torch.zeros_like(out[-1]))
    for b, n in enumerate(lens[:-1]):
        rows = gather_context(cache, tables[b], 0, n)[:, 0]

        def attend(dtype, b=b, rows=rows):
            c, k_pe = rows[:, :rank].to(dtype), rows[:, rank:].to(dtype)
            s = (q_lat[b].to(dtype) @ c.T + q_pe[b].to(dtype) @ k_pe.T) * scale
            return s.softmax(-1) @ c

        ref64 = attend(torch.float64)
        torch_err = (attend(torch.float32).to(DTYPE).double() - ref64).abs().max()
        err = (out[b].double() - ref64).abs().max()
        assert err <= 2 * torch_err + 2e-3, f"kernel error {err:.2e} vs torch fp16 error {torch_err:.2e}"
    ref = mla_decode_reference(q_lat, q_pe, cache, tables, ctx, scale)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=0)


def test_store_latent_writes_exactly_the_mapped_slots():
    gen = torch.Generator().manual_seed(1)
    cache = torch.zeros(5, 8, 1, 40, dtype=DTYPE, device=DEVICE)
    rows = torch.randn(6, 40, generator=gen).to(DTYPE).to(DEVICE)
    slots = torch.tensor([3, -1, 17, 39, -1, 0], device=DEVICE)
    store_latent(rows, cache, slots)
    keep = slots >= 0
    assert torch.equal(cache.view(-1, 40)[slots[keep]], rows[keep])
    assert int((cache.view(-1, 40).abs().sum(1) > 0).sum()) == int(keep.sum())


def test_mla_decode_refuses_mismatched_shapes():
    cache = torch.zeros(4, 16, 1, 40, dtype=DTYPE, device=DEVICE)
    q = torch.zeros(2, 4, 32, dtype=DTYPE, device=DEVICE)
    tables, ctx = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE), torch.ones(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="disagree"):
        mla_decode(q, torch.zeros(2, 4, 16, dtype=DTYPE, device=DEVICE), cache, tables, ctx, 1.0)
    with pytest.raises(ValueError, match="int32"):
        mla_decode(q, torch.zeros(2, 4, 8, dtype=DTYPE, device=DEVICE), cache, tables.long(), ctx, 1.0)


def test_default_num_splits_fills_the_gpu_without_short_splits():
    assert default_num_splits(64, 8, 4096) == 3  # 1056 programs wanted over 512 (batch, kv head) pairs
    assert default_num_splits(8, 8, 8192) == 17
    assert default_num_splits(1, 8, 32768) == MAX_SPLITS == 64  # capped
    assert default_num_splits(1, 8, 1000) == 4  # no split shorter than 4 tiles of 64


PREFILL_CASES = [  # (page, kv heads, group, head dim, window): chunks with and without a cached prefix
    (16, 2, 1, 32, 0),
    (16, 1, 4, 64, 0),
    (8, 2, 3, 48, 0),
    (16, 2, 2, 32, 11),
]


def check_prefill(q_lens, prefix, page, hkv, group, d, window, seed, **launch):
    """Chunks of ``q_lens`` queries after ``prefix`` cached tokens: the chunk's K/V come packed, and their cache
    slots hold NaN, so the kernel must read the chunk from the packed tensors and only the prefix from the cache."""
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [a + b for a, b in zip(q_lens, prefix, strict=True)]
    k_cache, v_cache, tables = paged_cache(kv_lens, page, hkv, d, gen)
    full_k = [gather_context(k_cache, tables[n], 0, kl).clone() for n, kl in enumerate(kv_lens)]
    full_v = [gather_context(v_cache, tables[n], 0, kl).clone() for n, kl in enumerate(kv_lens)]
    k = torch.cat([fk[p:] for fk, p in zip(full_k, prefix, strict=True)])
    v = torch.cat([fv[p:] for fv, p in zip(full_v, prefix, strict=True)])
    for n, (p, kl) in enumerate(zip(prefix, kv_lens, strict=True)):
        pos = torch.arange(p, kl, device=DEVICE)
        slots = tables[n, pos // page].long() * page + pos % page
        k_cache.view(-1, hkv, d)[slots] = float("nan")
        v_cache.view(-1, hkv, d)[slots] = float("nan")
    q = torch.randn(sum(q_lens), hkv * group, d, generator=gen).to(DTYPE).to(DEVICE)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    scale = d**-0.5
    out = flash_prefill(q, k, v, k_cache, v_cache, tables, cu, ctx, max(q_lens), scale, window=window, **launch)
    for n, (ql, kl) in enumerate(zip(q_lens, kv_lens, strict=True)):
        rows = slice(int(cu[n]), int(cu[n + 1]))
        q_pos = torch.arange(kl - ql, kl, device=DEVICE)
        check_close(out[rows], q[rows], full_k[n], full_v[n], q_pos, kl, scale, window)
    ref = flash_prefill_reference(q, k, v, k_cache, v_cache, tables, cu, ctx, scale, window)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=0)


@pytest.mark.parametrize("use_tma", [False, None])  # None: TMA descriptors where tma_compatible (d = 48 is not)
@pytest.mark.parametrize("page,hkv,group,d,window", PREFILL_CASES)
def test_flash_prefill_chunks_against_paged_context(page, hkv, group, d, window, use_tma):
    check_prefill([1, 37, 20, 5], [0, 30, 0, 3], page, hkv, group, d, window, seed=page * hkv + group + d + window,
                  use_tma=use_tma)  # fmt: skip


@pytest.mark.parametrize("page,hkv,group,d,window", PREFILL_CASES[::3])
def test_flash_prefill_first_prefills_without_prefix_loops(page, hkv, group, d, window):
    """has_prefix=False (chunks all at position 0): the kernel compiled without its block-table loops."""
    check_prefill([1, 37, 20], [0, 0, 0], page, hkv, group, d, window, seed=d + window, has_prefix=False)


def test_flash_prefill_tma_descriptor_rows():
    """TMA tiles [T, H * D] rows: a slice of a fused qkv row qualifies, a head dim of 48 or heads apart do not."""
    assert tma_compatible(torch.randn(4, 2, 64), torch.randn(4, 6, 64)[:, 2:4])
    assert not tma_compatible(torch.randn(4, 2, 48))
    assert not tma_compatible(torch.randn(2, 4, 64).transpose(0, 1))
    q = torch.randn(8, 2, 48)
    with pytest.raises(ValueError, match="use_tma"):
        flash_prefill(q, q, q, q.view(4, 2, 2, 48), q.view(4, 2, 2, 48), torch.zeros(1, 4, dtype=torch.int32),
                      torch.tensor([0, 8], dtype=torch.int32), torch.tensor([8], dtype=torch.int32), 8, 1.0,
                      use_tma=True)  # fmt: skip


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("block_m,block_n", [(32, 16), (16, 32)])
def test_flash_prefill_tile_shapes(block_m, block_n, lazy):
    """Tiles taller or wider than a page and than the diagonal step: full, diagonal and prefix tiles all occur."""
    check_prefill([70, 9], [21, 40], 16, 2, 2, 32, 0, seed=block_m + block_n, block_m=block_m, block_n=block_n,
                  lazy_rescale=lazy)  # fmt: skip


@pytest.mark.parametrize("lazy", [False, True])
def test_flash_prefill_lazy_rescale_follows_growing_scores(lazy):
    """Scores that grow along the keys move the running maximum past the rescale margin many times (and far
    enough that exp2 against a stale maximum would overflow fp32)."""
    gen = torch.Generator().manual_seed(5)
    t, hkv, d = 96, 1, 32
    q = (torch.randn(t, 2, d, generator=gen) * 2).to(DTYPE).to(DEVICE)
    growth = torch.linspace(1, 60, t).view(t, 1, 1)  # scores past 2**128 above the first tile's maximum
    k = (torch.randn(t, hkv, d, generator=gen) * growth).to(DTYPE).to(DEVICE)
    v = torch.randn(t, hkv, d, generator=gen).to(DTYPE).to(DEVICE)
    cache = torch.zeros(1, 16, hkv, d, dtype=DTYPE, device=DEVICE)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, t], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor([t], dtype=torch.int32, device=DEVICE)
    out = flash_prefill(q, k, v, cache, cache, tables, cu, ctx, t, d**-0.5, block_m=16, block_n=16,
                        lazy_rescale=lazy)  # fmt: skip
    ref = flash_prefill_reference(q, k, v, cache, cache, tables, cu, ctx, d**-0.5)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=0)


def random_parents(n: int, gen) -> list[int]:
    """A random tree of n tokens in topological order: token 0 the root, token i's parent any earlier token."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def dense_tree_mask(parents) -> torch.Tensor:
    """bool [n, n] by walking up the parent array: row i is True at i and at each of its ancestors."""
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for i in range(len(parents)):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def check_tree_prefill(chunks, prefix, page, hkv, group, d, seed, **launch):
    """Chunks (a parent array: a draft tree; an int: a causal chunk of that length) after ``prefix`` cached
    tokens, fp32: the kernel against float64 attention under an explicit dense mask (every prefix key, plus the
    tree's ancestors or the causal earlier tokens) and against ``flash_prefill_reference``. The chunks' own cache
    slots hold NaN, as in ``check_prefill``. Returns the kernel's output and its inputs for further launches."""
    gen = torch.Generator().manual_seed(seed)
    q_lens = [c if isinstance(c, int) else len(c) for c in chunks]
    kv_lens = [a + b for a, b in zip(q_lens, prefix, strict=True)]
    k_cache, v_cache, tables = paged_cache(kv_lens, page, hkv, d, gen, dtype=torch.float32)
    full_k = [gather_context(k_cache, tables[n], 0, kl).clone() for n, kl in enumerate(kv_lens)]
    full_v = [gather_context(v_cache, tables[n], 0, kl).clone() for n, kl in enumerate(kv_lens)]
    k = torch.cat([fk[p:] for fk, p in zip(full_k, prefix, strict=True)])
    v = torch.cat([fv[p:] for fv, p in zip(full_v, prefix, strict=True)])
    for n, (p, kl) in enumerate(zip(prefix, kv_lens, strict=True)):
        pos = torch.arange(p, kl, device=DEVICE)
        k_cache.view(-1, hkv, d)[tables[n, pos // page].long() * page + pos % page] = float("nan")
        v_cache.view(-1, hkv, d)[tables[n, pos // page].long() * page + pos % page] = float("nan")
    q = torch.randn(sum(q_lens), hkv * group, d, generator=gen).to(DEVICE)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    words = pack_tree_masks(chunks, DEVICE)
    args = (q, k, v, k_cache, v_cache, tables, cu, ctx)
    out = flash_prefill(*args, max(q_lens), d**-0.5, tree_mask=words, **launch)
    for n, (c, ql, p) in enumerate(zip(chunks, q_lens, prefix, strict=True)):
        rows = slice(int(cu[n]), int(cu[n + 1]))
        own = torch.ones(ql, ql).tril().bool() if isinstance(c, int) else dense_tree_mask(c)
        allowed = torch.cat([torch.ones(ql, p, dtype=torch.bool), own], 1).to(DEVICE)
        kk, vv = (x.repeat_interleave(group, dim=1) for x in (full_k[n], full_v[n]))
        ref64 = plain_attention(q[rows], kk, vv, d**-0.5, allowed, torch.float64)
        assert torch.isfinite(out[rows]).all()
        torch.testing.assert_close(out[rows].double(), ref64, atol=2e-5, rtol=0)
    ref = flash_prefill_reference(*args, d**-0.5, tree_mask=words)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
    return out, args, max(q_lens), d**-0.5


TREE_CASES = [  # (page, kv heads, group, head dim, block_m, block_n)
    (16, 2, 2, 16, 16, 16),
    (8, 1, 3, 24, 32, 16),
    (16, 2, 1, 16, 16, 32),
    (4, 1, 2, 16, 64, 64),
]


@pytest.mark.parametrize("page,hkv,group,d,block_m,block_n", TREE_CASES)
def test_flash_prefill_tree_mask_mixed_batch(page, hkv, group, d, block_m, block_n):
    """Random trees (one of the full 64 tokens: bit 63, several tiles of tree keys) beside causal chunks (one
    longer than 64 tokens, whose later keys pass on causality alone), a single decode and a first prefill; the
    causal rows equal a launch without any tree mask bit for bit."""
    gen = torch.Generator().manual_seed(block_m + block_n + d)
    chunks = [random_parents(13, gen), 70, 1, random_parents(64, gen), random_parents(5, gen), 9]
    prefix = [21, 6, 33, 3, 0, 0]
    out, args, max_q, scale = check_tree_prefill(chunks, prefix, page, hkv, group, d, seed=d + block_m,
                                                 block_m=block_m, block_n=block_n)  # fmt: skip
    causal = flash_prefill(*args, max_q, scale, block_m=block_m, block_n=block_n)
    chain_rows = pack_tree_masks(chunks) == CAUSAL_ROW
    assert torch.equal(out[chain_rows], causal[chain_rows])


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16)])
def test_flash_prefill_tree_that_is_a_path_equals_the_causal_kernel_exactly(block_m, block_n):
    chunks = [[-1, *range(0, 39)], [-1, 0, 1, 2, 3]]  # paths of 40 and 5 tokens
    out, args, max_q, scale = check_tree_prefill(chunks, [17, 40], 16, 2, 2, 16, seed=block_m,
                                                 block_m=block_m, block_n=block_n)  # fmt: skip
    assert torch.equal(out, flash_prefill(*args, max_q, scale, block_m=block_m, block_n=block_n))


def test_tree_mask_words_encode_ancestors_and_refuse_bad_trees():
    assert tree_mask_words([-1, 0, 0, 1, 2]).tolist() == [0b1, 0b11, 0b101, 0b1011, 0b10101]
    assert int(tree_mask_words([-1, *range(63)])[63]) == CAUSAL_ROW  # a 64-token path: every bit, as a causal row
    for bad in ([0], [-1, 1], [-1, -2], [-1, *range(64)]):  # own parent, a later parent, below -1, 65 tokens
        with pytest.raises(ValueError, match="parents must precede"):
            tree_mask_words(bad)
    q = torch.randn(4, 2, 16)
    args = (q, q[:, :1], q[:, :1], q.view(4, 2, 1, 16), q.view(4, 2, 1, 16))
    meta = (torch.zeros(1, 4, dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32),
            torch.tensor([4], dtype=torch.int32), 4, 1.0)  # fmt: skip
    for words, window in ((torch.zeros(4, dtype=torch.int32), 0), (torch.zeros(3, dtype=torch.int64), 0),
                          (torch.full((4,), -1), 2)):  # fmt: skip
        with pytest.raises(ValueError, match="tree_mask"):
            flash_prefill(*args, *meta, window=window, tree_mask=words)
