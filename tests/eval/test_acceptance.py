"""``quantkit eval --draft``: the mean acceptance length tau of draft heads, the same figure as the runtime's
``llm.spec.totals``; heads of another model refused, bad heads folders one line and exit 2."""

import json

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantkit.calib.data import evaluation_windows
from quantkit.cli.main import cli
from quantkit.errors import QuantkitError
from quantkit.eval.acceptance import acceptance_length
from quantkit.runtime import LLM, SamplingParams
from quantkit.runtime.speculative.config import SpeculativeConfig
from quantkit.train_draft import TrainDraftConfig, train_draft
from tests.tiny_models import tiny_model_dir

TEXT = " ".join(["the cat sat on the mat and the dog sat on the log"] * 60)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("acceptance")
    folder = tiny_model_dir(root / "target")
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    (root / "eval.txt").write_text(TEXT)
    ids = torch.tensor(tokenizer(TEXT * 4, add_special_tokens=False).input_ids)
    heads = {}
    for method in ("eagle", "medusa"):
        config = TrainDraftConfig(method=method, num_heads=3, tokens=2048, seqlen=32, batch_size=4, epochs=2, lr=3e-3)
        train_draft(model, config, root / method, ids=ids)
        heads[method] = root / method
    windows, _ = evaluation_windows(tokenizer, str(root / "eval.txt"), 32, 3, bos=False)
    return root, folder, model, tokenizer, heads, windows


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_tau_is_the_runtimes_tokens_per_verify_step(setup, method):
    _, _, model, tokenizer, heads, windows = setup
    result = acceptance_length(model, tokenizer, windows, heads[method], num_speculative_tokens=3, max_tokens=10)
    assert result.method == method and result.prompts == 3 and result.prompt_tokens == 16
    # each prompt's first new token comes from its prefill, its last may come from a plain step (no draft fits)
    assert 3 * (10 - 2) <= result.emitted <= 3 * (10 - 1) and result.verify_steps > 0
    assert result.tau == pytest.approx(result.emitted / result.verify_steps) and 1.0 <= result.tau <= 4.0
    assert result.acceptance_rate == pytest.approx(result.accepted / result.drafted)
    assert result.emitted == result.accepted + result.verify_steps
    # the runtime, run by hand on the same prompts with the same fixed chain, counts the same steps
    spec = SpeculativeConfig(method=method, draft=str(heads[method]), num_speculative_tokens=3, adaptive=False)
    llm = LLM(model, tokenizer, speculative=spec, cpu_kv_blocks=64, enable_prefix_caching=False)
    llm.generate([w[:16].tolist() for w in windows], SamplingParams(max_tokens=10, ignore_eos=True))
    totals = llm.spec.totals
    assert (totals.steps, totals.emitted, totals.accepted) == (result.verify_steps, result.emitted, result.accepted)


def test_tree_drafting_reports_tau(setup):
    _, _, model, tokenizer, heads, windows = setup
    result = acceptance_length(model, tokenizer, windows, heads["eagle"], 3, 10, num_tree_tokens=6)
    assert result.num_tree_tokens == 6 and 24 <= result.emitted <= 27 and 1.0 <= result.tau <= 4.0


def test_heads_of_another_model_are_refused(setup, tmp_path):
    _, _, _, tokenizer, heads, windows = setup
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir(tmp_path / "other", seed=1)).eval()
    with pytest.raises(QuantkitError, match="were made for another model"):
        acceptance_length(other, tokenizer, windows, heads["eagle"])


def test_bad_inputs(setup, tmp_path):
    _, _, model, tokenizer, heads, windows = setup
    with pytest.raises(QuantkitError, match="draft heads folder not found"):
        acceptance_length(model, tokenizer, windows, tmp_path / "missing")
    with pytest.raises(QuantkitError, match="max_tokens"):
        acceptance_length(model, tokenizer, windows, heads["medusa"], max_tokens=1)
    with pytest.raises(QuantkitError, match="num_speculative_tokens"):
        acceptance_length(model, tokenizer, windows, heads["medusa"], num_speculative_tokens=0)


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def eval_args(root, folder, *more):
    return ["eval", "--model", folder, "--data", root / "eval.txt", "--seqlen", 32, "--windows", 3, "--device", "cpu",
            *more]  # fmt: skip


def test_cli_reports_tau_beside_perplexity(setup):
    root, folder, _, _, heads, _ = setup
    r = run(*eval_args(root, folder, "--draft", heads["eagle"], "--num-spec-tokens", 3, "--draft-new-tokens", 10,
                       "--json"))  # fmt: skip
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["perplexity"] > 1 and report["draft"]["method"] == "eagle"
    assert 24 <= report["draft"]["emitted"] <= 27 and 1.0 <= report["draft"]["tau"] <= 4.0
    r = run(*eval_args(root, folder, "--draft", heads["medusa"], "--draft-new-tokens", 6))
    assert r.exit_code == 0, r.output
    assert "tau" in r.stdout and "(medusa, chain of 4)" in r.stdout
    plain = run(*eval_args(root, folder, "--json"))
    assert plain.exit_code == 0 and "draft" not in json.loads(plain.stdout)


def assert_clean_failure(result, fragment):
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("quantkit: error:") and fragment in lines[0], result.stderr


def test_cli_bad_heads_are_one_line_errors(setup, tmp_path):
    root, folder, _, _, heads, _ = setup
    assert_clean_failure(run(*eval_args(root, folder, "--draft", tmp_path / "nope")), "draft heads folder not found")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{not json")
    assert_clean_failure(run(*eval_args(root, folder, "--draft", corrupt)), "is not a draft heads folder")
    other = tiny_model_dir(tmp_path / "other", seed=1)
    assert_clean_failure(run(*eval_args(root, other, "--draft", heads["eagle"])), "were made for another model")
    assert_clean_failure(run(*eval_args(root, folder, "--num-tree-tokens", 4)), "--num-tree-tokens needs --draft")
