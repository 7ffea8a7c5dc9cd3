"""``quantkit inspect --kernels``: the kernel explain() names for each layer shape of a checkpoint, at each M."""

import json

import pytest
from click.testing import CliRunner
from quantkit.kernels import GPU, explain
from transformers import AutoConfig, AutoModelForCausalLM

import quantkit
from quantkit.cli.main import cli


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = dict(model_type="llama", vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    quantkit.quantize(
        hf, quantkit.Recipe.from_dict({"scheme": {"bits": 4, "group_size": 128}, "stages": [{"method": "rtn"}]})
    )
    return quantkit.save_quantized(hf, tmp_path_factory.mktemp("ck") / "q")


def test_kernels_per_shape_and_m(checkpoint):
    result = CliRunner().invoke(
        cli, ["inspect", str(checkpoint), "--kernels", "--ms", "1,64", "--gpu", "h100", "--json"]
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    shapes = {tuple(r["shape"]) for r in rows}
    assert shapes == {(256, 512), (512, 256), (128, 256), (256, 256)}  # down; gate/up; k/v; q/o
    assert sum(r["modules"] for r in rows if r["m"] == 1) == 14  # 7 linears in each of 2 layers
    h100 = GPU((9, 0), 132, name="H100")
    for r in rows:
        scheme = quantkit.QuantScheme(bits=4, group_size=128, sym=True)
        assert r["kernel"] == explain(r["m"], *r["shape"], scheme, h100)


def test_cpu_and_bad_values(checkpoint):
    result = CliRunner().invoke(cli, ["inspect", str(checkpoint), "--kernels", "--ms", "1", "--gpu", "cpu"])
    assert result.exit_code == 0 and "on the CPU" in result.output
    result = CliRunner().invoke(cli, ["inspect", str(checkpoint), "--kernels", "--ms", "0"])
    assert result.exit_code == 2 and "--ms values must be >= 1" in result.output
