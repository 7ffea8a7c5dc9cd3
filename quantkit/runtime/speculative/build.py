"""Make the proposer a ``SpeculativeConfig`` names, in two stages around the target's KV cache: the draft model
first (so the target's cache is sized to leave room for the draft's), then its runner and cache."""

from __future__ import annotations

import copy
import dataclasses

import torch

from quantkit.errors import QuantkitError
from quantkit.runtime.config import EngineConfig
from quantkit.runtime.model import CausalLM
from quantkit.runtime.model_runner import ModelRunner, kv_block_bytes
from quantkit.runtime.speculative.config import SpeculativeConfig
from quantkit.runtime.speculative.decoder import SpeculativeDecoder
from quantkit.runtime.speculative.draft_model import (
    DraftModelProposer,
    check_vocabulary,
    config_with_layers,
    quantized_copy,
    weight_scheme,
)
from quantkit.runtime.speculative.ngram import NgramProposer


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
    from quantkit.nn.qlinear import QuantLinear

    return any(isinstance(m, QuantLinear) for m in model.modules())


def load_draft(spec: SpeculativeConfig, target: CausalLM, target_tokenizer, dtype: str, device) -> CausalLM | None:
    """The draft model of ``spec`` (None for n-gram lookup), checked against the target."""
    if spec.method == "ngram":
        return None
    from quantkit.runtime import loader

    if spec.method == "self" and spec.draft is None:
        if _is_weight_only_quantized(target):
            raise QuantkitError(
                "method 'self' quantizes the target's own weights, but this target is already a weight-only "
                "quantized checkpoint: serve its float or W8A8 model, or give a draft checkpoint"
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


def make_decoder(
    spec: SpeculativeConfig,
    draft: CausalLM | None,
    target_runner: ModelRunner,
    config: EngineConfig,
    device: torch.device,
    max_model_len: int,
) -> SpeculativeDecoder:
    if draft is None:
        proposer = NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)
    else:
        draft_config = dataclasses.replace(config, num_kv_blocks=target_runner.num_blocks)
        runner = ModelRunner(draft, draft_config, device, max_model_len)
        proposer = DraftModelProposer(draft, runner, cost_per_token=draft_cost(draft, target_runner.model))
    return SpeculativeDecoder(spec, proposer, max_model_len)


def draft_block_bytes(draft: CausalLM | None, block_size: int) -> int:
    return 0 if draft is None else kv_block_bytes(draft, block_size)


def draft_cost(draft: CausalLM, target: CausalLM) -> float:
    """A draft token's cost relative to a target decode step, before measurement: the ratio of the bytes of their
    decoder weights (batch-1 decode reads every weight once)."""

    def weight_bytes(model: CausalLM) -> int:
        return sum(t.numel() * t.element_size() for n, t in model.state_dict().items() if n.startswith("model.layers."))

    return weight_bytes(draft) / max(weight_bytes(target), 1)
