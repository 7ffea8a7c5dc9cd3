"""What makes long quantize runs trustworthy: quality gates, resuming after a crash (byte for byte), the preflight
plan, determinism, and faults injected while writing (one line each, nothing half-written)."""

import json

import pytest
import torch
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


# -- resume -------------------------------------------------------------------------------------------------------

CALIB = torch.randint(3, 320, (8, 32), generator=torch.Generator().manual_seed(1))
W4 = {"bits": 4, "group_size": 32, "sym": False}
METHODS = {
    "rtn": [{"method": "rtn"}],
    "gptq": [{"method": "gptq"}],
    "awq": [{"method": "awq", "params": {"grid": 4, "refine_steps": 5}}, {"method": "rtn"}],
}


class Crash(Exception):
    pass


def crash_after(k):
    def progress(done, total, note):
        if done == k:  # called once layer k-1's state is saved
            raise Crash

    return progress


def recipe_of(method, **scheme):
    return {"scheme": {**W4, **scheme}, "stages": METHODS[method], "calibration": {"batch_size": 4}}


def same_bytes(a, b, names=("model.safetensors", "config.json", "recipe.yaml")):
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


@pytest.mark.parametrize("arch, method", [("llama", "rtn"), ("llama", "gptq"), ("llama", "awq"), ("mixtral", "gptq")])
def test_resume_after_a_crash_writes_the_same_bytes(tmp_path, tokenizer, arch, method):
    model = tiny_model(arch)
    quantkit.quantize(model, recipe_of(method), CALIB)
    whole = quantkit.save_quantized(model, tmp_path / "whole", tokenizer=tokenizer)
    state = tmp_path / "state"
    with pytest.raises(Crash):
        quantkit.quantize(tiny_model(arch), recipe_of(method), CALIB, state_dir=state, progress=crash_after(1))
    assert json.loads((state / "state.json").read_text())["done"] == 1
    model = tiny_model(arch)
    result = quantkit.quantize(model, recipe_of(method), CALIB, state_dir=state, resume=True)
    assert result.state.resumed == 1 and set(result.layers) == set(model.quantkit.layers)
    resumed = quantkit.save_quantized(model, tmp_path / "resumed", tokenizer=tokenizer)
    assert same_bytes(whole, resumed)
    assert not state.exists()  # the checkpoint is written: nothing left to resume


def test_resume_refuses_a_changed_recipe_or_calibration(tmp_path):
    state = tmp_path / "state"
    with pytest.raises(Crash):
        quantkit.quantize(tiny_model("llama"), recipe_of("gptq"), CALIB, state_dir=state, progress=crash_after(1))
    with pytest.raises(QuantkitError, match=r"cannot resume from .*: the recipe differs from the interrupted run's"):
        quantkit.quantize(tiny_model("llama"), recipe_of("gptq", bits=8), CALIB, state_dir=state, resume=True)
    with pytest.raises(QuantkitError, match=r"the calibration data differs"):
        quantkit.quantize(tiny_model("llama"), recipe_of("gptq"), CALIB.flip(0), state_dir=state, resume=True)
    with pytest.raises(QuantkitError, match=r"the model differs"):
        quantkit.quantize(tiny_model("llama", seed=1), recipe_of("gptq"), CALIB, state_dir=state, resume=True)
    assert json.loads((state / "state.json").read_text())["done"] == 1  # a refusal leaves the state as it was
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(QuantkitError, match="not a resume state folder"):
        quantkit.quantize(tiny_model("llama"), recipe_of("rtn"), state_dir=tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


KILL_AFTER_FIRST_LAYER = """
import os, signal, sys
import quantkit.calib.runner as runner
def killed():  # the runner calls this right after a layer's state is saved
    os.kill(os.getpid(), signal.SIGKILL)
runner.release_host_memory = killed
from quantkit.cli.main import main
sys.argv = ["quantkit", *sys.argv[1:]]
main()
"""


def test_cli_resume_after_sigkill(tmp_path, tiny_dir):
    import subprocess
    import sys

    args = ["quantize", "--model", str(tiny_dir), "--method", "gptq", "--bits", "4", "--group-size", "32",
            "--nsamples", "8", "--seqlen", "32"]  # fmt: skip
    assert run(*args, "--out", tmp_path / "whole", "--no-resume-state").exit_code == 0
    assert not (tmp_path / ".whole.resume").exists()
    out = tmp_path / "q"
    killed = subprocess.run([sys.executable, "-c", KILL_AFTER_FIRST_LAYER, *args, "--out", str(out)],
                            capture_output=True, text=True)  # fmt: skip
    assert killed.returncode == -9, killed.stderr
    assert not out.exists() and json.loads((tmp_path / ".q.resume" / "state.json").read_text())["done"] == 1
    r = run(*args, "--out", out, "--resume")
    assert r.exit_code == 0, r.output
    assert "resumed: 1 of 2 layers restored" in r.stdout
    assert same_bytes(tmp_path / "whole", out) and not (tmp_path / ".q.resume").exists()
    bad = run(*args, "--out", tmp_path / "other", "--resume", "--no-resume-state")
    assert bad.exit_code == 2 and "--no-resume-state turns off" in bad.stderr


# -- preflight plan -----------------------------------------------------------------------------------------------

OVERRIDDEN = {"scheme": W4, "stages": [{"method": "gptq", "overrides": [{"match": "re:.*1\\.mlp\\.down_proj",
                                                                          "scheme": {"bits": 8}}]}],
              "calibration": {"nsamples": 8, "seqlen": 32}}  # fmt: skip


def test_dry_run_prints_the_plan_without_reading_weights(tmp_path, tiny_dir):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_dir, folder)
    (folder / "model.safetensors").write_bytes(b"not read")  # a dry run never opens the weights
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(OVERRIDDEN))
    r = run("quantize", "--model", folder, "--recipe", recipe, "--out", tmp_path / "q", "--dry-run")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].endswith("(llama), 2 decoder layers, processed on cpu")
    assert "  self_attn.q_proj [64 x 64]: gptq w4a16-g32-asym (layers 0-1)" in lines
    assert "  mlp.down_proj [64 x 96]: gptq w4a16-g32-asym (layers 0)" in lines
    assert "  mlp.down_proj [64 x 96]: gptq w8a16-g32-asym (layers 1)" in lines
    assert lines[-3].startswith("memory: host ~") and lines[-2].startswith("disk: output ~")
    assert lines[-1].startswith("time: ~")
    assert not list(tmp_path.glob("*q*"))  # no output, no resume state


def test_the_plan_estimates_the_checkpoint_size(tmp_path, tiny_dir, tokenizer):
    from quantkit.checkpoint.inspect import inspect_checkpoint
    from quantkit.plan import make_plan

    recipe = quantkit.Recipe.from_dict(OVERRIDDEN)
    plan = make_plan(tiny_dir, recipe, "cpu", torch.float32, offload=True, resume_state=True)
    model = tiny_model("llama")
    quantkit.quantize(model, recipe, CALIB)
    out = quantkit.save_quantized(model, tmp_path / "q", tokenizer=tokenizer)
    stored = inspect_checkpoint(out)["totals"]["file_bytes"]  # the tensors' bytes
    assert plan.output_bytes == stored
    hidden = 8 * 32 * 64 * 4  # nsamples x seqlen x hidden size, fp32
    assert 2 * hidden < plan.scratch_bytes < 2 * hidden + plan.output_bytes  # hidden states and quantized layers


@pytest.mark.parametrize(
    "patch, fragment",
    [("disk", "GiB of disk in"), ("host", "GiB of host memory, 0.0 available")],
)
def test_a_run_that_does_not_fit_stops_before_loading(tmp_path, tiny_dir, monkeypatch, patch, fragment):
    import collections

    from quantkit import plan

    if patch == "disk":
        usage = collections.namedtuple("usage", "total used free")
        monkeypatch.setattr(plan.shutil, "disk_usage", lambda p: usage(1, 1, 0))
    else:
        monkeypatch.setattr(plan, "_free_host_bytes", lambda: 0)
    r = run("quantize", "--model", tiny_dir, "--out", tmp_path / "q")
    assert r.exit_code == 2 and r.stderr.strip().startswith("quantkit: error: needs ~")
    assert fragment in r.stderr and "quantizing" not in r.stderr
    assert not list(tmp_path.iterdir())
