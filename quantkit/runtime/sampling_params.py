"""How one request is decoded: greedy or sampled, how long, when to stop, how many completions."""

from __future__ import annotations

import math
from dataclasses import dataclass

from quantkit.errors import QuantkitError


@dataclass(frozen=True)
class SamplingParams:
    """- ``temperature`` 0 is greedy (argmax); otherwise logits are divided by it before sampling.
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
        for name in ("n", "top_k", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise QuantkitError(f"{name} must be an integer, got {value!r}")
        if self.n < 1:
            raise QuantkitError(f"n must be >= 1, got {self.n}")
        if not self.temperature >= 0 or math.isinf(self.temperature):
            raise QuantkitError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise QuantkitError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise QuantkitError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise QuantkitError(f"max_tokens must be >= 1, got {self.max_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
