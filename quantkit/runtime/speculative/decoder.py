"""The engine's side of speculative decoding: attach drafts before a step, verify them after it, and decide how
many tokens to draft.

Before scheduling, every running sequence that is decoding (all but its last token computed) gets up to k drafted
tokens appended to its ``token_ids``; the scheduler then gives it k + 1 new tokens, scored in one forward pass over
its paged prefix by the prefill path, next to plain decodes and prefill chunks of other sequences. After the pass
the target's logits at those k + 1 positions verify the drafts (``rejection``), the rejected ones are dropped from
``token_ids``, and the scheduler commits only the positions of accepted tokens and gives the rest of the step's
blocks back. Steps with speculation run synchronously (the host reads each step's tokens before it schedules the
next: how many tokens a step keeps decides the next step's input).

How many tokens to draft (``adaptive``): each sequence keeps a running mean of its acceptance rate a, and drafts
the k in 1..K that maximise the expected tokens per step, (1 - a^(k+1)) / (1 - a), per unit of cost 1 + c k, with c
the proposer's cost per token relative to a decode step. For each batch-size bucket the decoder also times plain
decode steps and speculative steps (draft + verify) and keeps speculation off where the tokens it gains do not pay
for the time it costs, e.g. at large batches, where a decode step is no longer memory-bound and scoring k + 1 tokens
costs nearly k + 1 times as much. The mode not in use is measured again after ``PROBE_EVERY`` steps, an interval
that doubles (up to ``MAX_PROBE_EVERY``) while speculation keeps losing; where a speculative step costs more than
k + 1 plain ones, no acceptance can pay, and speculation stays off at that batch size and every larger one (one
speculative step settles it when it costs more than twice that: on SmolLM2 at batch 64 a speculative step costs
~20 plain ones, so each probe is dear). Paused steps run through the engine's asynchronous path, so they cost what
a step without speculation costs.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from quantkit.runtime.config import EngineConfig
from quantkit.runtime.model import CausalLM
from quantkit.runtime.model_runner import ModelRunner
from quantkit.runtime.sampler import filter_logits
from quantkit.runtime.sequence import Sequence, SpecStats
from quantkit.runtime.speculative.config import SpeculativeConfig
from quantkit.runtime.speculative.draft_model import DraftModelProposer, draft_cost
from quantkit.runtime.speculative.proposers import NgramProposer, Proposer
from quantkit.runtime.speculative.rejection import verify_greedy, verify_sampled
from quantkit.runtime.speculative.tree_draft import TreeDrafter, tree_drafter

EMA = 0.2  # weight of a new measurement in every running mean
PRIOR_ACCEPTANCE = 0.6
PROBE_EVERY = 32  # steps between re-measurements of the mode not in use for a batch-size bucket
MAX_PROBE_EVERY = 1024  # the longest interval, after probes that kept finding speculation a loss
MIN_SAMPLES = 2
DRAFT_PENDING = -1  # a drafted token still on the device (``SpeculativeDecoder.on_device``)
HOPELESS_AT_ONCE = 2.0  # a first speculative step this many times past the k + 1 plain steps' cost: no second one


@dataclass
class SpecTotals(SpecStats):
    """Engine-wide figures: ``SpecStats`` over every completion, and seconds spent drafting and in speculative
    steps (draft included), plus steps where the adaptive rule kept speculation off."""

    draft_time: float = 0.0
    step_time: float = 0.0
    paused_steps: int = 0


@dataclass
class _Bucket:
    plain_time: float = 0.0
    plain_samples: int = 0
    spec_time: float = 0.0  # per step, draft included
    spec_tokens: float = 0.0  # tokens emitted per sequence per speculative step
    spec_samples: int = 0
    since_probe: int = 0
    probe_every: int = PROBE_EVERY  # doubles whenever a probe finds speculation still losing
    hopeless: bool = False  # a speculative step costs more than k + 1 plain ones: it cannot pay here

    def pays(self) -> bool:
        """Whether speculative steps emit more tokens per second than plain ones, as measured so far."""
        return self.spec_tokens * self.plain_time > self.spec_time


def _bucket(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def expected_tokens(a: float, k: int) -> float:
    """Tokens a verify step emits on average when each draft is accepted with probability a."""
    return k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class SpeculativeDecoder:
    config: SpeculativeConfig
    proposer: Proposer
    max_model_len: int
    trees: TreeDrafter | None = None  # tree drafting (``num_tree_tokens``): drafts and verifies trees
    # drafts of the step in flight still on the device: (drafted [rows, k], seq_id -> row); their sequences hold
    # DRAFT_PENDING until ``drafts_read``, and the runner copies them into the step's input ids on the device
    on_device: tuple[torch.Tensor, dict[int, int]] | None = None
    totals: SpecTotals = field(default_factory=SpecTotals)
    acceptance: dict[int, float] = field(default_factory=dict)  # seq_id -> running mean
    buckets: dict[int, _Bucket] = field(default_factory=dict)
    _mode: tuple[int, bool] | None = None  # (bucket, speculating) of the step in flight
    _t0: float = 0.0

    # -- before the step ---------------------------------------------------------------------------------------

    def _num_tokens(self, seq: Sequence) -> int:
        k = self.config.num_speculative_tokens
        # never draft past max_tokens (a verify step emits accepted + 1 tokens) nor the model's length
        k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)
        if k <= 0 or not self.config.adaptive or self.trees is not None:  # a tree's depth is not adapted
            return max(k, 0)
        a = self.acceptance.get(seq.seq_id, PRIOR_ACCEPTANCE)
        c = self.proposer.cost_per_token
        return max(range(1, k + 1), key=lambda j: expected_tokens(a, j) / (1.0 + c * j))

    def _speculate_now(self, bucket: int) -> bool:
        """Whether a step of ``bucket`` decoding sequences should draft: the mode that pays, except every
        ``PROBE_EVERY`` steps, when the other one is measured again (the acceptance may have changed). Pure: the
        engine may ask twice about the same step."""
        if not self.config.adaptive:
            return True
        if any(b.hopeless for size, b in self.buckets.items() if size <= bucket):
            return False  # a larger batch gains even less from speculation than a smaller one
        b = self.buckets.setdefault(bucket, _Bucket())
        if b.plain_samples < MIN_SAMPLES:
            return False
        if b.spec_samples < MIN_SAMPLES:
            return True
        return b.pays() != (b.since_probe >= b.probe_every)

    def wants_draft(self, running: list[Sequence]) -> bool:
        """Whether the engine's next step should be a speculative one (synchronous, with drafts), judged by the
        number of running sequences; if not, it runs as a plain step through the engine's asynchronous path,
        whose time ``plain_step_done`` records."""
        n = sum(not s.is_finished for s in running)
        cap = self.config.disable_by_batch_size
        if not n or (cap is not None and n >= cap):
            return False
        return self._speculate_now(_bucket(n))

    def plain_step_done(self, num_seqs: int, elapsed: float) -> None:
        """Record a plain decode step of ``num_seqs`` sequences run by the engine's asynchronous path."""
        self.totals.paused_steps += 1
        self._record(_bucket(num_seqs), False, elapsed, 1.0)

    def propose(
        self, running: list[Sequence], generator_for: Callable[[Sequence], torch.Generator | None], token_budget: int
    ) -> None:
        """Append drafted tokens to the decoding sequences of ``running`` (the engine asked ``wants_draft``). The
        drafts fit in what ``token_budget`` (the step's) leaves after every running sequence's own tokens, so a
        sequence's drafts never push another out of the step."""
        self._t0 = time.perf_counter()
        keep = {s.seq_id for s in running}
        self.proposer.release(keep)
        self.acceptance = {i: a for i, a in self.acceptance.items() if i in keep}
        decoding = [s for s in running if not s.is_finished and s.num_computed_tokens == s.num_tokens - 1
                    and not s.pending_forks]  # fmt: skip
        # a step without prefills is timed, for the choice between speculating and not at its batch size
        self._mode = (_bucket(len(decoding)), False) if decoding and len(decoding) == len(running) else None
        room = token_budget - sum(s.num_tokens - s.num_computed_tokens for s in running if not s.is_finished)
        cap = self.config.disable_by_batch_size
        if not decoding or (cap is not None and len(decoding) >= cap):
            return
        if self.trees is not None:
            self._propose_trees(decoding, room)
            return
        seqs, ks = [], []
        for seq in decoding:
            k = min(self._num_tokens(seq), room)
            if k > 0:
                seqs.append(seq)
                ks.append(k)
                room -= k
        if not seqs:
            return
        launched = self.proposer.launch(seqs, ks) if hasattr(self.proposer, "launch") else None
        if launched is not None:  # drafted on the device, read with the verify step's tokens (``drafts_read``)
            rows, drafted = launched
            for i in rows:
                seqs[i].add_draft([DRAFT_PENDING] * ks[i], None)
            self.on_device = (drafted, {seqs[i].seq_id: row for i, row in rows.items()})
        else:
            drafts = self.proposer.propose(seqs, ks, [generator_for(s) for s in seqs])
            for seq, draft in zip(seqs, drafts, strict=True):
                if draft.tokens:
                    seq.add_draft(draft.tokens, draft.probs)
        if self._mode is not None:
            self._mode = (self._mode[0], True)
        self.totals.draft_time += time.perf_counter() - self._t0

    def _propose_trees(self, decoding: list[Sequence], room: int) -> None:
        """Trees of up to ``num_tree_tokens`` tokens (within the step's ``room`` and the model's length), at most
        k deep; the step is timed like a chain's."""
        seqs, sizes, depths = [], [], []
        for seq in decoding:
            depth = self._num_tokens(seq)
            size = min(self.config.num_tree_tokens, room, self.max_model_len - seq.num_tokens - 1)
            if depth > 0 and size > 0:
                seqs.append(seq)
                sizes.append(size)
                depths.append(depth)
                room -= size
        drafted = False
        for seq, tree in zip(seqs, self.trees.propose(seqs, sizes, depths) if seqs else [], strict=True):
            if tree is not None and tree.size:
                seq.add_draft(tree.tokens.tolist(), None, tree.parent.tolist())
                drafted = True
        if drafted and self._mode is not None:
            self._mode = (self._mode[0], True)
        self.totals.draft_time += time.perf_counter() - self._t0

    # -- after the step ----------------------------------------------------------------------------------------

    def drafts_read(self, seqs: list[Sequence]) -> None:
        """Write the drafts of a step drafted on the device into ``seqs``' token_ids (one copy to the host, which
        waits for the verify step launched after them); no-op otherwise."""
        if self.on_device is None:
            return
        drafted, rows = self.on_device
        self.on_device = None
        tokens = drafted.tolist()
        for seq in seqs:
            k = seq.num_draft_tokens
            if k and seq.seq_id in rows:
                seq.token_ids[-k:] = tokens[rows[seq.seq_id]][:k]

    def verify(
        self, seq: Sequence, logits: torch.Tensor, generator: torch.Generator | None, best: list[int] | None = None
    ) -> list[int]:
        """``logits`` [k + 1, V] of the target at the sequence's last k + 1 positions -> the tokens to emit (the
        accepted drafts, then the target's own). Drops the drafts from ``seq.token_ids``. ``best``: the target's
        argmax at those positions, already on the host (a greedy batch reads them all in one copy): the greedy
        rule then runs on the host, without a device round trip per sequence."""
        k = seq.num_draft_tokens
        params = seq.params
        if seq.draft_parents is not None:  # a tree: drafted counts its depth, the most tokens it can accept
            tokens, depth = self.trees.verify(seq, logits, generator, best)
            self._count(seq, depth, len(tokens) - 1)
            return tokens
        if params.greedy and best is not None:
            drafted = seq.token_ids[-k:]
            accepted = next((i for i in range(k) if drafted[i] != best[i]), k)
            tokens = [*drafted[:accepted], best[accepted]]
            seq.drop_draft()
            self._count(seq, k, accepted)
            return tokens
        draft = torch.tensor(seq.token_ids[-k:], device=logits.device).unsqueeze(0)
        if params.greedy:
            verdict = verify_greedy(draft, logits.unsqueeze(0))
        else:
            p = torch.stack([filter_logits(row, params).softmax(-1) for row in logits]).unsqueeze(0)
            q = seq.draft_probs
            if q is None:  # a deterministic proposer: one-hot on its tokens
                q = torch.nn.functional.one_hot(draft[0], logits.shape[-1]).to(p.dtype)
            uniform = torch.rand(1, k, generator=generator, device=logits.device)
            noise = torch.empty(1, logits.shape[-1], device=logits.device).exponential_(generator=generator)
            verdict = verify_sampled(draft, q.unsqueeze(0).to(p.dtype), p, uniform, noise)
        accepted = int(verdict.num_accepted[0])
        tokens = verdict.tokens[0, : accepted + 1].tolist()
        seq.drop_draft()
        self._count(seq, k, accepted)
        return tokens

    def _count(self, seq: Sequence, k: int, accepted: int) -> None:
        for stats in (seq.spec, self.totals):
            stats.steps += 1
            stats.drafted += k
            stats.accepted += accepted
            stats.emitted += accepted + 1
        rate = accepted / k
        self.acceptance[seq.seq_id] = (1 - EMA) * self.acceptance.get(seq.seq_id, PRIOR_ACCEPTANCE) + EMA * rate

    def step_done(self, tokens_per_seq: float) -> None:
        """Time the step that just ended (its tokens were read, so the device is done with it)."""
        elapsed = time.perf_counter() - self._t0
        if self._mode is None:
            return
        bucket, speculated = self._mode
        if speculated:
            self.totals.step_time += elapsed
        self._record(bucket, speculated, elapsed, tokens_per_seq)
        self._mode = None

    def _record(self, bucket: int, speculated: bool, elapsed: float, tokens_per_seq: float) -> None:
        b = self.buckets.setdefault(bucket, _Bucket())
        if speculated:
            b.spec_time = elapsed if not b.spec_samples else (1 - EMA) * b.spec_time + EMA * elapsed
            b.spec_tokens = tokens_per_seq if not b.spec_samples else (1 - EMA) * b.spec_tokens + EMA * tokens_per_seq
            b.spec_samples += 1
        else:
            b.plain_time = elapsed if not b.plain_samples else (1 - EMA) * b.plain_time + EMA * elapsed
            b.plain_samples += 1
        if b.plain_samples < MIN_SAMPLES or not b.spec_samples:
            return
        limit = (self.config.num_speculative_tokens + 1) * b.plain_time  # no acceptance pays for a dearer step
        if b.spec_samples < MIN_SAMPLES:  # one step far past the limit settles it: each probe costs that much
            b.hopeless = b.spec_time > HOPELESS_AT_ONCE * limit
            return
        b.hopeless = b.spec_time > limit
        if b.since_probe < b.probe_every:
            b.since_probe += 1
        else:  # this step probed the other mode; one that finds speculation still losing waits twice as long next
            b.since_probe = 0
            b.probe_every = min(2 * b.probe_every, MAX_PROBE_EVERY) if speculated and not b.pays() else PROBE_EVERY


def make_decoder(
    spec: SpeculativeConfig,
    draft: CausalLM | None,
    target_runner: ModelRunner,
    config: EngineConfig,
    device: torch.device,
    max_model_len: int,
) -> SpeculativeDecoder:
    if spec.method in ("eagle", "medusa"):
        from quantkit.runtime.speculative.heads import head_proposer

        proposer = head_proposer(spec, target_runner)
        if spec.num_tree_tokens is not None:
            return SpeculativeDecoder(spec, proposer, max_model_len, tree_drafter(spec, proposer, target_runner))
    elif spec.method == "mtp":
        from quantkit.runtime.speculative.mtp import mtp_proposer

        proposer = mtp_proposer(spec, target_runner)
    elif draft is None:
        proposer = NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)
    else:
        draft_config = dataclasses.replace(config, num_kv_blocks=target_runner.num_blocks)
        runner = ModelRunner(draft, draft_config, device, max_model_len)
        # the draft catches up on at most k + 1 verified tokens per step: as wide as the target's verify steps
        runner.capture_verify_graphs(spec.num_speculative_tokens + 1)
        cost = draft_cost(draft, target_runner.model)
        proposer = DraftModelProposer(draft, runner, cost, config.max_num_batched_tokens)
    return SpeculativeDecoder(spec, proposer, max_model_len)
