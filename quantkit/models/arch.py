"""Architecture tables: what quantkit needs to know about each Hugging Face model family, as data.

A table says where the decoder layers are, which linears a layer holds in execution order (the groups of
true-sequential quantization), which norm or projection feeds which linears (the smoothing groups of AWQ and
SmoothQuant) and what is never quantized by default. Module names inside a layer are patterns in which ``*``
stands for an expert index; a pattern that matches nothing in a layer is skipped (dense layers of MoE models).
Tables are registered by the HF class name; nothing in quantkit inspects type names elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.errors import QuantkitError


@dataclass(frozen=True)
class SmoothGroup:
    """``producer`` computes the activations that enter every linear in ``consumers``.

    Scaling input channel j of the consumers by s_j and dividing the producer's output j by s_j leaves the
    float model unchanged. ``block`` is the module whose output AWQ compares (the smallest module that holds all
    consumers). ``producer_rows="second_half"`` means only the second half of the producer's outputs feeds the
    consumers (Phi-3's fused gate_up_proj, whose up half multiplies act(gate)).
    """

    producer: str
    consumers: tuple[str, ...]
    block: str
    producer_rows: str = "all"


@dataclass(frozen=True)
class ArchSpec:
    name: str
    hf_classes: tuple[str, ...]
    layers: str
    sequential: tuple[tuple[str, ...], ...]
    smooth: tuple[SmoothGroup, ...]
    norm: str = "rms"  # "rms" | "rms_plus_one" (Gemma: x * (1 + w)) | "layernorm" (with bias)
    never_quantize: tuple[str, ...] = ()
    fused_experts: str | None = None  # path of a 3-D experts module (transformers 5) to split into linears

    def linear_patterns(self) -> tuple[str, ...]:
        return tuple(p for group in self.sequential for p in group)


ATTN_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
MLP_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")
LLAMA_SEQUENTIAL = (ATTN_QKV, ("self_attn.o_proj",), MLP_GATE_UP, ("mlp.down_proj",))
LLAMA_SMOOTH = (
    SmoothGroup("input_layernorm", ATTN_QKV, block="self_attn"),
    SmoothGroup("self_attn.v_proj", ("self_attn.o_proj",), block="self_attn.o_proj"),
    SmoothGroup("post_attention_layernorm", MLP_GATE_UP, block="mlp"),
    SmoothGroup("mlp.up_proj", ("mlp.down_proj",), block="mlp.down_proj"),
)
GEMMA_SMOOTH = (
    SmoothGroup("input_layernorm", ATTN_QKV, block="self_attn"),
    SmoothGroup("self_attn.v_proj", ("self_attn.o_proj",), block="self_attn.o_proj"),
    SmoothGroup("pre_feedforward_layernorm", MLP_GATE_UP, block="mlp"),
    SmoothGroup("mlp.up_proj", ("mlp.down_proj",), block="mlp.down_proj"),
)
EXPERT_GATE_UP = ("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj")
EXPERT_DOWN = ("mlp.experts.*.down_proj",)
SHARED_GATE_UP = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj")
MOE_DENSE_MLP = MLP_GATE_UP  # dense layers inside MoE models (Qwen2-MoE's mlp_only_layers)

ARCHITECTURES: tuple[ArchSpec, ...] = (
    ArchSpec("llama", ("LlamaForCausalLM",), "model.layers", LLAMA_SEQUENTIAL, LLAMA_SMOOTH),
    ArchSpec("mistral", ("MistralForCausalLM",), "model.layers", LLAMA_SEQUENTIAL, LLAMA_SMOOTH),
    ArchSpec("qwen2", ("Qwen2ForCausalLM",), "model.layers", LLAMA_SEQUENTIAL, LLAMA_SMOOTH),
    ArchSpec("qwen3", ("Qwen3ForCausalLM",), "model.layers", LLAMA_SEQUENTIAL, LLAMA_SMOOTH),
    ArchSpec("gemma2", ("Gemma2ForCausalLM",), "model.layers", LLAMA_SEQUENTIAL, GEMMA_SMOOTH, norm="rms_plus_one"),
    ArchSpec("gemma3", ("Gemma3ForCausalLM",), "model.layers", LLAMA_SEQUENTIAL, GEMMA_SMOOTH, norm="rms_plus_one"),
    ArchSpec(
        "phi3",
        ("Phi3ForCausalLM",),
        "model.layers",
        (("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",)),
        (
            SmoothGroup("input_layernorm", ("self_attn.qkv_proj",), block="self_attn"),
            SmoothGroup("post_attention_layernorm", ("mlp.gate_up_proj",), block="mlp"),
            SmoothGroup("mlp.gate_up_proj", ("mlp.down_proj",), block="mlp.down_proj", producer_rows="second_half"),
        ),
    ),
    ArchSpec(
        "opt",
        ("OPTForCausalLM",),
        "model.decoder.layers",
        (ATTN_QKV, ("self_attn.out_proj",), ("fc1",), ("fc2",)),
        (
            SmoothGroup("self_attn_layer_norm", ATTN_QKV, block="self_attn"),
            SmoothGroup("self_attn.v_proj", ("self_attn.out_proj",), block="self_attn.out_proj"),
            SmoothGroup("final_layer_norm", ("fc1",), block="fc1"),
            SmoothGroup("fc1", ("fc2",), block="fc2"),  # ReLU between commutes with positive scales
        ),
        norm="layernorm",
    ),
    ArchSpec(
        "mixtral",
        ("MixtralForCausalLM",),
        "model.layers",
        (ATTN_QKV, ("self_attn.o_proj",), EXPERT_GATE_UP, EXPERT_DOWN),
        (
            SmoothGroup("input_layernorm", ATTN_QKV, block="self_attn"),
            SmoothGroup("self_attn.v_proj", ("self_attn.o_proj",), block="self_attn.o_proj"),
            SmoothGroup("post_attention_layernorm", EXPERT_GATE_UP, block="mlp"),
            SmoothGroup("mlp.experts.*.up_proj", EXPERT_DOWN, block="mlp.experts.*.down_proj"),
        ),
        never_quantize=("mlp.gate",),
        fused_experts="mlp.experts",
    ),
    *(
        ArchSpec(
            name,
            (cls,),
            "model.layers",
            (
                ATTN_QKV,
                ("self_attn.o_proj",),
                (*EXPERT_GATE_UP, *SHARED_GATE_UP, *MOE_DENSE_MLP),
                (*EXPERT_DOWN, "mlp.shared_expert.down_proj", "mlp.down_proj"),
            ),
            (
                SmoothGroup("input_layernorm", ATTN_QKV, block="self_attn"),
                SmoothGroup("self_attn.v_proj", ("self_attn.o_proj",), block="self_attn.o_proj"),
                SmoothGroup(
                    "post_attention_layernorm", (*EXPERT_GATE_UP, *SHARED_GATE_UP, *MOE_DENSE_MLP), block="mlp"
                ),
                SmoothGroup("mlp.experts.*.up_proj", EXPERT_DOWN, block="mlp.experts.*.down_proj"),
                SmoothGroup(
                    "mlp.shared_expert.up_proj", ("mlp.shared_expert.down_proj",), block="mlp.shared_expert.down_proj"
                ),
                SmoothGroup("mlp.up_proj", ("mlp.down_proj",), block="mlp.down_proj"),
            ),
            never_quantize=("mlp.gate", "mlp.shared_expert_gate"),
            fused_experts="mlp.experts",
        )
        for name, cls in (("qwen2_moe", "Qwen2MoeForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM"))
    ),
)

# DeepSeek-V3 (and V2): multi-head latent attention, whose queries and keys/values go through low-rank projections
# with a norm between (q_a_proj -> q_a_layernorm -> q_b_proj; kv_a_proj_with_mqa -> kv_a_layernorm (its first
# kv_lora_rank outputs) -> kv_b_proj; q_proj without q_lora_rank), the first ``first_k_dense_replace`` layers dense,
# the others routed experts plus shared experts. The router (``mlp.gate``, with its ``e_score_correction_bias``) is
# not a Linear and stays float. kv_b_proj's value rows mix with the keys' rows per head: o_proj is not smoothed.
MLA_IN = ("self_attn.q_a_proj", "self_attn.q_proj", "self_attn.kv_a_proj_with_mqa")
MLA_UP = ("self_attn.q_b_proj", "self_attn.kv_b_proj")
DS_SHARED_GATE_UP = ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj")
DS_MLP_IN = (*EXPERT_GATE_UP, *DS_SHARED_GATE_UP, *MOE_DENSE_MLP)
DEEPSEEK_V3 = ArchSpec(
    "deepseek_v3",
    ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"),
    "model.layers",
    (MLA_IN, MLA_UP, ("self_attn.o_proj",), DS_MLP_IN, (*EXPERT_DOWN, "mlp.shared_experts.down_proj", "mlp.down_proj")),
    (
        SmoothGroup("input_layernorm", MLA_IN, block="self_attn"),
        SmoothGroup("self_attn.q_a_layernorm", ("self_attn.q_b_proj",), block="self_attn.q_b_proj"),
        SmoothGroup("self_attn.kv_a_layernorm", ("self_attn.kv_b_proj",), block="self_attn.kv_b_proj"),
        SmoothGroup("post_attention_layernorm", DS_MLP_IN, block="mlp"),
        SmoothGroup("mlp.experts.*.up_proj", EXPERT_DOWN, block="mlp.experts.*.down_proj"),
        SmoothGroup(
            "mlp.shared_experts.up_proj", ("mlp.shared_experts.down_proj",), block="mlp.shared_experts.down_proj"
        ),
        SmoothGroup("mlp.up_proj", ("mlp.down_proj",), block="mlp.down_proj"),
    ),
    never_quantize=("mlp.gate",),
    fused_experts="mlp.experts",
)
ARCHITECTURES = (*ARCHITECTURES, DEEPSEEK_V3)

_BY_CLASS = {cls: spec for spec in ARCHITECTURES for cls in spec.hf_classes}


def supported_architectures() -> list[str]:
    return sorted(_BY_CLASS)


def arch_for(model_or_class) -> ArchSpec:
    """The table for a model instance, a model class, or an HF architecture name."""
    if isinstance(model_or_class, str):
        name = model_or_class
    else:
        cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
        name = cls.__name__
    try:
        return _BY_CLASS[name]
    except KeyError:
        raise QuantkitError(
            f"unsupported model architecture {name}; supported: {', '.join(supported_architectures())}"
        ) from None


def position_limit(config) -> int | None:
    """The longest sequence the model's positions describe: ``max_position_embeddings``, or, where the config scales
    its rotary embedding (yarn, linear, dynamic, llama3, ...), ``original_max_position_embeddings`` (else
    ``max_position_embeddings``) times the scaling factor when that is longer. None when the config does not say."""
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool):
        return None
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(params, dict) and params.get("rope_type", params.get("type", "default")) != "default":
        factor = params.get("factor")
        if isinstance(factor, int | float) and factor > 1:
            original = params.get("original_max_position_embeddings") or limit
            return max(limit, int(original * factor))
    return limit
