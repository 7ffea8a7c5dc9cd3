"""What makes long quantize runs trustworthy: quality gates, resuming after a crash (byte for byte), the preflight
plan, determinism, and faults injected while writing (one line each, nothing half-written)."""

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

import quantkit
from quantkit.cli.main import cli
from quantkit.errors import GateFailedError, QuantkitError
from tests.tiny_models import CONFIGS, tiny_model, tiny_model_dir, tiny_tokenizer

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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_resume_on_the_gpu_writes_the_same_bytes(tmp_path, tokenizer):
    """Layers and hidden states leave the GPU on a side stream while the next layer runs."""
    model = tiny_model("llama")
    quantkit.quantize(model, recipe_of("gptq"), CALIB, device="cuda")
    whole = quantkit.save_quantized(model, tmp_path / "whole", tokenizer=tokenizer)
    state = tmp_path / "state"
    with pytest.raises(Crash):
        quantkit.quantize(tiny_model("llama").cuda(), recipe_of("gptq"), CALIB, state_dir=state,
                          progress=crash_after(1), device="cuda")  # fmt: skip
    model = tiny_model("llama")
    quantkit.quantize(model, recipe_of("gptq"), CALIB, state_dir=state, resume=True, device="cuda")
    assert same_bytes(whole, quantkit.save_quantized(model, tmp_path / "resumed", tokenizer=tokenizer))


def test_the_state_is_written_beside_the_next_layer(tmp_path, monkeypatch):
    """save returns before the files are written; the run waits for one write only, at the next save or at the
    end, and a write error reaches the run there."""
    import threading

    from quantkit import resume

    write, go, seen = resume.write_tensors, threading.Event(), []

    def slow(tensors, path, metadata=None):
        go.wait(30)
        write(tensors, path, metadata)

    def progress(done, total, note):
        seen.append((done, json.loads((tmp_path / "state" / "state.json").read_text())["done"]
                     if (tmp_path / "state" / "state.json").exists() else 0))  # fmt: skip
        go.set()

    monkeypatch.setattr(resume, "write_tensors", slow)
    result = quantkit.quantize(tiny_model("llama"), recipe_of("rtn"), state_dir=tmp_path / "state", progress=progress)
    assert seen[0] == (1, 0)  # layer 0 done, its state still being written
    assert result.state.done == result.state.saves == 2  # all written by the time quantize returns

    def broken(tensors, path, metadata=None):
        raise RuntimeError("writer failed")

    monkeypatch.setattr(resume, "write_tensors", broken)
    with pytest.raises(RuntimeError, match="writer failed"):
        quantkit.quantize(tiny_model("llama"), recipe_of("rtn"), state_dir=tmp_path / "other")


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
from quantkit.resume import RunState
def killed():  # the runner calls this right after a layer's state is saved
    os.kill(os.getpid(), signal.SIGKILL)
save = RunState.save
def save_and_wait(self, *args):  # the layer on disk before the kill (a kill mid-write loses that layer only)
    save(self, *args)
    self.flush()
RunState.save = save_and_wait
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


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_the_plan_estimates_each_architectures_checkpoint_exactly(tmp_path, arch):
    from quantkit.checkpoint.inspect import inspect_checkpoint
    from quantkit.plan import make_plan

    model = tiny_model(arch)
    model.save_pretrained(tmp_path / "float")
    recipe = quantkit.Recipe.from_dict({"scheme": W4, "stages": [{"method": "rtn"}]})
    plan = make_plan(tmp_path / "float", recipe, "cpu", torch.float32, offload=True, resume_state=False)
    quantkit.quantize(model, recipe)
    out = quantkit.save_quantized(model, tmp_path / "q")
    assert plan.output_bytes == inspect_checkpoint(out)["totals"]["file_bytes"]


def test_the_plan_of_a_mixture_of_experts(tmp_path, tokenizer):
    from quantkit.checkpoint.inspect import inspect_checkpoint
    from quantkit.plan import make_plan

    recipe = quantkit.Recipe.from_dict(recipe_of("gptq"))
    plan = make_plan(tiny_model_dir(tmp_path / "moe", "qwen2_moe"), recipe, "cpu", torch.float32, True, True)
    assert ("mlp.experts.*.gate_proj", "32 x 64", 4, "gptq w4a16-g32-asym", "0") in plan.rows
    assert ("mlp.down_proj", "64 x 96", 1, "gptq w4a16-g32-asym", "1") in plan.rows  # mlp_only_layers: [1]
    model = tiny_model("qwen2_moe")
    quantkit.quantize(model, recipe, CALIB)
    out = quantkit.save_quantized(model, tmp_path / "q", tokenizer=tokenizer)
    assert plan.output_bytes == inspect_checkpoint(out)["totals"]["file_bytes"]


@pytest.mark.parametrize(
    "patch, fragment",
    [("disk", "of disk in"), ("host", "of host memory, 0 B available")],
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


# -- determinism and faults ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_the_same_inputs_give_the_same_bytes(tmp_path, tokenizer, method):
    outs = []
    for name in ("a", "b"):
        model = tiny_model("llama")
        quantkit.quantize(model, recipe_of(method), CALIB)
        outs.append(quantkit.save_quantized(model, tmp_path / name, tokenizer=tokenizer))
    assert same_bytes(*outs)
    qc = json.loads((outs[0] / "config.json").read_text())["quantization_config"]
    assert qc["determinism"] == {"device": "cpu", "gpu": None, "cuda": None, "tf32_matmul": None, "tf32_cudnn": None,
                                 "deterministic_algorithms": False}  # fmt: skip


def full_disk(*names):
    """A stand-in for safetensors' writer that fails as it does on a full disk, for files named ``names``: half the
    file written, then its error."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    def write(tensors, path, metadata=None):
        if not any(n in Path(path).name for n in names):
            return save_file(tensors, path, metadata=metadata)
        Path(path).write_bytes(b"\0" * 100)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    return write


def snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}


GPTQ_ARGS = ["--method", "gptq", "--bits", "4", "--group-size", "32", "--nsamples", "8", "--seqlen", "32"]


def test_a_full_disk_while_saving_keeps_the_resume_state(tmp_path, tiny_dir, monkeypatch):
    from quantkit.checkpoint import save

    before = snapshot(tiny_dir)
    assert (
        run("quantize", "--model", tiny_dir, *GPTQ_ARGS, "--out", tmp_path / "whole", "--no-resume-state").exit_code
        == 0
    )
    out = tmp_path / "deeper" / "q"
    monkeypatch.setattr(save, "save_file", full_disk("model"))
    r = run("quantize", "--model", tiny_dir, *GPTQ_ARGS, "--out", out)
    assert r.exit_code == 2 and "Traceback" not in r.output
    state = tmp_path / "deeper" / ".q.resume"
    assert r.stderr.splitlines()[-1] == (f"quantkit: error: cannot write checkpoint {out}: No space left on device "
                                         f"(the quantized layers stay in {state}: rerun with --resume)")  # fmt: skip
    assert not out.exists() and sorted(p.name for p in out.parent.iterdir()) == [".q.resume"]
    assert json.loads((state / "state.json").read_text())["done"] == 2
    monkeypatch.undo()
    r = run("quantize", "--model", tiny_dir, *GPTQ_ARGS, "--out", out, "--resume")
    assert r.exit_code == 0 and "resumed: 2 of 2 layers" in r.stdout
    assert same_bytes(tmp_path / "whole", out) and snapshot(tiny_dir) == before


def test_a_full_disk_while_writing_resume_state(tmp_path, tiny_dir, monkeypatch):
    import errno

    from quantkit import resume

    write = resume.write_tensors

    def full(tensors, path, metadata=None):  # on the background writer's thread
        if "layer-00001" not in Path(path).name:
            return write(tensors, path, metadata)
        Path(path).write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(resume, "write_tensors", full)
    r = run("quantize", "--model", tiny_dir, *GPTQ_ARGS, "--out", tmp_path / "q")
    state = tmp_path / ".q.resume"
    assert r.exit_code == 2 and r.stderr.splitlines()[-1] == (
        f"quantkit: error: cannot write resume state in {state}: No space left on device (--no-resume-state runs "
        "without it)"
    )
    assert sorted(p.name for p in state.iterdir()) == ["hidden-00001.safetensors", "layer-00000.safetensors",
                                                       "state.json"]  # fmt: skip
    assert json.loads((state / "state.json").read_text())["done"] == 1 and not (tmp_path / "q").exists()


def test_a_truncated_safetensors_input(tmp_path, tiny_dir, rtn_checkpoint):
    import shutil

    for source, command in ((tiny_dir, ["quantize", "--model"]), (rtn_checkpoint[0], ["export"])):
        cut = tmp_path / f"cut-{command[0]}"
        shutil.copytree(source, cut)
        data = (cut / "model.safetensors").read_bytes()
        (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
        before = snapshot(cut)
        out = tmp_path / f"out-{command[0]}"
        extra = ["--format", "gptq"] if command[0] == "export" else []
        r = run(*command, cut, *extra, "--out", out)
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("quantkit")]
        assert r.exit_code == 2 and len(lines) == 1 and "Traceback" not in r.output, r.output
        assert "safetensors" in lines[0].lower() and str(cut) in lines[0], lines[0]
        assert not out.exists() and snapshot(cut) == before
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".out-{command[0]}")]


@pytest.mark.parametrize("crash", [KeyboardInterrupt, RuntimeError])
def test_a_crash_during_export_leaves_nothing(tmp_path, rtn_checkpoint, monkeypatch, crash):
    from quantkit.checkpoint import export

    source = rtn_checkpoint[0]
    before = snapshot(source)

    def crashing(tensors, folder, shard_bytes):
        (folder / "model.safetensors").write_bytes(b"\0" * 100)  # half-written
        raise crash("crash")

    monkeypatch.setattr(export, "write_shards", crashing)
    out = tmp_path / "ct"
    if crash is KeyboardInterrupt:
        r = run("export", source, "--format", "compressed-tensors", "--out", out)
        assert r.exit_code == 130 and r.stderr.strip() == "quantkit: aborted"
    else:
        with pytest.raises(RuntimeError):
            export.export_checkpoint(source, out, "compressed-tensors")
    assert list(tmp_path.iterdir()) == [] and snapshot(source) == before
