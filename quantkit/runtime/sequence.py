"""One completion being generated: its tokens, how many have KV in the cache, and the blocks holding them."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from quantkit.runtime.sampling_params import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    """Speculative decoding of one completion: verify steps, drafted and accepted tokens, tokens emitted by verify
    steps (accepted drafts plus the target's own token)."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_emitted(self) -> float:
        """tau: tokens emitted per verify step."""
        return self.emitted / self.steps if self.steps else 0.0


class Sequence:
    """``token_ids`` = prompt + output. The first ``num_computed_tokens`` have K/V in the cache, in the blocks of
    ``block_table`` (block i holds positions i*P .. i*P + P - 1); ``table_version`` changes whenever entries of the
    table are replaced (not when blocks are appended), so copies of it can be extended instead of rebuilt.
    ``pending_forks`` completions of an n > 1 request
    are split off when this sequence samples its first token; ``index`` numbers the completions of a request."""

    def __init__(self, seq_id: int, request_id: int, prompt: list[int], params: SamplingParams, index: int = 0):
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index
        self.params = params
        self.token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.table_version = 0
        self.block_keys: list[bytes] = []  # prefix hash of each full block of token_ids (computed lazily)
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.pending_forks = params.n - 1 if index == 0 else 0
        self.generator: torch.Generator | None = None
        # speculative decoding: the last ``num_draft_tokens`` of token_ids are drafted, not yet verified;
        # ``draft_probs`` [k, V] is the proposer's distribution at each (None: greedy or a deterministic proposer)
        self.num_draft_tokens = 0
        self.draft_probs: torch.Tensor | None = None
        # a drafted tree instead of a chain: the parent of each drafted token (-1: the last verified token), in
        # topological order, so dropping drafted tokens from the end keeps a tree
        self.draft_parents: list[int] | None = None
        self.spec = SpecStats()

    def add_draft(self, tokens: list[int], probs: torch.Tensor | None, parents: list[int] | None = None) -> None:
        self.token_ids += tokens
        self.num_draft_tokens = len(tokens)
        self.draft_probs = probs
        self.draft_parents = parents if tokens else None

    def drop_draft(self, count: int | None = None) -> None:
        """Forget the last ``count`` drafted tokens (all by default)."""
        count = self.num_draft_tokens if count is None else min(count, self.num_draft_tokens)
        if count:
            del self.token_ids[-count:]
            self.num_draft_tokens -= count
            if self.draft_probs is not None:
                self.draft_probs = self.draft_probs[: self.num_draft_tokens]
            if self.draft_parents is not None:
                self.draft_parents = self.draft_parents[: self.num_draft_tokens]
        if not self.num_draft_tokens:
            self.draft_probs = self.draft_parents = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def fork(self, seq_id: int, index: int) -> Sequence:
        """A copy sharing this sequence's history (the caller shares its blocks through the block manager)."""
        child = Sequence(seq_id, self.request_id, self.token_ids[: self.num_prompt_tokens], self.params, index)
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.block_keys = list(self.block_keys)
        child.status = self.status
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.request_id}.{self.index}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)}, {self.status.value})"
        )
