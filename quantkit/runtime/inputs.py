"""A step's integer inputs, written on the host into buffers kept between steps and copied to the device at once.

Two host buffers (pinned on CUDA, so the copies are asynchronous DMA):

- ``BlockTableRows`` [rows, width] int32: the block table of every scheduled sequence, in packed order. A row that
  holds the same sequence (same ``table_version``) as in the previous step only gets its appended entries, so a
  decode step writes one entry per sequence every ``block_size`` tokens instead of rebuilding every table.
- a flat int32 buffer, laid out ``[ids T | positions T | slots T | context lens N | cu_seqlens P + 1 | sample rows S]``
  for an eager step (T tokens, N sequences, P prefill chunks, S sampled rows), or ``[ids B | positions B | slots B |
  context lens B | sample rows S]`` for a decode step replayed from the CUDA graph of B rows (rows past the batch:
  slot -1, context 0, so they write and read nothing). Sample rows are written only when they are not simply every
  row in order.

A step therefore costs two host-to-device copies, and no device-to-host copy. A chunk that ends with a drafted tree
(``Sequence.draft_parents``) gives each tree token the position of the last verified token + its depth and an
ancestor word for the prefill kernel's tree mask (``StepLayout.tree_mask``, one int64 word per prefill row); its
slots stay in chunk order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from quantkit.kernels.attention.tree_mask import CAUSAL_ROW, TREE_MAX_TOKENS, tree_mask_words
from quantkit.runtime.scheduler import ScheduledBatch
from quantkit.runtime.sequence import Sequence


class HostBuffer:
    """A growable 1-D host tensor (pinned when ``pin``) with a numpy view of the same memory."""

    def __init__(self, shape: tuple[int, ...], pin: bool):
        self.pin = pin
        self.tensor = torch.zeros(shape, dtype=torch.int32, pin_memory=pin)
        self.array = self.tensor.numpy()

    def reserve(self, rows: int) -> None:
        """At least ``rows`` entries along the first axis, keeping the contents."""
        if rows > self.tensor.shape[0]:
            old = self.tensor
            self.tensor = torch.zeros((max(rows, 2 * old.shape[0]), *old.shape[1:]), dtype=torch.int32,
                                      pin_memory=self.pin)  # fmt: skip
            self.tensor[: old.shape[0]] = old
            self.array = self.tensor.numpy()


class BlockTableRows:
    """Host block-table rows of the scheduled sequences, extended in place from one step to the next."""

    def __init__(self, width: int, pin: bool):
        self.width = width
        self.buf = HostBuffer((16, width), pin)
        self.keys: list[tuple[int, int] | None] = []  # (seq_id, table_version) each row holds
        self.lens: list[int] = []  # entries of the row that are up to date

    def fill(self, seqs: list[Sequence]) -> np.ndarray:
        """Rows ``0 .. len(seqs)-1`` = the sequences' block tables (entries past a table's length are stale)."""
        self.buf.reserve(len(seqs))
        if len(self.keys) < len(seqs):
            self.keys += [None] * (len(seqs) - len(self.keys))
            self.lens += [0] * (len(seqs) - len(self.lens))
        rows, keys, lens = self.buf.array, self.keys, self.lens
        for i, seq in enumerate(seqs):
            table, key = seq.block_table, (seq.seq_id, seq.table_version)
            start = lens[i] if keys[i] == key else 0
            if len(table) > start:
                rows[i, start : len(table)] = table[start:]
            keys[i], lens[i] = key, len(table)
        return rows


@dataclass
class StepLayout:
    """What was written for one step: sizes, where each part lies in the flat buffer, and host-side bounds."""

    num_tokens: int
    num_decodes: int
    num_seqs: int
    rows: int  # padded row count of a graph replay (= num_tokens for an eager step)
    offsets: dict[str, tuple[int, int]]  # part -> (start, end) in the flat buffer
    size: int  # entries of the flat buffer to copy
    sample_rows: list[int] | None  # packed row of each sampled sequence; None: every row, in order
    last_rows: dict[int, int]  # seq_id -> packed row of the sequence's last token this step
    max_decode_context: int
    max_prefill_len: int
    prefill_has_prefix: bool  # some chunk starts after cached context (else a first prefill of every chunk)
    tree_mask: np.ndarray | None = None  # int64 [prefill rows]: ancestor words when some chunk is a draft tree


def tree_chunk(seq: Sequence, n: int) -> tuple[np.ndarray, list[int]]:
    """A chunk of ``n`` tokens of ``seq`` ending with its drafted tree -> (each row's position offset from the chunk's
    start [n], the chunk's parent array): rows up to the last verified token (the root) form a chain, a tree token
    sits at the root's position + its depth and sees its ancestors."""
    k = seq.num_draft_tokens
    root = n - k - 1
    if root < 0 or n > TREE_MAX_TOKENS:
        raise RuntimeError(f"a tree chunk of {n} tokens cannot hold {k} tree tokens and its root")  # a bug
    parents = list(range(-1, root))
    offsets = list(range(root + 1))
    for p in seq.draft_parents:
        parents.append(root + 1 + p if p >= 0 else root)
        offsets.append(offsets[parents[-1]] + 1)
    return np.asarray(offsets, dtype=np.int32), parents


def packed_order(batch) -> list[int]:
    """The order in which a step packs ``batch``'s sequences (indices into ``batch.seqs``): decodes first, stable;
    the hidden rows a runner hands ``on_hidden`` follow it."""
    return sorted(range(len(batch.seqs)), key=lambda i: batch.num_new[i] != 1)


class StepInputs:
    def __init__(self, block_size: int, width: int, pin: bool):
        self.block_size = block_size
        self.tables = BlockTableRows(width, pin)
        self.flat = HostBuffer((1024,), pin)

    def write(self, batch: ScheduledBatch, graph_rows: int | None = None) -> StepLayout:
        """Pack ``batch`` (decodes first, then prefill chunks) into the host buffers; ``graph_rows``: lay the step out
        for the decode graph of that many rows (the batch must then be all decodes)."""
        bs = self.block_size
        order = packed_order(batch)
        seqs = [batch.seqs[i] for i in order]
        num_new = [batch.num_new[i] for i in order]
        nd = next((i for i, n in enumerate(num_new) if n != 1), len(num_new))
        n_seq, t = len(seqs), sum(num_new)
        tables = self.tables.fill(seqs)

        rows = graph_rows or t
        n_ctx = graph_rows or n_seq
        n_cu = 0 if graph_rows else n_seq - nd + 1
        n_sample = sum(1 + s.num_draft_tokens for s in batch.sampled)
        parts = (("ids", rows), ("pos", rows), ("slots", rows), ("ctx", n_ctx), ("cu", n_cu), ("sample", n_sample))
        offsets, at = {}, 0
        for name, size in parts:
            offsets[name] = (at, at + size)
            at += size
        self.flat.reserve(at)
        flat = self.flat.array
        ids, pos, slots, ctx = (flat[a:b] for a, b in (offsets[k] for k in ("ids", "pos", "slots", "ctx")))

        # decodes: one token each, at position num_computed_tokens
        dec_pos = [s.num_computed_tokens for s in seqs[:nd]]
        ids[:nd] = [s.token_ids[p] for s, p in zip(seqs, dec_pos, strict=False)]
        pos[:nd] = dec_pos
        slots[:nd] = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, dec_pos, strict=False)]
        ctx[:nd] = pos[:nd] + 1
        if graph_rows:
            ids[nd:], pos[nd:], slots[nd:], ctx[nd:] = 0, 0, -1, 0
        # prefill chunks: num_new tokens each, from num_computed_tokens
        cu = flat[offsets["cu"][0] : offsets["cu"][1]]
        at, max_prefill, has_prefix = nd, 0, False
        words: list[int | list[int]] = []  # per chunk: a length (causal rows) or a tree chunk's parent array
        if n_cu:
            cu[0] = 0
        for j, (seq, n) in enumerate(zip(seqs[nd:], num_new[nd:], strict=True)):
            start = seq.num_computed_tokens
            p = np.arange(start, start + n, dtype=np.int32)
            ids[at : at + n] = seq.token_ids[start : start + n]
            if seq.draft_parents is not None and start + n == seq.num_tokens:
                shift, parents = tree_chunk(seq, n)
                pos[at : at + n] = start + shift
                words.append(parents)
            else:
                pos[at : at + n] = p
                words.append(n)
            slots[at : at + n] = tables[nd + j, p // bs] * bs + p % bs
            ctx[nd + j] = start + n
            cu[j + 1] = cu[j] + n
            at += n
            max_prefill = max(max_prefill, n)
            has_prefix |= start > 0

        last_row, row = {}, 0
        for seq, n in zip(seqs, num_new, strict=True):
            row += n
            last_row[seq.seq_id] = row - 1
        # a sequence verifying k drafted tokens takes the logits of its last k + 1 rows
        sample_rows = [r for s in batch.sampled for r in range(last_row[s.seq_id] - s.num_draft_tokens,
                                                                last_row[s.seq_id] + 1)]  # fmt: skip
        if sample_rows == list(range(t)):
            sample_rows = None  # a pure decode step samples every row: no gather
        else:
            flat[offsets["sample"][0] : offsets["sample"][1]] = sample_rows
        return StepLayout(
            num_tokens=t,
            num_decodes=nd,
            num_seqs=n_seq,
            rows=rows,
            offsets=offsets,
            size=offsets["sample"][1],
            sample_rows=sample_rows,
            last_rows=last_row,
            max_decode_context=max(dec_pos) + 1 if nd else 0,
            max_prefill_len=max_prefill,
            prefill_has_prefix=has_prefix,
            tree_mask=_mask_words(words) if any(not isinstance(w, int) for w in words) else None,
        )

    def write_verify(self, batch: ScheduledBatch, rows: int, width: int, tree: bool = False) -> StepLayout:
        """Pack a step where every sequence verifies drafted tokens for the verify graph of ``rows`` sequences of
        ``width`` tokens each: sequence i's tokens (up to ``width``, of which the last d + 1 are sampled: its d drafted
        tokens and the one before them) start at row i * width, the rest of its rows (and the rows of padding
        sequences) are padding that stores nothing (slot -1) and comes after every real token of its chunk, so the
        causal attention of the real tokens never sees it. Layout: [ids R*W | positions R*W | slots R*W | context
        lens R | cu_seqlens R + 1 | sample rows S]. ``tree``: also the tree mask's word of every row (``tree_mask``:
        causal rows but for chunks ending with a drafted tree, laid out as ``write`` lays them)."""
        bs, seqs = self.block_size, batch.seqs
        n = rows * width
        parts = (("ids", n), ("pos", n), ("slots", n), ("ctx", rows), ("cu", rows + 1),
                 ("sample", sum(seq.num_draft_tokens + 1 for seq in seqs)))  # fmt: skip
        offsets, at = {}, 0
        for name, size in parts:
            offsets[name] = (at, at + size)
            at += size
        self.flat.reserve(at)
        flat = self.flat.array
        ids, pos, slots, ctx, cu, sample = (flat[a:b] for a, b in offsets.values())
        tables = self.tables.fill(seqs)
        ids[:], slots[:], ctx[:] = 0, -1, width
        cu[:] = np.arange(rows + 1, dtype=np.int32) * width
        pos[:] = np.tile(np.arange(width, dtype=np.int32), rows)
        words = np.full(n, CAUSAL_ROW, dtype=np.int64) if tree else None
        last_row, at = {}, 0
        for i, (seq, count) in enumerate(zip(seqs, batch.num_new, strict=True)):
            start, base = seq.num_computed_tokens, i * width
            p = np.arange(start, start + count, dtype=np.int32)
            ids[base : base + count] = seq.token_ids[start : start + count]
            pos[base : base + count] = p
            if words is not None and seq.draft_parents is not None:
                shift, parents = tree_chunk(seq, count)
                pos[base : base + count] = start + shift
                words[base : base + count] = tree_mask_words(parents).numpy()
            pos[base + count : base + width] = start + count - 1  # padding: any position the rotary tables hold
            slots[base : base + count] = tables[i, p // bs] * bs + p % bs
            ctx[i] = start + width
            keep = seq.num_draft_tokens + 1
            sample[at : at + keep] = np.arange(base + count - keep, base + count, dtype=np.int32)
            at += keep
            last_row[seq.seq_id] = base + count - 1
        return StepLayout(
            num_tokens=n,
            num_decodes=0,
            num_seqs=len(seqs),  # block-table rows to copy; the graph's padding sequences read none
            rows=n,
            offsets=offsets,
            size=at + offsets["sample"][0],
            sample_rows=list(sample[:at]),
            last_rows=last_row,
            max_decode_context=0,
            max_prefill_len=width,
            prefill_has_prefix=True,
            tree_mask=words,
        )


def _mask_words(chunks: list[int | list[int]]) -> np.ndarray:
    rows = [
        np.full(c, CAUSAL_ROW, dtype=np.int64) if isinstance(c, int) else tree_mask_words(c).numpy() for c in chunks
    ]
    return np.concatenate(rows)
