"""Calibration across processes (gloo on the CPU): the checkpoint of 2 and 3 processes is the single process's, byte
for byte; a failing rank stops the run with one line naming it. Spawning costs seconds a process, so each spawned
run quantizes every recipe at once."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import quantkit
from quantkit.cli.main import cli
from quantkit.distributed import Shard, launch, owners
from quantkit.errors import QuantkitError
from tests.tiny_models import tiny_model, tiny_model_dir

W4 = {"bits": 4, "group_size": 32}
W8A8_STATIC = {"bits": 8, "group_size": -1, "act_bits": 8, "act_dynamic": False}
SMALL_AWQ = {"grid": 4, "clip_grid": 4, "refine_steps": 2, "search_samples": 4, "search_tokens": 64}
# 8 windows in batches of 2: 4 batches, shared 2 + 2 and 1 + 1 + 2; GPTQ holds out windows 3 and 7 (grid choice)
CALIBRATION = {"batch_size": 2}
RECIPES = {
    "rtn": {"scheme": W4, "stages": [{"method": "rtn"}]},
    "gptq": {"scheme": W4, "calibration": CALIBRATION, "stages": [{"method": "gptq"}]},
    "awq": {"scheme": W4, "calibration": CALIBRATION, "stages": [{"method": "awq", "params": SMALL_AWQ}, "rtn"]},
    "smoothquant": {
        "scheme": W8A8_STATIC,
        "calibration": CALIBRATION,
        "stages": [{"method": "smoothquant", "params": {"search_tokens": 64}}, {"method": "gptq"}],
    },
    "moe-gptq": {"scheme": W4, "calibration": CALIBRATION, "stages": [{"method": "gptq"}]},
}
TIMING = ("seconds", "awq_seconds", "awq_clip_seconds")


def windows() -> torch.Tensor:
    return torch.randint(0, 320, (8, 16), generator=torch.Generator().manual_seed(1))


def quantize_all(out: Path, names=tuple(RECIPES), **kwargs) -> None:
    """Each recipe named on a fresh tiny model; the checkpoints are written where save_quantized is called: on rank
    0. ``kwargs`` go to quantize."""
    for name in names:
        recipe = RECIPES[name]
        model = tiny_model("qwen3_moe" if name.startswith("moe") else "llama")
        recipe = {**recipe, "stages": [s if isinstance(s, dict) else {"method": s} for s in recipe["stages"]]}
        quantkit.quantize(model, recipe, windows(), device="cpu", **kwargs)
        if torch.distributed.get_rank() == 0 if torch.distributed.is_initialized() else True:
            quantkit.save_quantized(model, out / name)


def spawned(out: str, fail_rank=None, crash_after_layer=None, hang_rank=None, timeout_s: float = 60, **kwargs) -> None:
    """A rank of :func:`launch`: join the group as torchrun's ranks do, quantize (``kwargs`` go to
    :func:`quantize_all`); ``fail_rank`` fails at once, ``hang_rank`` never reaches the first collective,
    ``crash_after_layer`` makes rank 1 fail after that layer."""
    import time

    from quantkit.distributed import init_from_env, named_failures
    from quantkit.resume import RunState

    init_from_env("cpu", timeout_s=timeout_s)
    rank = torch.distributed.get_rank()
    if fail_rank == rank:
        raise ValueError("a deliberate failure")
    if hang_rank == rank:
        time.sleep(600)
    if crash_after_layer is not None and rank == 1:
        save = RunState.save

        def crash(self, i, *args):
            save(self, i, *args)
            if i == crash_after_layer:
                raise RuntimeError("a crash")

        RunState.save = crash
    with named_failures():
        quantize_all(Path(out), **kwargs)


def report(folder: Path) -> dict:
    layers = json.loads((folder / "quant_report.json").read_text())["layers"]
    return {n: {k: v for k, v in r.items() if k not in TIMING} for n, r in layers.items()}


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """The single-process checkpoints, on one thread as every rank runs: the tensors do not depend on the number of
    threads, but the last digits of a figure in the report (GPTQ's loss: a sum over a matrix) do."""
    out = tmp_path_factory.mktemp("single")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        quantize_all(out)
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.parametrize("nproc", [2, 3])
def test_checkpoints_across_processes_are_the_single_process_ones(single, tmp_path, nproc):
    launch(nproc, spawned, {"out": str(tmp_path)}, threads=1)
    for name in RECIPES:
        ours, theirs = load_file(tmp_path / name / "model.safetensors"), load_file(single / name / "model.safetensors")
        assert ours.keys() == theirs.keys()
        for key, t in theirs.items():
            assert ours[key].dtype == t.dtype and torch.equal(ours[key], t), f"{name}: {key}"
        assert report(tmp_path / name) == report(single / name), name


@pytest.mark.parametrize(
    "how, message",
    [
        ({"fail_rank": 1}, r"^rank 1 of 2 failed: ValueError: a deliberate failure$"),
        ({"hang_rank": 1, "timeout_s": 2}, r"^rank 0 of 2 failed: .*[Tt]imed out[^\n]*$"),  # rank 0 waited 2 s
    ],
)
def test_a_failing_rank_stops_all_with_one_line_naming_it(tmp_path, how, message):
    t0 = time.monotonic()
    with pytest.raises(QuantkitError, match=message):
        launch(2, spawned, {"out": str(tmp_path), **how}, threads=1)
    assert not any(tmp_path.iterdir())  # rank 0 stopped at its first collective, before writing anything
    assert time.monotonic() - t0 < 120  # no hang


def test_shards_are_contiguous_and_owners_balance_cost():
    shards = [Shard(r, 3, (2, 2, 2, 2, 1)) for r in range(3)]
    assert [(s.start, s.stop, s.first_window) for s in shards] == [(0, 1, 0), (1, 3, 2), (3, 5, 6)]
    assert [shards[0].owner(b) for b in range(5)] == [0, 1, 1, 2, 2]
    loads = [0.0, 0.0]
    assert owners({"q": 3.0, "k": 1.0, "v": 1.0}, 2, loads) == {"q": 0, "k": 1, "v": 1}
    assert owners({"o": 2.0}, 2, loads) == {"o": 1} and loads == [3.0, 4.0]


def test_cli_nproc_writes_the_single_process_checkpoint_once(tmp_path):
    """``quantize --nproc 2`` (gloo): the tensors of ``quantize`` in one process; rank 0 alone prints and writes."""
    folder = tiny_model_dir(tmp_path / "llama")
    args = ["quantize", "--model", str(folder), "--method", "gptq", "--group-size", "32", "--nsamples", "16",
            "--seqlen", "16", "--device", "cpu", "--no-resume-state"]  # fmt: skip
    one = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "one")])
    two = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "two"), "--nproc", "2"])
    assert one.exit_code == 0 and two.exit_code == 0, one.output + two.output
    ours, theirs = load_file(tmp_path / "two" / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], t) for k, t in theirs.items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama", "one", "two"]  # no resume state, no scratch


@pytest.mark.parametrize(
    "extra, world_size, fragment",
    [(["--nproc", "2"], "2", "--nproc under torchrun"), ([], "two", "WORLD_SIZE must be an integer, got 'two'")],
)
def test_cli_refuses_what_does_not_work_across_processes(tmp_path, monkeypatch, extra, world_size, fragment):
    monkeypatch.setenv("WORLD_SIZE", world_size)
    r = CliRunner().invoke(cli, ["quantize", "--model", "m", "--out", str(tmp_path / "o"), *extra])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and fragment in r.stderr, r.output


def test_a_run_of_two_processes_resumes_in_three(single, tmp_path):
    """Rank 1 of 2 crashes after layer 0: rank 0 has written the resume state (every rank's batches), from which 3
    processes finish the single process's checkpoint."""
    state = tmp_path / "state"
    run = {"out": str(tmp_path), "names": ["gptq"], "state_dir": str(state)}
    with pytest.raises(QuantkitError, match=r"^rank 1 of 2 failed: RuntimeError: a crash$"):
        launch(2, spawned, {**run, "crash_after_layer": 0}, threads=1)
    assert json.loads((state / "state.json").read_text())["done"] == 1
    launch(3, spawned, {**run, "resume": True}, threads=1)
    ours, theirs = load_file(tmp_path / "gptq" / "model.safetensors"), load_file(single / "gptq" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], t) for k, t in theirs.items())
    assert report(tmp_path / "gptq") == report(single / "gptq") and not state.exists()


@pytest.mark.slow
def test_smollm2_gptq_in_two_processes_is_the_single_process_checkpoint(tmp_path):
    """SmolLM2-135M, GPTQ (16 windows of 64 tokens, 2 batches): ``--nproc 2`` writes the one-process tensors, so the
    perplexity of the two checkpoints is the same. The one process runs on as many threads as each of the two: on
    the CPU the thread count changes the last bits of a layer's forward pass (BLAS blocking), and GPTQ carries them
    into other codes (one process on 2 threads against two on 1: 207 of SmolLM2's 902 tensors differ)."""
    from quantkit.calib.data import evaluation_windows
    from quantkit.eval import evaluate_windows

    args = ["quantize", "--model", "smollm2-135m", "--method", "gptq", "--no-mse", "--nsamples", "16", "--seqlen",
            "64", "--device", "cpu", "--no-resume-state"]  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // 2))  # what launch gives each of 2 processes
    try:
        r = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "one")])
    finally:
        torch.set_num_threads(threads)
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "two"), "--nproc", "2"])
    assert r.exit_code == 0, r.output
    ours, theirs = load_file(tmp_path / "two" / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], t) for k, t in theirs.items())
    from transformers import AutoTokenizer

    windows, _ = evaluation_windows(AutoTokenizer.from_pretrained(tmp_path / "one"), "moby-dick", 256, 2)
    perplexity = []
    for out in ("one", "two"):
        model = quantkit.load_quantized(tmp_path / out)
        perplexity.append(round(evaluate_windows(model, windows).perplexity, 3))
    assert perplexity[0] == perplexity[1]
