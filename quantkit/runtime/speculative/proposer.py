"""What every proposer offers the engine: draft up to k tokens for each of a batch of sequences."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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
