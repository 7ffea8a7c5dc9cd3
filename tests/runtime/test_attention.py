"""runtime/attention.py: one mixed step (a decode, then a prefill chunk after a cached prefix) through the paged
cache gives what plain causal attention over each sequence's whole K/V gives, computed in float64."""

import pytest
import torch
from quantkit.kernels.attention.tree_mask import pack_tree_masks

from quantkit.runtime.attention import AttentionMetadata, paged_attention

HQ, HKV, D, PAGE = 4, 2, 8, 4
SCALE = D**-0.5


def dense_attention(q, k, v, positions, window=0, allowed=None):
    """q [t, Hq, D] at ``positions`` over keys / values [L, Hkv, D] of positions 0..L-1 (float64); ``allowed``
    [t, L] replaces the causal (and window) mask."""
    k, v = (x.double().repeat_interleave(HQ // HKV, dim=1) for x in (k, v))
    scores = torch.einsum("thd,lhd->htl", q.double(), k) * SCALE
    if allowed is None:
        pos = torch.arange(k.shape[0])[None, :]
        allowed = pos <= positions[:, None]
        if window:
            allowed &= pos > positions[:, None] - window
    return torch.einsum("htl,lhd->thd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def slots(table, positions):
    return [table[p // PAGE] * PAGE + p % PAGE for p in positions]


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("stored", [False, True])
def test_a_mixed_step_equals_dense_causal_attention(window, stored):
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.zeros(8, PAGE, HKV, D), torch.zeros(8, PAGE, HKV, D)
    # sequence a decodes its token 5 (5 cached), sequence b prefills tokens 3..6 (3 cached); pages are scattered
    kv = {s: tuple(torch.randn(n, HKV, D, generator=gen) for _ in "kv") for s, n in [("a", 6), ("b", 7)]}
    tables = {"a": [2, 5], "b": [0, 7]}
    for s, cached in [("a", 5), ("b", 3)]:
        index = torch.tensor(slots(tables[s], range(cached)))
        k_cache.view(-1, HKV, D)[index] = kv[s][0][:cached]
        v_cache.view(-1, HKV, D)[index] = kv[s][1][:cached]
    step_slots = torch.tensor(slots(tables["a"], [5]) + slots(tables["b"], range(3, 7)))
    k = torch.cat([kv["a"][0][5:], kv["b"][0][3:]])  # [5, Hkv, D]: the step's own tokens, packed
    v = torch.cat([kv["a"][1][5:], kv["b"][1][3:]])
    q = torch.randn(5, HQ, D, generator=gen)
    if stored:  # the caller's fused kernel wrote them already
        k_cache.view(-1, HKV, D)[step_slots] = k
        v_cache.view(-1, HKV, D)[step_slots] = v
    meta = AttentionMetadata(
        slot_mapping=step_slots,
        num_decodes=1,
        decode_block_tables=torch.tensor([tables["a"]], dtype=torch.int32),
        decode_context_lens=torch.tensor([6], dtype=torch.int32),
        max_decode_context=6,
        prefill_block_tables=torch.tensor([tables["b"]], dtype=torch.int32),
        prefill_cu_seqlens=torch.tensor([0, 4], dtype=torch.int32),
        prefill_context_lens=torch.tensor([7], dtype=torch.int32),
        max_prefill_len=4,
        backend="torch",
    )
    assert meta.has_prefill
    out = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE, window, stored=stored)
    expected = torch.cat(
        [
            dense_attention(q[:1], *kv["a"], torch.tensor([5]), window),
            dense_attention(q[1:], *kv["b"], torch.arange(3, 7), window),
        ]
    )
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k_cache.view(-1, HKV, D)[step_slots], k)  # the step's K/V are in the cache


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_step_with_a_draft_tree_masks_the_tree_by_ancestry(backend):
    """Sequence a decodes (5 cached); b verifies a draft tree of 5 tokens after 3 cached ones (token i sees the
    prefix, its ancestors and itself); c prefills 3 causal tokens after 2 cached: one ``prefill_tree_mask``."""
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.zeros(8, PAGE, HKV, D), torch.zeros(8, PAGE, HKV, D)
    lens, cached = {"a": 6, "b": 8, "c": 5}, {"a": 5, "b": 3, "c": 2}
    tables = {"a": [2, 5], "b": [0, 7], "c": [4, 1]}
    kv = {s: tuple(torch.randn(n, HKV, D, generator=gen) for _ in "kv") for s, n in lens.items()}
    for s in lens:
        index = torch.tensor(slots(tables[s], range(cached[s])))
        k_cache.view(-1, HKV, D)[index] = kv[s][0][: cached[s]]
        v_cache.view(-1, HKV, D)[index] = kv[s][1][: cached[s]]
    step_slots = torch.tensor([x for s in lens for x in slots(tables[s], range(cached[s], lens[s]))])
    k, v = (torch.cat([kv[s][i][cached[s] :] for s in lens]) for i in (0, 1))  # [9, Hkv, D]
    q = torch.randn(9, HQ, D, generator=gen)
    parents = [-1, 0, 0, 1, 2]
    meta = AttentionMetadata(
        slot_mapping=step_slots,
        num_decodes=1,
        decode_block_tables=torch.tensor([tables["a"]], dtype=torch.int32),
        decode_context_lens=torch.tensor([6], dtype=torch.int32),
        max_decode_context=6,
        prefill_block_tables=torch.tensor([tables["b"], tables["c"]], dtype=torch.int32),
        prefill_cu_seqlens=torch.tensor([0, 5, 8], dtype=torch.int32),
        prefill_context_lens=torch.tensor([8, 5], dtype=torch.int32),
        max_prefill_len=5,
        backend=backend,
        prefill_tree_mask=pack_tree_masks([parents, 3]),
    )
    out = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE, 0)
    tree = torch.eye(5, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            tree[i] |= tree[p]  # a parent's row already holds its own ancestors
    allowed_b = torch.cat([torch.ones(5, 3, dtype=torch.bool), tree], 1)
    expected = torch.cat(
        [
            dense_attention(q[:1], *kv["a"], torch.tensor([5])),
            dense_attention(q[1:6], *kv["b"], torch.arange(3, 8), allowed=allowed_b),
            dense_attention(q[6:], *kv["c"], torch.arange(2, 5)),
        ]
    )
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
