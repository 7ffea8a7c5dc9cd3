import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import quantkit
from quantkit.models.arch import arch_for
from quantkit.nn.factory import quantized_modules
from quantkit.recipe import Recipe
from tests.tiny_models import CONFIGS, tiny_model

RTN_W4 = Recipe.from_dict({"scheme": {"bits": 4, "group_size": 32, "sym": False}, "stages": [{"method": "rtn"}]})


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_quantize_save_reload_equal_logits(arch, tmp_path):
    model = tiny_model(arch)
    ids = torch.randint(3, 320, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        float_logits = model(ids).logits
    result = quantkit.quantize(model, RTN_W4)
    assert result.layers, "nothing was quantized"
    quantized = quantized_modules(model)
    n_linears_expected = len(result.layers)
    assert len(quantized) == n_linears_expected
    with torch.no_grad():
        q_logits = model(ids).logits
    assert not torch.equal(q_logits, float_logits)  # quantization did something
    # 4-bit weights perturb the logits, but a random model stays close
    assert (q_logits - float_logits).abs().mean() < 0.5 * float_logits.abs().mean()

    out = quantkit.save_quantized(model, tmp_path / "q")
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert set(quantized_modules(reloaded)) == set(quantized)
    with torch.no_grad():
        r_logits = reloaded(ids).logits
    torch.testing.assert_close(r_logits, q_logits, rtol=0, atol=0)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_never_quantized_modules_stay_float(arch):
    model = tiny_model(arch)
    quantkit.quantize(model, RTN_W4)
    names = set(quantized_modules(model))
    assert not any("lm_head" in n or "embed" in n for n in names)
    spec = arch_for(model)
    for pattern in spec.never_quantize:
        assert not any(n.endswith(pattern) for n in names), pattern


DEEPSEEK_RECIPES = {
    "gptq": {"scheme": {"bits": 4, "group_size": 16}, "stages": [{"method": "gptq"}]},
    "awq": {"scheme": {"bits": 4, "group_size": 16}, "stages": [{"method": "awq"}, {"method": "rtn"}]},
    "fp8-block": {"scheme": {"bits": 8, "group_size": -1, "fmt": "fp8", "act_bits": 8, "block_size": 16},
                  "stages": [{"method": "rtn"}]},
}  # fmt: skip


@pytest.mark.parametrize("method", sorted(DEEPSEEK_RECIPES))
def test_deepseek_v3_quantizes_saves_and_reloads(method, tmp_path):
    """MLA projections (q_a/q_b, kv_a_proj_with_mqa, kv_b, o) and experts quantized; the router and its correction
    bias untouched in float; the reloaded model computes the quantized model's logits exactly."""
    model = tiny_model("deepseek_v3")
    gate = model.model.layers[1].mlp.gate
    with torch.no_grad():
        gate.e_score_correction_bias.copy_(torch.linspace(-0.1, 0.1, 4))
    router = (gate.weight.detach().clone(), gate.e_score_correction_bias.clone())
    ids = torch.randint(3, 320, (2, 12), generator=torch.Generator().manual_seed(1))
    calib = torch.randint(3, 320, (4, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        float_logits = model(ids).logits
    result = quantkit.quantize(model, Recipe.from_dict(DEEPSEEK_RECIPES[method]), calib=calib)
    names = set(quantized_modules(model))
    for short in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        assert f"model.layers.1.self_attn.{short}" in names
    assert {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.experts.3.down_proj",
            "model.layers.1.mlp.shared_experts.up_proj"} <= names  # fmt: skip
    assert len(result.layers) == len(names) == 28  # 8 in the dense layer, 5 + 4 x 3 + 3 in the MoE layer
    with torch.no_grad():
        q_logits = model(ids).logits
    assert (q_logits - float_logits).abs().mean() < 0.5 * float_logits.abs().mean()
    out = quantkit.save_quantized(model, tmp_path / "q")
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    gate = reloaded.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    if method != "awq":  # AWQ folds its scales into the norms, never into the router
        assert torch.equal(gate.weight, router[0])
    assert torch.equal(gate.e_score_correction_bias, router[1])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, q_logits, rtol=0, atol=0)


def float_folder_with_mtp(path, arch: str):
    """A float checkpoint folder of ``arch`` whose safetensors also hold an MTP layer past the last decoder layer
    (``model.layers.{num_hidden_layers}``: norms, eh_proj, one attention projection, the shared head)."""
    model = tiny_model(arch)
    model.save_pretrained(path)
    n = model.config.num_hidden_layers
    g = torch.Generator().manual_seed(5)
    mtp = {f"model.layers.{n}.eh_proj.weight": torch.randn(64, 128, generator=g),
           f"model.layers.{n}.enorm.weight": torch.rand(64, generator=g),
           f"model.layers.{n}.self_attn.o_proj.weight": torch.randn(64, 64, generator=g),
           f"model.layers.{n}.shared_head.head.weight": torch.randn(320, 64, generator=g)}  # fmt: skip
    tensors = load_file(path / "model.safetensors")
    save_file({**tensors, **mtp}, path / "model.safetensors", metadata={"format": "pt"})
    return mtp


@pytest.mark.parametrize("mode", ["keep", "quantize"])
def test_mtp_layers_are_kept_or_quantized_never_dropped(mode, tmp_path):
    mtp = float_folder_with_mtp(tmp_path / "float", "deepseek_v3")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float")  # transformers drops model.layers.2
    recipe = Recipe.from_dict({"scheme": {"bits": 4, "group_size": 16}, "stages": [{"method": "rtn"}], "mtp": mode})
    quantkit.quantize(model, recipe)
    out = quantkit.save_quantized(model, tmp_path / "q")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    stored = load_file(out / "model.safetensors")
    assert qc["mtp"]["layers"] == ["model.layers.2"] and qc["mtp"]["mode"] == mode
    kept = mtp if mode == "keep" else {k: v for k, v in mtp.items() if "_proj" not in k}
    for key, t in kept.items():
        assert torch.equal(stored[key], t), key
    if mode == "quantize":
        assert qc["mtp"]["modules"] == {"model.layers.2.eh_proj": "w4a16-g16-sym",
                                        "model.layers.2.self_attn.o_proj": "w4a16-g16-sym"}  # fmt: skip
        assert "model.layers.2.eh_proj.weight" not in stored and stored["model.layers.2.eh_proj.qweight"].shape == (
            16,
            64,
        )
        from quantkit.algorithms.rtn import rtn
        from quantkit.quant.scheme import QuantScheme

        want = rtn(mtp["model.layers.2.eh_proj.weight"], QuantScheme(bits=4, group_size=16)).pack()["qweight"]
        assert torch.equal(stored["model.layers.2.eh_proj.qweight"], want)
    reloaded = quantkit.load_quantized(out)  # the MTP tensors stay in the folder, unused by transformers
    assert reloaded(torch.tensor([[5, 6]])).logits.isfinite().all()
    assert len(stored) - len(reloaded.state_dict()) >= 3
    from quantkit.checkpoint.verify import verify_checkpoint

    assert verify_checkpoint(out).ok  # the MTP tensors are accounted for, not "unused"
    stored["model.layers.2.enorm.weight"][0] = float("nan")
    save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
    assert verify_checkpoint(out).problems["finite"] == ["model.layers.2.enorm.weight has NaN or Inf"]


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_an_export_carries_the_mtp_layers(tmp_path, arch):
    """DeepSeek-V3 (its experts one linear each in every export) and a dense family."""
    from quantkit.checkpoint.export import export_checkpoint
    from quantkit.checkpoint.verify import verify_checkpoint

    mtp = float_folder_with_mtp(tmp_path / "float", arch)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float")
    scheme = {"bits": 8, "group_size": -1, "fmt": "fp8", "act_bits": 8, "block_size": 16}
    quantkit.quantize(model, Recipe.from_dict({"scheme": scheme, "stages": [{"method": "rtn"}], "mtp": "quantize"}))
    out = quantkit.save_quantized(model, tmp_path / "q")
    for fmt in ("fp8", "compressed-tensors"):
        exported = export_checkpoint(out, tmp_path / fmt, fmt).path
        assert verify_checkpoint(exported).ok, verify_checkpoint(exported).line()
        stored = load_file(exported / "model.safetensors")
        if arch == "deepseek_v3":
            assert stored["model.layers.1.mlp.experts.3.down_proj.weight"].dtype == torch.float8_e4m3fn
        scale = "weight_scale_inv" if fmt == "fp8" else "weight_scale"
        assert stored["model.layers.2.eh_proj.weight"].dtype == torch.float8_e4m3fn
        assert stored[f"model.layers.2.eh_proj.{scale}"].shape == (4, 8)
        assert torch.equal(
            stored["model.layers.2.shared_head.head.weight"], mtp["model.layers.2.shared_head.head.weight"]
        )
