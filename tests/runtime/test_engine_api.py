"""The engine's front ends and sampling: streaming, seeds, top-k / top-p, settings checks, the Triton backend."""

import dataclasses
import os

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.runtime import LLM, EngineConfig, SamplingParams, loader
from quantkit.runtime.engine import RequestOutput
from quantkit.runtime.sampler import filter_logits
from tests.runtime.helpers import hf_greedy, random_prompts, sharpen
from tests.tiny_models import COMMON, tiny_model

VOCAB = COMMON["vocab_size"]


@pytest.fixture(scope="module")
def model():
    return sharpen(tiny_model("llama"))


def test_stream_yields_the_generated_tokens_in_order(model):
    prompts = random_prompts([4, 18], VOCAB, seed=11)
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    expected = [
        o.completions[0].token_ids for o in LLM(model, device="cpu", num_kv_blocks=16).generate(prompts, params)
    ]
    got: dict[int, list[int]] = {}
    last = {}
    for ev in LLM(model, device="cpu", num_kv_blocks=16).stream(prompts, params):
        got.setdefault(ev.request_id, []).append(ev.token_id)
        last[ev.request_id] = ev.finish_reason
    assert [got[0], got[1]] == expected
    assert last == {0: "length", 1: "length"}


def test_request_output_holds_its_completions_in_outputs_as_vllm_does(model):
    """``out.outputs[i]`` (vLLM's name) are the request's ``n`` completions; ``completions`` is the same list."""
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=4, ignore_eos=True)
    (out,) = LLM(model, device="cpu", num_kv_blocks=16).generate(random_prompts([9], VOCAB, seed=13), params)
    assert isinstance(out, RequestOutput) and [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 4 and c.finish_reason == "length" for c in out.outputs)
    assert out.completions is out.outputs
    assert [f.name for f in dataclasses.fields(out)] == ["request_id", "prompt_token_ids", "outputs"]


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    prompts = random_prompts([6, 25, 3], VOCAB, seed=12)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    alone = LLM(model, device="cpu", num_kv_blocks=32).generate(prompts[1:2], params)[0].completions[0].token_ids
    batched = LLM(model, device="cpu", num_kv_blocks=32, max_num_batched_tokens=8).generate(prompts, params)
    assert batched[1].completions[0].token_ids == alone
    n3 = LLM(model, device="cpu", num_kv_blocks=32).generate(prompts[1:2], dataclasses.replace(params, n=3))[0]
    assert n3.completions[0].token_ids == alone  # completion 0 uses the seed itself
    assert len({tuple(c.token_ids) for c in n3.completions}) == 3  # the others use seed + i


def test_filter_logits_keeps_top_k_and_the_nucleus():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])
    kept = lambda p: torch.isfinite(filter_logits(logits, p)).nonzero().flatten().tolist()
    assert kept(SamplingParams(temperature=1.0, top_k=2)) == [1, 3]
    probs = logits.softmax(-1)  # sorted: 0.64, 0.24, 0.09, ...: 0.64 < 0.7 so the nucleus needs two tokens
    assert probs[1] < 0.7 < probs[1] + probs[3]
    assert kept(SamplingParams(temperature=1.0, top_p=0.7)) == [1, 3]
    assert kept(SamplingParams(temperature=1.0, top_p=0.5)) == [1]
    assert kept(SamplingParams(temperature=1.0, top_p=1e-300)) == [1]  # 0 in fp32: the top token still stays


def test_a_temperature_too_small_to_divide_by_decodes_greedily(model):
    llm = LLM(model, device="cpu")
    prompt = [[5, 6, 7]]
    greedy = llm.generate(prompt, SamplingParams(max_tokens=4))[0].completions[0].token_ids
    for t in (1e-45, 1e-6):
        assert (
            llm.generate(prompt, SamplingParams(max_tokens=4, temperature=t, seed=0))[0].completions[0].token_ids
            == greedy
        )


def test_sampling_follows_the_distribution(model):
    """With top_k = 2 only the two most likely tokens appear, at their renormalised probabilities (4 sigma)."""
    llm = LLM(model, device="cpu", num_kv_blocks=64, max_num_seqs=256)
    prompt = random_prompts([5], VOCAB, seed=13)[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    top = logits.topk(2)
    q = float(top.values.softmax(-1)[0])
    n = 256
    out = llm.generate([prompt], SamplingParams(n=n, temperature=1.0, top_k=2, seed=3, max_tokens=1))[0]
    firsts = [c.token_ids[0] for c in out.completions]
    assert set(firsts) <= set(top.indices.tolist())
    assert abs(firsts.count(int(top.indices[0])) - n * q) <= 4 * (n * q * (1 - q)) ** 0.5 + 1


def test_async_scheduling_gives_the_same_outputs(model):
    """Launching each step before the previous one's tokens are read changes no output: greedy and seeded
    sampling, n > 1, stop tokens, EOS, chunked prefill and preemption (a cache of 12 blocks for 7 requests)."""
    prompts = random_prompts([5, 23, 1, 40, 16, 9, 70], VOCAB, seed=21)
    params = [
        SamplingParams(max_tokens=12),
        SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, top_p=0.9, seed=5),
        SamplingParams(max_tokens=6, n=3, temperature=1.0, top_k=5, seed=1),
        SamplingParams(max_tokens=16, ignore_eos=True),
        SamplingParams(max_tokens=16, stop_token_ids=(7, 11, 19)),
        SamplingParams(max_tokens=3, n=2),
        SamplingParams(max_tokens=25, ignore_eos=True, temperature=1.0, seed=9),
    ]
    runs = {}
    for on in (False, True):
        llm = LLM(model, device="cpu", num_kv_blocks=12, max_num_batched_tokens=32, async_scheduling=on)
        ahead, run = [], llm.runner.run
        llm.runner.run = lambda batch, ids_from=None, ahead=ahead, run=run: (
            ahead.append(ids_from is not None) or run(batch, ids_from)
        )
        out = llm.generate(prompts, params)
        assert sum(ahead) > len(ahead) // 2 if on else not any(ahead)  # steps launched before the last was read
        runs[on] = ([[(c.token_ids, c.finish_reason) for c in o.completions] for o in out], llm.stats.output_tokens)
        assert llm.scheduler.num_preemptions > 0 and llm._pending is None
        assert llm.block_manager.num_free == llm.block_manager.num_blocks
    assert runs[True] == runs[False]


def test_bad_settings_are_user_errors(model):
    with pytest.raises(QuantkitError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(QuantkitError, match="unknown engine setting 'blocks'"):
        EngineConfig.from_dict({"blocks": 3})
    with pytest.raises(QuantkitError, match="top_p"):
        SamplingParams(top_p=0.0)
    llm = LLM(model, device="cpu", num_kv_blocks=2)
    with pytest.raises(QuantkitError, match="cannot fit the KV cache"):
        llm.generate([[5] * 30], SamplingParams(max_tokens=10))
    with pytest.raises(QuantkitError, match="no tokenizer"):
        llm.generate(["hello"])


@pytest.mark.parametrize(
    "settings, fragment",
    [
        ({"block_size": "16"}, "block_size must be an integer, got '16'"),
        ({"block_size": 2.5}, "block_size must be an integer"),
        ({"block_size": 10**6}, "block_size must be in [1, 1024]"),
        ({"max_num_seqs": 1.5}, "max_num_seqs must be an integer"),
        ({"max_num_seqs": None}, "max_num_seqs must be an integer"),
        ({"num_kv_blocks": 2.5}, "num_kv_blocks must be an integer or None"),
        ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization must be a number"),
        ({"seed": "abc"}, "seed must be an integer"),
        ({"enable_prefix_caching": "false"}, "enable_prefix_caching must be True or False"),
        ({"async_scheduling": "no"}, "async_scheduling must be True or False"),
        ({"bogus_option": 1}, "unknown engine setting 'bogus_option'"),
        ({"max_model_len": 10**6}, "max_model_len 1000000 is longer than the model's"),
    ],
)
def test_engine_settings_of_the_wrong_type_or_size(model, settings, fragment):
    with pytest.raises(QuantkitError) as exc:
        LLM(model, device="cpu", **settings)
    assert fragment in str(exc.value)


@pytest.mark.parametrize(
    "params, fragment",
    [
        ({"temperature": "0.7"}, "temperature must be a finite number >= 0"),
        ({"top_p": None}, "top_p must be a number"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids"),
        ({"stop_token_ids": "12"}, "stop_token_ids must be a list of token ids"),  # was read as (1, 2)
        ({"stop_token_ids": [1.7]}, "a stop token id must be an integer"),  # was cut to 1
        ({"stop_token_ids": [-5]}, "a stop token id must be >= 0"),
        ({"seed": "abc"}, "seed must be an integer or None"),
        ({"seed": 1.5}, "seed must be an integer or None"),
        ({"seed": 10**30}, "seed must be in [0, "),
        ({"ignore_eos": "False"}, "ignore_eos must be True or False"),
    ],
)
def test_sampling_params_of_the_wrong_type(params, fragment):
    with pytest.raises(QuantkitError) as exc:
        SamplingParams(**params)
    assert fragment in str(exc.value)


def test_prompts_and_params_of_the_wrong_type_are_refused_and_queue_nothing(model):
    llm = LLM(model, device="cpu")
    for prompts, params, fragment in (
        (None, None, "prompts must be a string or a list of prompts, got NoneType"),
        (123, None, "prompts must be a string or a list of prompts, got int"),
        ([123], None, "a prompt is a string or a sequence of integer token ids, got int"),
        ([[5.9, 6.2]], None, "a prompt is a string or a sequence of integer token ids"),  # was run as [5, 6]
        ([torch.tensor([[5, 6]])], None, "a prompt is a string or a sequence of integer token ids"),
        ([[5, 6]], {"max_tokens": 2}, "sampling parameters must be SamplingParams (or a list of them), got dict"),
        ([[5, 6]], "greedy", "sampling parameters must be SamplingParams"),
    ):
        with pytest.raises(QuantkitError) as exc:
            llm.generate(prompts, params)
        assert fragment in str(exc.value)
        assert not llm.scheduler.has_unfinished()
    assert llm.generate([torch.tensor([5, 6])], SamplingParams(max_tokens=1))[0].prompt_token_ids == [5, 6]
    for model_arg, fragment in ((123, "model must be a folder's path"), ({"model_type": "nope"}, "cannot build")):
        with pytest.raises(QuantkitError, match=fragment):
            LLM(model_arg, device="cpu")
    with pytest.raises(QuantkitError, match="tokenizer must be a Hugging Face tokenizer, got str"):
        LLM(model, device="cpu", tokenizer="x")
    with torch.device("meta"):  # a LoadedModel whose weights are elsewhere than the engine
        elsewhere = torch.nn.Linear(2, 2)
    with pytest.raises(QuantkitError, match="weights are on meta, the engine's is cpu"):
        LLM(loader.LoadedModel(elsewhere, None, ()), device="cpu")


def test_a_rejected_batch_queues_nothing(model):
    """generate() checks every prompt before it queues any: a bad one leaves the engine as it was, and the next
    call runs only its own prompts."""
    llm = LLM(model, device="cpu")
    for bad in ([5, 6], []), ([5, 6], [10**9]), ([5, 6], [-1]):
        with pytest.raises(QuantkitError, match=r"empty prompt|outside the model.s vocabulary"):
            llm.generate(list(bad), SamplingParams(max_tokens=2))
        assert not llm.scheduler.has_unfinished()
    out = llm.generate([[7, 8]], SamplingParams(max_tokens=2))
    assert len(out) == 1 and out[0].request_id == 0 and len(out[0].completions[0].token_ids) == 2
    with pytest.raises(QuantkitError, match="temperature"):
        SamplingParams(temperature=float("nan"))


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1", reason="needs CUDA or the interpreter"
)
def test_triton_backend_matches_hf():
    """The Triton kernels inside the engine (mixed decode + chunked prefill steps) give HF's greedy tokens."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = sharpen(tiny_model("llama")).to(device)
    prompts = random_prompts([3, 21, 9], VOCAB, seed=14)
    reference = hf_greedy(model, prompts, 6)
    llm = LLM(model, num_kv_blocks=16, max_num_batched_tokens=12, attention_backend="triton", enforce_eager=True)
    assert [o.completions[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6))] == reference


class EagerGraph:
    """Stands in for a captured CUDA graph on CPU: replay re-runs the captured step into the same output tensor."""

    def __init__(self, forward, out):
        self.forward, self.out = forward, out

    def replay(self):
        self.out.copy_(self.forward())


def test_graph_replay_path_matches_eager(model):
    """The decode-replay path (static buffers, padded rows writing nowhere, one packed host copy) on CPU, with the
    graphs replaced by eager re-runs, gives the logits of plain eager steps, step by step."""
    prompts = random_prompts([3, 21, 9, 30, 2], VOCAB, seed=15)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    settings = dict(device="cpu", num_kv_blocks=32, max_num_seqs=8, max_num_batched_tokens=16)
    logits = {}
    for name in ("eager", "replayed"):
        llm = LLM(model, **settings)
        runner = llm.runner
        if name == "replayed":
            assert runner.graph_sizes() == [1, 2, 4, 8]
            runner.alloc_static(8)
            for b in runner.graph_sizes():
                forward = runner.static_forward(b)
                out = forward()
                runner.graphs[b] = (EagerGraph(forward, out), out)
        steps = logits[name] = []
        run = runner.run
        runner.run = lambda batch, *a, run=run, steps=steps: (steps.append(run(batch, *a)), steps[-1])[1]
        llm.generate(prompts, params)
    assert len(logits["eager"]) == len(logits["replayed"])
    replayed_steps = 0
    for a, b in zip(logits["eager"], logits["replayed"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        replayed_steps += a.shape[0] == len(prompts)
    assert replayed_steps > 5


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_stream_left_early_withdraws_its_requests(model, async_scheduling):
    """Breaking out of a stream aborts what it left: no request stays queued, every block is free again, and the
    next call gives exactly what a fresh engine gives."""
    llm = LLM(model, device="cpu", async_scheduling=async_scheduling)
    prompts = random_prompts([5, 17, 9, 30, 3, 12], VOCAB, seed=3)
    params = SamplingParams(max_tokens=12, ignore_eos=True, n=2, temperature=0.8, seed=1)
    for i, _ in enumerate(llm.stream(prompts, params)):
        if i == 20:  # mid-decode, with forks running and prompts still waiting or prefilling
            break
    bm = llm.block_manager
    assert not llm.scheduler.has_unfinished()
    assert bm.num_free == bm.num_blocks and not any(bm.ref_counts)
    again = [[c.token_ids for c in o.completions] for o in llm.generate(prompts[:2], params)]
    fresh = LLM(model, device="cpu", async_scheduling=async_scheduling)
    assert again == [[c.token_ids for c in o.completions] for o in fresh.generate(prompts[:2], params)]


def test_numpy_and_torch_values_are_taken_as_plain_numbers(model):
    import numpy as np

    p = SamplingParams(stop_token_ids=np.array([1, 2]), temperature=np.float32(0.5), top_p=np.float32(0.5),
                       seed=np.int64(3), max_tokens=torch.tensor(2))  # fmt: skip
    assert p.stop_token_ids == (1, 2) and type(p.temperature) is float and type(p.max_tokens) is int
    assert SamplingParams(stop_token_ids=torch.tensor([5, 6])).stop_token_ids == (5, 6)
    cfg = EngineConfig(block_size=np.int64(16), gpu_memory_utilization=np.float32(0.5), device=torch.device("cpu"))
    assert type(cfg.block_size) is int and cfg.device == "cpu" and cfg.to_dict()["device"] == "cpu"
    llm = LLM(model, device=torch.device("cpu"))
    rows = np.array([[5, 6, 7], [8, 9, 10]])
    as_lists = llm.generate(rows.tolist(), SamplingParams(max_tokens=3))
    for batch in (rows, torch.tensor(rows)):  # a 2-D batch of equal-length prompts, one per row
        out = llm.generate(batch, SamplingParams(max_tokens=3))
        assert [o.completions[0].token_ids for o in out] == [o.completions[0].token_ids for o in as_lists]
    with pytest.raises(QuantkitError, match="top_p must be in"):
        SamplingParams(top_p=10**400)


def test_abort_takes_one_id_or_several(model):
    llm = LLM(model, device="cpu")
    first = llm.add_request([5, 6, 7], SamplingParams(max_tokens=8))
    second = llm.add_request([8, 9], SamplingParams(max_tokens=8))
    llm.step()
    llm.abort(first)
    assert [s.request_id for s in llm.scheduler.running] == [second]
    llm.abort([second])
    assert not llm.scheduler.has_unfinished() and llm.block_manager.num_free == llm.block_manager.num_blocks
    with pytest.raises(QuantkitError, match="abort takes a request id or a list of them"):
        llm.abort("12")


def test_max_model_len_may_reach_what_rope_scaling_adds():
    config = {**COMMON, "model_type": "llama", "max_position_embeddings": 64,
              "rope_scaling": {"rope_type": "linear", "factor": 4.0}}  # fmt: skip
    llm = LLM(config, device="cpu", max_model_len=256, num_kv_blocks=64)
    assert llm.max_model_len == 256
    with pytest.raises(QuantkitError, match="max_model_len 512 is longer than the model's 256 positions"):
        LLM(config, device="cpu", max_model_len=512, num_kv_blocks=64)
