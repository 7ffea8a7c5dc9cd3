"""Iteration-level scheduling (Orca, OSDI 2022) with chunked prefill and preemption by recomputation.

Every step first serves the running sequences in admission order (a decode takes one token; an unfinished
prefill takes its next chunk), then admits waiting sequences first come, first served while the token budget
(``max_num_batched_tokens``), ``max_num_seqs`` and free blocks allow. When a running sequence needs a block and
none is free, the most recently admitted sequence is preempted: its blocks are freed and it goes back to the front
of the queue, to be prefilled again (prompt and output so far) later. The oldest sequence therefore always
progresses, and every sequence fits the cache on its own (checked in ``add``), so the engine cannot deadlock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from quantkit.errors import QuantkitError
from quantkit.runtime.block_manager import BlockManager
from quantkit.runtime.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """``seqs[i]`` computes ``num_new[i]`` tokens from position ``seqs[i].num_computed_tokens``; ``copies`` are
    copy-on-write block copies (src, dst) to do before the forward pass; ``sampled`` are the sequences whose step
    reaches their last token, so that they sample the next one (in batch order)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    sampled: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, num_new: int, copies: list[tuple[int, int]]) -> None:
        self.seqs.append(seq)
        self.num_new.append(num_new)
        self.copies += copies
        if seq.num_computed_tokens + num_new == seq.num_tokens:
            self.sampled.append(seq)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        longest = seq.num_prompt_tokens + seq.params.max_tokens
        if longest > self.bm.num_blocks * self.bm.block_size:
            raise QuantkitError(
                f"a sequence of {longest} tokens cannot fit the KV cache ({self.bm.num_blocks} blocks of "
                f"{self.bm.block_size}); lower max_tokens or give the cache more blocks"
            )
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            want = seq.num_tokens - seq.num_computed_tokens
            num_new = min(want, budget, self.bm.appendable_tokens(seq))
            if seq.num_draft_tokens and num_new < want:  # verify fewer drafted tokens rather than split the check
                seq.drop_draft(want - num_new)
                num_new = min(seq.num_tokens - seq.num_computed_tokens, num_new)
            while num_new == 0 and seq.status is Status.RUNNING:  # out of blocks: preempt the newest
                self._preempt(self.running.pop())
                preempted = True
                num_new = min(seq.num_tokens - seq.num_computed_tokens, budget, self.bm.appendable_tokens(seq))
            if seq.status is Status.RUNNING:
                batch.add(seq, num_new, self.bm.append(seq, num_new))
                budget -= num_new
                i += 1
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.bm.match_prefix(seq)
            num_new = min(seq.num_tokens - len(hits) * self.bm.block_size, budget)
            if not self.bm.can_admit(seq, hits, num_new):
                break
            self.waiting.popleft()
            self.bm.admit(seq, hits, num_new)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.add(seq, num_new, [])
            budget -= num_new
        return batch

    def _preempt(self, seq: Sequence) -> None:
        seq.drop_draft()
        self.bm.free_seq(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Start the other completions of an n > 1 request, sharing all of the parent's blocks."""
        at = self.running.index(parent) + 1
        for child in children:
            self.bm.fork(parent, child)
        self.running[at:at] = children

    def commit(self, batch: ScheduledBatch, kept: dict[int, int] | None = None) -> None:
        """Account for the K/V the step wrote. ``kept`` (seq_id -> tokens) limits a verify step's sequences to the
        positions that held accepted tokens; the blocks past them go back (speculative decoding's rollback)."""
        for seq, num_new in zip(batch.seqs, batch.num_new, strict=True):
            start = seq.num_computed_tokens
            if kept is not None and seq.seq_id in kept:
                num_new = kept[seq.seq_id]
            seq.num_computed_tokens += num_new
            self.bm.commit(seq, start)
            if kept is not None and seq.seq_id in kept:
                self.bm.truncate(seq)

    def drop_finished(self) -> None:
        """Free the finished sequences' blocks and forget them. A finished one can also be waiting: preempted by
        a step scheduled before its last token was read (the engine's async scheduling); its blocks are freed."""
        for seq in self.running:
            if seq.is_finished:
                self.bm.free_seq(seq)
        self.running = [s for s in self.running if not s.is_finished]
        if any(s.is_finished for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if not s.is_finished)
