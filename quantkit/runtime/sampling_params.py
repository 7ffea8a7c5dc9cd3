"""How one request is decoded: greedy or sampled, how long, when to stop, how many completions."""

from __future__ import annotations

import math
from dataclasses import dataclass

from quantkit.checks import flag, integer, number, shown
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
        t = self.temperature
        try:
            t = number("temperature", t, 0.0, math.inf)
        except QuantkitError:
            t = math.nan
        if not t < math.inf:  # nan too
            raise QuantkitError(f"temperature must be a finite number >= 0, got {shown(self.temperature)}")
        stops = self.stop_token_ids
        if isinstance(stops, str | bytes) or not hasattr(stops, "__iter__"):
            raise QuantkitError(f"stop_token_ids must be a list of token ids, got {shown(stops)}")
        checked = {
            "n": integer("n", self.n, low=1),
            "temperature": t,
            "top_k": integer("top_k", self.top_k, low=0),  # 0 = off
            "top_p": number("top_p", self.top_p, 0.0, 1.0, low_open=True),
            "seed": integer("seed", self.seed, low=0, high=2**64 - 1, none=True),
            "max_tokens": integer("max_tokens", self.max_tokens, low=1),
            "ignore_eos": flag("ignore_eos", self.ignore_eos),
            "stop_token_ids": tuple(integer("a stop token id", i, low=0) for i in stops),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
