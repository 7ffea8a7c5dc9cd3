"""Next-token choice from logits: greedy argmax, or temperature / top-k / top-p sampling with per-request seeds.

Sampling draws with the exponential race (argmax of p / E, E ~ Exp(1)), which picks token i with probability p_i
and lets each row draw its noise from its own generator, so a seeded request gives the same tokens whatever else
shares the batch.
"""

from __future__ import annotations

import torch

from quantkit.runtime.sampling_params import SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] fp32 -> temperature-scaled logits with everything outside top-k / top-p set to -inf."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        outside = probs.cumsum(-1) - probs >= params.top_p  # tokens after the nucleus is complete
        outside[0] = False  # the most likely token always stays (a top_p below fp32's range would drop it)
        logits = logits.masked_fill(torch.zeros_like(outside).scatter(0, order, outside), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """logits [B, V] -> one token per row [B] on logits' device (no device-to-host copy)."""
    tokens = logits.argmax(-1)
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        probs = filter_logits(logits[row].float(), p).softmax(-1)
        noise = torch.empty_like(probs).exponential_(generator=gen)
        tokens[row] = (probs / noise).argmax()
    return tokens
