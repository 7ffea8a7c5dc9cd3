"""Verification of drafted tokens: the rule that keeps exactly the target model's output distribution.

Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et
al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling"). A proposer drafts tokens
x_1 .. x_k with probabilities q_i(x_i); the target scores all k + 1 positions in one forward pass, giving p_1 .. p_k+1.
In order, draft token x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)). At the first rejection, position
i emits a token drawn from the residual norm(max(0, p_i - q_i)) and the rest is discarded; if all k are accepted,
position k + 1 emits a token drawn from p_k+1. Each emitted token is then distributed exactly as p at its position:
P(emit y) = q(y) min(1, p(y)/q(y)) + (1 - sum_z min(p(z), q(z))) max(0, p(y) - q(y)) / sum_z max(0, p(z) - q(z))
          = min(p(y), q(y)) + max(0, p(y) - q(y)) = p(y).
Temperature, top-k and top-p are applied to both p and q before the test (the caller passes filtered probabilities).
Greedy: a draft token is accepted while it equals the target's argmax; the first position where it does not (or
position k + 1) emits the target's argmax.

Randomness comes in as tensors drawn by the caller from each request's own generator, so that a seeded request gives
the same tokens whatever else shares the batch: ``uniform`` [B, k] for the acceptance tests and ``noise`` [B, V] of
Exp(1) draws for the one emitted token per row, chosen by the exponential race argmax(dist / noise), which picks
token y with probability dist(y) / sum(dist) (the runtime's sampler draws the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    """``num_accepted`` [B]: drafted tokens kept per row. ``tokens`` [B, k + 1]: the kept drafts followed by the one
    token the target emits, padded with -1; row b holds ``num_accepted[b] + 1`` tokens."""

    num_accepted: torch.Tensor
    tokens: torch.Tensor


def _emit(accepted: torch.Tensor, draft: torch.Tensor, last: torch.Tensor) -> Verdict:
    """accepted [B, k] bool per position, draft [B, k], last [B] -> the prefix of accepted drafts, then ``last``."""
    b, k = draft.shape
    # a position counts only if every earlier one was accepted too
    prefix = accepted.to(torch.int32).cumprod(dim=1)
    num_accepted = prefix.sum(dim=1)
    tokens = torch.full((b, k + 1), -1, dtype=torch.long, device=draft.device)
    tokens[:, :k] = torch.where(prefix.bool(), draft, torch.full_like(draft, -1))
    tokens.scatter_(1, num_accepted.long().unsqueeze(1), last.unsqueeze(1))
    return Verdict(num_accepted.long(), tokens)


def verify_greedy(draft: torch.Tensor, target_logits: torch.Tensor, num_draft: torch.Tensor | None = None) -> Verdict:
    """draft [B, k] token ids, target_logits [B, k + 1, V] -> Verdict. ``num_draft`` [B] (default k) lets rows
    carry fewer drafts: positions at or past a row's count are never accepted."""
    _b, k = draft.shape
    best = target_logits.argmax(dim=-1)  # [B, k + 1]
    accepted = draft == best[:, :k]
    if num_draft is not None:
        accepted &= torch.arange(k, device=draft.device).unsqueeze(0) < num_draft.unsqueeze(1)
    prefix = accepted.to(torch.int32).cumprod(dim=1).sum(dim=1)
    last = best.gather(1, prefix.long().unsqueeze(1)).squeeze(1)
    return _emit(accepted, draft, last)


def verify_sampled(
    draft: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniform: torch.Tensor,
    noise: torch.Tensor,
    num_draft: torch.Tensor | None = None,
) -> Verdict:
    """The speculative sampling rule.

    draft [B, k] token ids; draft_probs q [B, k, V] (the proposer's filtered distribution at each drafted position;
    a deterministic proposer such as n-gram lookup passes one-hot rows); target_probs p [B, k + 1, V]; uniform
    [B, k] in [0, 1); noise [B, V] of Exp(1) draws; num_draft [B] as in ``verify_greedy``.
    """
    b, k = draft.shape
    if k == 0:
        return _emit(
            torch.zeros(b, 0, dtype=torch.bool, device=draft.device), draft, (target_probs[:, 0] / noise).argmax(-1)
        )
    idx = draft.unsqueeze(-1)
    p_x = target_probs[:, :k].gather(2, idx).squeeze(-1)  # [B, k]
    q_x = draft_probs.gather(2, idx).squeeze(-1)
    # accept iff u < p/q, written without the division (q_x > 0 for any token the proposer could draft)
    accepted = uniform * q_x < p_x
    if num_draft is not None:
        accepted &= torch.arange(k, device=draft.device).unsqueeze(0) < num_draft.unsqueeze(1)
    stop = accepted.to(torch.int32).cumprod(dim=1).sum(dim=1).long()  # position that emits: first rejection or k
    p_stop = target_probs.gather(1, stop.view(b, 1, 1).expand(b, 1, target_probs.shape[-1])).squeeze(1)
    q_pad = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)  # q = 0 past the drafts: p itself
    q_stop = q_pad.gather(1, stop.view(b, 1, 1).expand(b, 1, q_pad.shape[-1])).squeeze(1)
    if num_draft is not None:  # a row that drafted fewer tokens emits from p at its own last position
        q_stop = torch.where((stop >= num_draft).unsqueeze(1), torch.zeros_like(q_stop), q_stop)
    residual = (p_stop - q_stop).clamp_min(0)
    # p == q to the last bit leaves no residual; such a position never rejects, but guard the division anyway
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p_stop, residual)
    last = (residual / noise).argmax(-1)
    return _emit(accepted, draft, last)


def emitted_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exact distribution of the token emitted at one drafted position, by enumerating the rule's branches: the
    draft token x ~ q is accepted with min(1, p(x)/q(x)), else the residual is drawn. p, q [V] -> [V]. For tests."""
    out = torch.zeros_like(p, dtype=torch.float64)
    p64, q64 = p.double(), q.double()
    residual = (p64 - q64).clamp_min(0)
    residual = residual / residual.sum() if residual.sum() > 0 else p64
    for x in range(p.shape[0]):
        if q64[x] == 0:
            continue
        keep = min(1.0, float(p64[x] / q64[x]))
        out[x] += q64[x] * keep
        out += q64[x] * (1.0 - keep) * residual
    return out
