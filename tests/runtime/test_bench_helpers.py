"""quantkit.runtime.bench: the warm-up that keeps kernel compiles out of timed runs, and the throughput measure."""

import sys
import types

import torch
from quantkit.kernels._device import interpreting
from triton.runtime.jit import JITFunction

from quantkit.runtime import LLM, SamplingParams
from quantkit.runtime.bench import (
    DUMMY_MODELS,
    WARM_UP_BATCH,
    WARM_UP_LENGTHS,
    compiled_kernels,
    hf_from_runtime,
    long_chunk_prompts,
    offline_throughput,
    warm_up,
)
from quantkit.runtime.loader import LoadedModel, dummy
from quantkit.runtime.model import fuse_projections
from tests.runtime.helpers import random_prompts
from tests.tiny_models import COMMON, tiny_model


def test_warm_up_covers_each_length_then_a_batch_capped_by_the_model_length_and_the_cache():
    model = tiny_model("llama")
    for blocks, model_len, longest in [(128, 128, 126), (6, 2048, 94)]:  # 6 blocks of 16 hold 96 tokens
        llm = LLM(model, device="cpu", num_kv_blocks=blocks, max_model_len=model_len, max_num_batched_tokens=1000)
        calls = []

        def generate(prompts, params, run=llm.generate, seen=calls):
            seen.append([len(p) for p in prompts])
            return run(prompts, params)

        llm.generate = generate
        warm_up(llm, full=True)
        singles = [[n] for n in sorted({min(n, longest) for n in WARM_UP_LENGTHS})]
        assert calls == [*singles, [min(longest, 63)] * WARM_UP_BATCH]  # 1000 tokens over 16 prompts, odd: 63
    assert all(n % 16 for n in WARM_UP_LENGTHS) and max(WARM_UP_LENGTHS) > 256  # ragged and large-M steps


def test_warm_up_batch_runs_several_sequences_and_mixed_steps():
    """The batch is larger than one step's token budget: some steps run many sequences, some mix a chunk of
    prefill with decodes (num_new 1), as the timed workload's steps do."""
    llm = LLM(tiny_model("llama"), device="cpu", num_kv_blocks=256, max_num_batched_tokens=256)
    steps = []
    run = llm.runner.run
    llm.runner.run = lambda batch, *a: steps.append(list(batch.num_new)) or run(batch, *a)
    warm_up(llm, full=True)
    assert max(len(s) for s in steps) >= 8
    assert any(1 in s and max(s) > 1 for s in steps)  # decodes and a prefill chunk in one step


def test_warm_up_off_cuda_is_one_short_prompt():
    llm = LLM(tiny_model("llama"), device="cpu", num_kv_blocks=64)
    calls = []
    run = llm.generate
    llm.generate = lambda prompts, params: calls.append([len(p) for p in prompts]) or run(prompts, params)
    warm_up(llm)
    assert calls == [[WARM_UP_LENGTHS[1]]]


def test_offline_throughput_counts_every_generated_token():
    model = tiny_model("llama")
    llm = LLM(model, device="cpu", num_kv_blocks=128)
    prompts = random_prompts([5, 12, 9], COMMON["vocab_size"], seed=3)
    result, tokens = offline_throughput(llm, prompts, output_len=4)
    assert result.requests == 3 and result.prompt_tokens == 26 and result.output_tokens == 12
    assert [len(t) for t in tokens] == [4, 4, 4] and result.seconds > 0
    expected = [
        o.completions[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    ]
    assert tokens == expected
    assert result.compiles == 0 and result.compiled == []  # the interpreter compiles nothing


def _kernel(x):
    pass


def test_compiled_kernels_names_every_specialization_of_quantkit_kernels(monkeypatch):
    """What the throughput measure uses to flag (and name) a compile inside a timed run: compiled entries of the
    JIT functions in quantkit.kernels modules, over devices; other packages' kernels do not count."""
    before = compiled_kernels()
    mine, other = JITFunction(_kernel), JITFunction(_kernel)
    mine.device_caches = {0: ({"a": 1, "b": 2}, {}), 1: ({"c": 3}, {})}  # (kernel cache, key cache, ...) per device
    other.device_caches = {0: ({"d": 4}, {})}
    monkeypatch.setitem(sys.modules, "quantkit.kernels._count_probe", types.SimpleNamespace(k=mine))
    monkeypatch.setitem(sys.modules, "elsewhere._count_probe", types.SimpleNamespace(k=other))
    assert compiled_kernels() - before == {"_kernel: a", "_kernel: b", "_kernel: c"}


def test_hf_from_runtime_holds_the_runtime_tensors_and_computes_the_same_logits():
    """transformers' model of a ``dummy`` shape from the runtime's weights: per-expert weights stacked (CPU), or,
    after q/k/v fusion and expert stacking (the CUDA layout), the very tensors; the logits equal either way, and
    equal the runtime's own greedy tokens."""
    config = DUMMY_MODELS["tiny-qwen3-moe"]
    model = dummy(config, "float32", torch.device("cpu"), seed=3).model
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    hf = hf_from_runtime(model, config)
    logits = hf(ids).logits
    llm = LLM(LoadedModel(model, None, ()), device="cpu", num_kv_blocks=8)
    ours = llm.generate([ids[0].tolist()], SamplingParams(max_tokens=6, ignore_eos=True))[0].outputs[0].token_ids
    ref = hf.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)[0, 6:].tolist()
    assert ours == ref
    if interpreting():  # the fused kernels' layout (stack_experts needs CUDA or Triton's interpreter)
        assert all(layer.mlp.stack_experts() for layer in model.model.layers)
    fuse_projections(model)
    hf = hf_from_runtime(model, config)
    attn = model.model.layers[0].self_attn
    assert hf.model.layers[0].self_attn.k_proj.weight.data_ptr() == attn.qkv_proj.weight[64].data_ptr()
    if interpreting():
        assert (
            hf.model.layers[1].mlp.experts.down_proj.data_ptr() == model.model.layers[1].mlp.fused[1].weight.data_ptr()
        )
    assert torch.equal(hf(ids).logits, logits)


def test_warm_up_makes_a_long_chunk_after_cached_context():
    """Where the model length and the cache allow it, the warm-up ends with prompts whose prefill runs a chunk of
    more than the small prefill tiles' limit after cached context (what a preempted sequence's recompute runs), so
    that kernel variant is compiled before a timed run too."""
    from quantkit.kernels.attention.prefill import PREFILL_CONFIGS

    llm = LLM(tiny_model("llama"), device="cpu", num_kv_blocks=256, max_model_len=2048, max_num_batched_tokens=1536)
    chunks = []
    run = llm.runner.run
    llm.runner.run = lambda batch, *a: (
        chunks.extend((s.num_computed_tokens, n) for s, n in zip(batch.seqs, batch.num_new, strict=True))
        or run(batch, *a)
    )
    warm_up(llm, full=True)
    assert any(done > 0 and n > PREFILL_CONFIGS[0][0] for done, n in chunks)
    assert long_chunk_prompts(1536, 998, 2048, 4096, 256) == [515, 2046]  # 1,021 + 1,025 tokens of the long one
    assert long_chunk_prompts(16384, 998, 2048, 1 << 20, 256)[-1] == 2046
    assert long_chunk_prompts(1536, 126, 128, 2048, 256) is None  # the model length leaves no such chunk
    assert long_chunk_prompts(1536, 998, 2048, 2048, 256) is None  # nor a small cache
