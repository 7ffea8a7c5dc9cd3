"""quantkit verify: every valid checkpoint and export of the tiny models passes; each kind of damage is caught and
named; the command's exit status says which (0 passes, 1 fails, 2 cannot run)."""

import contextlib
import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import quantkit
from quantkit.checkpoint.export import export_checkpoint
from quantkit.checkpoint.save import EXPORT_FORMATS
from quantkit.checkpoint.verify import verify_checkpoint
from quantkit.cli.main import cli
from quantkit.errors import QuantkitError
from tests.tiny_models import tiny_model, tiny_model_dir, tiny_tokenizer

CALIB = torch.randint(3, 320, (4, 32), generator=torch.Generator().manual_seed(1))
SCHEMES = {
    "rtn-asym": ("llama", {"bits": 4, "group_size": 32, "sym": False}, {"method": "rtn"}),
    "gptq-actorder": ("llama", {"bits": 4, "group_size": 32, "sym": True},
                      {"method": "gptq", "params": {"static_groups": False}}),
    "gptq-moe": ("mixtral", {"bits": 4, "group_size": 32, "sym": True}, {"method": "gptq"}),
    "w8a8": ("llama", {"bits": 8, "group_size": -1, "sym": True, "act_bits": 8}, {"method": "rtn"}),
    "fp8-static": ("qwen3", {"bits": 8, "group_size": -1, "sym": True, "act_bits": 8, "fmt": "fp8",
                             "act_dynamic": False}, {"method": "rtn"}),
    "fp8-block": ("llama", {"bits": 8, "group_size": -1, "sym": True, "act_bits": 8, "fmt": "fp8",
                            "block_size": 32}, {"method": "rtn"}),
}  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> folder: a quantkit checkpoint of each of SCHEMES and each export it allows (``name/format``)."""
    root = tmp_path_factory.mktemp("verify")
    tokenizer = tiny_tokenizer(320)
    out = {}
    for name, (arch, scheme, stage) in SCHEMES.items():
        model = tiny_model(arch)
        quantkit.quantize(model, {"scheme": scheme, "stages": [stage]}, calib=CALIB)
        out[name] = quantkit.save_quantized(model, root / name, tokenizer=tokenizer)
        for fmt in EXPORT_FORMATS:
            with contextlib.suppress(QuantkitError):  # a format that cannot hold this scheme
                out[f"{name}/{fmt}"] = export_checkpoint(out[name], root / f"{name}-{fmt}", fmt).path
    return out


def damaged(folders, tmp_path, name, change_tensors=None, change_config=None):
    """A copy of ``folders[name]`` with its tensors (a dict, changed in place) or config.json changed."""
    copy = tmp_path / "damaged"
    shutil.copytree(folders[name], copy)
    if change_tensors is not None:
        tensors = load_file(copy / "model.safetensors")
        change_tensors(tensors)
        save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    if change_config is not None:
        config = json.loads((copy / "config.json").read_text())
        change_config(config)
        (copy / "config.json").write_text(json.dumps(config))
    return copy


def failures(folder) -> dict[str, list[str]]:
    return {k: v for k, v in verify_checkpoint(folder).problems.items() if v}


def test_every_valid_checkpoint_and_export_passes(folders):
    assert {"rtn-asym/gptq", "rtn-asym/awq", "rtn-asym/compressed-tensors", "gptq-actorder/gptq", "gptq-moe",
            "w8a8/compressed-tensors", "fp8-static/compressed-tensors", "fp8-block/fp8",
            "fp8-block/compressed-tensors"} <= set(folders)  # fmt: skip
    for name, folder in folders.items():
        verdict = verify_checkpoint(folder)
        assert verdict.ok, (name, verdict.line())
        assert verdict.line().startswith("ok: ")


def test_a_dropped_expert_is_named(folders, tmp_path):
    gone = "model.layers.1.mlp.experts.2.up_proj.qweight"
    folder = damaged(folders, tmp_path, "gptq-moe", change_tensors=lambda t: t.pop(gone))
    assert failures(folder) == {"coverage": [f"missing {gone}"]}


@pytest.mark.parametrize("name", ["gptq-moe", "rtn-asym/gptq"])
def test_an_extra_tensor_is_named_unused(folders, tmp_path, name):
    extra = "model.layers.0.mlp.experts.9.up_proj.bias"
    folder = damaged(folders, tmp_path, name, change_tensors=lambda t: t.update({extra: torch.zeros(2)}))
    assert failures(folder) == {"coverage": [f"unused {extra}"]}


def test_a_nan_scale(folders, tmp_path):
    name = "model.layers.0.self_attn.q_proj.scales"

    def poison(t):
        t[name][0, 3] = float("nan")

    assert failures(damaged(folders, tmp_path, "rtn-asym", change_tensors=poison)) == {
        "finite": [f"{name} holds NaN or infinity"]
    }


def test_a_nan_block_scale_in_a_deepseek_style_fp8_folder(folders, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"

    def poison(t):
        t[name].view(-1)[0] = float("nan")

    found = failures(damaged(folders, tmp_path, "fp8-block/fp8", change_tensors=poison))
    assert len(found) == 1 and "model.layers.0.mlp.down_proj" in " ".join(next(iter(found.values())))


def test_zero_points_out_of_range(folders, tmp_path):
    name = "model.layers.0.mlp.up_proj"

    def shift(t):  # a symmetric 4-bit grid's zero points are all 8 (0x88888888 a word)
        t[f"{name}.qzeros"][0, 0] = 0x7888888

    (found,) = failures(damaged(folders, tmp_path, "gptq-actorder", change_tensors=shift))["zero_points"]
    assert found.startswith(f"{name}: 2 zero points are not 8")

    def wrap(t):  # GPTQ v1 stores zero - 1: 15 reads as 16, which 4 bits cannot hold
        t[f"{name}.qzeros"][0, 0] = 0x7777777F

    (found,) = failures(damaged(folders, tmp_path / "v1", "gptq-actorder/gptq", change_tensors=wrap))["loader"]
    assert f"{name}: a v1 zero point stored as 15" in found


def test_a_shape_that_disagrees_with_the_config(folders, tmp_path):
    folder = damaged(folders, tmp_path, "rtn-asym/awq", change_config=lambda c: c.update(intermediate_size=128))
    found = failures(folder)
    assert set(found) == {"shapes"}
    assert "model.layers.0.mlp.down_proj.scales is [3, 64], expected [4, 64]" in " ".join(found["shapes"])


@pytest.mark.parametrize("name", ["rtn-asym", "rtn-asym/gptq"])
def test_a_config_edited_to_another_group_size(folders, tmp_path, name):
    def edit(config):
        qc = config["quantization_config"]
        for scheme in qc.get("schemes", {}).values():
            scheme["group_size"] = 64
        if "group_size" in qc:
            qc["group_size"] = 64

    found = failures(damaged(folders, tmp_path, name, change_config=edit))
    if name == "rtn-asym":
        assert found["loader"] == ["quantization_config scheme w4a16-g32-asym describes w4a16-g64-asym"]
    assert "model.layers.0.self_attn.q_proj.scales is [2, 64], expected [1, 64] by its scheme w4a16-g64" in " ".join(
        found["shapes"]
    )


def test_a_scale_of_zero_and_a_scale_stored_in_another_dtype(folders, tmp_path):
    name = "model.layers.1.mlp.gate_proj"

    def change(t):
        t[f"{name}.weight_scale"][5] = 0.0
        t[f"{name}.weight"] = t[f"{name}.weight"].to(torch.int32)

    assert failures(damaged(folders, tmp_path, "w8a8", change_tensors=change)) == {
        "dtypes": [f"{name}.weight is torch.int32, the layer reads torch.int8"],
        "scales": [f"{name}.weight_scale holds scales <= 0"],
    }


def test_a_g_idx_that_is_no_group_map(folders, tmp_path):
    name = "model.layers.1.self_attn.o_proj.g_idx"

    def lump(t):  # every input in group 0: in range, but not groups of 32
        t[name].zero_()

    assert failures(damaged(folders, tmp_path, "gptq-actorder", change_tensors=lump)) == {
        "g_idx": [f"{name[:-6]}.g_idx gives groups of 0..64 inputs, the scheme w4a16-g32-sym groups of 32"]
    }


def test_a_truncated_file_fails_and_a_missing_folder_cannot_run(folders, tmp_path):
    copy = tmp_path / "cut"
    shutil.copytree(folders["w8a8"], copy)
    data = (copy / "model.safetensors").read_bytes()
    (copy / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert list(failures(copy)) == ["files"]
    with pytest.raises(QuantkitError, match="checkpoint not found"):
        verify_checkpoint(tmp_path / "nothing")


def test_cli_exit_status_and_json(folders, tmp_path):
    runner = CliRunner()
    ok = runner.invoke(cli, ["verify", str(folders["rtn-asym/compressed-tensors"])])
    assert ok.exit_code == 0 and ok.output.startswith("ok: "), ok.output
    folder = damaged(folders, tmp_path, "w8a8", change_tensors=lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    bad = runner.invoke(cli, ["verify", str(folder), "--json"])
    assert bad.exit_code == 1
    report = json.loads(bad.output)
    assert not report["ok"] and report["problems"]["coverage"] == ["missing model.layers.0.mlp.up_proj.weight"]
    cannot = runner.invoke(cli, ["verify", str(tmp_path / "nothing")])
    assert cannot.exit_code == 2 and "checkpoint not found" in cannot.output


def test_baseline_figures_and_thresholds(folders, tmp_path):
    base = tiny_model_dir(tmp_path / "float")
    runner = CliRunner()
    args = ["verify", str(folders["w8a8/compressed-tensors"]), "--baseline", str(base), "--windows", "2",
            "--seqlen", "64", "--json"]  # fmt: skip
    ok = runner.invoke(cli, args)
    assert ok.exit_code == 0, ok.output
    figures = json.loads(ok.output)["figures"]
    assert figures["kl"] < 0.01 and figures["top1_agreement"] > 0.9 and figures["tokens"] == 126
    strict = runner.invoke(cli, [*args, "--max-kl", "0"])
    assert strict.exit_code == 1
    assert json.loads(strict.output)["problems"]["baseline"][0].startswith("KL ")
