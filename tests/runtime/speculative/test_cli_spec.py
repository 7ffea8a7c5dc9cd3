"""``quantkit generate`` / ``bench-serve`` with --speculative: same tokens as without, figures reported, bad
settings one line with exit 2."""

import json

from click.testing import CliRunner

from quantkit.cli.main import cli

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
