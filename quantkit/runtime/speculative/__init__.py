"""Speculative decoding: a proposer drafts tokens, the target scores them in one pass, the rejection rule keeps
exactly the target's distribution (``LLM(model, speculative=SpeculativeConfig(...))``)."""

from quantkit.runtime.speculative.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
