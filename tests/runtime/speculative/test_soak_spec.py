"""The engine's soak (tests/runtime/test_soak.py) with speculation: 1,000 requests into a cache too small for them,
every decoding sequence drafting 1-4 random tokens each step, which the shadow model accepts often but not always.
The shadow runner checks every write and every attended position (rejected drafts' slots are rewritten before they
are read again); at the end every request is complete within its max_tokens / stop rules and every block is free."""

import numpy as np
import torch

from quantkit.runtime import LLM
from quantkit.runtime.speculative.config import SpeculativeConfig
from quantkit.runtime.speculative.proposer import Draft
from tests.runtime.test_soak import EOS, TINY, VOCAB, P, ShadowRunner, random_request


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

    def run(self, batch, ids_from=None):
        plain = super().run(batch, ids_from)
        rows = []
        for seq, row in zip(batch.sampled, plain, strict=True):
            drafted = seq.token_ids[len(seq.token_ids) - seq.num_draft_tokens :]
            for token in drafted:
                extra = torch.randn(VOCAB, generator=self.gen)
                if torch.rand((), generator=self.gen) < 0.7:
                    extra[token] += 50.0
                rows.append(extra)
            rows.append(row)
        return torch.stack(rows)


def test_soak_1000_requests_with_speculation():
    rng = np.random.default_rng(0)
    llm = LLM(TINY, device="cpu", num_kv_blocks=24, block_size=P, max_num_seqs=16, max_num_batched_tokens=128,
              speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False))  # fmt: skip
    bm = llm.block_manager
    runner = llm.runner = AgreeingShadow(bm, seed=1)
    llm.spec.proposer = RandomProposer(np.random.default_rng(2))
    prefixes = [rng.integers(3, VOCAB, int(rng.integers(20, 60))).tolist() for _ in range(3)]
    requests, done = {}, {}
    while len(requests) < 1000 or llm.scheduler.has_unfinished():
        for _ in range(int(rng.integers(0, 4)) if len(requests) < 1000 else 0):
            prompt, params = random_request(rng, prefixes)
            requests[llm.add_request(prompt, params)] = (prompt, params)
        if not llm.scheduler.has_unfinished():
            continue
        for seq, _ in llm.step():
            if seq.is_finished and seq not in done.setdefault(seq.request_id, []):
                done[seq.request_id].append(seq)

    assert sorted(done) == sorted(requests)
    for rid, seqs in done.items():
        prompt, params = requests[rid]
        assert sorted(s.index for s in seqs) == list(range(params.n))
        for s in seqs:
            out = s.output_token_ids
            assert s.token_ids[: len(prompt)] == prompt and 1 <= len(out) <= params.max_tokens
            assert s.num_draft_tokens == 0
            if s.finish_reason == "length":
                assert len(out) == params.max_tokens
            elif s.finish_reason == "stop":
                assert out[-1] in params.stop_token_ids and not set(out[:-1]) & set(params.stop_token_ids)
            else:
                assert s.finish_reason == "eos" and out[-1] == EOS and not params.ignore_eos
    assert bm.num_free == bm.num_blocks and not any(bm.ref_counts) and bm.used_slots == 0
    totals = llm.spec.totals
    assert llm.scheduler.num_preemptions > 50 and runner.copies > 50
    assert totals.steps > 1000 and 0.2 < totals.acceptance_rate < 0.9  # rollbacks of every length happened
