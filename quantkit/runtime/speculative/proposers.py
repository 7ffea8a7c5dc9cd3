"""Proposers draft up to k tokens for each of a batch of sequences: the interface every one offers, and prompt lookup.

Prompt lookup (``NgramProposer``) drafts the tokens that followed the latest earlier occurrence of the sequence's
last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) in its prompt and output. No model; the
proposal is deterministic, so its distribution is one-hot and the verification rule accepts a drafted token x with
probability p(x). It pays where outputs quote their inputs (summaries, edits, answers about a given passage). The
draft models are in ``draft_model``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from quantkit.runtime.sequence import Sequence


@dataclass
class Draft:
    """``tokens`` drafted after the sequence's last token; ``probs`` [len(tokens), V]: the proposer's (filtered)
    distribution at each, for sampled requests (None: greedy requests, or a deterministic proposer, whose
    distribution is one-hot on its token)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    """``propose`` sees the sequences' verified tokens only (no earlier drafts); ``ks[i]`` is the most tokens to
    draft for ``seqs[i]`` (a proposer may return fewer, or none). ``release`` forgets sequences that left the
    batch (finished, aborted or preempted), so a proposer with state of its own (a draft model's KV cache) frees it.
    ``cost_per_token``: a draft token's cost as a fraction of a target decode step, before any measurement."""

    cost_per_token: float

    def propose(self, seqs: list[Sequence], ks: list[int], generators: list[torch.Generator | None]) -> list[Draft]: ...

    def release(self, keep: set[int]) -> None: ...


def lookup(tokens: np.ndarray, k: int, n_max: int, n_min: int) -> list[int]:
    """The up to ``k`` tokens after the latest earlier match of the last n tokens of ``tokens``, longest n first."""
    length = tokens.shape[0]
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # all earlier n-grams
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    cost_per_token = 0.0

    def __init__(self, n_max: int, n_min: int):
        self.n_max, self.n_min = n_max, n_min

    def propose(self, seqs: list[Sequence], ks: list[int], generators: list[torch.Generator | None]) -> list[Draft]:
        return [
            Draft(lookup(np.asarray(s.token_ids), k, self.n_max, self.n_min)) for s, k in zip(seqs, ks, strict=True)
        ]

    def release(self, keep: set[int]) -> None:
        pass
