"""How one request is decoded: greedy or sampled, how long, when to stop, how many completions."""

from __future__ import annotations

import math
from dataclasses import dataclass

from quantkit.checks import flag, integer, number
from quantkit.errors import QuantkitError

GREEDY_BELOW = 1e-5  # temperatures below this decode greedily (vLLM's threshold too)


@dataclass(frozen=True)
class SamplingParams:
    """- ``temperature`` 0 is greedy (argmax), as is any below 1e-5 (dividing logits by less overflows fp32, and the
      distribution is already a point mass); otherwise logits are divided by it before sampling.
    - ``top_k`` 0 keeps the whole vocabulary; ``top_p`` 1.0 disables nucleus filtering.
    - ``seed`` makes a sampled request reproducible whatever else is in the batch (completion i uses seed + i).
    - ``max_tokens``: new tokens at most; ``stop_token_ids`` end a completion (the stop token is kept), as does the
      model's EOS unless ``ignore_eos``.
    - ``n`` completions share the prompt's KV blocks (copy-on-write once they diverge).
    """

    n: int = 1
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        integer("n", self.n, low=1)
        t = self.temperature
        if not isinstance(t, int | float) or isinstance(t, bool) or not 0 <= t < math.inf:
            raise QuantkitError(f"temperature must be a finite number >= 0, got {t!r}")
        integer("top_k", self.top_k, low=0)  # 0 = off
        number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        integer("seed", self.seed, low=0, high=2**63 - 1, none=True)
        integer("max_tokens", self.max_tokens, low=1)
        flag("ignore_eos", self.ignore_eos)
        stops = self.stop_token_ids
        if isinstance(stops, int) or not isinstance(stops, list | tuple | set | frozenset | range):
            raise QuantkitError(f"stop_token_ids must be a list of token ids, got {stops!r}")
        for t in stops:
            integer("a stop token id", t, low=0)
        object.__setattr__(self, "stop_token_ids", tuple(stops))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
