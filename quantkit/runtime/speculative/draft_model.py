"""A draft model with its own paged KV cache: a smaller model of the same vocabulary, or the target's own weights
quantized (``self``), optionally cut to its first L decoder layers (layer-skip drafting).

The draft keeps one mirror sequence per target sequence. Before drafting, a mirror takes the target's verified
tokens: the K/V of the positions where both agree stay, the rest (rejected drafts) is rolled back, and the mirror
prefills whatever it has not computed (the whole prompt the first time, else the last verified tokens) while it
drafts its first token; the next k - 1 tokens are plain decode steps, which replay the draft runner's CUDA graphs.
The draft's cache has as many blocks as the target's and no prefix caching; a mirror that does not fit drafts nothing.
"""

from __future__ import annotations

import copy

import torch

from quantkit.errors import QuantkitError
from quantkit.quant.scheme import QuantScheme
from quantkit.runtime.block_manager import BlockManager
from quantkit.runtime.model import CausalLM, FloatLinear
from quantkit.runtime.model_runner import ModelRunner, kv_block_bytes
from quantkit.runtime.sampler import filter_logits
from quantkit.runtime.scheduler import ScheduledBatch
from quantkit.runtime.sequence import Sequence
from quantkit.runtime.speculative.config import SpeculativeConfig, weight_scheme
from quantkit.runtime.speculative.proposers import Draft


def config_with_layers(config, num_layers: int):
    """A copy of an HF config with its first ``num_layers`` decoder layers (per-layer lists cut alike)."""
    data = config.to_dict()
    data["num_hidden_layers"] = num_layers
    for key in ("layer_types",):
        if isinstance(data.get(key), list):
            data[key] = data[key][:num_layers]
    return config.__class__.from_dict(data)


def float_weight(module: torch.nn.Module) -> torch.Tensor:
    if isinstance(module, FloatLinear):
        return module.weight.detach()
    if hasattr(module, "dequantize_weight"):  # a W8A8 or W4A16 target: its own values, re-quantized
        return module.dequantize_weight(torch.float32)
    raise QuantkitError(f"cannot quantize a {type(module).__name__} for a self draft")


def quantized_copy(target: CausalLM, scheme: QuantScheme, num_layers: int | None) -> CausalLM:
    """The target's first ``num_layers`` decoder layers (all by default) with every linear rounded to ``scheme``
    (RTN) and every other tensor shared with the target (embeddings, norms, head: no copy)."""
    from quantkit.algorithms.rtn import rtn
    from quantkit.nn.factory import make_quantized_linear

    cfg = target.config
    layers = cfg.num_hidden_layers if num_layers is None else num_layers
    if layers > cfg.num_hidden_layers:
        raise QuantkitError(f"draft_layers {layers} exceeds the model's {cfg.num_hidden_layers} layers")
    modules = dict(target.named_modules())
    if any(name.endswith(("qkv_proj", "gate_up_proj")) for name in modules):
        raise QuantkitError("build the self draft before the target's projections are fused")
    quantized = {}
    for name, mod in modules.items():
        in_draft = name.startswith("model.layers.") and int(name.split(".")[2]) < layers
        # MoE routers (``mlp.gate``, a plain nn.Linear, not the factory's) stay float, shared with the target
        if in_draft and isinstance(mod, torch.nn.Linear) and type(mod) is not torch.nn.Linear:
            bias = None if mod.bias is None else mod.bias.detach()
            qw = rtn(float_weight(mod).float(), scheme)
            quantized[name] = make_quantized_linear(qw, bias, target.dtype).to(mod.weight.device)
    config = config_with_layers(cfg, layers)

    def linear(name, n_in, n_out, bias):
        if name in quantized:
            return quantized[name]
        return FloatLinear(n_in, n_out, bias=bias, dtype=target.dtype)  # meta: given the target's tensors below

    with torch.device("meta"):
        draft = CausalLM(config, linear, target.dtype)
    wanted = {k for k, v in draft.state_dict().items() if v.is_meta}
    shared = {k: v for k, v in target.state_dict().items() if k in wanted}
    draft.load_state_dict(shared, assign=True, strict=False)
    missing = [k for k, v in draft.state_dict().items() if v.is_meta]
    if missing:
        raise QuantkitError(f"self draft: no target tensor for {missing[0]}")
    return draft


def check_vocabulary(target: CausalLM, draft: CausalLM, target_tok, draft_tok) -> None:
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise QuantkitError(f"the draft model's vocabulary ({dv} tokens) differs from the target's ({tv})")
    if target_tok is not None and draft_tok is not None and target_tok.get_vocab() != draft_tok.get_vocab():
        raise QuantkitError("the draft model's tokenizer maps tokens to other ids than the target's")


class DraftModelProposer:
    """``token_budget``: the most tokens one draft forward pass takes (the engine's ``max_num_batched_tokens``): a
    mirror with more to catch up on (a new or preempted sequence's prompt) prefills in chunks over several steps and
    drafts once it has caught up."""

    def __init__(self, model: CausalLM, runner: ModelRunner, cost_per_token: float, token_budget: int):
        self.model = model
        self.runner = runner
        self.token_budget = token_budget
        self.bm = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
        self.mirrors: dict[int, Sequence] = {}
        self.cost_per_token = cost_per_token

    def _mirror(self, seq: Sequence) -> Sequence:
        m = self.mirrors.get(seq.seq_id)
        if m is None:
            m = self.mirrors[seq.seq_id] = Sequence(seq.seq_id, seq.request_id, seq.token_ids, seq.params)
            return m
        target, mine = seq.token_ids, m.token_ids
        common = next(
            (i for i, (a, b) in enumerate(zip(mine, target, strict=False)) if a != b), min(len(mine), len(target))
        )
        m.token_ids = list(target)
        m.num_computed_tokens = min(m.num_computed_tokens, common, len(target) - 1)
        self.bm.truncate(m)
        return m

    def _fits(self, m: Sequence, num_new: int) -> bool:
        if m.block_table or m.num_computed_tokens:
            return self.bm.appendable_tokens(m) >= num_new
        return self.bm.can_admit(m, [], num_new)

    def propose(self, seqs: list[Sequence], ks: list[int], generators: list[torch.Generator | None]) -> list[Draft]:
        mirrors = [self._mirror(s) for s in seqs]
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = [i for i, k in enumerate(ks) if k > 0]
        while active:
            batch = ScheduledBatch()
            stepped, budget = [], self.token_budget
            for i in active:
                m = mirrors[i]
                num_new = min(m.num_tokens - m.num_computed_tokens, budget)
                if num_new <= 0 or not self._fits(m, num_new):
                    continue
                if m.block_table or m.num_computed_tokens:
                    batch.add(m, num_new, self.bm.append(m, num_new))
                else:
                    self.bm.admit(m, [], num_new)
                    batch.add(m, num_new, [])
                budget -= num_new
                if batch.sampled and batch.sampled[-1] is m:  # a chunk that does not reach the end drafts nothing
                    stepped.append(i)
            if not batch.seqs:
                break
            logits = self.runner.run(batch)
            for row, i in enumerate(stepped):
                params = seqs[i].params
                if params.greedy:
                    token = int(logits[row].argmax())
                else:
                    q = filter_logits(logits[row], params).softmax(-1)
                    noise = torch.empty_like(q).exponential_(generator=generators[i])
                    token = int((q / noise).argmax())
                    probs[i].append(q)
                tokens[i].append(token)
            for seq, num_new in zip(batch.seqs, batch.num_new, strict=True):
                start = seq.num_computed_tokens
                seq.num_computed_tokens += num_new
                self.bm.commit(seq, start)
            for i in stepped:
                mirrors[i].token_ids.append(tokens[i][-1])
            active = [i for i in stepped if len(tokens[i]) < ks[i]]  # a mirror still catching up waits a step
        return [Draft(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs, strict=True)]

    def release(self, keep: set[int]) -> None:
        for seq_id in [s for s in self.mirrors if s not in keep]:
            self.bm.free_seq(self.mirrors.pop(seq_id))


def keep_layers(model: CausalLM, num_layers: int) -> CausalLM:
    """``model`` cut to its first ``num_layers`` decoder layers (the modules are shared, not copied)."""
    n = model.config.num_hidden_layers
    if num_layers > n:
        raise QuantkitError(f"draft_layers {num_layers} exceeds the model's {n} layers")
    if num_layers == n:
        return model
    cut = copy.copy(model)  # a shallow copy would share _modules: give the copy its own
    cut._modules = dict(model._modules)
    cut.config = config_with_layers(model.config, num_layers)
    decoder = copy.copy(model.model)
    decoder._modules = dict(model.model._modules)
    decoder.layers = torch.nn.ModuleList(list(model.model.layers)[:num_layers])
    cut.model = decoder
    return cut


def _is_weight_only_quantized(model: CausalLM) -> bool:
    from quantkit.nn.progressive import ProgressiveW4A8Linear
    from quantkit.nn.qlinear import QuantLinear

    return any(isinstance(m, QuantLinear | ProgressiveW4A8Linear) for m in model.modules())


def load_draft(spec: SpeculativeConfig, target: CausalLM, target_tokenizer, dtype: str, device) -> CausalLM | None:
    """The draft model of ``spec`` (None for n-gram lookup, draft heads and MTP layers), checked against the target."""
    if spec.method in ("ngram", "eagle", "medusa", "mtp"):
        return None
    from quantkit.runtime import loader

    if spec.method == "self" and spec.draft is None:
        if _is_weight_only_quantized(target):
            raise QuantkitError(
                "method 'self' quantizes the target's own weights, but this target is already a weight-only "
                "(or W4A8) quantized checkpoint: serve its float or W8A8 model, or give a draft checkpoint"
            )
        return quantized_copy(target, weight_scheme(spec.draft_scheme), spec.draft_layers)
    loaded = loader.load_folder(spec.draft, dtype, device)
    check_vocabulary(target, loaded.model, target_tokenizer, loaded.tokenizer)
    if spec.method == "self":
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads"):
            if getattr(loaded.model.config, key) != getattr(target.config, key):
                raise QuantkitError(f"a self draft must be the target model quantized: {key} differs")
    model = loaded.model
    return keep_layers(model, spec.draft_layers) if spec.draft_layers else model


def draft_block_bytes(draft: CausalLM | None, block_size: int) -> int:
    return 0 if draft is None else kv_block_bytes(draft, block_size)


def draft_cost(draft: CausalLM, target: CausalLM) -> float:
    """A draft token's cost relative to a target decode step, before measurement: the ratio of the bytes of their
    decoder weights (batch-1 decode reads every weight once)."""

    def weight_bytes(model: CausalLM) -> int:
        return sum(t.numel() * t.element_size() for n, t in model.state_dict().items() if n.startswith("model.layers."))

    return weight_bytes(draft) / max(weight_bytes(target), 1)
