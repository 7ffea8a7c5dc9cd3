"""Perplexity, KL divergence and top-1 agreement on an evaluation text.

Protocol (the numbers in quantkit's tables use it):
- The text (default: the shipped ``moby-dick``) is tokenized once without special tokens and cut into
  non-overlapping windows of ``seqlen`` tokens (default 512); the first ``max_windows`` (default 40, i.e.
  20,480 tokens) are used. Each window is evaluated independently, with no context carried between windows.
- BOS follows the tokenizer (``bos="auto"``, :mod:`quantkit.calib.data`): where it adds BOS by default, each
  window is BOS + ``seqlen - 1`` text tokens, otherwise ``seqlen`` text tokens; the protocol records ``bos``.
- In each window, position t predicts token t+1: ``seqlen - 1`` predictions per window (with BOS, every one a
  text token).
- Perplexity = exp(mean negative log-likelihood over all predictions).
- Against a float baseline on the same tokens: mean KL(P_baseline || P_model) of the next-token distributions,
  and top-1 agreement (fraction of positions where both models' most likely next token is the same).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from quantkit.calib.data import DEFAULT_EVAL, evaluation_windows

DEFAULT_SEQLEN = 512
DEFAULT_WINDOWS = 40


@dataclass
class EvalResult:
    perplexity: float
    tokens: int
    kl: float | None = None  # mean KL(baseline || model), nats per token
    top1_agreement: float | None = None
    baseline_perplexity: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def window_log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    """log-softmax of the next-token logits for one window: ids [L] -> fp32 [L-1, V]."""
    logits = model(ids[None].to(_device_of(model)), use_cache=False).logits[0, :-1]
    return F.log_softmax(logits.float(), dim=-1)


@torch.no_grad()
def evaluate_windows(
    model, windows: torch.Tensor, baseline=None, progress=None, float_from_baseline: bool = False
) -> EvalResult:
    """Evaluate ``model`` (and compare with ``baseline``: a model, or a list of per-window log-prob tensors).

    ``float_from_baseline``: the baseline log-probs are the model's own; score them without a forward pass.
    """
    nll = kl = agree = base_nll = 0.0
    count = 0
    for i, ids in enumerate(windows):
        lp = baseline[i].float() if float_from_baseline else window_log_probs(model, ids)
        target = ids[1:].to(lp.device)
        nll += -lp.gather(1, target[:, None]).sum().item()
        if baseline is not None:
            base = baseline[i] if isinstance(baseline, list) else window_log_probs(baseline, ids)
            base = base.to(lp.device).float()
            kl += (base.exp() * (base - lp)).sum().item()
            agree += (base.argmax(-1) == lp.argmax(-1)).sum().item()
            base_nll += -base.gather(1, target[:, None]).sum().item()
        count += target.numel()
        if progress is not None:
            progress(i + 1, len(windows))
    result = EvalResult(perplexity=math.exp(nll / count), tokens=count)
    if baseline is not None:
        result.kl = kl / count
        result.top1_agreement = agree / count
        result.baseline_perplexity = math.exp(base_nll / count)
    return result


def evaluate(
    model,
    tokenizer,
    baseline=None,
    source: str = DEFAULT_EVAL,
    seqlen: int = DEFAULT_SEQLEN,
    max_windows: int | None = DEFAULT_WINDOWS,
    progress=None,
    bos: bool | str = "auto",
) -> tuple[EvalResult, dict]:
    """(result, protocol) for ``model`` on ``source``; ``protocol`` records the text fingerprint, sizes and BOS."""
    windows, protocol = evaluation_windows(tokenizer, source, seqlen, max_windows, bos=bos)
    return evaluate_windows(model, windows, baseline, progress), protocol
