"""The offline engine: ``LLM(model).generate(prompts, params)`` and its streaming form ``LLM.stream``.

A step is: schedule, run the model, sample, append (nano-vllm's loop, with n > 1 completions split off the first
time a prompt samples). Prompts are strings (needs a tokenizer) or lists of token ids.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantkit.errors import QuantkitError
from quantkit.runtime import loader
from quantkit.runtime.block_manager import BlockManager
from quantkit.runtime.config import EngineConfig
from quantkit.runtime.model import fuse_projections
from quantkit.runtime.model_runner import ModelRunner
from quantkit.runtime.sampler import sample
from quantkit.runtime.sampling_params import SamplingParams
from quantkit.runtime.scheduler import Scheduler
from quantkit.runtime.sequence import Sequence, Status

MAX_DEFAULT_MODEL_LEN = 32768
Params = SamplingParams | list[SamplingParams] | None  # one for all prompts, or one per prompt


@dataclass
class Completion:
    index: int
    token_ids: list[int]
    finish_reason: str | None
    text: str | None = None


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    completions: list[Completion] = field(default_factory=list)


@dataclass(frozen=True)
class StreamEvent:
    """One new token of completion ``index`` of request ``request_id``; ``finish_reason`` is set on its last."""

    request_id: int
    index: int
    token_id: int
    finish_reason: str | None


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


class LLM:
    """``model``: a float HF folder, a quantkit checkpoint folder, an HF model object (its modules are shared), or a
    config (dict with ``model_type``, or an HF config) for random weights. Settings are ``EngineConfig`` fields."""

    def __init__(self, model, tokenizer=None, **settings):
        self.config = EngineConfig(**settings)
        device = torch.device(self.config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if isinstance(model, str | Path):
            loaded = loader.load_folder(model, self.config.dtype, device)
        elif isinstance(model, torch.nn.Module):
            loaded = loader.from_hf_model(model, device, tokenizer)
        else:
            loaded = loader.dummy(model, self.config.dtype, device, self.config.seed)
        self.model = loaded.model
        self.tokenizer = tokenizer or loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        if device.type == "cuda":
            from quantkit.nn.w8a8 import set_execution

            # W8A8 layers run the 8-bit kernels, not the fp32 simulation
            set_execution(self.model, "integer", fp8_fast_accum=self.config.fp8_fast_accum)
            fuse_projections(self.model)  # q/k/v and gate/up (float, W4A16 or W8A8): one GEMM each
        mcfg = self.model.config
        self.max_model_len = self.config.max_model_len or min(mcfg.max_position_embeddings, MAX_DEFAULT_MODEL_LEN)
        self.runner = ModelRunner(self.model, self.config, device, self.max_model_len)
        self.block_manager = BlockManager(
            self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        self.device = device
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self._generator = torch.Generator(device).manual_seed(self.config.seed)
        self.stats = EngineStats()

    # -- requests --------------------------------------------------------------------------------------------------

    def tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise QuantkitError("this model has no tokenizer: give prompts as lists of token ids")
            return self.tokenizer(prompt)["input_ids"]
        return [int(t) for t in prompt]

    def add_request(self, prompt, params: SamplingParams) -> int:
        ids = self.tokenize(prompt)
        if not ids:
            raise QuantkitError("empty prompt")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise QuantkitError(
                f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) > max_model_len {self.max_model_len}"
            )
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
            seq.generator = torch.Generator(self.device).manual_seed(seq.params.seed + seq.index)
        return seq.generator

    # -- the step --------------------------------------------------------------------------------------------------

    def step(self) -> list[tuple[Sequence, int]]:
        """Run one iteration; returns (sequence, new token) for every sequence that got one."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            raise RuntimeError("scheduler produced an empty step with requests pending")  # a bug, not bad input
        logits = self.runner.run(batch)
        self.scheduler.commit(batch)
        seqs, rows = self._split_forks(batch.sampled)
        if rows is not None:
            logits = logits[rows]
        if all(s.params.greedy for s in seqs):
            tokens = logits.argmax(-1).tolist()  # on the device; the step's one device-to-host copy
        else:
            tokens = sample(logits, [s.params for s in seqs], [self._generator_for(s) for s in seqs])
        finished = False
        for seq, token in zip(seqs, tokens, strict=True):
            finished |= self._append(seq, token)
        allocated, used = self.block_manager.kv_usage()
        self.stats.allocated_slots += allocated
        self.stats.used_slots += used
        if finished:
            self.scheduler.drop_finished()
        self.stats.steps += 1
        self.stats.output_tokens += len(seqs)
        return list(zip(seqs, tokens, strict=True))

    def _split_forks(self, sampled: list[Sequence]) -> tuple[list[Sequence], list[int] | None]:
        """The sampled sequences with the first-time forks of n > 1 requests, and the logits row of each (None:
        one row per sampled sequence, in order)."""
        if not any(s.pending_forks for s in sampled):
            return sampled, None
        seqs, rows = [], []
        for row, seq in enumerate(sampled):
            children = [seq.fork(next(self._seq_ids), i + 1) for i in range(seq.pending_forks)]
            seq.pending_forks = 0
            if children:
                self.scheduler.fork(seq, children)
            seqs += [seq, *children]
            rows += [row] * (1 + len(children))
        return seqs, rows

    def _append(self, seq: Sequence, token: int) -> bool:
        """Add a sampled token; returns whether the sequence finished."""
        seq.token_ids.append(token)
        p = seq.params
        if token in p.stop_token_ids:
            seq.finish_reason = "stop"
        elif not p.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "eos"
        elif seq.num_output_tokens >= p.max_tokens:
            seq.finish_reason = "length"
        if seq.finish_reason is None:
            return False
        seq.status = Status.FINISHED
        return True

    # -- front ends ------------------------------------------------------------------------------------------------

    def _add_all(self, prompts: Seq, params: Params) -> list[int]:
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise QuantkitError(f"{len(prompts)} prompts but {len(per_prompt)} sampling parameters")
        return [self.add_request(prompt, p) for prompt, p in zip(prompts, per_prompt, strict=True)]

    def stream(self, prompts: Seq, params: Params = None) -> Iterator[StreamEvent]:
        """Add the prompts and yield every new token as it is produced, until all requests are finished."""
        self._add_all(prompts, params)
        while self.scheduler.has_unfinished():
            for seq, token in self.step():
                yield StreamEvent(seq.request_id, seq.index, token, seq.finish_reason)

    def generate(self, prompts: Seq, params: Params = None) -> list[RequestOutput]:
        """Complete every prompt; one ``RequestOutput`` per prompt, in order, with ``n`` completions each."""
        request_ids = self._add_all(prompts, params)
        finished: dict[int, list[Sequence]] = {r: [] for r in request_ids}
        while self.scheduler.has_unfinished():
            for seq, _ in self.step():
                if seq.is_finished and seq.request_id in finished:
                    finished[seq.request_id].append(seq)
        return [self._output(r, sorted(finished[r], key=lambda s: s.index)) for r in request_ids]

    def _output(self, request_id: int, seqs: list[Sequence]) -> RequestOutput:
        out = RequestOutput(request_id, seqs[0].token_ids[: seqs[0].num_prompt_tokens])
        for seq in seqs:
            ids = seq.output_token_ids
            text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else None
            out.completions.append(Completion(seq.index, ids, seq.finish_reason, text))
        return out
