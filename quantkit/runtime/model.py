"""The runtime's own forward pass for the Llama family (Llama, Mistral, Qwen2, Qwen3), its mixture-of-experts
relatives (Mixtral, Qwen2-MoE, Qwen3-MoE: ``runtime.moe``) and DeepSeek-V3 (multi-head latent attention over a paged
cache of the compressed latent: ``runtime.mla``; routed and shared experts) on packed tokens.

Tokens of all sequences in a step lie on one axis [T]; attention reads and writes the paged KV cache
(``runtime.attention``). Module names equal Hugging Face's, so checkpoints load by name, and every linear is made by
a factory: ``FloatLinear`` for float weights, ``QuantLinear`` (W4A8: ``W4A8Linear``; progressive W4A8:
``ProgressiveW4A8Linear``) / ``W8A8Linear``. The arithmetic follows transformers' modeling code step for step
(RMSNorm in fp32, rotary tables in fp32 cast to the activation dtype), so fp32 greedy outputs match it token for
token. On CUDA, RMSNorm (fused with the residual add before it), the rotary embedding (fused with the KV-cache store
when q/k/v come from one fused projection) and the SiLU-gated product run as single Triton kernels
(``quantkit.kernels.dense.norm_rope``): same arithmetic, a few launches per layer instead of ~40; float linears take
one row of x (batch-1 decode) through ``quantkit.kernels.dense.gemv``, 6-31% faster than cuBLAS on these shapes.
Where the fused q/k/v or gate/up projection, or down, is a W4A8 layer that takes int8 codes (``takes_codes``), the
norm or the SiLU-gated product before it quantizes its output in the same launch (``kernels.dense.norm_quant``):
the codes the layer would make, up to three launches fewer per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.kernels.dense.gemv import gemv, use_gemv
from quantkit.kernels.dense.norm_quant import add_rms_norm_quant, silu_mul_quant, silu_quant_pays
from quantkit.kernels.dense.norm_rope import add_rms_norm, add_rms_norm_reference, rotary_, rotary_store_, silu_mul
from quantkit.nn.w4a8 import KernelOrSimulated
from quantkit.runtime.attention import AttentionMetadata, paged_attention
from quantkit.runtime.mla import MLAttention
from quantkit.runtime.moe import MoESpec, SparseMoE, is_sparse_layer

LinearFactory = Callable[[str, int, int, bool], nn.Module]  # (name, in_features, out_features, bias) -> module


@dataclass(frozen=True)
class DecoderSpec:
    """What distinguishes one Llama-family class: ``qkv_bias`` q/k/v carry a bias unless the config's ``qkv_bias``
    says otherwise (Qwen2, Qwen2-MoE); ``qk_norm`` an RMSNorm over each head of q and k before the rotary embedding
    (Qwen3); ``moe`` the routed experts that replace the MLP of its sparse layers; ``mla`` multi-head latent
    attention (DeepSeek-V3) instead of q/k/v heads."""

    qkv_bias: bool = False
    qk_norm: bool = False
    moe: MoESpec | None = None
    mla: bool = False


DECODERS = {
    "LlamaForCausalLM": DecoderSpec(),
    "MistralForCausalLM": DecoderSpec(),
    "Qwen2ForCausalLM": DecoderSpec(qkv_bias=True),
    "Qwen3ForCausalLM": DecoderSpec(qk_norm=True),
    "MixtralForCausalLM": DecoderSpec(moe=MoESpec("num_local_experts", "intermediate_size", norm_topk=True)),
    "Qwen2MoeForCausalLM": DecoderSpec(qkv_bias=True, moe=MoESpec(shared_expert=True)),
    "Qwen3MoeForCausalLM": DecoderSpec(qk_norm=True, moe=MoESpec()),
    "DeepseekV3ForCausalLM": DecoderSpec(mla=True, moe=MoESpec("n_routed_experts", grouped_sigmoid=True)),
}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
               "deepseek_v3": "DeepseekV3ForCausalLM"}  # fmt: skip
# families the runtime knows it cannot serve yet, and why
NOT_YET = {
    "DeepseekV2ForCausalLM": "DeepSeek-V2 needs its own router (grouped softmax scores, no correction bias)",
}
UNSUPPORTED_ROPE = ("dynamic", "longrope")  # their frequencies depend on the current sequence length


def architecture(config) -> str:
    """The HF class name of a config: its ``architectures`` entry, else the one its ``model_type`` implies."""
    names = getattr(config, "architectures", None)
    return names[0] if names else MODEL_TYPES.get(config.model_type, config.model_type)


def decoder_spec(config) -> DecoderSpec:
    arch = architecture(config)
    if arch in NOT_YET:
        raise QuantkitError(f"the runtime does not serve {arch} yet: {NOT_YET[arch]}; supported: {supported()}")
    if arch not in DECODERS:
        raise QuantkitError(f"the runtime does not support {arch}; supported: {supported()}")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise QuantkitError(f"the runtime supports SiLU-gated MLPs only, got hidden_act={config.hidden_act!r}")
    return DECODERS[arch]


def supported() -> str:
    return ", ".join(sorted(DECODERS))


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_windows(config) -> list[int]:
    """Sliding-window size of each layer (0 = full attention)."""
    window = getattr(config, "sliding_window", None) or 0
    types = getattr(config, "layer_types", None)
    if types is None:
        return [window] * config.num_hidden_layers
    return [window if t == "sliding_attention" else 0 for t in types]


def rope_tables(config, max_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin fp32 [max_len, head_dim], computed as transformers does (including its rope scaling types)."""
    params = getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": config.rope_theta}
    rope_type = params.get("rope_type", "default")
    if rope_type in UNSUPPORTED_ROPE:
        raise QuantkitError(f"rope_type {rope_type!r} is not supported by the runtime")
    if rope_type == "default":
        dim = head_dim(config)
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    freqs = torch.arange(max_len, dtype=torch.float)[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(device), (emb.sin() * scaling).to(device)


class FloatLinear(nn.Linear):
    """``nn.Linear`` whose one-row CUDA products (decode at batch 1) run ``kernels.gemv``; everything else is
    ``F.linear``, so CPU and batched results are nn.Linear's own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_gemv(x, self.weight):
            return gemv(x.reshape(1, -1), self.weight, self.bias).reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


@dataclass(frozen=True)
class QuantizedRows:
    """A projection's input x [T, n] as the per-token int8 codes that the kernel before it made (qa int8 [T, n],
    a_scale fp32 [T]; ``quantize_activations(x, "int8")``'s numerics), and x's dtype, the projection's output dtype."""

    qa: torch.Tensor
    a_scale: torch.Tensor
    dtype: torch.dtype


def takes_codes(linear: nn.Module | None, x: torch.Tensor) -> bool:
    """Whether ``linear`` is a W4A8 layer that takes x's per-token int8 codes in x's place
    (``KernelOrSimulated.takes_quantized_input``: x on CUDA in fp16 / bf16, int8 activations, no act-order
    permutation in the kernel); the kernel before it then makes them in its own launch."""
    return isinstance(linear, KernelOrSimulated) and linear.takes_quantized_input(x)


def project(linear: nn.Module, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
    """``linear(x)``, or the layer's GEMM on the codes of x made before it."""
    if isinstance(x, QuantizedRows):
        return linear.forward_quantized(x.qa, x.a_scale, x.dtype)
    return linear(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return add_rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps)[0].view(x.shape)
        return add_rms_norm_reference(x, self.weight, self.eps)[0]

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, consumer: nn.Module | None = None
    ) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
        """(norm(x + residual), x + residual) for x, residual [T, n]; without residual, (norm(x), x). Where
        ``consumer``, the projection the norm feeds, ``takes_codes``, the norm comes as its int8 codes
        (``QuantizedRows``, made in the norm's launch, launched with the projection's ``pdl`` flag)."""
        if takes_codes(consumer, x):
            pdl = consumer.quantized_input_pdl(x)
            qa, a_scale, h = add_rms_norm_quant(x, self.weight, self.eps, residual, pdl=pdl)
            return QuantizedRows(qa, a_scale, x.dtype), h
        norm = add_rms_norm if x.is_cuda else add_rms_norm_reference
        return norm(x, self.weight, self.eps, residual)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D] in x's dtype."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, config, spec: DecoderSpec, prefix: str, linear: LinearFactory, window: int, dtype):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim(config)
        self.scale = self.head_dim**-0.5
        self.window = window
        bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = bias or bool(getattr(config, "qkv_bias", spec.qkv_bias))
        hidden, q_size, kv_size = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = linear(f"{prefix}.q_proj", hidden, q_size, qkv_bias)
        self.k_proj = linear(f"{prefix}.k_proj", hidden, kv_size, qkv_bias)
        self.v_proj = linear(f"{prefix}.v_proj", hidden, kv_size, qkv_bias)
        self.o_proj = linear(f"{prefix}.o_proj", q_size, hidden, bias)
        self.qkv_proj = None  # set by fuse_projections
        self.sizes = (q_size, kv_size, kv_size)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]):
        """x [T, hidden], or ``QuantizedRows`` of it where the fused ``qkv_proj`` ``takes_codes``."""
        if self.qkv_proj is not None:
            q, k, v = project(self.qkv_proj, x).split(self.sizes, dim=-1)  # strided views, head dim contiguous
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        stored = False  # whether k and v are in the cache already
        if q.is_cuda:
            stored = meta.backend == "triton" and rotary_store_(q, k, v, cos, sin, *kv_cache, meta.slot_mapping)
            if not stored:
                rotary_(q, k, cos, sin)
        else:
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        o = paged_attention(q, k, v, *kv_cache, meta, self.scale, self.window, stored=stored)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SiLU-gated MLP of ``inter`` (default ``config.intermediate_size``) hidden units: the dense layers' MLP and each
    expert of an MoE block."""

    def __init__(self, config, prefix: str, linear: LinearFactory, inter: int | None = None):
        super().__init__()
        hidden, bias = config.hidden_size, bool(getattr(config, "mlp_bias", False))
        inter = inter or config.intermediate_size
        self.gate_proj = linear(f"{prefix}.gate_proj", hidden, inter, bias)
        self.up_proj = linear(f"{prefix}.up_proj", hidden, inter, bias)
        self.down_proj = linear(f"{prefix}.down_proj", inter, hidden, bias)
        self.gate_up_proj = None  # set by fuse_projections
        self.inter = inter

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        """x [T, hidden], or ``QuantizedRows`` of it where the fused ``gate_up_proj`` ``takes_codes``. Where
        ``down_proj`` does, the SiLU-gated product comes as its codes, made in one launch where that is faster than
        two (``silu_quant_pays``)."""
        if self.gate_up_proj is not None:
            g, u = project(self.gate_up_proj, x).split(self.inter, dim=-1)
        else:
            g, u = self.gate_proj(x), self.up_proj(x)
        if takes_codes(self.down_proj, g):
            pdl = self.down_proj.quantized_input_pdl(g)
            if silu_quant_pays(g, pdl):
                qa, a_scale = silu_mul_quant(g, u, pdl=pdl)
                return self.down_proj.forward_quantized(qa, a_scale, g.dtype)
        return self.down_proj(silu_mul(g, u) if g.is_cuda else F.silu(g) * u)


class DecoderLayer(nn.Module):
    def __init__(self, config, spec: DecoderSpec, i: int, linear: LinearFactory, window: int, dtype):
        super().__init__()
        prefix = f"model.layers.{i}"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if spec.mla:
            norm = partial(RMSNorm, dtype=dtype)
            self.self_attn = MLAttention(config, f"{prefix}.self_attn", linear, norm)
        else:
            self.self_attn = Attention(config, spec, f"{prefix}.self_attn", linear, window, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if spec.moe is not None and is_sparse_layer(config, i):
            experts = partial(MLP, config, linear=linear)
            self.mlp = SparseMoE(config, spec.moe, f"{prefix}.mlp", experts, linear, dtype)
        else:
            self.mlp = MLP(config, f"{prefix}.mlp", linear)

    def forward(self, x, residual, cos, sin, meta, kv_cache):
        """x: the previous layer's output (not yet added to the residual stream ``residual``; None at layer 0).
        Returns (this layer's MLP output, the residual stream before it), so each add fuses into the next norm. A norm
        feeding a fused W4A8 projection that ``takes_codes`` hands it int8 codes it quantized itself."""
        qkv = self.self_attn.qkv_proj if isinstance(self.self_attn, Attention) else None
        h, residual = self.input_layernorm.add_forward(x, residual, qkv)
        a = self.self_attn(h, cos, sin, meta, kv_cache)
        gate_up = self.mlp.gate_up_proj if isinstance(self.mlp, MLP) else None
        h, residual = self.post_attention_layernorm.add_forward(a, residual, gate_up)
        return self.mlp(h), residual


class Decoder(nn.Module):
    def __init__(self, config, spec: DecoderSpec, linear: LinearFactory, dtype):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        windows = layer_windows(config)
        self.layers = nn.ModuleList(
            DecoderLayer(config, spec, i, linear, windows[i], dtype) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class CausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], meta, kv_caches) -> hidden [T, hidden]``; ``logits(hidden)``.

    The rotary tables (``cos``, ``sin`` [max_len, D] fp32) are plain attributes set by ``set_rope``."""

    def __init__(self, config, linear: LinearFactory, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.model = Decoder(config, decoder_spec(config), linear, dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = (
            None if self.tie_word_embeddings else linear("lm_head", config.hidden_size, config.vocab_size, False)
        )
        self.cos = self.sin = None

    @property
    def graph_safe(self) -> bool:
        """Whether a step can be captured in a CUDA graph (MoE blocks read their expert counts on the host unless
        their experts are stacked for the fused kernels, MLA attention its context lengths)."""
        looped = any(isinstance(layer.mlp, SparseMoE) and layer.mlp.fused is None for layer in self.model.layers)
        return not (looped or self.is_mla)

    @property
    def is_mla(self) -> bool:
        return isinstance(self.model.layers[0].self_attn, MLAttention)

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """(tensors per layer, heads, values per head) of one token's cache entry: (2, Hkv, head_dim) for K and V;
        (1, 1, kv_lora_rank + qk_rope_head_dim) for MLA's latent rows."""
        attn = self.model.layers[0].self_attn
        if isinstance(attn, MLAttention):
            return 1, 1, attn.latent_width
        return 2, attn.num_kv_heads, attn.head_dim

    def set_rope(self, max_len: int, device) -> None:
        self.cos, self.sin = rope_tables(self.config, max_len, device)

    def forward(
        self, input_ids, positions, meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ):
        h = self.model.embed_tokens(input_ids)
        cos = self.cos[positions].to(h.dtype)  # [T, D]
        sin = self.sin[positions].to(h.dtype)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, cos, sin, meta, kv_cache)
        return self.model.norm.add_forward(h, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden)


def fuse_projections(model: CausalLM) -> int:
    """Concatenate q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` per layer (per expert and
    shared expert in MoE layers; the parts are dropped); returns how many fused linears were made. On CUDA, MoE
    experts the fused MoE kernels serve are stacked instead (``SparseMoE.stack_experts``, one count per block).

    One GEMM instead of three (two) saves launches and reads the k/v weights at full bandwidth, which is what
    batch-1 decode is bound by; a W8A8 or W4A8 group also quantizes its shared input once. Float, W4A16
    (``QuantLinear``, packed buffers concatenated along N), W4A8 (the same buffers; progressive W4A8's per-channel
    buffers along N too) and W8A8 parts fuse when they are all of one kind and compatible (same scheme, same
    act-order group map, ...); other groups stay separate.
    Done on CUDA only: on CPU the runtime must match transformers' fp32 outputs token for token, and a fused GEMM
    may sum in another order.
    """
    fused = 0
    for layer in model.model.layers:
        attn = layer.self_attn
        qkv = None if isinstance(attn, MLAttention) else concat_projections((attn.q_proj, attn.k_proj, attn.v_proj))
        if qkv is not None:
            attn.qkv_proj, attn.q_proj, attn.k_proj, attn.v_proj = qkv, None, None, None
            fused += 1
        mlps = [layer.mlp]
        if isinstance(layer.mlp, SparseMoE):
            shared = [m for m in (layer.mlp.shared_expert, layer.mlp.shared_experts) if m is not None]
            mlps = [*layer.mlp.experts, *shared]
            if layer.mlp.gate.weight.is_cuda and layer.mlp.stack_experts():  # all experts: one weight per projection
                mlps, fused = shared, fused + 1
        for mlp in mlps:
            gate_up = concat_projections((mlp.gate_proj, mlp.up_proj))
            if gate_up is not None:
                mlp.gate_up_proj, mlp.gate_proj, mlp.up_proj = gate_up, None, None
                fused += 1
    return fused


def concat_projections(parts: tuple[nn.Module, ...]) -> nn.Module | None:
    """The parts as one linear, or None when they are of different kinds or cannot share one weight."""
    from quantkit.nn.progressive import ProgressiveW4A8Linear
    from quantkit.nn.qlinear import QuantLinear
    from quantkit.nn.w4a8 import W4A8Linear
    from quantkit.nn.w8a8 import W8A8Linear

    kind = type(parts[0])
    if any(type(p) is not kind for p in parts):
        return None
    if kind in (nn.Linear, FloatLinear):
        return _concat_linears(parts)
    if kind in (QuantLinear, W4A8Linear, ProgressiveW4A8Linear, W8A8Linear):
        try:
            return kind.concat(list(parts))
        except ValueError:
            return None  # e.g. act-order parts with different permutations: they run one GEMM each
    return None


def _concat_linears(parts: tuple[nn.Linear, ...]) -> nn.Linear:
    """One linear (of the parts' class) whose output is the parts' outputs side by side (missing biases are zeros)."""
    w = parts[0].weight
    with torch.device("meta"):  # no storage: the parameters are assigned below
        n_out, bias = sum(p.out_features for p in parts), any(p.bias is not None for p in parts)
        out = type(parts[0])(w.shape[1], n_out, bias=bias)
    with torch.no_grad():
        out.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
        if out.bias is not None:
            biases = [
                p.bias if p.bias is not None else torch.zeros(p.out_features, dtype=w.dtype, device=w.device)
                for p in parts
            ]
            out.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
    return out
