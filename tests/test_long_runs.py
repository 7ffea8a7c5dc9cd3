"""What makes long quantize runs trustworthy: quality gates, resuming after a crash (byte for byte), the preflight
plan, determinism, and faults injected while writing (one line each, nothing half-written)."""

import json

import pytest
import yaml
from click.testing import CliRunner

import quantkit
from quantkit.cli.main import cli
from quantkit.errors import GateFailedError, QuantkitError
from tests.tiny_models import tiny_model, tiny_model_dir, tiny_tokenizer

W8 = {"bits": 8, "group_size": -1, "sym": True}


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer(320)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "llama")


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


# -- quality gates ------------------------------------------------------------------------------------------------


def gated(gate: dict) -> dict:
    return {"scheme": W8, "stages": [{"method": "rtn"}], "gate": {"windows": 2, "seqlen": 64, **gate}}


def test_a_passing_gate_records_its_figures(tmp_path, tokenizer):
    model = tiny_model("llama")
    result = quantkit.quantize(model, gated({"max_kl": 0.01, "min_top1": 0.9}), tokenizer=tokenizer)
    assert result.gate["passed"] and result.gate["failures"] == []
    assert 0 < result.gate["kl"] < 0.01 and result.gate["tokens"] == 126
    out = quantkit.save_quantized(model, tmp_path / "q", tokenizer=tokenizer)
    report = json.loads((out / "quant_report.json").read_text())
    assert report["gate"]["kl"] == result.gate["kl"]
    assert quantkit.load_recipe(out / "recipe.yaml").gate.max_kl == 0.01


def test_a_failing_gate_leaves_the_output_rejected_beside_its_destination(tmp_path, tokenizer):
    model = tiny_model("llama")
    quantkit.quantize(model, gated({"max_kl": 0.0, "min_top1": 1.01}), tokenizer=tokenizer)
    with pytest.raises(GateFailedError, match=r"gate failed \(KL .* > 0.0; top-1 .* < 1.01\): the checkpoint is at"):
        quantkit.save_quantized(model, tmp_path / "q", tokenizer=tokenizer)
    assert not (tmp_path / "q").exists()
    report = json.loads((tmp_path / "q.rejected" / "quant_report.json").read_text())
    assert not report["gate"]["passed"] and len(report["gate"]["failures"]) == 2


def test_cli_exits_3_on_a_failing_gate(tmp_path, tiny_dir):
    recipe = tmp_path / "gated.yaml"
    recipe.write_text(yaml.safe_dump(gated({"min_top1": 1.01})))
    out = tmp_path / "q"
    r = run("quantize", "--model", tiny_dir, "--recipe", recipe, "--out", out)
    assert r.exit_code == 3, r.output
    assert "gate: FAILED" in r.stdout
    assert r.stderr.splitlines()[-1].startswith("quantkit: error: quality gate failed (top-1 agreement")
    assert not out.exists() and (tmp_path / "q.rejected" / "config.json").is_file()


@pytest.mark.parametrize(
    "gate, fragment",
    [({}, "needs at least one of"), ({"max_kl": -1}, "max_kl must be a number"), ({"maxkl": 1}, "unknown key 'maxkl'"),
     ({"max_kl": 1, "windows": 0}, "windows must be an integer >= 1")],
)  # fmt: skip
def test_bad_gates_are_refused_when_the_recipe_is_read(gate, fragment):
    with pytest.raises(QuantkitError, match=fragment):
        quantkit.Recipe.from_dict({"scheme": W8, "stages": [{"method": "rtn"}], "gate": gate})
