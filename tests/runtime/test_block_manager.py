"""The block allocator on its own: reference counts, prefix keys, copy-on-write, eviction, waste accounting."""

from quantkit.runtime.block_manager import BlockManager
from quantkit.runtime.sampling_params import SamplingParams
from quantkit.runtime.sequence import Sequence

P = 4  # block size


def seq(tokens, seq_id=0) -> Sequence:
    return Sequence(seq_id, seq_id, list(tokens), SamplingParams())


def admit_and_compute(bm: BlockManager, s: Sequence) -> None:
    hits = bm.match_prefix(s)
    n = s.num_tokens - len(hits) * P
    assert bm.can_admit(s, hits, n)
    bm.admit(s, hits, n)
    start = s.num_computed_tokens
    s.num_computed_tokens += n
    bm.commit(s, start)


def test_allocation_and_free_return_every_block():
    bm = BlockManager(8, P)
    a = seq(range(10))
    admit_and_compute(bm, a)
    assert len(a.block_table) == 3 and bm.num_free == 5
    assert bm.kv_usage() == (12, 10)
    bm.free_seq(a)
    assert bm.num_free == 8 and bm.kv_usage() == (0, 0)


def test_prefix_hits_skip_full_blocks_but_never_the_last_token():
    bm = BlockManager(8, P)
    a = seq(range(9))
    admit_and_compute(bm, a)  # blocks [0-3] [4-7] full and keyed, [8] partial
    b = seq([*range(8), 99, 100], seq_id=1)
    assert bm.match_prefix(b) == a.block_table[:2]
    exact = seq(range(8), seq_id=2)  # its last token sits in block 1: only block 0 may be reused
    assert bm.match_prefix(exact) == a.block_table[:1]
    admit_and_compute(bm, b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.ref_counts[x] for x in b.block_table] == [2, 2, 1]
    assert bm.kv_usage() == (4 * P, 9 + 2)  # the shared blocks are counted once


def test_freed_blocks_stay_cached_until_reused_oldest_first():
    bm = BlockManager(4, P)
    a = seq(range(9))
    admit_and_compute(bm, a)
    bm.free_seq(a)
    again = seq(range(9), seq_id=1)
    hits = bm.match_prefix(again)
    assert len(hits) == 2 and all(bm.ref_counts[h] == 0 for h in hits)
    other = seq(range(50, 62), seq_id=2)  # needs 3 of the 4 blocks: evicts the free ones, oldest first
    admit_and_compute(bm, other)
    assert len(bm.match_prefix(again)) == 1  # block 0 was freed last, so it survived


def test_fork_then_copy_on_write_of_the_partial_block():
    bm = BlockManager(8, P)
    parent = seq(range(6))
    admit_and_compute(bm, parent)
    child = parent.fork(1, 1)
    bm.fork(parent, child)
    assert [bm.ref_counts[x] for x in parent.block_table] == [2, 2]
    for s in (parent, child):
        s.token_ids.append(7)
    copies = bm.append(parent, 1)  # writes position 6, in the shared partial block 1
    assert copies == [(child.block_table[1], parent.block_table[1])]
    assert bm.ref_counts[parent.block_table[1]] == 1 and bm.ref_counts[child.block_table[1]] == 1
    assert bm.append(child, 1) == []  # now the only owner: writes in place
    assert bm.ref_counts[parent.block_table[0]] == 2  # the full block stays shared


def test_appendable_tokens_counts_the_copy():
    bm = BlockManager(3, P)
    parent = seq(range(6))
    admit_and_compute(bm, parent)
    child = parent.fork(1, 1)
    bm.fork(parent, child)
    # 2 spare slots in the shared block, but writing there needs a copy: the free block pays for it
    assert bm.appendable_tokens(parent) == (2 + 1 - 1) * P - 6
