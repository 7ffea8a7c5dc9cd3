"""How the runtime speculates: which proposer drafts tokens, how many, and when speculation is worth its cost."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from quantkit.checks import flag, integer
from quantkit.errors import QuantkitError
from quantkit.quant.scheme import QuantScheme

METHODS = ("draft", "self", "ngram", "eagle", "medusa", "mtp")
HEAD_METHODS = ("eagle", "medusa")  # draft heads on the target's features (``heads``)
ACCEPTANCE_METHODS = ("rejection_sampler", "typical_acceptance_sampler")  # vLLM's names for the two rules
TREE_MAX_NODES = 63  # the verify chunk (the sequence's last token, then the tree) fits one 64-bit tree-mask word
_SCHEME = re.compile(r"w(\d)a16-(g\d+|pc)(?:-(sym|asym))?")


def weight_scheme(name: str) -> QuantScheme:
    """``w4a16-g128``, ``w3a16-g64-asym``, ``w8a16-pc`` (per channel) ... -> a weight-only QuantScheme (sym default)."""
    m = _SCHEME.fullmatch(name)
    if m is None:
        raise QuantkitError(f"draft scheme must look like w4a16-g128, w3a16-g64-asym or w8a16-pc, got {name!r}")
    group = -1 if m[2] == "pc" else int(m[2][1:])
    return QuantScheme(bits=int(m[1]), group_size=group, sym=m[3] != "asym")


@dataclass(frozen=True)
class SpeculativeConfig:
    """- ``method``: ``draft`` (a smaller model with the same vocabulary: ``draft`` is its folder, float or a quantkit
      checkpoint), ``self`` (the target's own weights quantized: ``draft`` is a quantkit checkpoint of the same
      model, or None to quantize the target in memory with RTN to ``draft_scheme``; ``draft_layers`` keeps only the
      first L decoder layers), ``ngram`` (prompt lookup: the tokens that followed the last ``prompt_lookup_max`` ..
      ``prompt_lookup_min`` tokens where they occurred before in prompt + output; no model), ``eagle`` / ``medusa``
      (draft heads on the target's own hidden states, trained by ``quantkit train-draft``: ``draft`` is their folder),
      ``mtp`` (the checkpoint's own multi-token-prediction layers, DeepSeek-V3's: ``speculative.mtp``; no draft).
    - ``num_speculative_tokens``: k, the most tokens drafted per sequence and step.
    - ``adaptive``: k follows each sequence's recent acceptance, and speculation pauses for a batch size whose
      measured verify + draft cost exceeds what the accepted tokens save; False drafts k tokens every step. Either
      way the output follows the target's distribution; a seeded sampled request draws the same tokens run after
      run only with ``adaptive=False`` (the adaptive choices depend on measured times).
    - ``disable_by_batch_size``: no speculation while this many sequences or more are decoding (None: no fixed cap).
    - ``num_tree_tokens`` (``eagle`` / ``medusa`` only): draft a tree of up to this many tokens per sequence and step
      instead of a chain (None: chains), at most ``num_speculative_tokens`` deep; ``tree_topk`` candidates per
      expanded node (EAGLE-2's top-k) or per Medusa head. At most ``TREE_MAX_NODES`` (the prefill kernel's tree mask
      holds 64 tokens: the sequence's last token and the tree).
    - ``acceptance_method`` (vLLM's names): ``rejection_sampler``, the lossless rule (default); or
      ``typical_acceptance_sampler``, Medusa's typical acceptance for sampled requests in tree steps: a drafted token
      is kept where the target's probability of it exceeds min(``posterior_threshold``, ``posterior_alpha`` *
      exp(-entropy)). LOSSY: the output no longer follows the target's distribution; it trades that for longer
      accepted paths. Greedy requests are verified exactly either way.
    - ``draft_vocab_size`` (``eagle`` only): greedy chains and trees draft among the N most frequent tokens of the
      heads' training text only, reading out N rows of the lm_head instead of all (``speculative.draft_vocab``;
      None: the whole vocabulary). Lossless either way.
    """

    method: str
    num_speculative_tokens: int = 4
    draft: str | None = None
    draft_scheme: str = "w4a16-g128"
    draft_layers: int | None = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    adaptive: bool = True
    disable_by_batch_size: int | None = None
    num_tree_tokens: int | None = None
    tree_topk: int = 8
    acceptance_method: str = "rejection_sampler"
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise QuantkitError(f"unknown speculative method {self.method!r}; available: {', '.join(METHODS)}")
        checked = {
            "num_speculative_tokens": integer("num_speculative_tokens", self.num_speculative_tokens, low=1, high=64),
            "draft_layers": integer("draft_layers", self.draft_layers, low=1, none=True),
            "prompt_lookup_max": integer("prompt_lookup_max", self.prompt_lookup_max, low=1),
            "prompt_lookup_min": integer("prompt_lookup_min", self.prompt_lookup_min, low=1),
            "disable_by_batch_size": integer("disable_by_batch_size", self.disable_by_batch_size, low=1, none=True),
            "adaptive": flag("adaptive", self.adaptive),
            "num_tree_tokens": integer("num_tree_tokens", self.num_tree_tokens, low=1, high=TREE_MAX_NODES, none=True),
            "tree_topk": integer("tree_topk", self.tree_topk, low=1, high=TREE_MAX_NODES),
            "draft_vocab_size": integer("draft_vocab_size", self.draft_vocab_size, low=1, none=True),
        }
        if checked["draft_vocab_size"] is not None and self.method != "eagle":
            raise QuantkitError(f"draft_vocab_size (a draft vocabulary) needs method eagle, not {self.method!r}")
        if checked["prompt_lookup_min"] > checked["prompt_lookup_max"]:
            raise QuantkitError("prompt_lookup_min must not exceed prompt_lookup_max")
        if self.method == "draft" and not self.draft:
            raise QuantkitError("speculative method 'draft' needs a draft model (a folder)")
        if self.method in HEAD_METHODS and not self.draft:
            raise QuantkitError(f"speculative method {self.method!r} needs draft heads (a folder from train-draft)")
        if self.method in ("ngram", "mtp") and (self.draft or self.draft_layers):
            raise QuantkitError(f"speculative method {self.method!r} takes no draft model")
        if self.num_tree_tokens is not None and self.method not in HEAD_METHODS:
            raise QuantkitError(f"num_tree_tokens (tree drafting) needs method eagle or medusa, not {self.method!r}")
        if self.acceptance_method not in ACCEPTANCE_METHODS:
            raise QuantkitError(f"unknown acceptance_method {self.acceptance_method!r}; available: "
                                f"{', '.join(ACCEPTANCE_METHODS)}")  # fmt: skip
        if self.acceptance_method == "typical_acceptance_sampler" and checked["num_tree_tokens"] is None:
            raise QuantkitError("acceptance_method 'typical_acceptance_sampler' applies to draft trees: set "
                                "num_tree_tokens (method eagle or medusa)")  # fmt: skip
        for name in ("posterior_threshold", "posterior_alpha"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise QuantkitError(f"{name} must be a number in (0, 1], got {value!r}")
        weight_scheme(self.draft_scheme)  # a bad name fails here, before any weight loads
        if self.method != "self" and self.draft_layers is not None:
            raise QuantkitError("draft_layers applies to method 'self' only")
        if self.draft is not None and not isinstance(self.draft, str):
            object.__setattr__(self, "draft", str(self.draft))
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def verify_width(self) -> int:
        """Tokens a sequence scores in a verify step at most: its last token and its chain, or its tree."""
        return 1 + (self.num_speculative_tokens if self.num_tree_tokens is None else self.num_tree_tokens)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeculativeConfig:
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise QuantkitError(f"unknown speculative setting {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}")
        if "method" not in data:
            raise QuantkitError(f"speculative settings need a method ({', '.join(METHODS)})")
        return cls(**data)
