"""Greedy outputs of the runtime equal Hugging Face ``generate`` token for token (fp32, CPU).

The runtime repeats transformers' arithmetic (fp32 RMSNorm, rotary tables, softmax attention), so on the same
weights the logits agree to ~1e-6 and greedy tokens are identical; any scheduling bug (a wrong slot, block table,
position or chunk boundary) changes the K/V a token sees and shows up as a different token.
"""

import pytest
import torch
import transformers as T
from quantkit.kernels._device import interpreting

import quantkit
from quantkit.recipe import Recipe
from quantkit.runtime import LLM, SamplingParams
from tests.runtime.helpers import assert_logits_match_hf, hf_greedy, random_prompts, record_logits, sharpen
from tests.tiny_models import COMMON, tiny_model

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"]
LENGTHS = [5, 23, 1, 40, 16, 9]  # mixed, including one-token and exactly-one-block prompts
NEW = 24
VOCAB = COMMON["vocab_size"]

SETTINGS = {
    "roomy": dict(num_kv_blocks=64),
    "chunked": dict(num_kv_blocks=64, max_num_batched_tokens=16),  # long prompts prefilled in pieces
    "preempting": dict(num_kv_blocks=8, max_num_batched_tokens=64),  # 128 slots for 6 sequences of up to 64
}


# Qwen3-MoE as Qwen3-30B-A3B routes (top-k weights renormalised; tiny_models keeps the default, unnormalised, which
# Qwen2-MoE covers), with 8 experts so that most of them receive no token in a small step
MOE_CONFIGS = {
    "qwen3_moe": lambda: T.Qwen3MoeConfig(
        **COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True
    ),
    # DeepSeek-V3's router and shared expert after one dense layer (MLA attention: tests/runtime/test_deepseek.py)
    "deepseek_v3": lambda: T.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4},
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        routed_scaling_factor=2.5,
    ),
}


def build(arch: str):
    if arch not in MOE_CONFIGS:
        return tiny_model(arch)
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(MOE_CONFIGS[arch](), dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=ARCHS)
def arch_and_reference(request):
    model = sharpen(build(request.param))
    prompts = random_prompts(LENGTHS, VOCAB, seed=1)
    return model, prompts, hf_greedy(model, prompts, NEW)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_matches_hf(arch_and_reference, setting):
    """Tokens equal HF generate's, and every step's logits equal HF's forward pass over the final sequence
    (greedy text of a random model soon repeats itself, so the logits are the sharper check of decode steps)."""
    model, prompts, reference = arch_and_reference
    llm = LLM(model, device="cpu", **SETTINGS[setting])
    rows = record_logits(llm)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW))
    assert [o.completions[0].token_ids for o in outputs] == reference
    assert_logits_match_hf(model, prompts, outputs, rows, atol=1e-5)  # seen: 6e-7
    if setting == "preempting":
        assert llm.scheduler.num_preemptions > 0
    assert llm.block_manager.num_free == llm.block_manager.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_parallel_sampling_shares_prompt_blocks(arch_and_reference, async_scheduling):
    """n = 3 greedy completions equal HF's greedy output; they fork from one prefill and copy the shared
    partly filled last block on their first write."""
    model, prompts, reference = arch_and_reference
    llm = LLM(model, device="cpu", num_kv_blocks=64, async_scheduling=async_scheduling)
    copies, computed = [], []
    run = llm.runner.run
    llm.runner.run = lambda batch, *a: (copies.extend(batch.copies), computed.append(batch.num_tokens), run(batch, *a))[
        2
    ]
    outputs = llm.generate(prompts, SamplingParams(n=3, max_tokens=NEW))
    for out, ref in zip(outputs, reference, strict=True):
        assert [c.index for c in out.completions] == [0, 1, 2]
        assert all(c.token_ids == ref for c in out.completions)
    partial_prompts = sum(1 for p in prompts if len(p) % llm.config.block_size)
    assert len(copies) == 2 * partial_prompts  # two of the three completions copy; the last owner writes in place
    # each prompt is prefilled once; each completion then computes every sampled token but its last
    decoded = sum(len(c.token_ids) - 1 for o in outputs for c in o.completions)
    exact = sum(map(len, prompts)) + decoded
    if async_scheduling:  # at most one more row per completion: a step launched before its last token was read
        assert exact <= sum(computed) <= exact + sum(len(o.completions) for o in outputs)
    else:
        assert sum(computed) == exact


def test_common_prefix_is_computed_once():
    model = sharpen(tiny_model("llama"))
    prefix = random_prompts([40], VOCAB, seed=2)[0]
    prompts = [prefix + tail for tail in random_prompts([3, 7, 12], VOCAB, seed=3)]
    reference = hf_greedy(model, prompts, 8)
    llm = LLM(model, device="cpu", num_kv_blocks=64)
    first = llm.generate(prompts[:1], SamplingParams(max_tokens=8))
    computed = []
    run = llm.runner.run
    llm.runner.run = lambda batch, *a: (computed.append(batch.num_tokens), run(batch, *a))[1]
    rest = llm.generate(prompts[1:], SamplingParams(max_tokens=8))
    assert [o.completions[0].token_ids for o in first + rest] == reference
    # the 32 tokens of the two full prefix blocks come from the cache: only tails are prefilled
    assert computed[0] == sum(len(p) - 32 for p in prompts[1:])


def test_sliding_window_matches_hf():
    torch.manual_seed(0)
    config = T.MistralConfig(**COMMON, sliding_window=8)
    model = sharpen(T.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())
    prompts = random_prompts([5, 20, 13], VOCAB, seed=4)
    reference = hf_greedy(model, prompts, 16)
    for settings in (dict(num_kv_blocks=32), dict(num_kv_blocks=32, max_num_batched_tokens=7)):
        outputs = LLM(model, device="cpu", **settings).generate(prompts, SamplingParams(max_tokens=16))
        assert [o.completions[0].token_ids for o in outputs] == reference


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 16},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    ],
)  # fmt: skip
def test_rope_scaling_matches_hf(rope):
    torch.manual_seed(0)
    config = T.LlamaConfig(**COMMON, rope_parameters=rope, max_position_embeddings=256)
    model = sharpen(T.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())
    prompts = random_prompts([30, 7], VOCAB, seed=8)
    reference = hf_greedy(model, prompts, 12)
    outputs = LLM(model, device="cpu", num_kv_blocks=16).generate(prompts, SamplingParams(max_tokens=12))
    assert [o.completions[0].token_ids for o in outputs] == reference


def test_quantized_checkpoint_matches_hf(tmp_path):
    """A quantkit checkpoint (RTN 4-bit, QuantLinear) loaded from disk by the runtime's own loader gives the same
    greedy tokens as the same checkpoint loaded into transformers by quantkit.load_quantized."""
    model = sharpen(tiny_model("qwen2"))
    recipe = Recipe.from_dict({"scheme": {"bits": 4, "group_size": 32, "sym": False}, "stages": [{"method": "rtn"}]})
    quantkit.quantize(model, recipe)
    folder = quantkit.save_quantized(model, tmp_path / "q")
    hf = quantkit.load_quantized(folder)
    prompts = random_prompts([7, 30, 2], VOCAB, seed=5)
    reference = hf_greedy(hf, prompts, 12)
    llm = LLM(str(folder), device="cpu", num_kv_blocks=32, max_num_batched_tokens=16)
    assert type(llm.model.model.layers[0].mlp.down_proj).__name__ == "QuantLinear"
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12))
    assert [o.completions[0].token_ids for o in outputs] == reference


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe"])  # qwen2_moe: every expert and the shared expert W8A8
def test_w8a8_modules_match_hf(arch):
    w8a8 = pytest.importorskip("quantkit.nn.w8a8")
    model = sharpen(tiny_model(arch))
    recipe = Recipe.from_dict(
        {"scheme": {"bits": 8, "group_size": -1, "sym": True, "act_bits": 8}, "stages": [{"method": "rtn"}]}
    )
    quantkit.quantize(model, recipe)
    assert any(isinstance(m, w8a8.W8A8Linear) for m in model.modules())
    prompts = random_prompts([6, 19], VOCAB, seed=6)
    reference = hf_greedy(model, prompts, 12)
    outputs = LLM(model, device="cpu", num_kv_blocks=32).generate(prompts, SamplingParams(max_tokens=12))
    assert [o.completions[0].token_ids for o in outputs] == reference


def test_float_folder_and_stop_tokens(tmp_path):
    model = sharpen(tiny_model("llama"))
    model.save_pretrained(tmp_path / "m")
    prompts = random_prompts([11, 4], VOCAB, seed=7)
    reference = hf_greedy(model, prompts, 10)
    llm = LLM(str(tmp_path / "m"), device="cpu", num_kv_blocks=32)
    assert [o.completions[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=10))] == reference
    stop = reference[0][3]
    out = llm.generate(prompts[:1], SamplingParams(max_tokens=10, stop_token_ids=(stop,)))[0].completions[0]
    assert out.token_ids == reference[0][: reference[0].index(stop) + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_fused_projections_match_hf(arch):
    """q/k/v and gate/up fused into one linear each (what the engine does on CUDA) keep the logits of HF's forward."""
    from quantkit.runtime.model import FloatLinear, fuse_projections

    model = sharpen(tiny_model(arch))
    prompts = random_prompts(LENGTHS, VOCAB, seed=2)
    llm = LLM(model, device="cpu", num_kv_blocks=64)
    assert fuse_projections(llm.model) == 2 * COMMON["num_hidden_layers"]
    layer = llm.model.model.layers[0]
    assert layer.self_attn.q_proj is None and layer.mlp.gate_proj is None
    assert type(layer.self_attn.qkv_proj) is FloatLinear and type(layer.mlp.gate_up_proj) is FloatLinear
    rows = record_logits(llm)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12))
    assert_logits_match_hf(model, prompts, outputs, rows, atol=1e-5)


@pytest.mark.parametrize(
    ("scheme", "atol"),
    [
        ({"bits": 4, "group_size": 32, "sym": False}, 1e-4),  # W4A16: packed buffers concatenated along N
        # W8A8: the shared input quantized once. A 1e-7 difference in summation order can move an activation across
        # a rounding boundary of its int8 grid, which changes logits by ~1e-3: the tokens must still agree
        ({"bits": 8, "group_size": -1, "sym": True, "act_bits": 8}, 1e-2),
    ],
)
def test_fused_quantized_projections_match_hf(scheme, atol):
    """Quantized q/k/v and gate/up fuse like float ones (what the engine does on CUDA) and keep HF's greedy tokens
    and logits."""
    from quantkit.runtime.model import fuse_projections

    model = sharpen(tiny_model("qwen2"))
    quantkit.quantize(model, Recipe.from_dict({"scheme": scheme, "stages": [{"method": "rtn"}]}))
    prompts = random_prompts(LENGTHS, VOCAB, seed=3)
    llm = LLM(model, device="cpu", num_kv_blocks=64)
    kind = type(llm.model.model.layers[0].mlp.gate_proj)
    assert kind.__name__ in ("QuantLinear", "W8A8Linear")
    assert fuse_projections(llm.model) == 2 * COMMON["num_hidden_layers"]
    assert type(llm.model.model.layers[0].mlp.gate_up_proj) is kind
    rows = record_logits(llm)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12))
    assert [o.completions[0].token_ids for o in outputs] == hf_greedy(model, prompts, 12)
    assert_logits_match_hf(model, prompts, outputs, rows, atol=atol)


# -- mixture of experts ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_block_equals_hf_and_runs_only_the_chosen_experts(arch):
    """The runtime's MoE block (tokens grouped by expert, one pass per expert that received any) equals transformers'
    block on the same weights; at batch 1 exactly the top-k experts run, and experts routed no token never run."""
    from quantkit.runtime.moe import SparseMoE

    model = build(arch)
    block = LLM(model, device="cpu", num_kv_blocks=4).model.model.layers[0].mlp
    assert isinstance(block, SparseMoE)
    ran = []
    for e, expert in enumerate(block.experts):
        expert.register_forward_hook(lambda *_, e=e: ran.append(e))
    gen = torch.Generator().manual_seed(0)
    for tokens in (1, 3, 40):
        x = torch.randn(tokens, COMMON["hidden_size"], generator=gen)
        ran.clear()
        with torch.no_grad():
            out, expected = block(x), model.model.layers[0].mlp(x[None])[0]
            chosen = block.route(x)[1]
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)  # seen: 0 to 7e-10
        assert ran == sorted(set(chosen.flatten().tolist()))  # each routed expert once, in expert order
        if tokens == 1:  # 2 of 4 or 8 experts: the others received no token
            assert len(ran) == model.config.num_experts_per_tok < len(block.experts)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])  # Mixtral: on-disk w1/w2/w3 names; Qwen2: shared expert
def test_moe_folder_and_quantized_checkpoint_match_hf(arch, tmp_path):
    """A float folder as transformers saves it (per-expert tensors, Mixtral's legacy names) and a quantkit RTN 4-bit
    checkpoint (every expert a QuantLinear) load through the runtime's loader and keep HF's greedy tokens."""
    model = sharpen(build(arch))
    model.save_pretrained(tmp_path / "float")
    prompts = random_prompts([7, 30, 2], VOCAB, seed=5)
    outputs = LLM(str(tmp_path / "float"), device="cpu", num_kv_blocks=32).generate(
        prompts, SamplingParams(max_tokens=12)
    )
    assert [o.completions[0].token_ids for o in outputs] == hf_greedy(model, prompts, 12)
    recipe = Recipe.from_dict({"scheme": {"bits": 4, "group_size": 32, "sym": False}, "stages": [{"method": "rtn"}]})
    quantkit.quantize(model, recipe)
    folder = quantkit.save_quantized(model, tmp_path / "q")
    reference = hf_greedy(quantkit.load_quantized(folder), prompts, 12)
    llm = LLM(str(folder), device="cpu", num_kv_blocks=32, max_num_batched_tokens=16)
    assert type(llm.model.model.layers[0].mlp.experts[3].down_proj).__name__ == "QuantLinear"
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12))
    assert [o.completions[0].token_ids for o in outputs] == reference


def test_moe_models_run_eagerly_and_fuse_per_expert():
    """MoE steps read expert counts on the host, so they are never captured in a CUDA graph; fusing gate/up (what
    the engine does on CUDA) fuses each expert and the shared expert, and keeps HF's logits."""
    from quantkit.runtime.model import fuse_projections

    model = sharpen(build("qwen2_moe"))  # layer 0: 4 experts and a shared expert; layer 1 dense
    llm = LLM(model, device="cpu", num_kv_blocks=64)
    assert not llm.model.graph_safe and LLM(tiny_model("llama"), device="cpu", num_kv_blocks=4).model.graph_safe
    assert fuse_projections(llm.model) == 2 + 5 + 1  # q/k/v twice, gate/up of 5 MLPs in layer 0 and 1 in layer 1
    assert llm.model.model.layers[0].mlp.experts[0].gate_proj is None
    prompts = random_prompts(LENGTHS, VOCAB, seed=2)
    rows = record_logits(llm)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12))
    assert_logits_match_hf(model, prompts, outputs, rows, atol=1e-5)


@pytest.mark.skipif(not interpreting(), reason="the fused MoE kernels on CPU need TRITON_INTERPRET=1")
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_stacked_experts_run_the_fused_kernels_and_keep_hf_tokens(arch):
    """Experts stacked at load (what fuse_projections does on CUDA) run ``kernels.moe`` (here in Triton's
    interpreter, fp32; shared experts added around it): HF's greedy tokens, the per-expert modules gone, and the
    model graph safe (DeepSeek-V3 stays eager for its MLA attention)."""
    from quantkit.runtime.moe import SparseMoE

    model = build(arch)
    if arch == "deepseek_v3":
        with torch.no_grad():
            model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0, 0.1)  # choice and weights differ
    else:
        sharpen(model)
    prompts = random_prompts([5, 23, 1], VOCAB, seed=3)
    llm = LLM(model, device="cpu", num_kv_blocks=64, max_num_batched_tokens=16)
    blocks = [layer.mlp for layer in llm.model.model.layers if isinstance(layer.mlp, SparseMoE)]
    assert not llm.model.graph_safe and all(b.stack_experts() for b in blocks)
    assert llm.model.graph_safe == (arch != "deepseek_v3")
    n_experts = getattr(model.config, "num_local_experts", None) or model.config.num_experts
    assert len(blocks[0].experts) == 0 and blocks[0].fused[0].weight.shape[0] == n_experts
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8))
    assert [o.completions[0].token_ids for o in outputs] == hf_greedy(model, prompts, 8)


@pytest.mark.skipif(not interpreting(), reason="the fused MoE kernels on CPU need TRITON_INTERPRET=1")
@pytest.mark.parametrize("fmt", ["w4a16", "w4a16_act", "fp8_block"])
def test_stacked_quantized_experts_equal_the_loop(fmt):
    """W4A16 (act-order too: each expert's gate/up share a group map, its own) and block-fp8 experts (fp16) stack
    into the fused kernels' layouts; the block's output equals the loop's within 4 fp16 ulps of its largest value
    (the loop rounds each expert's output before weighting it, the kernel the weighted fp32 product)."""
    from dataclasses import replace

    from quantkit.algorithms.rtn import rtn
    from quantkit.nn.qlinear import QuantLinear
    from quantkit.nn.w8a8 import W8A8Linear
    from quantkit.quant import QuantScheme

    llm = LLM(build("qwen3_moe").half(), device="cpu", num_kv_blocks=4)
    block = llm.model.model.layers[0].mlp
    for e, expert in enumerate(block.experts):
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(expert, name)
            if fmt.startswith("w4a16"):
                qw = rtn(lin.weight.float(), QuantScheme(bits=4, group_size=32))
                if fmt == "w4a16_act":  # a shuffled group map: gate and up share one, down has its own
                    order = torch.randperm(qw.g_idx.numel(), generator=torch.Generator().manual_seed(e))
                    qw = replace(qw, g_idx=qw.g_idx[order])
                q = QuantLinear.from_quantized(qw, None, torch.float16)
            else:
                scheme = QuantScheme(bits=8, group_size=-1, fmt="fp8", act_bits=8, block_size=16)
                q = W8A8Linear.from_float(lin.float(), scheme)
                q.dtype, q.execution = torch.float16, "integer"
            setattr(expert, name, q)
    x = torch.randn(9, COMMON["hidden_size"], generator=torch.Generator().manual_seed(0)).half()
    with torch.no_grad():
        loop = block(x)
        assert block.stack_experts() and block.fused[0].fmt == fmt.removesuffix("_act")
        assert (block.fused[0].perm is not None) == (fmt == "w4a16_act")
        fused = block(x)
    assert (fused.float() - loop.float()).abs().max() <= 4 * 2**-10 * loop.float().abs().max()


def test_dummy_moe_shapes_and_random_weights():
    """``dummy:`` MoE shapes have their published sizes (built on the meta device: no memory), and a small MoE
    config with random weights serves."""
    from quantkit.runtime.bench import DUMMY_MODELS
    from quantkit.runtime.loader import float_linear
    from quantkit.runtime.model import CausalLM

    for name, total, active in (("mixtral-8x7b", 46.70e9, 12.88e9), ("qwen3-30b-a3b", 30.53e9, 3.35e9)):
        config = T.AutoConfig.for_model(**DUMMY_MODELS[name])
        with torch.device("meta"):
            model = CausalLM(config, float_linear(torch.bfloat16), torch.bfloat16)
        experts = model.model.layers[0].mlp.experts
        idle = (
            config.num_hidden_layers
            * (len(experts) - config.num_experts_per_tok)
            * sum(p.numel() for p in experts[0].parameters())
        )
        params = sum(p.numel() for p in model.parameters())
        assert abs(params - total) < 0.01e9 and abs(params - idle - active) < 0.01e9, name
    config = {"model_type": "qwen3_moe", **COMMON, "num_experts": 8, "num_experts_per_tok": 2,
              "moe_intermediate_size": 32}  # fmt: skip
    out = LLM(config, device="cpu", num_kv_blocks=8).generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    assert len(out[0].completions[0].token_ids) == 4


def test_unserved_moe_family_is_refused_before_weights_load(tmp_path):
    """DeepSeek-V2 (its own router) is named in one QuantkitError line before any weight is read: the folder here
    has no weights at all."""
    from quantkit.errors import QuantkitError

    T.DeepseekV2Config(**COMMON).save_pretrained(tmp_path)
    for source in (str(tmp_path), {"model_type": "deepseek_v2"}):
        with pytest.raises(QuantkitError, match=r"does not serve DeepseekV2ForCausalLM yet: DeepSeek-V2 needs") as e:
            LLM(source, device="cpu")
        assert "\n" not in str(e.value)
