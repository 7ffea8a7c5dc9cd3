"""Mean acceptance length tau of draft heads (``quantkit train-draft``) on a target: any checkpoint, float or quantized.

Protocol (``quantkit eval --draft DIR`` uses it):
- The prompts are the evaluation windows of :mod:`quantkit.eval.perplexity` (same text, BOS and windows), each cut
  to its first ``seqlen // 2`` tokens.
- The runtime (``quantkit.runtime.LLM`` on the target's own modules, shared with the perplexity evaluation) completes
  every prompt greedily with ``max_tokens`` new tokens, EOS ignored, speculating with the heads:
  ``SpeculativeConfig(method, draft=DIR, num_speculative_tokens=k, adaptive=False)``, i.e. a chain of k drafts every
  step (or a tree of ``num_tree_tokens``, at most k deep).
- tau = tokens emitted / verify steps, over every verify step of every prompt: ``llm.spec.totals.emitted /
  llm.spec.totals.steps``, the figure ``bench-serve`` reports as tokens per verify step. A step emits the accepted
  drafts plus the target's own next token, so 1 <= tau <= k + 1. The first new token of each prompt comes from its
  prefill (no verify step); the last steps of a prompt draft fewer than k tokens where fewer are left to reach
  ``max_tokens`` (as the runtime always does), which lowers tau by a little at a small ``max_tokens``.
- Greedy verification is exact: the completions are the target's own greedy ones, so tau measures how far the heads
  follow the target (float or quantized) on its own continuation of real text, as it would be served.
- Acceptance rate = accepted drafts / drafted tokens.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from quantkit.errors import QuantkitError

DEFAULT_NEW_TOKENS = 64
DEFAULT_SPEC_TOKENS = 4


@dataclass
class AcceptanceResult:
    tau: float  # mean tokens emitted per verify step
    acceptance_rate: float  # accepted drafts / drafted tokens
    verify_steps: int
    emitted: int
    drafted: int
    accepted: int
    prompts: int
    prompt_tokens: int  # per prompt
    new_tokens: int  # per prompt
    method: str
    num_speculative_tokens: int
    num_tree_tokens: int | None
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def draft_method(draft) -> str:
    """The heads' method (eagle or medusa) from their config; one-line errors for a missing or corrupt folder."""
    from quantkit.runtime.speculative.heads import METHODS, read_meta

    if not Path(draft).is_dir():
        raise QuantkitError(f"draft heads folder not found: {draft}")
    method = read_meta(draft).get("method")
    if method not in METHODS:
        raise QuantkitError(f"draft heads {draft} name no known method ({method!r}; known: {', '.join(METHODS)})")
    return method


def check_heads(model, draft) -> str:
    """The method of the heads in ``draft``, refused in one line where they were made for another model than
    ``model`` (a loaded HF causal LM; the fingerprint check of ``runtime.speculative.heads``)."""
    from quantkit.runtime.speculative.heads import base_fingerprint, check_base, read_meta

    method = draft_method(draft)
    check_base(read_meta(draft).get("base") or {}, base_fingerprint(model.config, model.get_input_embeddings().weight),
               draft)  # fmt: skip
    return method


@torch.no_grad()
def acceptance_length(
    model,
    tokenizer,
    windows: torch.Tensor,
    draft,
    num_speculative_tokens: int = DEFAULT_SPEC_TOKENS,
    max_tokens: int = DEFAULT_NEW_TOKENS,
    num_tree_tokens: int | None = None,
    device=None,
) -> AcceptanceResult:
    """tau of the heads in ``draft`` on ``model`` (a loaded HF causal LM, float or quantized) over ``windows``
    [n, L] (evaluation windows; each prompt is a window's first L // 2 tokens). Heads made for another model are
    refused in one line (the runtime checks the base model's fingerprint)."""
    from quantkit.runtime import LLM, SamplingParams
    from quantkit.runtime.speculative.config import SpeculativeConfig

    method = check_heads(model, draft)
    if windows.dim() != 2 or windows.shape[0] == 0 or windows.shape[1] < 2:
        raise QuantkitError("measuring acceptance needs at least one evaluation window of 2 tokens or more")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 2:
        raise QuantkitError(f"max_tokens (new tokens per prompt) must be an integer >= 2, got {max_tokens!r}")
    spec = SpeculativeConfig(method=method, draft=str(draft), num_speculative_tokens=num_speculative_tokens,
                             adaptive=False, num_tree_tokens=num_tree_tokens)  # fmt: skip
    prompt_len = max(1, windows.shape[1] // 2)
    prompts = [w[:prompt_len].tolist() for w in windows]
    block = 16
    length = prompt_len + max_tokens + (num_tree_tokens or num_speculative_tokens) + 2
    blocks = len(prompts) * -(-length // block) + 8  # every prompt at once: no preemption
    settings = {"block_size": block, "cpu_kv_blocks": blocks, "max_model_len": length, "enable_prefix_caching": False}
    if device is not None:
        settings["device"] = str(device)
    t0 = time.perf_counter()
    llm = LLM(model, tokenizer, speculative=spec, **settings)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    t = llm.spec.totals
    return AcceptanceResult(
        tau=t.emitted / max(t.steps, 1),
        acceptance_rate=t.accepted / max(t.drafted, 1),
        verify_steps=t.steps,
        emitted=t.emitted,
        drafted=t.drafted,
        accepted=t.accepted,
        prompts=len(prompts),
        prompt_tokens=prompt_len,
        new_tokens=max_tokens,
        method=method,
        num_speculative_tokens=num_speculative_tokens,
        num_tree_tokens=num_tree_tokens,
        seconds=round(time.perf_counter() - t0, 1),
    )
