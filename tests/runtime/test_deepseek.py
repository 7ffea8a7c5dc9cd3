"""DeepSeek-V3 in the runtime (MLA over a paged latent cache, grouped sigmoid router, shared experts, dense first
layers) against transformers (fp32, CPU), and MTP drafting against plain greedy decoding."""

import json

import pytest
import torch
import transformers as T
from click.testing import CliRunner
from safetensors.torch import save_file

import quantkit
from quantkit.cli.main import cli
from quantkit.errors import QuantkitError
from quantkit.recipe import Recipe
from quantkit.runtime import LLM, SamplingParams
from quantkit.runtime.loader import float_linear
from quantkit.runtime.mla import MLAttention
from quantkit.runtime.speculative.mtp import random_mtp
from tests.runtime.helpers import assert_logits_match_hf, hf_greedy, random_prompts, record_logits
from tests.tiny_models import COMMON

LENGTHS = [5, 23, 1, 40, 16, 9]
NEW = 16
VOCAB = COMMON["vocab_size"]
SETTINGS = {
    "roomy": dict(num_kv_blocks=64),
    "chunked": dict(num_kv_blocks=64, max_num_batched_tokens=16),
    "preempting": dict(num_kv_blocks=8, max_num_batched_tokens=64),
}


def config(**over):
    """Three layers: the first dense, then 8 routed experts in 4 groups (the best 2 groups open per token), one
    shared expert; low-rank queries, DeepSeek's interleaved rotary pairs."""
    fields = dict(**{**COMMON, "num_key_value_heads": 4, "num_hidden_layers": 3}, moe_intermediate_size=32,
                  n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
                  first_k_dense_replace=1, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                  v_head_dim=16, routed_scaling_factor=2.5)  # fmt: skip
    return T.DeepseekV3Config(**{**fields, **over})


def build(seed: int = 0, **over):
    """A random tiny DeepSeek-V3 with sharp attention (scaled q_b / kv_b: near-uniform attention would hide a wrong
    slot) and a non-zero router correction bias (so choice and weights differ)."""
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(config(**over), dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            (attn.q_proj if attn.q_proj is not None else attn.q_b_proj).weight.mul_(10)
            attn.kv_b_proj.weight.mul_(3)
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module")
def reference():
    model = build()
    prompts = random_prompts(LENGTHS, VOCAB, seed=1)
    return model, prompts, hf_greedy(model, prompts, NEW)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_matches_hf(reference, setting):
    """Tokens equal HF generate's and every step's logits HF's forward pass, with mixed decode + prefill steps,
    chunked prefills and preemption; the cache holds one latent row (kv_lora_rank + rope) per token and layer."""
    model, prompts, expected = reference
    llm = LLM(model, device="cpu", **SETTINGS[setting])
    assert llm.runner.kv.shape == (3, 1, llm.runner.num_blocks, 16, 1, 32 + 8)
    assert llm.runner.block_bytes == 3 * 16 * 40 * 4  # not 2 x 4 heads x (24 + 16)
    rows = record_logits(llm)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW))
    assert [o.completions[0].token_ids for o in outputs] == expected
    assert_logits_match_hf(model, prompts, outputs, rows, atol=1e-5)
    if setting == "preempting":
        assert llm.scheduler.num_preemptions > 0
    assert llm.block_manager.num_free == llm.block_manager.num_blocks


def test_triton_mla_decode_kernel_matches_hf(reference):
    """The Triton MLA decode kernel (Triton's interpreter on CPU) in the engine: HF's tokens and logits."""
    model, prompts, expected = reference
    llm = LLM(model, device="cpu", attention_backend="triton", num_kv_blocks=64)
    rows = record_logits(llm)
    outputs = llm.generate(prompts[:2], SamplingParams(max_tokens=NEW))
    assert [o.completions[0].token_ids for o in outputs] == expected[:2]
    assert_logits_match_hf(model, prompts[:2], outputs, rows, atol=1e-5)


def test_full_rank_queries_yarn_and_plain_rotary_match_hf():
    """q_lora_rank None (one q_proj), YaRN with mscale_all_dim (the softmax scale grows by mscale^2) and
    non-interleaved rotary halves."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
    model = build(seed=3, q_lora_rank=None, rope_parameters=rope, rope_interleave=False, max_position_embeddings=256)
    prompts = random_prompts([70, 3, 12], VOCAB, seed=2)
    llm = LLM(model, device="cpu", num_kv_blocks=32, max_num_batched_tokens=32)
    attn = llm.model.model.layers[0].self_attn
    assert isinstance(attn, MLAttention) and hasattr(attn, "q_proj") and attn.scale > 24**-0.5
    rows = record_logits(llm)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW))
    assert [o.completions[0].token_ids for o in outputs] == hf_greedy(model, prompts, NEW)
    assert_logits_match_hf(model, prompts, outputs, rows, atol=1e-5)


def test_absorbed_decode_equals_decompressed_attention():
    """The decode path (q through W_UK, attention over latent rows, output through W_UV) equals attention over the
    decompressed per-head keys and values, on random latents far from the model's (float64 would agree to 1e-12;
    fp32 to ~1e-6 of the output's size)."""
    torch.manual_seed(0)
    attn = LLM(build(), device="cpu", num_kv_blocks=4).model.model.layers[1].self_attn
    ctx, bs = 37, 16
    cache = torch.randn(4, bs, 1, attn.latent_width)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    q_nope, q_pe = torch.randn(1, attn.num_heads, attn.nope), torch.randn(1, attn.num_heads, attn.rope_dim)
    lens = torch.tensor([ctx], dtype=torch.int32)
    meta = type("Meta", (), dict(decode_block_tables=table, decode_context_lens=lens, backend="torch"))
    absorbed = attn._decode(q_nope, q_pe, cache, meta)
    slots = torch.arange(ctx)
    latents = cache[table[0, slots // bs].long(), slots % bs, 0]
    dense = attn.attend(q_nope, q_pe, latents, torch.ones(1, ctx, dtype=torch.bool))
    torch.testing.assert_close(absorbed, dense, atol=1e-5 * dense.abs().max().item(), rtol=0)


def test_router_equals_hf():
    """Group-limited top-k on sigmoid scores + correction bias, weights renormalised and scaled, as transformers'
    router chooses them (the same expert sets and weights), including tokens whose groups tie."""
    model = build()
    llm = LLM(model, device="cpu", num_kv_blocks=4)
    ours, theirs = llm.model.model.layers[2].mlp, model.model.layers[2].mlp.gate
    x = torch.randn(64, COMMON["hidden_size"])
    x[:8] = 0  # every score 0.5: ties everywhere
    weights, chosen = ours.route(x)
    _, hf_weights, hf_chosen = theirs(x)
    for w, c, hw, hc in zip(weights, chosen, hf_weights, hf_chosen, strict=True):
        mine, hf = dict(zip(c.tolist(), w.tolist(), strict=True)), dict(zip(hc.tolist(), hw.tolist(), strict=True))
        assert mine.keys() == hf.keys() and all(abs(mine[e] - hf[e]) < 1e-6 for e in mine)


def test_quantized_checkpoint_matches_hf(tmp_path):
    """An RTN W4A16 checkpoint (MLA projections and experts quantized; the absorbed decode dequantizes kv_b_proj)
    keeps the tokens transformers gives on the same quantized model."""
    model = build()
    recipe = Recipe.from_dict({"scheme": {"bits": 4, "group_size": 16, "sym": False}, "stages": [{"method": "rtn"}]})
    quantkit.quantize(model, recipe)
    folder = quantkit.save_quantized(model, tmp_path / "q")
    prompts = random_prompts([7, 30, 2], VOCAB, seed=5)
    expected = hf_greedy(quantkit.load_quantized(folder), prompts, 12)
    llm = LLM(str(folder), device="cpu", num_kv_blocks=32, max_num_batched_tokens=16)
    layer = llm.model.model.layers[1]
    assert {type(layer.self_attn.kv_b_proj).__name__, type(layer.mlp.experts[3].down_proj).__name__} == {"QuantLinear"}
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12))
    assert [o.completions[0].token_ids for o in outputs] == expected


def test_parallel_sampling_shares_latent_blocks_and_self_drafts(reference):
    """n = 3 greedy completions (forked from one prefill: their latent blocks shared, the partly filled one copied on
    write) equal HF's; a self draft (the target's first 2 layers in 4 bits; routers stay float) keeps the plain
    tokens; a later prompt with the same first block reads its latent rows from the prefix cache."""
    model, prompts, _ = reference
    pair = [[*prompts[1], 5], [*prompts[1], 7, 8]]
    llm = LLM(model, device="cpu", num_kv_blocks=64)
    outputs = llm.generate(pair, SamplingParams(max_tokens=8, n=3))
    expected = hf_greedy(model, pair, 8)
    assert all(c.token_ids == e for o, e in zip(outputs, expected, strict=True) for c in o.completions)
    assert llm.block_manager.num_free == llm.block_manager.num_blocks
    spec = dict(method="self", draft_layers=2, adaptive=False)
    drafted = LLM(model, device="cpu", num_kv_blocks=64, speculative=spec).generate(pair, SamplingParams(max_tokens=8))
    assert [o.completions[0].token_ids for o in drafted] == expected
    computed = []  # a later request with the same 16-token first block takes it from the prefix cache
    run = llm.runner.run
    llm.runner.run = lambda batch, *a: (computed.append(batch.num_tokens), run(batch, *a))[1]
    again = llm.generate([[*prompts[1], 9]], SamplingParams(max_tokens=8))
    assert again[0].completions[0].token_ids == hf_greedy(model, [[*prompts[1], 9]], 8)[0]
    assert computed[0] == len(prompts[1]) + 1 - 16


def test_dummy_shape():
    """``dummy:deepseek-v3-tiny``: 6.92B parameters, 1.59B active per token (8 of 64 experts in 11 MoE layers),
    576 latent values per token and layer in the cache; built on the meta device."""
    from quantkit.runtime.bench import DUMMY_MODELS
    from quantkit.runtime.loader import float_linear
    from quantkit.runtime.model import CausalLM
    from quantkit.runtime.model_runner import kv_block_bytes

    cfg = T.AutoConfig.for_model(**DUMMY_MODELS["deepseek-v3-tiny"])
    with torch.device("meta"):
        model = CausalLM(cfg, float_linear(torch.bfloat16), torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for p in model.model.layers[1].mlp.experts[0].parameters())
    assert abs(params - 6.92e9) < 0.01e9 and abs(params - 11 * 56 * expert - 1.59e9) < 0.01e9
    assert kv_block_bytes(model, 16) == 12 * 16 * 576 * 2


# -- MTP drafting -----------------------------------------------------------------------------------------------------


def mtp_folder(path, model, oracle: bool = False):
    """``model`` saved as transformers saves it, plus an MTP layer at model.layers.3 in a second file (random; or
    an oracle for a target whose layers add nothing: see ``test_mtp_oracle_is_accepted``)."""
    model.save_pretrained(path)
    gen = torch.Generator().manual_seed(1)
    layer = random_mtp(model.config, float_linear(torch.float32), torch.float32, torch.device("cpu"), gen)[0]
    tensors = {k: v.clone() for k, v in layer.state_dict().items()}
    tensors["embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    if oracle:  # h' = enorm(e(x_{t+1})); the block adds nothing; shared head = the target's norm and lm_head
        hidden = model.config.hidden_size
        tensors["eh_proj.weight"] = torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), dim=1)
        for name in tensors:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                tensors[name].zero_()
        tensors["shared_head.norm.weight"] = model.model.norm.weight.detach().clone()
        tensors["shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    save_file({f"model.layers.3.{k}": v.contiguous() for k, v in tensors.items()}, str(path / "mtp.safetensors"))
    return str(path)


def spec_llm(folder, k=3, **settings):
    spec = dict(method="mtp", num_speculative_tokens=k, adaptive=False)
    return LLM(folder, device="cpu", speculative=spec, **settings)


@pytest.mark.parametrize("setting", ["roomy", "preempting"])
def test_mtp_drafting_keeps_plain_greedy_tokens(tmp_path, setting):
    """A random MTP layer drafts 3 tokens a step (most rejected); the verified output equals plain greedy decoding,
    and the acceptance figures are reported per completion."""
    folder = mtp_folder(tmp_path, build())
    prompts = random_prompts(LENGTHS, VOCAB, seed=1)
    plain = LLM(folder, device="cpu", num_kv_blocks=64).generate(prompts, SamplingParams(max_tokens=NEW))
    llm = spec_llm(folder, **SETTINGS[setting])
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW))
    assert [o.completions[0].token_ids for o in outputs] == [o.completions[0].token_ids for o in plain]
    stats = [o.completions[0].spec for o in outputs]
    assert all(s.steps > 0 and 0.0 <= s.acceptance_rate <= 1.0 for s in stats)
    assert llm.spec.totals.drafted > 0
    if setting == "preempting":
        assert llm.scheduler.num_preemptions > 0


def test_mtp_oracle_is_accepted(tmp_path):
    """A target whose layers add nothing predicts from its last token alone; an MTP layer that reads out the next
    token's embedding through the same norm and head predicts what the target will: its drafts are accepted (the
    chain: each drafted token's output feeds the next), and the tokens still equal plain greedy's."""
    model = build()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            mlp = layer.mlp
            for m in (mlp, getattr(mlp, "shared_experts", None)):
                if m is not None and hasattr(m, "down_proj") and isinstance(m.down_proj, torch.nn.Linear):
                    m.down_proj.weight.zero_()
            if hasattr(mlp, "experts"):
                mlp.experts.down_proj.zero_()
    folder = mtp_folder(tmp_path, model, oracle=True)
    prompts = random_prompts([4, 9], VOCAB, seed=7)
    plain = LLM(folder, device="cpu", num_kv_blocks=64).generate(prompts, SamplingParams(max_tokens=NEW))
    llm = spec_llm(folder, k=4, num_kv_blocks=64)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW))
    assert [o.completions[0].token_ids for o in outputs] == [o.completions[0].token_ids for o in plain]
    assert llm.spec.totals.accepted >= 0.9 * llm.spec.totals.drafted > 0


def test_quantized_mtp_layer_drafts(tmp_path):
    """A quantkit checkpoint made from a folder with an MTP layer and recipe ``mtp: quantize``: the MTP layer loads
    as QuantLinear modules and drafts; the tokens equal the checkpoint's plain greedy ones."""
    folder = mtp_folder(tmp_path / "float", build())
    model = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    recipe = Recipe.from_dict({"scheme": {"bits": 4, "group_size": 16, "sym": False}, "stages": [{"method": "rtn"}],
                               "mtp": "quantize"})  # fmt: skip
    quantkit.quantize(model, recipe)
    q = str(quantkit.save_quantized(model, tmp_path / "q"))
    prompts = random_prompts([7, 30, 2], VOCAB, seed=5)
    plain = LLM(q, device="cpu", num_kv_blocks=32).generate(prompts, SamplingParams(max_tokens=10))
    llm = spec_llm(q, k=2, num_kv_blocks=32)
    layer = llm.model.mtp_layers[0]
    assert {type(layer.eh_proj).__name__, type(layer.mlp.experts[0].down_proj).__name__} == {"QuantLinear"}
    outputs = llm.generate(prompts, SamplingParams(max_tokens=10))
    assert [o.completions[0].token_ids for o in outputs] == [o.completions[0].token_ids for o in plain]
    assert llm.spec.totals.drafted > 0


def test_fp8_block_checkpoint_and_its_mtp_layer(tmp_path):
    """DeepSeek-V3's own format, block-wise fp8 W8A8 (the MTP layer quantized too): the runtime's tokens equal
    transformers' on the same checkpoint, with and without MTP drafting."""
    model = T.AutoModelForCausalLM.from_pretrained(mtp_folder(tmp_path / "float", build()), dtype=torch.float32)
    scheme = {"bits": 8, "group_size": -1, "fmt": "fp8", "act_bits": 8, "block_size": 16}
    quantkit.quantize(model, Recipe.from_dict({"scheme": scheme, "stages": [{"method": "rtn"}], "mtp": "quantize"}))
    q = quantkit.save_quantized(model, tmp_path / "q")
    prompts = random_prompts([7, 30, 2], VOCAB, seed=5)
    expected = hf_greedy(quantkit.load_quantized(q), prompts, 10)
    for spec in (None, dict(method="mtp", num_speculative_tokens=2, adaptive=False)):
        llm = LLM(str(q), device="cpu", num_kv_blocks=32, speculative=spec)
        assert type(llm.model.model.layers[1].self_attn.kv_b_proj).__name__ == "W8A8Linear"
        outputs = llm.generate(prompts, SamplingParams(max_tokens=10))
        assert [o.completions[0].token_ids for o in outputs] == expected
    assert type(llm.model.mtp_layers[0].eh_proj).__name__ == "W8A8Linear"


def test_mtp_needs_mtp_layers(tmp_path, monkeypatch):
    """A checkpoint without MTP layers (refused before its weights are read) and an HF model object (transformers
    drops them) are refused in one line."""
    model = build()
    model.save_pretrained(tmp_path)
    with monkeypatch.context() as m:
        m.setattr("quantkit.checkpoint.read.read_tensors", lambda *a: pytest.fail("weights were read"))
        with pytest.raises(QuantkitError, match="needs a checkpoint with multi-token-prediction layers") as e:
            LLM(str(tmp_path), device="cpu", num_kv_blocks=8, speculative=dict(method="mtp"))
        assert "\n" not in str(e.value)
    with pytest.raises(QuantkitError, match="needs a checkpoint with multi-token-prediction layers") as e:
        LLM(model, device="cpu", num_kv_blocks=8, speculative=dict(method="mtp"))
    assert "\n" not in str(e.value)
    with pytest.raises(QuantkitError, match="'mtp' takes no draft model"):
        LLM(str(tmp_path), device="cpu", speculative=dict(method="mtp", draft=str(tmp_path)))
    from quantkit.runtime.speculative.heads import make_heads

    with pytest.raises(QuantkitError, match="EAGLE heads need q/k/v attention; DeepSeek-V3"):
        make_heads("eagle", model.config, 1)


def test_cli_speculative_mtp(tmp_path):
    """``generate --speculative mtp`` gives the plain tokens on a folder with an MTP layer."""
    folder = mtp_folder(tmp_path, build())
    base = ["generate", "--model", folder, "--device", "cpu", "--json", "--token-ids", "--max-tokens", "10"]
    prompts = ["5 6 7 8 9", "11 12"]

    def tokens(*extra):
        result = CliRunner().invoke(cli, [*base, *extra, *prompts])
        assert result.exit_code == 0, result.output
        return [json.loads(line)["completions"][0]["token_ids"] for line in result.output.strip().splitlines()]

    assert tokens("--speculative", "mtp", "--num-spec-tokens", "2") == tokens()


def test_dummy_model_drafts_with_a_random_mtp_layer():
    """A ``dummy:`` DeepSeek-V3 config (num_nextn_predict_layers 1) gets one random MTP layer for --speculative mtp
    (to measure drafting's cost), and its tokens stay the plain ones."""
    shape = {"model_type": "deepseek_v3", **{k: v for k, v in config().to_dict().items() if k in config_keys()}}
    prompts = random_prompts([6, 11], VOCAB, seed=3)
    plain = LLM(shape, device="cpu", num_kv_blocks=16).generate(prompts, SamplingParams(max_tokens=8))
    llm = LLM(shape, device="cpu", num_kv_blocks=16, speculative=dict(method="mtp", num_speculative_tokens=2))
    assert len(llm.model.mtp_layers) == 1 and llm.spec.proposer.cost_per_token < 0.5
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8))
    assert [o.completions[0].token_ids for o in outputs] == [o.completions[0].token_ids for o in plain]


def config_keys() -> set[str]:
    return set(COMMON) | {"num_key_value_heads", "num_hidden_layers", "moe_intermediate_size", "n_routed_experts",
                          "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group", "first_k_dense_replace",
                          "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                          "num_nextn_predict_layers"}  # fmt: skip
