"""Speculative decoding in the engine: greedy output equals non-speculative greedy with every proposer, in mixed
batches, under preemption, with n > 1 and shared prefixes; sampled output keeps the target's distribution."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from quantkit.cli.main import cli
from quantkit.errors import QuantkitError
from quantkit.runtime import LLM, SamplingParams
from quantkit.runtime.speculative.config import SpeculativeConfig
from tests.runtime.helpers import random_prompts


def tiny(model_type: str = "llama", layers: int = 4, hidden: int = 64, vocab: int = 96) -> dict:
    cfg = dict(model_type=model_type, vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               initializer_range=0.2)  # fmt: skip
    return cfg


def sharp(llm: LLM) -> LLM:
    """Sharpen attention (random init is nearly uniform) so that a wrong position or cache slot shows."""
    with torch.no_grad():
        for layer in llm.model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
    return llm


def repetitive_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase, so prompt lookup finds matches; mixed lengths."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        phrase = torch.randint(3, vocab, (3 + i % 4,), generator=gen).tolist()
        out.append((phrase * (2 + i % 3))[: 4 + 3 * i])
    return out


def greedy(llm: LLM, prompts, max_tokens: int = 20, **kw):
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, **kw))
    return [[c.token_ids for c in o.completions] for o in outs], outs


def assert_no_leaks(llm: LLM) -> None:
    bm = llm.block_manager
    assert bm.num_free == bm.num_blocks and bm.used_slots == 0
    draft = getattr(llm.spec.proposer, "bm", None)
    if draft is not None:
        llm.spec.proposer.release(set())
        assert draft.num_free == draft.num_blocks


SPECS = {
    "ngram": dict(method="ngram", prompt_lookup_max=3),
    "self-w4": dict(method="self", draft_scheme="w4a16-g32"),
    "self-w8-skip": dict(method="self", draft_scheme="w8a16-pc", draft_layers=2),
}


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equals_plain_greedy(model_type, name, k):
    cfg = tiny(model_type)
    prompts = repetitive_prompts(6, cfg["vocab_size"]) + random_prompts([5, 17, 30], cfg["vocab_size"], seed=1)
    expected, _ = greedy(sharp(LLM(cfg, cpu_kv_blocks=128, seed=3)), prompts)
    spec = SpeculativeConfig(**SPECS[name], num_speculative_tokens=k, adaptive=False)
    llm = sharp(LLM(cfg, cpu_kv_blocks=128, seed=3, speculative=spec))
    got, outs = greedy(llm, prompts)
    assert got == expected
    assert llm.spec.totals.steps > 0
    assert all(len(c.token_ids) == 20 for o in outs for c in o.completions)  # never past max_tokens
    assert_no_leaks(llm)


def test_draft_model_folder(tmp_path):
    """A smaller random model of the same vocabulary, saved as an HF folder, drafts for a larger one."""
    from transformers import AutoConfig, AutoModelForCausalLM

    small = tiny(layers=2, hidden=32)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**small))
    hf.save_pretrained(tmp_path / "draft")
    cfg = tiny()
    prompts = repetitive_prompts(5, cfg["vocab_size"])
    expected, _ = greedy(sharp(LLM(cfg, cpu_kv_blocks=128)), prompts)
    spec = SpeculativeConfig(method="draft", draft=str(tmp_path / "draft"), num_speculative_tokens=3, adaptive=False)
    llm = sharp(LLM(cfg, cpu_kv_blocks=128, speculative=spec))
    got, _ = greedy(llm, prompts)
    assert got == expected
    assert llm.spec.totals.drafted > 0
    assert_no_leaks(llm)
    with pytest.raises(QuantkitError, match="vocabulary"):
        LLM(tiny(vocab=97), cpu_kv_blocks=64, speculative=spec)


def test_preemption_parallel_sampling_and_shared_prefixes():
    """A cache too small for the batch forces preemption mid-speculation; n = 3 completions share their prompt's
    blocks (copy-on-write) and two prompts share a prefix; greedy output is unchanged and nothing leaks."""
    cfg = tiny()
    prefix = repetitive_prompts(1, cfg["vocab_size"], seed=5)[0] * 3
    prompts = [[*prefix, 7, 8], [*prefix, 9], *repetitive_prompts(4, cfg["vocab_size"], seed=6)]
    params = dict(max_tokens=24, n=3)
    expected, _ = greedy(sharp(LLM(cfg, cpu_kv_blocks=256, block_size=4)), prompts, **params)
    spec = SpeculativeConfig(method="self", draft_scheme="w4a16-g32", num_speculative_tokens=4, adaptive=False)
    llm = sharp(LLM(cfg, cpu_kv_blocks=40, block_size=4, speculative=spec, async_scheduling=False))
    got, _ = greedy(llm, prompts, **params)
    assert got == expected
    assert llm.scheduler.num_preemptions > 0
    assert_no_leaks(llm)


def test_stop_token_inside_accepted_drafts():
    """A stop token met among accepted drafts ends the completion there (later accepted tokens are dropped)."""
    cfg = tiny()
    prompts = repetitive_prompts(4, cfg["vocab_size"], seed=2)
    plain, _ = greedy(sharp(LLM(cfg, cpu_kv_blocks=128)), prompts, max_tokens=16)
    stop = plain[0][0][5]  # a token the first completion produces mid-way
    expected, _ = greedy(sharp(LLM(cfg, cpu_kv_blocks=128)), prompts, max_tokens=16, stop_token_ids=[stop])
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)
    got, outs = greedy(sharp(LLM(cfg, cpu_kv_blocks=128, speculative=spec)), prompts, max_tokens=16,
                       stop_token_ids=[stop])  # fmt: skip
    assert got == expected
    assert outs[0].completions[0].finish_reason == "stop"


def test_stream_marks_only_the_last_token_finished():
    cfg = tiny()
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)
    llm = sharp(LLM(cfg, cpu_kv_blocks=128, speculative=spec))
    events = list(llm.stream(repetitive_prompts(3, cfg["vocab_size"]), SamplingParams(max_tokens=12)))
    for request in {e.request_id for e in events}:
        mine = [e for e in events if e.request_id == request]
        assert len(mine) == 12
        assert [e.finish_reason for e in mine] == [None] * 11 + ["length"]


def test_sampled_first_tokens_keep_the_target_distribution():
    """1,200 seeded requests of one prompt at temperature 1: the histogram of the second and third generated tokens
    with a self draft matches the one without (total variation within sampling noise)."""
    cfg = tiny(vocab=16)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    n = 1200

    def histograms(llm):
        params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)]
        outs = llm.generate([prompt] * n, params)
        return [torch.bincount(torch.tensor([o.completions[0].token_ids[i] for o in outs]), minlength=16).double() / n
                for i in (1, 2)]  # fmt: skip

    plain = histograms(LLM(cfg, cpu_kv_blocks=512, max_num_seqs=512))
    spec = SpeculativeConfig(method="self", draft_scheme="w3a16-g16", num_speculative_tokens=2, adaptive=False)
    llm = LLM(cfg, cpu_kv_blocks=512, max_num_seqs=512, speculative=spec)
    drafted = histograms(llm)
    assert llm.spec.totals.accepted > 0 and llm.spec.totals.accepted < llm.spec.totals.drafted
    for a, b in zip(plain, drafted, strict=True):
        # two independent samples of 1,200: the total variation between them stays well under 0.1 when equal
        assert 0.5 * (a - b).abs().sum() < 0.1


def test_metrics_in_outputs():
    cfg = tiny()
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False)
    llm = sharp(LLM(cfg, cpu_kv_blocks=128, speculative=spec))
    _, outs = greedy(llm, repetitive_prompts(3, cfg["vocab_size"]))
    stats = [c.spec for o in outs for c in o.completions]
    assert all(s is not None and s.steps > 0 for s in stats)
    for s in stats:
        assert 0.0 <= s.acceptance_rate <= 1.0 and 1.0 <= s.mean_emitted <= 4.0
        assert s.emitted == s.accepted + s.steps
    assert sum(s.drafted for s in stats) == llm.spec.totals.drafted


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(method="lookahead"), "unknown speculative method"),
        (dict(method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(method="draft"), "needs a draft model"),
        (dict(method="ngram", draft_layers=2), "takes no draft"),
        (dict(method="self", draft_scheme="int4"), "draft scheme"),
        (dict(method="self", draft_layers=9), "exceeds the model's 4 layers"),
    ],
)
def test_bad_settings(settings, message):
    with pytest.raises(QuantkitError, match=message):
        LLM(tiny(), cpu_kv_blocks=64, speculative=settings)


def test_self_draft_needs_a_quantizable_target(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    import quantkit

    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny()))
    recipe = quantkit.Recipe.from_dict({"scheme": {"bits": 4, "group_size": 32}, "stages": [{"method": "rtn"}]})
    quantkit.quantize(hf, recipe)
    quantkit.save_quantized(hf, tmp_path / "q")
    with pytest.raises(QuantkitError, match="already a weight-only"):
        LLM(str(tmp_path / "q"), speculative=dict(method="self"), cpu_kv_blocks=64)


# ``quantkit generate`` / ``bench-serve`` with --speculative: same tokens as without, figures reported, bad
# settings one line with exit 2.


BASE = ["--model", "dummy:tiny-llama", "--device", "cpu", "--json", "--token-ids", "--max-tokens", "12"]


def run(*args):
    return CliRunner().invoke(cli, list(args))


def tokens(result):
    assert result.exit_code == 0, result.output
    return [json.loads(line)["completions"][0]["token_ids"] for line in result.output.strip().splitlines()]


def test_generate_with_each_proposer_gives_the_plain_tokens():
    prompts = ["5 6 7 5 6 7 5 6", "9 10 11 12"]
    plain = tokens(run("generate", *BASE, *prompts))
    settings = [
        ["--speculative", "ngram"],
        ["--speculative", "self", "--draft-scheme", "w8a16-pc"],
        ["--speculative", "self", "--draft-layers", "1", "--num-spec-tokens", "2", "--spec-fixed"],
    ]
    for extra in settings:
        assert tokens(run("generate", *BASE, *extra, *prompts)) == plain, extra


def test_bench_serve_reports_speculation(tmp_path):
    out = tmp_path / "r.json"
    result = run("bench-serve", "--model", "dummy:tiny-llama", "--device", "cpu", "--num-requests", "3",
                 "--min-input-len", "4", "--max-input-len", "8", "--output-len", "6", "--speculative", "self",
                 "--spec-fixed", "--out", str(out))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "tokens per verify step" in result.output
    figures = json.loads(out.read_text())["speculative"]
    assert figures["verify_steps"] > 0 and 0.0 <= figures["acceptance_rate"] <= 1.0


def test_bad_speculative_settings_are_one_line_errors():
    for extra, message in [
        (["--num-spec-tokens", "3"], "--num-spec-tokens needs --speculative"),
        (["--speculative", "ngram", "--num-spec-tokens", "0"], "num_speculative_tokens"),
        (["--speculative", "draft"], "needs a draft model"),
        (["--speculative", "draft", "--draft-model", "/nonexistent/draft"], "nonexistent"),
        (["--speculative", "self", "--draft-scheme", "int4"], "draft scheme"),
    ]:
        result = run("generate", *BASE, *extra, "5 6 7")
        assert result.exit_code == 2, (extra, result.output)
        assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output


class EagerGraph:
    """Stands in for a captured CUDA graph on the CPU: ``replay`` runs the captured callable again into the same
    output tensor, so the runner's graph path (static buffers, padded layout, sample rows) runs as on a GPU."""

    def __init__(self, fn):
        self.fn = fn
        self.out = fn()

    def replay(self):
        self.out.copy_(self.fn())


@pytest.mark.parametrize("k", [2, 4])
def test_verify_graph_layout_gives_plain_greedy(k):
    """Verify steps through the graph path's padded layout (every sequence padded to k + 1 tokens, batches padded to
    a bucket) give the tokens of plain greedy decoding, with drafts of every length up to k."""
    cfg = tiny()
    prompts = repetitive_prompts(6, cfg["vocab_size"], seed=4) + random_prompts([9, 21], cfg["vocab_size"], seed=2)
    expected, _ = greedy(sharp(LLM(cfg, cpu_kv_blocks=128)), prompts)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k, adaptive=False)
    llm = sharp(LLM(cfg, cpu_kv_blocks=128, speculative=spec))
    runner = llm.runner
    runner.alloc_verify_static(k + 1, 8)
    replays = []
    for b in (1, 2, 4, 8):
        graph = EagerGraph(runner.static_verify_forward(b, k + 1))
        graph.replay = lambda g=graph, b=b: (replays.append(b), EagerGraph.replay(g))
        runner.verify_graphs[b] = (graph, graph.out)
    got, _ = greedy(llm, prompts)
    assert got == expected
    assert len(replays) > 5 and {2, 4, 8} & set(replays)
    assert_no_leaks(llm)


def test_drafts_fit_the_step_budget_and_long_prompts_prefill_the_draft_in_chunks():
    """With a budget of 12 tokens a step and four decoding sequences, drafts take only what the sequences' own
    tokens leave, so every sequence gains a token every step; prompts longer than the budget reach the draft model
    in chunks; greedy output is unchanged."""
    cfg = tiny()
    prompts = random_prompts([30, 41, 25, 33], cfg["vocab_size"], seed=9)
    expected, _ = greedy(sharp(LLM(cfg, cpu_kv_blocks=128, max_num_batched_tokens=12)), prompts)
    spec = SpeculativeConfig(method="self", draft_scheme="w8a16-pc", num_speculative_tokens=4, adaptive=False)
    llm = sharp(LLM(cfg, cpu_kv_blocks=128, max_num_batched_tokens=12, speculative=spec))
    llm._add_all(prompts, SamplingParams(max_tokens=20))
    starved = 0
    while llm.scheduler.has_unfinished():
        decoding = [s for s in llm.scheduler.running if s.num_computed_tokens == s.num_tokens - 1]
        gained = {s.seq_id for s, _ in llm.step()}
        starved += len(decoding) == 4 and len(gained) < 4
    assert starved == 0
    assert llm.spec.totals.drafted > 0
    got, _ = greedy(llm, prompts)
    assert got == expected


def test_adaptive_speculation_runs_the_mode_that_pays_and_probes_the_other():
    """The decoder drafts at a batch size only while its measured speculative steps emit more tokens per second than
    plain ones; paused, it measures a speculative step again every PROBE_EVERY steps. Plain steps are timed by the
    engine's asynchronous path (``plain_step_done``)."""
    from quantkit.runtime.sequence import Sequence
    from quantkit.runtime.speculative.decoder import MIN_SAMPLES, PROBE_EVERY, SpeculativeDecoder
    from quantkit.runtime.speculative.proposers import NgramProposer

    dec = SpeculativeDecoder(SpeculativeConfig(method="ngram"), NgramProposer(3, 1), max_model_len=64)
    running = [Sequence(0, 0, [1, 2, 3], SamplingParams(max_tokens=8))]

    def spec_step(seconds: float, tokens: float) -> None:
        dec._mode = (1, True)
        dec._t0 = 0.0
        dec._record(1, True, seconds, tokens)

    assert not dec.wants_draft(running)  # plain steps are measured first
    for _ in range(MIN_SAMPLES):
        dec.plain_step_done(1, 0.010)
    assert dec.wants_draft(running)  # then speculative ones
    for _ in range(MIN_SAMPLES):
        spec_step(0.030, 2.0)  # 2 tokens in 30 ms against 1 in 10 ms: a loss
    choices = []
    for _ in range(2 * PROBE_EVERY + 2):
        draft = dec.wants_draft(running)
        choices.append(draft)
        spec_step(0.030, 2.0) if draft else dec.plain_step_done(1, 0.010)
    # paused; probed after PROBE_EVERY plain steps, then after twice as many, since the probe found it still losing
    assert choices.count(True) == 1 and choices.index(True) == PROBE_EVERY - 1, choices.index(True)
    assert dec.buckets[1].probe_every == 2 * PROBE_EVERY
    for _ in range(10 * PROBE_EVERY):  # the acceptance rose: probes find that speculation pays, and it stays on
        spec_step(0.012, 3.0) if dec.wants_draft(running) else dec.plain_step_done(1, 0.010)
    assert dec.wants_draft(running)
    assert not dec.wants_draft([]) and dec.totals.paused_steps > 0


def test_speculation_that_cannot_pay_stays_off_at_that_batch_size_and_above():
    """A speculative step dearer than k + 1 plain ones loses at any acceptance: never probed again there, nor at
    larger batch sizes; smaller ones are judged on their own."""
    from quantkit.runtime.sequence import Sequence
    from quantkit.runtime.speculative.decoder import MIN_SAMPLES, SpeculativeDecoder
    from quantkit.runtime.speculative.proposers import NgramProposer

    dec = SpeculativeDecoder(SpeculativeConfig(method="ngram", num_speculative_tokens=4), NgramProposer(3, 1), 64)
    seqs = [Sequence(i, i, [1, 2, 3], SamplingParams(max_tokens=8)) for i in range(4)]
    for _ in range(MIN_SAMPLES):
        dec.plain_step_done(2, 0.010)
        dec._record(2, True, 0.060, 5.0)  # 5 tokens per sequence, but 6x the time
    assert dec.buckets[2].hopeless
    for _ in range(MIN_SAMPLES):
        dec.plain_step_done(4, 0.012)
    assert not dec.wants_draft(seqs[:2]) and not dec.wants_draft(seqs)  # buckets 2 and 4
    assert dec.wants_draft(seqs[:1]) is False  # bucket 1 has no plain measurement yet: plain first
    for _ in range(MIN_SAMPLES):
        dec.plain_step_done(1, 0.008)
    assert dec.wants_draft(seqs[:1])


def test_one_speculative_step_far_past_the_limit_settles_it():
    """A first speculative step costing more than twice k + 1 plain ones turns speculation off at once (each probe
    that dear costs the run ~20 plain steps); one just past the limit is measured again first."""
    from quantkit.runtime.speculative.decoder import HOPELESS_AT_ONCE, MIN_SAMPLES, SpeculativeDecoder
    from quantkit.runtime.speculative.proposers import NgramProposer

    dec = SpeculativeDecoder(SpeculativeConfig(method="ngram", num_speculative_tokens=4), NgramProposer(3, 1), 64)
    for bucket, ratio in ((64, 1.1 * HOPELESS_AT_ONCE * 5), (32, 0.9 * HOPELESS_AT_ONCE * 5)):
        for _ in range(MIN_SAMPLES):
            dec.plain_step_done(bucket, 0.001)
        dec._record(bucket, True, ratio * 0.001, 1.5)
    assert dec.buckets[64].hopeless and not dec.buckets[32].hopeless
    dec._record(32, True, 0.9 * HOPELESS_AT_ONCE * 5 * 0.001, 1.5)  # the second sample: past k + 1 plain steps
    assert dec.buckets[32].hopeless
