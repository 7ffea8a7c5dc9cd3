"""DeepSeek-V3's multi-token-prediction (MTP) module as the drafter of ``SpeculativeConfig(method="mtp")``.

DeepSeek-V3 (arXiv 2412.19437, section 2.2) trains one MTP module after its last decoder layer, stored as
``model.layers.{num_hidden_layers}``: the norms ``enorm`` and ``hnorm``, the projection ``eh_proj`` [H, 2H], a whole
decoder layer (MLA attention, routed and shared experts) and ``shared_head`` (``norm``, ``head``); its checkpoint also
repeats the embedding (``embed_tokens``). Position t takes the target's hidden state h_t and the embedding of the
next token x_{t+1}:

    h' = eh_proj([enorm(e(x_{t+1})), hnorm(h_t)]) -> decoder layer -> shared_head.head(shared_head.norm(.))

and predicts x_{t+2}. As a drafter (the authors' own use, and vLLM's ``mtp`` method) it runs like an EAGLE head
(``heads.EagleProposer``, whose catch-up and chaining it reuses): it catches up on the verified positions with the
target's final (post-norm) hidden states, the ones vLLM hands it, keeping its own dense latent history per sequence,
then drafts k tokens by feeding its own output back as the next h (with more MTP modules than one, only the first
drafts). Greedy and sampled requests are verified by the lossless rule as for every proposer.
"""

from __future__ import annotations

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.runtime.model import DecoderLayer, RMSNorm, decoder_spec, rope_tables
from quantkit.runtime.moe import experts_by_name
from quantkit.runtime.speculative.heads import EagleProposer, FeatureStore


class SharedHead(nn.Module):
    def __init__(self, config, prefix: str, linear, dtype):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.head = linear(f"{prefix}.head", config.hidden_size, config.vocab_size, False)


class MTPLayer(DecoderLayer):
    """``forward(features, embeds [1, T, H], positions [T], past) -> (h [1, T, H], (latents [1, S, W],))``: the
    signature of ``heads.EagleHead``; ``past`` is the latent history of earlier positions (None: none). Module
    names are the checkpoint's under ``model.layers.{i}``, so float and quantized MTP layers load by name."""

    def __init__(self, config, i: int, linear, dtype, own_embedding: bool):
        spec = decoder_spec(config)
        if not spec.mla:
            raise QuantkitError("MTP drafting reads DeepSeek-V3's MTP layout; this model is not DeepSeek-V3")
        super().__init__(config, spec, i, linear, 0, dtype)
        hidden, prefix = config.hidden_size, f"model.layers.{i}"
        self.config = config
        self.enorm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.eh_proj = linear(f"{prefix}.eh_proj", 2 * hidden, hidden, False)
        self.shared_head = SharedHead(config, f"{prefix}.shared_head", linear, dtype)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden, dtype=dtype) if own_embedding else None
        self.cos = self.sin = None

    def set_rope(self, max_len: int, device) -> None:
        self.cos, self.sin = rope_tables(self.config, max_len, device)

    def forward(self, features, embeds, positions, past=None):
        x = self.eh_proj(torch.cat((self.enorm(embeds[0]), self.hnorm(features[0])), dim=-1))  # [T, H]
        cos, sin = self.cos[positions].to(x.dtype), self.sin[positions].to(x.dtype)
        h, residual = self.input_layernorm.add_forward(x, None)
        a, latents = self.self_attn.forward_dense(h, cos, sin, None if past is None else past[0][0])
        h, residual = self.post_attention_layernorm.add_forward(a, residual)
        return (self.mlp(h) + residual)[None], (latents[None],)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(h))


def build_mtp(config, layers: list[str], tensors: dict[str, torch.Tensor], linear, dtype, device) -> list[MTPLayer]:
    """The MTP layers ``layers`` (prefixes ``model.layers.{i}``) filled from the checkpoint's ``tensors``."""
    out = []
    for prefix in layers:
        own = {k.removeprefix(prefix + "."): v for k, v in tensors.items() if k.startswith(prefix + ".")}
        own = experts_by_name(own)
        with torch.device("meta"):
            layer = MTPLayer(config, int(prefix.rsplit(".", 1)[1]), linear, dtype, "embed_tokens.weight" in own)
        expected = layer.state_dict()
        missing = sorted(set(expected) - set(own))
        if missing:
            raise QuantkitError(f"MTP layer {prefix} lacks {missing[0]} (and {len(missing) - 1} more)")
        layer.load_state_dict({k: own[k].to(device=device, dtype=t.dtype) for k, t in expected.items()}, assign=True)
        out.append(layer.eval())
    return out


def random_mtp(config, linear, dtype, device, gen: torch.Generator) -> list[MTPLayer]:
    """One MTP layer of random weights, its linears made by ``linear`` (``dummy:`` models that declare
    ``num_nextn_predict_layers``)."""
    std = getattr(config, "initializer_range", 0.02)
    with torch.device("meta"):
        layer = MTPLayer(config, config.num_hidden_layers, linear, dtype, own_embedding=False)
    layer.to_empty(device=device)
    with torch.no_grad():
        for name, t in layer.state_dict().items():
            if "norm" in name:
                t.fill_(1.0)
            elif name.endswith("e_score_correction_bias"):
                t.zero_()
            else:
                t.normal_(0.0, std, generator=gen)
    return [layer.eval()]


class MTPProposer(EagleProposer):
    """EAGLE's catch-up and chaining with the MTP layer as the head, read out by its own shared head."""

    def __init__(self, target, layer: MTPLayer, store: FeatureStore, cost_per_token: float):
        super().__init__(target, layer, store, cost_per_token)
        self.readout = layer.logits
        if layer.embed_tokens is not None:
            self.embed = layer.embed_tokens


def no_mtp_layers(config) -> QuantkitError:
    return QuantkitError(
        "speculative method 'mtp' needs a checkpoint with multi-token-prediction layers (DeepSeek-V3's "
        f"model.layers.{config.num_hidden_layers}.*); this model has none"
    )


def mtp_proposer(spec, runner) -> MTPProposer:
    """The MTP drafter of the target of ``runner`` (loaded with its MTP layers: ``LLM`` asks the loader for them when
    ``spec.method`` is mtp); a one-line error when its checkpoint has none."""
    target = runner.model
    layers = getattr(target, "mtp_layers", None)
    if not layers:
        raise no_mtp_layers(target.config)
    layer = layers[0]
    layer.set_rope(runner.max_model_len + spec.num_speculative_tokens + 1, runner.device)
    store = FeatureStore()
    runner.on_hidden = store.record

    def params(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    head = 0 if layer.embed_tokens is None else target.config.vocab_size * target.config.hidden_size
    return MTPProposer(target, layer, store, (params(layer) - head) / params(target))
