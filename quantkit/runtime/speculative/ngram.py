"""Prompt lookup decoding: draft the tokens that followed the latest earlier occurrence of the sequence's last n
tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) in its prompt and output. No model; the
proposal is deterministic, so its distribution is one-hot and the verification rule accepts a drafted token x with
probability p(x). It pays where outputs quote their inputs (summaries, edits, answers about a given passage)."""

from __future__ import annotations

import numpy as np
import torch

from quantkit.runtime.sequence import Sequence
from quantkit.runtime.speculative.proposer import Draft


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
