"""checkpoint/inspect.py: the per-module bytes, shapes and ratios it reports from the headers alone equal the
sizes of the tensors actually stored."""

import json

import pytest
from click.testing import CliRunner
from quantkit.kernels import GPU, explain
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

import quantkit
from quantkit.checkpoint.inspect import inspect_checkpoint
from quantkit.cli.main import cli
from quantkit.errors import QuantkitError


def test_the_report_adds_up_to_the_stored_tensors(rtn_checkpoint):
    folder, model = rtn_checkpoint
    stored = load_file(folder / "model.safetensors")
    info = inspect_checkpoint(folder)
    assert info["architecture"] == "llama" and info["format_version"] == 1
    assert info["stages"] == ["rtn"] and info["versions"]["quantkit"]
    assert len(info["modules"]) == 14
    for row in info["modules"]:
        linear = model.get_submodule(row["name"])
        n, k = linear.out_features, linear.in_features
        own = [t for key, t in stored.items() if key.startswith(row["name"] + ".")]
        assert row["shape"] == [n, k] and row["scheme"] == "w4a16-g32-asym" and row["layout"] == "gptq_v2"
        assert row["bytes"] == sum(t.numel() * t.element_size() for t in own)
        assert row["fp16_bytes"] == 2 * n * k and row["ratio"] == pytest.approx(2 * n * k / row["bytes"])
    totals = info["totals"]
    assert totals["file_bytes"] == sum(t.numel() * t.element_size() for t in stored.values())
    assert totals["quantized_bytes"] == sum(r["bytes"] for r in info["modules"])
    assert totals["ratio"] == pytest.approx(totals["fp16_bytes"] / totals["quantized_bytes"])
    assert 2.5 < totals["ratio"] < 4  # 4-bit codes plus a fp16 scale and a 4-bit zero point per 32 weights


def test_a_missing_tensor_or_folder_is_named(rtn_checkpoint, tmp_path):
    folder, _ = rtn_checkpoint
    with pytest.raises(QuantkitError, match="checkpoint not found"):
        inspect_checkpoint(tmp_path / "nothing")
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.0.mlp.gate_proj.scales"]
    save_file(tensors, damaged / "model.safetensors")
    with pytest.raises(QuantkitError, match=r"corrupt .*layers\.0\.mlp\.gate_proj\.scales is missing"):
        inspect_checkpoint(damaged)


# ``quantkit inspect --kernels``: the kernel explain() names for each layer shape of a checkpoint, at each M.


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
    result = CliRunner().invoke(cli, ["inspect", str(checkpoint), "--ms", "1"])
    assert result.exit_code == 2 and "--ms and --gpu go with --kernels" in result.output
