"""Step inputs: block-table rows extended in place between steps, and the flat layouts of eager and graph steps."""

import random

import numpy as np
import torch

from quantkit.runtime.inputs import BlockTableRows, StepInputs
from quantkit.runtime.sampling_params import SamplingParams
from quantkit.runtime.scheduler import ScheduledBatch
from quantkit.runtime.sequence import Sequence

PARAMS = SamplingParams(max_tokens=4)


def test_table_rows_follow_appends_replacements_and_reordering():
    """Random steps: sequences come and go (rows shift), grow, have entries replaced (copy-on-write, readmission);
    every filled row must equal its sequence's table, although rows are only partly rewritten."""
    rng = random.Random(0)
    rows = BlockTableRows(width=40, pin=False)
    seqs = [Sequence(i, i, [1], PARAMS) for i in range(6)]
    next_id = 6
    for _ in range(300):
        op = rng.random()
        seq = rng.choice(seqs)
        if op < 0.5 and len(seq.block_table) < 40:
            seq.block_table.append(rng.randrange(1000))  # growth: no version change
        elif op < 0.6 and seq.block_table:
            seq.block_table[rng.randrange(len(seq.block_table))] = rng.randrange(1000)
            seq.table_version += 1  # what the block manager does on copy-on-write
        elif op < 0.7:
            seq.block_table = [rng.randrange(1000) for _ in range(rng.randrange(5))]
            seq.table_version += 1  # preempted and readmitted
        elif op < 0.8:
            seqs.remove(seq)  # finished: later rows move up
            seqs.append(Sequence(next_id, next_id, [1], PARAMS))
            next_id += 1
        scheduled = [s for s in seqs if rng.random() < 0.9]
        out = rows.fill(scheduled)
        for i, s in enumerate(scheduled):
            assert out[i, : len(s.block_table)].tolist() == s.block_table
    assert rows.buf.tensor.shape[0] >= 6


def decode_batch(specs, block_size=4):
    """Sequences of (tokens, computed tokens) with tables covering their tokens, each scheduled for the rest."""
    batch = ScheduledBatch()
    for i, (n_tokens, computed) in enumerate(specs):
        seq = Sequence(i, i, list(range(100 + 10 * i, 100 + 10 * i + n_tokens)), PARAMS)
        seq.block_table = [50 + 7 * i + b for b in range(-(-n_tokens // block_size))]
        seq.num_computed_tokens = computed
        batch.add(seq, n_tokens - computed, [])
    return batch


def test_eager_layout_packs_decodes_first():
    inputs = StepInputs(block_size=4, width=8, pin=False)
    batch = decode_batch([(6, 2), (9, 8), (3, 0), (5, 4)])  # a chunk, a decode, a chunk, a decode
    layout = inputs.write(batch)
    flat = inputs.flat.array
    part = {k: flat[a:b].tolist() for k, (a, b) in layout.offsets.items()}
    assert (layout.num_tokens, layout.num_decodes, layout.num_seqs) == (4 + 1 + 3 + 1, 2, 4)
    assert part["ids"] == [118, 134, 102, 103, 104, 105, 120, 121, 122]
    assert part["pos"] == [8, 4, 2, 3, 4, 5, 0, 1, 2]
    slot = lambda seq, p: (50 + 7 * seq + p // 4) * 4 + p % 4
    chunks = [slot(0, p) for p in range(2, 6)] + [slot(2, p) for p in range(3)]
    assert part["slots"] == [slot(1, 8), slot(3, 4), *chunks]
    assert part["ctx"] == [9, 5, 6, 3]
    assert part["cu"] == [0, 4, 7]
    assert part["sample"] == [2 + 3, 0, 8, 1]  # batch.sampled order: seq 0, 1, 2, 3
    assert layout.sample_rows == part["sample"]
    assert (layout.max_decode_context, layout.max_prefill_len) == (9, 4)
    assert layout.prefill_has_prefix  # the first chunk starts at position 2
    tables = inputs.tables.buf.array
    assert tables[2, :2].tolist() == [50, 51] and tables[0, :3].tolist() == [57, 58, 59]


def test_layout_tells_first_prefills_from_chunks_after_cached_context():
    inputs = StepInputs(block_size=4, width=8, pin=False)
    assert not inputs.write(decode_batch([(6, 0), (9, 8), (3, 0)])).prefill_has_prefix  # decodes do not count
    assert inputs.write(decode_batch([(6, 0), (3, 1)])).prefill_has_prefix


def test_graph_layout_pads_rows_that_write_nothing():
    inputs = StepInputs(block_size=4, width=8, pin=False)
    inputs.flat.array[:] = 7  # stale values from an earlier step
    layout = inputs.write(decode_batch([(6, 5), (9, 8), (4, 3)]), graph_rows=4)
    flat = inputs.flat.array
    assert layout.rows == 4 and layout.sample_rows is None
    assert flat[0:4].tolist() == [105, 118, 123, 0]
    assert flat[4:8].tolist() == [5, 8, 3, 0]
    assert flat[8:12].tolist()[3] == -1 and np.all(flat[8:11] >= 0)
    assert flat[12:16].tolist() == [6, 9, 4, 0]


def test_verify_layout_samples_each_sequences_drafted_tokens_and_the_one_before():
    """A verify graph step: a sequence verifying 2 drafted tokens samples its last 3 rows; a draft model catching up
    on 3 verified tokens (nothing drafted) samples only its last; rows past each chunk are padding."""
    inputs = StepInputs(block_size=4, width=8, pin=False)
    batch = decode_batch([(7, 4), (9, 6)])
    batch.seqs[0].num_draft_tokens = 2
    layout = inputs.write_verify(batch, rows=2, width=4)
    flat = inputs.flat.array
    part = {k: flat[a:b].tolist() for k, (a, b) in layout.offsets.items()}
    assert part["ids"] == [104, 105, 106, 0, 116, 117, 118, 0]
    assert part["pos"] == [4, 5, 6, 6, 6, 7, 8, 8]
    assert part["slots"][3] == -1 and part["slots"][7] == -1
    assert part["sample"] == [0, 1, 2, 6]
    assert layout.last_rows == {0: 2, 1: 6}


def test_a_drafted_tree_gets_depth_positions_chunk_slots_and_mask_words():
    """A decoding sequence with a drafted tree beside a decode and a causal chunk: its tree tokens sit at the root's
    position + depth, keep the slots of their chunk order, and their rows carry the tree's ancestor words; the
    other prefill rows stay causal (-1)."""
    from quantkit.kernels.attention.tree_mask import pack_tree_masks

    from quantkit.runtime.speculative.tree import DraftTree

    inputs = StepInputs(block_size=4, width=8, pin=False)
    batch = decode_batch([(9, 8), (5, 0)])  # a decode, a first prefill
    tree = Sequence(7, 7, list(range(200, 211)), PARAMS)  # 11 verified tokens, the last not yet computed
    parents = [-1, -1, 0, 0, 1, 2]  # depths 1 1 2 2 2 3
    tree.add_draft([300 + i for i in range(6)], None, parents)
    tree.block_table = [40, 41, 42, 43, 44]
    tree.num_computed_tokens = 10
    batch.add(tree, 7, [])
    layout = inputs.write(batch)
    flat = inputs.flat.array
    part = {k: flat[a:b].tolist() for k, (a, b) in layout.offsets.items()}
    rows = slice(1 + 5, 1 + 5 + 7)  # after the decode and the causal chunk
    assert part["pos"][rows] == [10, 11, 11, 12, 12, 12, 13]
    assert part["slots"][rows] == [42 * 4 + 2, 42 * 4 + 3, *(43 * 4 + j for j in range(4)), 44 * 4 + 0]
    assert part["ids"][rows] == [210, *(300 + i for i in range(6))]
    chunk = DraftTree(torch.tensor([300 + i for i in range(6)]), torch.tensor(parents)).chunk_parents()
    assert layout.tree_mask.tolist() == pack_tree_masks([5, chunk]).tolist()
    assert part["sample"] == [0, 5, *range(6, 13)]  # the decode, the chunk's last row, the root and every tree token
