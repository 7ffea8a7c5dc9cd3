"""On CUDA: Triton kernels + CUDA graphs in the engine, fp32 against Hugging Face, and cache sizing from memory."""

import pytest
import torch

from quantkit.runtime import LLM, SamplingParams
from tests.runtime.helpers import assert_logits_match_hf, hf_greedy, random_prompts, record_logits, sharpen
from tests.tiny_models import COMMON, tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
VOCAB = COMMON["vocab_size"]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_triton_and_cuda_graphs_match_hf_fp32(arch):
    """fp32 end to end (the kernels keep fp32 dot products in IEEE precision), decode steps replayed from graphs,
    chunked prefill and preemption: the tokens must equal HF's on the same GPU."""
    model = sharpen(tiny_model(arch)).cuda()
    prompts = random_prompts([5, 23, 1, 40, 16, 9, 70], VOCAB, seed=1)
    reference = hf_greedy(model, prompts, 24)
    for settings in (dict(num_kv_blocks=64), dict(num_kv_blocks=10, max_num_batched_tokens=32)):
        llm = LLM(model, cuda_graph_max_bs=8, **settings)
        assert llm.runner.backend == "triton" and llm.runner.graphs
        rows = record_logits(llm)
        outputs = llm.generate(prompts, SamplingParams(max_tokens=24))
        assert [o.completions[0].token_ids for o in outputs] == reference
        assert_logits_match_hf(model, prompts, outputs, rows, atol=1e-4)


def test_graph_replay_equals_eager_bf16():
    """Graph replays give the logits of eager steps (bf16: they may differ in GEMM shape and split count, so a
    tolerance of a few bf16 ulps of the logits)."""
    model = sharpen(tiny_model("llama", dtype=torch.bfloat16)).cuda()
    prompts = random_prompts([7, 30, 12], VOCAB, seed=2)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    steps, tokens = {}, {}
    for eager in (False, True):
        llm = LLM(model, num_kv_blocks=32, enforce_eager=eager)
        assert bool(llm.runner.graphs) != eager
        rows = record_logits(llm)
        tokens[eager] = [o.completions[0].token_ids for o in llm.generate(prompts, params)]
        steps[eager] = [torch.stack(rows[r]) for r in sorted(rows)]
    for graphed, eager, a, b in zip(steps[False], steps[True], tokens[False], tokens[True], strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))  # a bf16 near-tie
        torch.testing.assert_close(graphed[: same + 1], eager[: same + 1], atol=0.05, rtol=0)  # may flip a token


def test_batch1_decode_through_the_gemv_matches_cublas_bf16():
    """One sequence decodes through kernels.gemv (one row per float linear, the lm_head excepted); the same steps with
    the gemv switched off (cuBLAS) give the same logits to a few bf16 ulps."""
    import quantkit.runtime.model as M

    model = sharpen(tiny_model("llama", dtype=torch.bfloat16)).cuda()
    prompt = random_prompts([9], VOCAB, seed=3)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    calls, steps = [], {}
    real_gemv, real_use = M.gemv, M.use_gemv
    for use in (True, False):
        M.gemv = lambda *a, **k: calls.append(1) or real_gemv(*a, **k)
        M.use_gemv = real_use if use else (lambda x, w: False)
        try:
            llm = LLM(model, num_kv_blocks=16)
            rows = record_logits(llm)
            tokens = llm.generate(prompt, params)[0].completions[0].token_ids
            steps[use] = (tokens, torch.stack([torch.stack(rows[r]) for r in sorted(rows)]))
        finally:
            M.gemv, M.use_gemv = real_gemv, real_use
    assert calls  # the decode graphs were captured through the gemv
    (a, la), (b, lb) = steps[True], steps[False]
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    torch.testing.assert_close(la[:, : same + 1], lb[:, : same + 1], atol=0.05, rtol=0)


def test_cache_sized_from_free_memory():
    config = dict(model_type="llama", vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)  # fmt: skip
    # the utilisation counts the whole device, other processes included (as in vLLM): leave 5% above what is in
    # use now, so that parallel test workers holding memory do not starve it
    free, total = torch.cuda.mem_get_info()
    llm = LLM(config, gpu_memory_utilization=min(1.0, (total - free) / total + 0.05), max_num_batched_tokens=1024,
              dtype="bfloat16")  # fmt: skip
    assert llm.runner.num_blocks * llm.runner.block_bytes <= 0.05 * total
    assert llm.runner.num_blocks >= 2048 // llm.config.block_size
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].completions[0].token_ids) == 4


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("spec", [dict(method="ngram"), dict(method="self", draft_scheme="w4a16-g32")])
def test_speculative_verify_graphs_match_hf_fp32(spec, adaptive):
    """fp32 with speculation: verify steps replay their CUDA graphs (padded to k + 1 tokens and to a batch bucket),
    the self draft replays its decode graphs and catches up on verified tokens through its own verify graphs;
    greedy tokens equal HF's, also when adaptive speculation mixes in plain steps of the asynchronous path."""
    from quantkit.runtime.speculative import SpeculativeConfig

    model = sharpen(tiny_model("llama")).cuda()
    prompts = [p * 3 for p in random_prompts([4, 7, 3, 9, 5], VOCAB, seed=3)] + random_prompts([11, 2], VOCAB, seed=4)
    reference = hf_greedy(model, prompts, 24)
    llm = LLM(model, num_kv_blocks=64, cuda_graph_max_bs=8,
              speculative=SpeculativeConfig(**spec, num_speculative_tokens=3, adaptive=adaptive))  # fmt: skip
    assert llm.runner.verify_graphs and llm.runner.verify_width == 4
    runners = [llm.runner] + ([llm.spec.proposer.runner] if spec["method"] == "self" else [])
    replays = [[] for _ in runners]

    def counted(run, log):
        return lambda batch, rows: (log.append(rows), run(batch, rows))[1]

    for r, log in zip(runners, replays, strict=True):
        r._run_verify_graph = counted(r._run_verify_graph, log)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24))
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert replays[0] and llm.spec.totals.accepted > 0
    # adaptive speculation pauses where drafting does not pay (on this tiny model, most steps: the H100 ran 7
    # speculative and 20 paused steps); after a pause the draft catches up on more tokens than a verify graph
    # holds, so it runs that step eagerly, and its verify graphs need not replay at all
    assert adaptive or all(replays)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_moe_models_on_the_fused_kernels_match_hf_fp32(arch):
    """MoE models on CUDA stack their experts at load and run the fused MoE kernels; Mixtral and Qwen3-MoE capture
    their decode steps in CUDA graphs (DeepSeek-V3 stays eager for its MLA attention): greedy tokens equal HF's."""
    model = tiny_model(arch)
    if arch == "deepseek_v3":  # MLA has no q_proj to sharpen: make the router's choice and weights differ instead
        with torch.no_grad():
            model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    else:
        sharpen(model)
    model = model.cuda()
    prompts = random_prompts([5, 23, 1, 40], VOCAB, seed=5)
    reference = hf_greedy(model, prompts, 16)
    llm = LLM(model, num_kv_blocks=64, cuda_graph_max_bs=8)
    assert llm.model.graph_safe == (arch != "deepseek_v3") and bool(llm.runner.graphs) == llm.model.graph_safe
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16))
    assert [o.outputs[0].token_ids for o in outputs] == reference
