"""quantkit.runtime.bench: the warm-up that keeps kernel compiles out of timed runs, and the throughput measure."""

from quantkit.runtime import LLM, SamplingParams
from quantkit.runtime.bench import WARM_UP_LENGTHS, offline_throughput, warm_up
from tests.runtime.helpers import random_prompts
from tests.tiny_models import COMMON, tiny_model


def test_warm_up_runs_one_prefill_per_length_capped_by_the_model_length():
    model = tiny_model("llama")
    llm = LLM(model, device="cpu", num_kv_blocks=128, max_model_len=128)
    calls = []
    generate = llm.generate
    llm.generate = lambda prompts, params: calls.append([len(p) for p in prompts]) or generate(prompts, params)
    warm_up(llm, random_prompts([50], COMMON["vocab_size"])[0])
    expected = sorted({min(n, 126) for n in WARM_UP_LENGTHS})
    assert calls == [[n] for n in expected]
    assert any(n % 16 for n in WARM_UP_LENGTHS) and max(WARM_UP_LENGTHS) > 256  # ragged and large-M steps


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
