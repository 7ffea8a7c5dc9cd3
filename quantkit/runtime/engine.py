"""The offline engine: ``LLM(model).generate(prompts, params)`` and its streaming form ``LLM.stream``.

A step is: schedule, run the model, sample, append (nano-vllm's loop, with n > 1 completions split off the first
time a prompt samples). Prompts are strings (needs a tokenizer) or lists of token ids.

With ``async_scheduling`` (the default) the engine schedules and launches step n + 1 before it reads step n's
tokens: the sequences that sampled in step n get a placeholder token, step n + 1 takes their real input ids from
step n's tokens on the device, and the host reads step n's tokens (one copy, started when they were made) while
the device runs step n + 1. So the device does not wait for the host's work between steps (a batch-1 decode step
of an 8B model spent 0.3-0.45 ms of its ~3-5 ms with the GPU idle; docs/results/serve.md). Outputs are
the same: a sequence that finishes in step n has one wasted row in step n + 1, whose token is dropped, and the K/V
that step n + 1 wrote is committed (counted, entered in the prefix cache) only once step n's tokens are known.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import PretrainedConfig

from quantkit import checks
from quantkit.checks import integer, shown
from quantkit.devices import resolve_device
from quantkit.errors import QuantkitError
from quantkit.models.arch import position_limit
from quantkit.runtime import loader
from quantkit.runtime.block_manager import BlockManager
from quantkit.runtime.config import EngineConfig
from quantkit.runtime.model import fuse_projections
from quantkit.runtime.model_runner import ModelRunner
from quantkit.runtime.sampler import sample
from quantkit.runtime.sampling_params import SamplingParams
from quantkit.runtime.scheduler import ScheduledBatch, Scheduler
from quantkit.runtime.sequence import Sequence, SpecStats, Status
from quantkit.runtime.speculative.config import SpeculativeConfig

MAX_DEFAULT_MODEL_LEN = 32768
PLACEHOLDER = -1  # token id of a sampled token the host has not read yet (async scheduling)
Params = SamplingParams | list[SamplingParams] | None  # one for all prompts, or one per prompt


@dataclass
class Completion:
    index: int
    token_ids: list[int]
    finish_reason: str | None
    text: str | None = None
    spec: SpecStats | None = None  # speculative decoding's figures for this completion (None without it)


@dataclass
class RequestOutput:
    """What one prompt produced: its ``n`` completions in ``outputs`` (vLLM's name: ``out.outputs[0].text``)."""

    request_id: int
    prompt_token_ids: list[int]
    outputs: list[Completion] = field(default_factory=list)

    @property
    def completions(self) -> list[Completion]:
        """The same list as ``outputs`` (this runtime's first name for it)."""
        return self.outputs


@dataclass(frozen=True)
class StreamEvent:
    """One new token of completion ``index`` of request ``request_id``; ``finish_reason`` is set on its last."""

    request_id: int
    index: int
    token_id: int
    finish_reason: str | None


@dataclass
class Launched:
    """A step on its way: its batch, the sequences it samples for (n > 1 forks split off), their tokens on the
    device, and a host copy of them that is complete once ``ready`` has passed (None on CPU: already complete)."""

    batch: ScheduledBatch
    seqs: list[Sequence]
    tokens: torch.Tensor  # int32 [len(seqs)]
    host: torch.Tensor
    ready: torch.cuda.Event | None
    placeholders: bool = False  # the seqs' last token_ids entry is a placeholder for these tokens


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    allocated_slots: int = 0  # summed over steps
    used_slots: int = 0

    @property
    def kv_waste(self) -> float:
        """Fraction of allocated KV slots holding no K/V, averaged over steps (weighted by allocation)."""
        return 1.0 - self.used_slots / self.allocated_slots if self.allocated_slots else 0.0


def _shown(value) -> str:
    """A short description of a bad argument for an error message."""
    return f"{type(value).__name__} {shown(value)}"


class LLM:
    """``model``: a float HF folder, a quantkit checkpoint folder, an HF model object (its modules are shared), a
    config (dict with ``model_type``, or an HF config) for random weights, or a ``loader.LoadedModel`` (e.g.
    ``loader.dummy``'s random quantized weights). Settings are ``EngineConfig`` fields.
    ``speculative``: a ``SpeculativeConfig`` (or its dict) to draft and verify tokens (``runtime.speculative``);
    its steps run with synchronous scheduling."""

    def __init__(self, model, tokenizer=None, speculative: SpeculativeConfig | dict | None = None, **settings):
        self.config = EngineConfig.from_dict(settings)
        if isinstance(speculative, dict):
            speculative = SpeculativeConfig.from_dict(speculative)
        elif speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise QuantkitError(f"speculative must be a SpeculativeConfig or a dict, got {_shown(speculative)}")
        if speculative is not None and speculative.draft is not None and not Path(speculative.draft).is_dir():
            raise QuantkitError(f"draft model folder not found: {speculative.draft}")  # before any weight loads
        device = resolve_device(self.config.device)
        checks.tokenizer(tokenizer)
        mtp = speculative is not None and speculative.method == "mtp"  # the checkpoint's MTP layers are the drafter
        if isinstance(model, str | Path):
            loaded = loader.load_folder(model, self.config.dtype, device, mtp=mtp)
        elif isinstance(model, torch.nn.Module):
            loaded = loader.from_hf_model(model, device, tokenizer)
        elif isinstance(model, dict | PretrainedConfig):
            loaded = loader.dummy(model, self.config.dtype, device, self.config.seed, mtp=mtp)
        elif isinstance(model, loader.LoadedModel):  # built by the caller, e.g. ``loader.dummy`` with a scheme
            loaded = model
            weight = next(loaded.model.parameters(), None)
            if weight is not None and weight.device.type != device.type:
                raise QuantkitError(f"the loaded model's weights are on {weight.device}, the engine's is {device}")
        else:
            raise QuantkitError(
                "model must be a folder's path, a Hugging Face model, a config (a dict with model_type) or a "
                f"loader.LoadedModel, got {_shown(model)}"
            )
        self.model = loaded.model
        self.tokenizer = tokenizer or loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        draft = None
        if speculative is not None:
            from quantkit.runtime.speculative.draft_model import load_draft

            draft = load_draft(speculative, self.model, self.tokenizer, self.config.dtype, device)
        if device.type == "cuda":
            from quantkit.nn.w8a8 import set_execution

            for m in (self.model, draft):  # W8A8 layers run the 8-bit kernels, not the fp32 simulation
                if m is not None:
                    set_execution(m, "integer", fp8_fast_accum=self.config.fp8_fast_accum)
                    fuse_projections(m)  # q/k/v and gate/up (float, W4A16 or W8A8): one GEMM each
        mcfg = self.model.config
        limit = position_limit(mcfg)
        if limit is not None and (self.config.max_model_len or 0) > limit:
            raise QuantkitError(
                f"max_model_len {self.config.max_model_len} is longer than the model's {limit} positions"
            )
        self.max_model_len = self.config.max_model_len or min(mcfg.max_position_embeddings, MAX_DEFAULT_MODEL_LEN)
        from quantkit.runtime.speculative.decoder import make_decoder
        from quantkit.runtime.speculative.draft_model import draft_block_bytes

        extra = draft_block_bytes(draft, self.config.block_size)
        from quantkit.runtime.speculative.eagle_chains import batched_cache_bytes  # EAGLE's batched drafters

        reserved = batched_cache_bytes(speculative, mcfg, self.model.dtype, self.max_model_len,
                                       self.config.max_num_seqs)  # fmt: skip
        self.runner = ModelRunner(self.model, self.config, device, self.max_model_len, extra_block_bytes=extra,
                                  reserved_bytes=reserved)  # fmt: skip
        self.spec = None
        if speculative is not None:
            self.spec = make_decoder(speculative, draft, self.runner, self.config, device, self.max_model_len)
            self.runner.capture_verify_graphs(speculative.verify_width, trees=speculative.num_tree_tokens is not None)
        self.block_manager = BlockManager(
            self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        self.device = device
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self._generator = torch.Generator(device).manual_seed(self.config.seed)
        self.stats = EngineStats()
        self._pending: Launched | None = None  # a step launched ahead of the host (async scheduling)
        self._stepping = False
        self._aborted: set[int] = set()  # request ids withdrawn while a step ran

    # -- requests --------------------------------------------------------------------------------------------------

    def tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise QuantkitError("this model has no tokenizer: give prompts as lists of token ids")
            return self.tokenizer(prompt)["input_ids"]
        try:
            return [operator.index(t) for t in prompt]  # ints, numpy ints, 0-d tensors; never a float cut short
        except TypeError:
            raise QuantkitError(
                f"a prompt is a string or a sequence of integer token ids, got {_shown(prompt)}"
            ) from None

    def _checked_ids(self, prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids, or a QuantkitError saying why the request cannot run."""
        ids = self.tokenize(prompt)
        if not ids:
            raise QuantkitError("empty prompt")
        vocab = self.model.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise QuantkitError(f"token id {bad} outside the model's vocabulary [0, {vocab})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise QuantkitError(
                f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) > max_model_len {self.max_model_len}"
            )
        return ids

    def add_request(self, prompt, params: SamplingParams) -> int:
        return self._queue(self._checked_ids(prompt, params), params)

    def _queue(self, ids: list[int], params: SamplingParams) -> int:
        request_id = next(self._request_ids)
        seq = Sequence(next(self._seq_ids), request_id, ids, params)
        self.scheduler.add(seq)
        self.stats.prompt_tokens += len(ids)
        return request_id

    def _generator_for(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.greedy:
            return None
        if seq.params.seed is None:
            return self._generator
        if seq.generator is None:
            seq.generator = torch.Generator(self.device).manual_seed((seq.params.seed + seq.index) % 2**64)
        return seq.generator

    # -- the step --------------------------------------------------------------------------------------------------

    def step(self) -> list[tuple[Sequence, int]]:
        """Run one iteration; returns (sequence, new token) for every sequence that got one. With async scheduling
        the iteration whose tokens it returns may have been launched by the previous call, and it launches the
        next one before reading them."""
        self._stepping = True
        try:
            return self._step()
        finally:
            self._stepping = False
            if self._aborted:
                self._apply_aborts()

    def _step(self) -> list[tuple[Sequence, int]]:
        spec = self.spec
        if spec is not None and self._pending is None and spec.wants_draft(self.scheduler.running):
            return self._spec_step()
        start = time.perf_counter()
        launched, self._pending = self._pending, None
        if launched is None:
            launched = self._launch(self.scheduler.schedule())
            self.scheduler.commit(launched.batch)
        usage = self.block_manager.kv_usage()  # after this step's K/V, before the next step allocates
        ahead = None
        # with speculation configured, a plain step launches the next one ahead only while that one will not draft
        # (a speculative step needs every token of the step before it)
        if (
            self.config.async_scheduling
            and self.scheduler.running
            and not (spec is not None and spec.wants_draft(self.scheduler.running))
        ):
            for seq in launched.seqs:
                if not seq.is_finished:  # a finished one's row is dropped when the step is read
                    seq.token_ids.append(PLACEHOLDER)
            launched.placeholders = True
            batch = self.scheduler.schedule()
            if batch.seqs:
                ahead = self._launch(batch, ({s.seq_id: i for i, s in enumerate(launched.seqs)}, launched.tokens))
        results = self._finish_step(launched, usage)
        batch = launched.batch
        if spec is not None and batch.num_tokens == len(batch.seqs) == len(self.scheduler.running):
            spec.plain_step_done(len(batch.seqs), time.perf_counter() - start)  # a decode of every running sequence
        if ahead is not None:
            self.scheduler.commit(ahead.batch)  # its input tokens are all known now
            if any(not s.is_finished for s in ahead.seqs):
                self._pending = ahead  # else it only holds rows of sequences that just finished: dropped
        if any(s.is_finished for s, _ in results):
            self.scheduler.drop_finished()
        return results

    def _spec_step(self) -> list[tuple[Sequence, int]]:
        """One synchronous step with drafts: propose, schedule, score, verify, commit only what was accepted."""
        spec = self.spec
        spec.propose(self.scheduler.running, self._generator_for, self.config.max_num_batched_tokens)
        batch = self.scheduler.schedule()
        if not batch.seqs:
            raise RuntimeError("scheduler produced an empty step with requests pending")  # a bug, not bad input
        usage = self.block_manager.kv_usage()
        logits = self.runner.run(batch, drafts=spec.on_device)
        spec.drafts_read(self.scheduler.running)
        starts = np.cumsum([0] + [1 + s.num_draft_tokens for s in batch.sampled]).tolist()
        plain = [j for j, s in enumerate(batch.sampled) if not s.num_draft_tokens]
        emitted: list[tuple[Sequence, list[int]]] = []
        # greedy batches read every row's argmax in one copy; the rule then runs on the host for each sequence
        best = logits.argmax(-1).tolist() if all(s.params.greedy for s in batch.sampled) else None
        if plain:
            seqs, rows = self._split_forks([batch.sampled[j] for j in plain])
            rows = [plain[r] for r in rows] if rows is not None else plain
            if best is not None:
                tokens = [best[starts[j]] for j in rows]
            else:
                sub = logits[[starts[j] for j in rows]]
                tokens = sample(sub, [s.params for s in seqs], [self._generator_for(s) for s in seqs]).tolist()
            emitted += [(s, [t]) for s, t in zip(seqs, tokens, strict=True)]
        verified = set()
        for j, seq in enumerate(batch.sampled):
            if seq.num_draft_tokens:
                a, b = starts[j], starts[j + 1]
                rows_best = best[a:b] if best is not None else None
                emitted.append((seq, spec.verify(seq, logits[a:b], self._generator_for(seq), rows_best)))
                verified.add(seq.seq_id)
        results = []
        for seq, tokens in emitted:
            for token in tokens:  # a stop token, EOS or max_tokens ends the completion there
                seq.token_ids.append(token)
                results.append((seq, token))
                self._check_finished(seq, token)
                if seq.is_finished:
                    break
        # verified sequences keep the K/V of their accepted positions only: all tokens but the newest
        kept = {s.seq_id: s.num_tokens - 1 - s.num_computed_tokens for s in batch.seqs if s.seq_id in verified}
        self.scheduler.commit(batch, kept)
        spec.step_done(len(results) / max(len(emitted), 1))
        self.stats.allocated_slots += usage[0]
        self.stats.used_slots += usage[1]
        self.stats.steps += 1
        self.stats.output_tokens += len(results)
        if any(s.is_finished for s, _ in results):
            self.scheduler.drop_finished()
        return results

    def _launch(self, batch: ScheduledBatch, ids_from: tuple[dict[int, int], torch.Tensor] | None = None) -> Launched:
        """Run ``batch`` (``ids_from``: see ``ModelRunner.run``) and sample on the device; the host copy of the
        tokens starts at once, unwaited."""
        if not batch.seqs:
            raise RuntimeError("scheduler produced an empty step with requests pending")  # a bug, not bad input
        logits = self.runner.run(batch, ids_from)
        seqs, rows = self._split_forks(batch.sampled)
        if rows is not None:
            logits = logits[rows]
        if all(s.params.greedy for s in seqs):
            sampled = logits.argmax(-1)
        else:
            sampled = sample(logits, [s.params for s in seqs], [self._generator_for(s) for s in seqs])
        sampled = sampled.to(torch.int32)
        cuda = sampled.is_cuda
        host = torch.empty(sampled.shape, dtype=torch.int32, pin_memory=cuda)
        host.copy_(sampled, non_blocking=cuda)
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record()
        return Launched(batch, seqs, sampled, host, ready)

    def _finish_step(self, launched: Launched, usage: tuple[int, int]) -> list[tuple[Sequence, int]]:
        """Read a launched step's tokens (waiting for them) and hand them to their sequences."""
        if launched.ready is not None:
            launched.ready.synchronize()
        results = []
        for seq, token in zip(launched.seqs, launched.host.tolist(), strict=True):
            if seq.is_finished:  # a row of a step launched before this sequence's last token was known
                continue
            if launched.placeholders:
                seq.token_ids[-1] = token
            else:
                seq.token_ids.append(token)
            self._check_finished(seq, token)
            results.append((seq, token))
        self.stats.allocated_slots += usage[0]
        self.stats.used_slots += usage[1]
        self.stats.steps += 1
        self.stats.output_tokens += len(results)
        return results

    def _split_forks(self, sampled: list[Sequence]) -> tuple[list[Sequence], list[int] | None]:
        """The sampled sequences with the first-time forks of n > 1 requests, and the logits row of each (None:
        one row per sampled sequence, in order)."""
        if not any(s.pending_forks for s in sampled):
            return sampled, None
        seqs, rows = [], []
        for row, seq in enumerate(sampled):
            children = [seq.fork(next(self._seq_ids), i + 1) for i in range(seq.pending_forks)]
            for child in children:  # the step computes the whole prompt: so much is cached once it is committed
                child.num_computed_tokens = seq.num_tokens
            seq.pending_forks = 0
            if children:
                self.scheduler.fork(seq, children)
            seqs += [seq, *children]
            rows += [row] * (1 + len(children))
        return seqs, rows

    def _check_finished(self, seq: Sequence, token: int) -> None:
        """Mark ``seq`` finished if its new last token ``token`` ends it."""
        p = seq.params
        if token in p.stop_token_ids:
            seq.finish_reason = "stop"
        elif not p.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "eos"
        elif seq.num_output_tokens >= p.max_tokens:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            seq.status = Status.FINISHED

    # -- front ends ------------------------------------------------------------------------------------------------

    def _add_all(self, prompts: Seq, params: Params) -> list[int]:
        """Queue every prompt, or none: all are checked before the first is queued. A single string is one
        prompt."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if isinstance(prompts, torch.Tensor | np.ndarray) and prompts.ndim == 2:
            prompts = list(prompts)  # a batch of equal-length prompts, one per row
        if not isinstance(prompts, list | tuple):
            raise QuantkitError(f"prompts must be a string or a list of prompts, got {_shown(prompts)}")
        params = SamplingParams() if params is None else params
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        bad = next((p for p in per_prompt if not isinstance(p, SamplingParams)), None)
        if bad is not None:
            raise QuantkitError(f"sampling parameters must be SamplingParams (or a list of them), got {_shown(bad)}")
        if len(per_prompt) != len(prompts):
            raise QuantkitError(f"{len(prompts)} prompts but {len(per_prompt)} sampling parameters")
        checked = [self._checked_ids(prompt, p) for prompt, p in zip(prompts, per_prompt, strict=True)]
        return [self._queue(ids, p) for ids, p in zip(checked, per_prompt, strict=True)]

    def stream(self, prompts: Seq, params: Params = None) -> Iterator[StreamEvent]:
        """Add the prompts and yield every new token as it is produced, until all requests are finished. A stream
        left early (``break``, an exception, the iterator dropped) withdraws the requests it had not finished."""
        request_ids = self._add_all(prompts, params)
        try:
            while self.scheduler.has_unfinished():
                results = self.step()
                last = {id(seq): i for i, (seq, _) in enumerate(results)}  # a verify step gives several tokens
                for i, (seq, token) in enumerate(results):
                    yield StreamEvent(
                        seq.request_id, seq.index, token, seq.finish_reason if last[id(seq)] == i else None
                    )
        finally:
            self.abort(request_ids)

    def generate(self, prompts: Seq, params: Params = None) -> list[RequestOutput]:
        """Complete every prompt; one ``RequestOutput`` per prompt, in order, with ``n`` completions each. An
        interrupted call (Ctrl-C) withdraws its requests."""
        request_ids = self._add_all(prompts, params)
        finished: dict[int, list[Sequence]] = {r: [] for r in request_ids}
        try:
            while self.scheduler.has_unfinished():
                for seq, _ in self.step():  # a verify step lists a sequence once per token it gained
                    done = finished.get(seq.request_id)
                    if seq.is_finished and done is not None and seq not in done:
                        done.append(seq)
        except BaseException:
            self.abort(request_ids)
            raise
        return [self._output(r, sorted(finished[r], key=lambda s: s.index)) for r in request_ids]

    def abort(self, request_ids) -> None:
        """Withdraw requests: their unfinished completions stop where they are (finish reason "abort") and give
        their KV blocks back. A step already launched for them may still write those blocks; any step that reuses
        the blocks runs after it on the device, so that is harmless. Called while a step runs (a stream finalized
        by the garbage collector), it takes effect when that step ends."""
        if isinstance(request_ids, int) and not isinstance(request_ids, bool):
            request_ids = [request_ids]
        if isinstance(request_ids, str | bytes) or not hasattr(request_ids, "__iter__"):
            raise QuantkitError(f"abort takes a request id or a list of them, got {_shown(request_ids)}")
        self._aborted.update(integer("a request id", r) for r in request_ids)
        if not self._stepping:
            self._apply_aborts()

    def _apply_aborts(self) -> None:
        ids, self._aborted = self._aborted, set()
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.request_id in ids and not seq.is_finished:
                seq.finish_reason = "abort"
                seq.status = Status.FINISHED
        self.scheduler.drop_finished()

    def _output(self, request_id: int, seqs: list[Sequence]) -> RequestOutput:
        out = RequestOutput(request_id, seqs[0].token_ids[: seqs[0].num_prompt_tokens])
        for seq in seqs:
            ids = seq.output_token_ids
            text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else None
            spec = seq.spec if self.spec is not None else None
            out.outputs.append(Completion(seq.index, ids, seq.finish_reason, text, spec))
        return out
