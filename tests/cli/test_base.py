"""What the commands share (cli/base.py, cli/progress.py) and how quantize's flags land in its recipe
(cli/commands.py): each flag changes the recipe key it names, and nothing else."""

import pytest
import torch
from rich.console import Console

from quantkit.cli.base import device_name, torch_dtype
from quantkit.cli.commands import FLAG_MAP, resolve_recipe
from quantkit.cli.progress import LoggedProgress
from quantkit.errors import QuantkitError

NO_FLAGS = dict.fromkeys(FLAG_MAP)


def test_device_and_dtype_options():
    assert device_name("cpu") == "cpu"
    assert device_name(None) == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(QuantkitError, match="unknown device 'tpu'"):
        device_name("tpu")
    assert torch_dtype("auto", "cpu") is torch.float32 and torch_dtype("auto", "cuda") is torch.bfloat16
    assert torch_dtype("float16", "cpu") is torch.float16


def test_flags_change_the_recipe_keys_they_name():
    base = resolve_recipe("gptq", None, NO_FLAGS)
    flags = {**NO_FLAGS, "bits": 3, "group_size": 64, "sym": False, "nsamples": 8, "damp": 0.05, "act_order": False}
    recipe = resolve_recipe("gptq", None, flags)
    (stage,) = recipe.stages
    assert (stage.scheme.bits, stage.scheme.group_size, stage.scheme.sym) == (3, 64, False)
    assert recipe.calibration.nsamples == 8 and recipe.calibration.seqlen == base.calibration.seqlen
    assert stage.params.damp == 0.05 and stage.params.act_order is False
    assert stage.params.block_size == base.stages[0].params.block_size


def test_flags_whose_value_is_not_the_parameter():
    """--act-static sets act_dynamic false; --clip-qk empties AWQ's clip_skip."""
    w8a8 = resolve_recipe("w8a8", None, {**NO_FLAGS, "act_static": True})
    assert w8a8.stages[0].scheme.act_dynamic is False
    awq = resolve_recipe("awq", None, {**NO_FLAGS, "clip_qk": True})
    assert awq.stages[0].params.clip_skip == []
    assert resolve_recipe("awq", None, NO_FLAGS).stages[0].params.clip_skip == ["q_proj", "k_proj", "qkv_proj"]


def test_flags_that_do_not_apply_are_refused():
    with pytest.raises(QuantkitError, match=r"--alpha does not apply to this recipe's methods \(gptq\)"):
        resolve_recipe("gptq", None, {**NO_FLAGS, "alpha": 0.5})
    with pytest.raises(QuantkitError, match="give either --method or --recipe, not both"):
        resolve_recipe("gptq", "default", NO_FLAGS)


def test_progress_off_a_terminal_prints_plain_lines(capsys):
    console = Console(file=None, force_terminal=False, stderr=True)
    with LoggedProgress(console=console, every=3600.0) as bar:
        task = bar.add_task("quantizing", total=3, note="")
        for done in (1, 2, 3):
            bar.update(task, completed=done, note=f"layer {done - 1}")
    lines = capsys.readouterr().err.splitlines()
    assert [ln.split()[:2] for ln in lines] == [["quantizing", "1/3"], ["quantizing", "3/3"]]  # first and last
    assert lines[-1].endswith("layer 2")
