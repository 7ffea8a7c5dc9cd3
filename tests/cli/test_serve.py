"""``quantkit generate`` and ``quantkit bench-serve`` on a random-weight model."""

import json

from click.testing import CliRunner

from quantkit.cli.main import cli
from quantkit.cli.serve import DUMMY_PREFIX
from quantkit.runtime import LLM, SamplingParams
from quantkit.runtime.bench import DUMMY_MODELS


def run(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_generate_prints_the_engine_tokens():
    args = ["--model", "dummy:tiny-llama", "--device", "cpu", "--json", "--token-ids", "--max-tokens", "6"]
    result = run("generate", *args, "5 6 7")
    assert result.exit_code == 0, result.output
    got = json.loads(result.output.strip().splitlines()[-1])
    expected = LLM(DUMMY_MODELS["tiny-llama"], device="cpu").generate([[5, 6, 7]], SamplingParams(max_tokens=6))
    assert got["completions"][0]["token_ids"] == expected[0].completions[0].token_ids


def test_generate_passes_fp8_fast_accumulation_to_the_engine(monkeypatch):
    import quantkit.runtime

    engines = []
    monkeypatch.setattr(quantkit.runtime, "LLM", lambda model, **settings: engines.append(LLM(model, **settings))
                        or engines[-1])  # fmt: skip
    args = ["--model", "dummy:tiny-llama", "--device", "cpu", "--token-ids", "--max-tokens", "2"]
    assert run("generate", *args, "--fp8-fast-accum", "5 6 7").exit_code == 0
    assert run("generate", *args, "5 6 7").exit_code == 0
    assert [e.config.fp8_fast_accum for e in engines] == [True, False]


def test_generate_takes_the_async_scheduling_switch(monkeypatch):
    import quantkit.runtime

    seen = []
    monkeypatch.setattr(
        quantkit.runtime,
        "LLM",
        lambda model, **settings: seen.append(settings["async_scheduling"]) or LLM(model, **settings),
    )
    args = ["--model", "dummy:tiny-llama", "--device", "cpu", "--token-ids", "--max-tokens", "2"]
    assert run("generate", *args, "5 6 7").exit_code == 0
    assert run("generate", *args, "--no-async-scheduling", "5 6 7").exit_code == 0
    assert seen == [True, False]


def test_an_unknown_dummy_model_names_the_known_ones():
    result = run("generate", "--model", f"{DUMMY_PREFIX}nope", "--device", "cpu", "--token-ids", "1 2")
    assert result.exit_code == 2
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("quantkit: error: unknown dummy model 'nope'; available: ") and "tiny-llama" in line


def test_bad_prompt_is_a_one_line_error():
    result = run("generate", "--model", "dummy:tiny-llama", "--token-ids", "5 x")
    assert result.exit_code == 2 and "space-separated integers" in result.output


def test_bad_serve_arguments_are_one_line_errors(tmp_path):
    """Bad values are one-line errors: out-of-range token ids and a NaN temperature before any step runs; an
    unknown device, lengths the random workload cannot draw and a JSON path whose folder does not exist before the
    engine is built."""
    gen = ["generate", "--model", "dummy:tiny-llama", "--device", "cpu", "--token-ids", "--max-tokens", "2"]
    for args, fragment in [
        ([*gen, "1 99999999"], "outside the model's vocabulary"),
        ([*gen, "1 -3"], "outside the model's vocabulary"),
        ([*gen, "--temperature", "nan", "1 2"], "finite number"),
        (["generate", "--model", "dummy:tiny-llama", "--device", "foo", "--token-ids", "1 2"], "unknown device"),
        (["bench-serve", "--model", "dummy:tiny-llama", "--device", "cpu", "--min-input-len", "32",
          "--max-input-len", "16"], "is above --max-input-len"),
        (["bench-serve", "--model", "dummy:tiny-llama", "--device", "cpu", "--out", str(tmp_path / "no" / "r.json")],
         "folder does not exist"),
    ]:  # fmt: skip
        result = run(*args)
        assert result.exit_code == 2, (args, result.output)
        assert fragment in result.output.strip().splitlines()[-1], (args, result.output)
    for bad in ("0", "-1"):
        result = run("bench-serve", "--model", "dummy:tiny-llama", "--num-requests", bad)
        assert result.exit_code == 2 and "--num-requests" in result.output


def test_bench_serve_writes_json(tmp_path):
    out = tmp_path / "r.json"
    args = ["--model", "dummy:tiny-llama", "--device", "cpu", "--num-requests", "6", "--min-input-len", "4"]
    args += ["--max-input-len", "20", "--output-len", "5", "--num-kv-blocks", "32", "--out", str(out)]
    result = run("bench-serve", *args)
    assert result.exit_code == 0, result.output
    row = json.loads(out.read_text())
    assert row["requests"] == 6 and row["output_tokens"] == 30 and 0 <= row["kv_waste"] < 1
    assert row["compiles"] == 0 and "compiled inside" not in result.output


def test_bench_serve_warns_when_a_compile_lands_in_the_timed_run(monkeypatch):
    counts = iter(range(0, 100, 2))  # every call finds two more compiled kernels: the warm-up's and the run's
    monkeypatch.setattr(
        "quantkit.runtime.bench.compiled_kernels", lambda: {f"_k{i % 3}: key{i}" for i in range(next(counts))}
    )
    args = ["--model", "dummy:tiny-llama", "--device", "cpu", "--num-requests", "2", "--min-input-len", "4"]
    result = run("bench-serve", *args, "--max-input-len", "8", "--output-len", "2", "--num-kv-blocks", "16")
    assert result.exit_code == 0, result.output
    assert "warning: 2 Triton kernels compiled inside the timed run (_k" in result.output
