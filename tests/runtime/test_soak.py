"""Randomized soak of the engine's bookkeeping: 1,000 requests of random lengths arriving over time into a cache
too small for them, with common prefixes, n > 1, sampling, stop tokens and preemption; with synchronous and
asynchronous scheduling, and with speculative decoding (drafts, partial acceptance, rollback).

The model is replaced by a shadow runner that records, for every cache slot, which token's K/V it would hold. Each
step it checks that no scheduled write lands in a block another sequence shares (or in an immutable cached block),
and that every position a sequence attends to holds that sequence's own token: a wrong block table, slot, copy or
prefix hit fails here. At the end every request must have completed and every block must be free again.
"""

import numpy as np
import pytest
import torch

from quantkit.runtime import LLM, SamplingParams
from quantkit.runtime.speculative import SpeculativeConfig
from quantkit.runtime.speculative.proposers import Draft

P = 16
VOCAB = 64
EOS = 2
TINY = dict(
    model_type="llama",
    vocab_size=VOCAB,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=512,
    eos_token_id=EOS,
)


class ShadowRunner:
    def __init__(self, bm, seed: int):
        self.bm = bm
        self.slots = np.full(bm.num_blocks * P, -1, dtype=np.int64)
        self.gen = torch.Generator().manual_seed(seed)
        self.copies = 0
        self.steps = 0
        self.ahead = 0  # steps run with inputs from a previous step's tokens still on the device

    def run(self, batch, ids_from=None, drafts=None):
        """``ids_from`` (seq_id -> index, tokens): those sequences' last token is a placeholder on the host and
        comes from ``tokens``, as the engine's device patch does (async scheduling). ``drafts``: none here (prompt
        lookup drafts on the host)."""
        assert drafts is None
        self.steps += 1
        self.ahead += ids_from is not None
        for src, dst in batch.copies:
            self.slots[dst * P : (dst + 1) * P] = self.slots[src * P : (src + 1) * P]
        self.copies += len(batch.copies)
        assert batch.num_tokens <= 128
        for seq, n in zip(batch.seqs, batch.num_new, strict=True):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            table = np.asarray(seq.block_table)
            for i in range(start // P, -(-end // P)):
                block = seq.block_table[i]
                assert self.bm.ref_counts[block] == 1, f"{seq} writes block {block} shared by others"
                assert self.bm.block_keys[block] is None, f"{seq} writes cached block {block}"
            tokens = list(seq.token_ids[:end])
            if ids_from is not None and seq.seq_id in ids_from[0]:
                assert tokens[-1] == -1, f"{seq}: a patched input that is not a placeholder"
                tokens[-1] = int(ids_from[1][ids_from[0][seq.seq_id]])
            assert -1 not in tokens, f"{seq} computes a placeholder"
            pos = np.arange(end)
            where = table[pos // P] * P + pos % P
            self.slots[where[start:]] = tokens[start:end]
            np.testing.assert_array_equal(self.slots[where], tokens, err_msg=f"{seq} context")
        return torch.randn(len(batch.sampled), VOCAB, generator=self.gen)


def random_request(rng: np.random.Generator, prefixes):
    n_prompt = int(rng.integers(1, 120))
    prompt = rng.integers(3, VOCAB, n_prompt).tolist()
    if rng.random() < 0.3:
        prompt = prefixes[rng.integers(len(prefixes))] + prompt
    sampled = rng.random() < 0.5
    params = SamplingParams(
        n=int(rng.choice([1, 1, 1, 2, 3])),
        temperature=1.0 if sampled else 0.0,
        top_k=int(rng.integers(0, 10)),
        top_p=float(rng.uniform(0.5, 1.0)),
        seed=int(rng.integers(1000)) if rng.random() < 0.5 else None,
        max_tokens=int(rng.integers(1, 60)),
        stop_token_ids=(int(rng.integers(3, VOCAB)),) if rng.random() < 0.2 else (),
        ignore_eos=rng.random() < 0.2,
    )
    return prompt, params


# With speculation every decoding sequence drafts 1-4 random tokens each step, which the shadow model accepts often
# but not always: rejected drafts' slots must be rewritten before they are read again.


class RandomProposer:
    cost_per_token = 0.0

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def propose(self, seqs, ks, generators):
        return [Draft(self.rng.integers(3, VOCAB, int(self.rng.integers(1, k + 1))).tolist()) for k in ks]

    def release(self, keep):
        pass


class AgreeingShadow(ShadowRunner):
    """Logits rows for every verified position: peaked on the drafted token with probability 0.7."""

    def run(self, batch, ids_from=None, drafts=None):
        plain = super().run(batch, ids_from, drafts)
        rows = []
        for seq, row in zip(batch.sampled, plain, strict=True):
            drafted = seq.token_ids[len(seq.token_ids) - seq.num_draft_tokens :]
            for token in drafted:
                extra = torch.randn(VOCAB, generator=self.gen)
                if torch.rand((), generator=self.gen) < 0.7:
                    extra[token] += 50.0
                rows.append(extra)
            rows.append(row)
        return torch.stack(rows) if rows else plain


@pytest.mark.parametrize("mode", ["sync", "async", "speculative"])
def test_soak_1000_requests_with_preemption(mode):
    rng = np.random.default_rng(0)
    spec = (
        SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False) if mode == "speculative" else None
    )
    llm = LLM(TINY, device="cpu", num_kv_blocks=24, block_size=P, max_num_seqs=16, max_num_batched_tokens=128,
              async_scheduling=mode == "async", speculative=spec)  # fmt: skip
    bm = llm.block_manager
    runner = llm.runner = (AgreeingShadow if spec else ShadowRunner)(bm, seed=1)
    if spec:
        llm.spec.proposer = RandomProposer(np.random.default_rng(2))
    hits = []
    match = bm.match_prefix
    bm.match_prefix = lambda seq: (lambda h: (hits.append(len(h)), h)[1])(match(seq))
    prefixes = [rng.integers(3, VOCAB, int(rng.integers(20, 60))).tolist() for _ in range(3)]
    requests, done = {}, {}
    while len(requests) < 1000 or llm.scheduler.has_unfinished():
        for _ in range(int(rng.integers(0, 4)) if len(requests) < 1000 else 0):
            prompt, params = random_request(rng, prefixes)
            requests[llm.add_request(prompt, params)] = (prompt, params)
        if not llm.scheduler.has_unfinished():
            continue
        for seq, _ in llm.step():  # a verify step lists a sequence once per token it gained
            if seq.is_finished and seq not in done.setdefault(seq.request_id, []):
                done[seq.request_id].append(seq)

    assert sorted(done) == sorted(requests)
    for rid, seqs in done.items():
        prompt, params = requests[rid]
        assert sorted(s.index for s in seqs) == list(range(params.n))
        for s in seqs:
            out = s.output_token_ids
            assert s.token_ids[: len(prompt)] == prompt and 1 <= len(out) <= params.max_tokens
            if s.finish_reason == "length":
                assert len(out) == params.max_tokens
            elif s.finish_reason == "stop":
                assert out[-1] in params.stop_token_ids and not set(out[:-1]) & set(params.stop_token_ids)
            else:
                assert s.finish_reason == "eos" and out[-1] == EOS and not params.ignore_eos
    assert bm.num_free == bm.num_blocks and not any(bm.ref_counts) and bm.used_slots == 0
    assert llm.scheduler.num_preemptions > 50 and runner.copies > 50 and sum(h > 0 for h in hits) > 50
    assert (runner.ahead > runner.steps // 2) if mode == "async" else runner.ahead == 0
    if spec:  # rollbacks of every length happened
        assert llm.spec.totals.steps > 1000 and 0.2 < llm.spec.totals.acceptance_rate < 0.9
