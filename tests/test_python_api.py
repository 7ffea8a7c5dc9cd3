"""The Python API's entry points refuse bad arguments with a QuantkitError that names the argument, as the CLI does,
instead of a TypeError or IndexError from deep inside torch or pathlib."""

import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

import quantkit
from quantkit._version import __version__
from quantkit.devices import resolve_device
from tests.tiny_models import tiny_model

RTN = {"scheme": {"bits": 4, "group_size": 32}, "stages": [{"method": "rtn"}]}
GPTQ = {"scheme": {"bits": 4, "group_size": 32}, "stages": [{"method": "gptq"}]}


@pytest.mark.parametrize(
    "model, recipe, kwargs, fragment",
    [
        ("llama", 123, {}, "a recipe is a YAML file or a shipped recipe's name, got int"),
        ("path", RTN, {}, "quantize needs a torch.nn.Module"),
        ("llama", GPTQ, {"calib": [[1, 2, 3]]}, "calib must be a torch.Tensor"),
        ("llama", GPTQ, {"calib": torch.ones(3, dtype=torch.long)}, "got shape [3]"),
        ("llama", GPTQ, {"calib": torch.ones(0, 8, dtype=torch.long)}, "got shape [0, 8]"),
        ("llama", GPTQ, {"calib": torch.ones(2, 8)}, "integer token ids, got torch.float32"),
        ("llama", GPTQ, {"calib": torch.full((2, 8), 320)}, "must lie in [0, 320)"),
        ("llama", GPTQ, {"calib": torch.full((2, 8), -1)}, "must lie in [0, 320)"),
        ("llama", RTN, {"device": "tpu"}, "unknown device 'tpu'"),
        ("llama", GPTQ, {"calib": torch.ones(2, 8, dtype=torch.long, device="meta")}, "on the meta device"),
        ("llama", GPTQ, {"calib": torch.ones(2, 4096, dtype=torch.long)}, "longer than the model's 2048 positions"),
        ("llama", GPTQ, {"tokenizer": "a tokenizer"}, "tokenizer must be a Hugging Face tokenizer, got str"),
    ],
)
def test_quantize_refuses_bad_arguments(model, recipe, kwargs, fragment):
    model = tiny_model("llama") if model == "llama" else "some/folder"
    with pytest.raises(quantkit.QuantkitError) as exc:
        quantkit.quantize(model, recipe, **kwargs)
    assert fragment in str(exc.value)


def test_quantize_takes_a_recipe_mapping_and_int32_windows():
    model = tiny_model("llama")
    result = quantkit.quantize(model, GPTQ, calib=torch.ones(2, 8, dtype=torch.int32))
    assert result.layers and result.recipe.stages[0].method == "gptq"


def test_save_and_load_refuse_what_is_not_a_model_or_a_path(tmp_path):
    with pytest.raises(quantkit.QuantkitError, match=r"needs the quantized torch\.nn\.Module, got str"):
        quantkit.save_quantized("model", tmp_path / "out")
    model = tiny_model("llama")
    quantkit.quantize(model, RTN)
    with pytest.raises(quantkit.QuantkitError, match="must be a folder's path, got int"):
        quantkit.save_quantized(model, 5)
    with pytest.raises(quantkit.QuantkitError, match="needs a checkpoint folder's path, got NoneType"):
        quantkit.load_quantized(None)
    with pytest.raises(quantkit.QuantkitError, match="got dict"):
        quantkit.load_recipe(RTN)
    for kwargs, fragment in (
        ({"overwrite": "no"}, "overwrite must be True or False, got 'no'"),  # a string read as true replaced folders
        ({"shard_bytes": "x"}, "shard_bytes must be an integer"),
        ({"shard_bytes": 0}, "shard_bytes must be >= 1"),
        ({"tokenizer": "tok"}, "tokenizer must be a Hugging Face tokenizer, got str"),
    ):
        with pytest.raises(quantkit.QuantkitError, match=fragment):
            quantkit.save_quantized(model, tmp_path / "out", **kwargs)
        assert not (tmp_path / "out").exists()


def test_recipe_and_scheme_objects_refuse_data_in_their_place():
    with pytest.raises(quantkit.QuantkitError, match=r"takes Stage objects; .* use Recipe\.from_dict"):
        quantkit.Recipe(stages="rtn")
    with pytest.raises(quantkit.QuantkitError, match="takes a CalibrationConfig, got dict"):
        quantkit.Recipe(stages=quantkit.load_recipe("default").stages, calibration={"nsamples": 8})
    with pytest.raises(quantkit.QuantkitError, match="scheme must be a mapping"):
        quantkit.QuantScheme.from_dict("w4")


def test_device_names():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    for bad in ("gpu", "cuda:x", ""):
        with pytest.raises(quantkit.QuantkitError, match="unknown device"):
            resolve_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(quantkit.QuantkitError, match="CUDA is not available"):
            resolve_device("cuda:0")
        assert resolve_device(None) == torch.device("cpu")


# quantkit.__version__ is pyproject.toml's version (read from the installed metadata), and ``python -m quantkit``
# is the console script.


PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_the_version_is_pyprojects():
    declared = re.search(r'^\[project\][^\[]*?^version = "([^"]+)"', PYPROJECT.read_text(), re.M | re.S).group(1)
    assert quantkit.__version__ == __version__ == version("quantkit") == declared


def test_python_dash_m_quantkit_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "quantkit", "--version"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == quantkit.__version__
