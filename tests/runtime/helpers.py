"""Shared pieces of the runtime tests: Hugging Face greedy references and random prompts."""

from __future__ import annotations

import torch


def random_prompts(lengths, vocab: int, seed: int = 0, low: int = 3) -> list[list[int]]:
    """Token-id prompts of the given lengths, avoiding the special ids below ``low``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Hugging Face ``generate`` one prompt at a time (no padding), greedy; new tokens only, stopping at EOS."""
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=model.device)
        seq = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
        )
        out.append(seq[0, len(p) :].tolist())
    return out


def sharpen(model, factor: float = 10.0):
    """Scale q/k projections so attention is far from uniform: at init it is nearly uniform, and then a wrong
    position or a wrong cache slot barely changes the logits. Returns the model."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(factor)
            layer.self_attn.k_proj.weight.mul_(factor)
    return model


class RecordedRows(dict):
    """request_id -> the logits rows of its sampled steps, in order. A row that predicts past a sequence's last
    token (the engine launched the step before it knew the sequence had finished) is left out when read."""

    def __getitem__(self, request_id):
        return [row for seq, at, row in super().__getitem__(request_id) if at < seq.num_tokens]


def record_logits(llm) -> RecordedRows:
    """Wrap the runner so every sampled row is kept, per request, in generation order."""
    rows = RecordedRows()
    run = llm.runner.run

    def recording(batch, *args):
        logits = run(batch, *args)
        for seq, row in zip(batch.sampled, logits, strict=True):
            at = seq.num_computed_tokens + batch.num_new[batch.seqs.index(seq)]  # the token index it predicts
            dict.setdefault(rows, seq.request_id, []).append((seq, at, row))
        return logits

    llm.runner.run = recording
    return rows


def assert_logits_match_hf(model, prompts, outputs, rows, atol: float) -> None:
    """Every recorded row equals HF's forward logits over prompt + completion at the same position."""
    for out, prompt in zip(outputs, prompts, strict=True):
        full = torch.tensor([prompt + out.completions[0].token_ids[:-1]], device=model.device)
        with torch.no_grad():
            expected = model(full).logits[0, len(prompt) - 1 :]
        torch.testing.assert_close(torch.stack(rows[out.request_id]), expected.float(), atol=atol, rtol=0)
