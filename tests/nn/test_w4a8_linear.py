"""W4A8 (4-bit weights, 8-bit per-token activations): the schemes, the module against a float64 reference of its
quantized operands, the CUDA path's call into the kernel family, RTN / GPTQ / the ``w4a8`` preset, checkpoints and
the HF hook, export to compressed-tensors and back, refusals, and the runtime.

The module's fp32 simulation multiplies fake-quantized activations (int8 or e4m3 codes times an fp32 scale) by the
dequantized weight (fp16 scale times a code difference of at most 15: exact in fp32). Against the float64 product of
the same operands its error is one fp32 rounding of each fake-quantized activation plus the fp32 dot-product bound,
so each output is within ``2 * K * eps(fp32) * sum_k |x_fq * w|`` of the reference: the tolerance used.
"""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from click.testing import CliRunner
from quantkit.kernels.w8a8 import quantize_activations_reference
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import quantkit
from quantkit.algorithms.rtn import rtn
from quantkit.checkpoint.export import export_checkpoint, export_formats
from quantkit.checkpoint.foreign import import_checkpoint
from quantkit.cli.main import cli
from quantkit.errors import QuantkitError
from quantkit.nn.qlinear import QuantLinear
from quantkit.nn.w4a8 import W4A8Linear
from quantkit.presets import preset_recipe
from quantkit.quant.scheme import QuantScheme
from tests.checkpoint.test_export import needs_compressed_tensors
from tests.runtime.helpers import hf_greedy, random_prompts, sharpen
from tests.tiny_models import COMMON, tiny_model, tiny_model_dir, tiny_tokenizer

F32_EPS = torch.finfo(torch.float32).eps
IDS = torch.randint(3, 320, (2, 12), generator=torch.Generator().manual_seed(0))
CALIB = torch.randint(3, 320, (4, 32), generator=torch.Generator().manual_seed(1))


def w4a8(act_fmt="int", group_size=32, sym=True) -> dict:
    return {"bits": 4, "group_size": group_size, "sym": sym, "act_bits": 8, "act_fmt": act_fmt}


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


def quantized_tiny(recipe: dict, arch="llama"):
    model = tiny_model(arch)
    needs_data = any(s["method"] != "rtn" for s in recipe["stages"])
    quantkit.quantize(model, recipe, calib=CALIB if needs_data else None)
    return model


# -- schemes -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, name",
    [
        ({"bits": 4, "group_size": 128, "act_bits": 8}, "w4a8-int8-g128-sym"),
        (w4a8("fp8", -1, sym=False), "w4a8-fp8-pc-asym"),
        (w4a8("int", 64), "w4a8-int8-g64-sym"),
    ],
)
def test_scheme_names_and_dicts(fields, name):
    s = QuantScheme(**fields)
    assert s.name == name and s.w4a8 and s.packed and not s.weight_only
    assert s.act_fmt in ("int", "fp8") and s.to_dict()["act_fmt"] == s.act_fmt  # int8 is filled in
    assert QuantScheme.from_dict(s.to_dict()) == s


def test_other_schemes_read_and_write_as_before():
    w8a8 = QuantScheme(bits=8, group_size=-1, act_bits=8, fmt="fp8", act_fmt="fp8")  # the weights' format: cleared
    assert w8a8 == QuantScheme(bits=8, group_size=-1, act_bits=8, fmt="fp8") and "act_fmt" not in w8a8.to_dict()
    assert not w8a8.packed and QuantScheme().packed and "act_fmt" not in QuantScheme().to_dict()


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"bits": 3, "act_bits": 8}, "8-bit activations need 8-bit weights (W8A8) or 4-bit ones (W4A8)"),
        ({**w4a8(), "act_dynamic": False}, "W4A8 needs integer 4-bit weights and dynamic per-token activations"),
        ({"bits": 4, "act_fmt": "fp8"}, "act_fmt is the format of quantized activations: it needs act_bits 8"),
        ({**w4a8(), "act_fmt": "e5m2"}, "act_fmt must be one of ('int', 'fp8'), got 'e5m2'"),
        ({**w4a8(), "act_fmt": 8}, "scheme act_fmt must be a string, got 8"),
        ({"bits": 8, "group_size": -1, "act_bits": 8, "act_fmt": "fp8"}, "W8A8 activations take the weights' format"),
        ({**w4a8(), "act_bits": 4}, "act_bits must be null (weight-only) or 8"),
    ],
)
def test_impossible_schemes_are_one_line_errors(fields, fragment):
    with pytest.raises(QuantkitError) as err:
        QuantScheme(**fields)
    assert fragment in str(err.value) and "\n" not in str(err.value)


# -- the module ----------------------------------------------------------------------------------------------------


def layer(k, n, scheme: QuantScheme, bias=True, seed=0) -> W4A8Linear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.linspace(0.2, 3.0, n)[:, None]  # channels of different ranges
    b = torch.randn(n, generator=g) if bias else None
    return W4A8Linear.from_quantized(rtn(w, scheme), b, torch.float32)


@pytest.mark.parametrize("act_fmt", ["int", "fp8"])
@pytest.mark.parametrize("k, n, group_size, sym", [(96, 40, 32, True), (80, 33, 32, False), (70, 64, -1, True)])
def test_forward_equals_a_float64_reference_of_the_quantized_operands(act_fmt, k, n, group_size, sym):
    """Ragged groups (80 = 2 x 32 + 16), odd widths, per channel; outliers in a few input channels."""
    mod = layer(k, n, QuantScheme(**w4a8(act_fmt, group_size, sym)))
    x = torch.randn(3, 5, k, generator=torch.Generator().manual_seed(1))
    x[..., :3] *= 30
    y = mod(x)
    assert y.shape == (3, 5, n) and y.dtype == torch.float32
    qa, a_scale = quantize_activations_reference(x.reshape(-1, k), mod.act_format)
    assert qa.dtype == (torch.int8 if act_fmt == "int" else torch.float8_e4m3fn)
    x_fq = qa.double() * a_scale.double()[:, None]
    w = mod.quantized_weight().dequantize(torch.float64)  # [N, K]
    ref = x_fq @ w.t() + mod.bias.double()
    bound = 2 * k * F32_EPS * (x_fq.abs() @ w.abs().t()) + F32_EPS * ref.abs()
    assert bool(((y.reshape(-1, n).double() - ref).abs() <= bound).all())
    assert mod.quantize_input(x.reshape(-1, k))[0].equal(qa)  # the reference quantizer, bit for bit


def test_buffers_are_w4a16s_and_bf16_inputs_run():
    scheme = QuantScheme(**w4a8())
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    mod = W4A8Linear.from_quantized(rtn(w, scheme), None, torch.float32)
    plain = QuantLinear.from_quantized(rtn(w, scheme.replace(act_bits=None, act_fmt=None)), None, torch.float32)
    assert dict(mod.state_dict()).keys() == dict(plain.state_dict()).keys() == {"qweight", "qzeros", "scales", "g_idx"}
    assert all(torch.equal(a, b) for a, b in zip(mod.state_dict().values(), plain.state_dict().values(), strict=True))
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert mod(x).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"expected input \[\.\.\., 64\]"):
        mod(torch.zeros(2, 63))
    with pytest.raises(QuantkitError, match="W4A8Linear needs a W4A8 scheme"):
        W4A8Linear(64, 32, QuantScheme())


@pytest.mark.parametrize("act_fmt, kernel_fmt", [("int", "int8"), ("fp8", "fp8")])
def test_cuda_path_hands_the_w4a16_kernel_weight_to_w4a8_linear(monkeypatch, act_fmt, kernel_fmt):
    """The CUDA branch (run here on CPU tensors) calls ``quantkit.kernels.w4a8.w4a8_linear(x, w, bias, fmt)`` with
    the ``W4A16Weight`` the W4A16 module would pass to its own kernel, built once."""
    from quantkit.kernels.w4a16 import W4A16Weight

    calls = []

    def w4a8_linear(x, w, bias=None, fmt="int8"):
        calls.append((x, w, bias, fmt))
        return torch.zeros(x.shape[0], w.out_features, dtype=x.dtype)

    monkeypatch.setitem(sys.modules, "quantkit.kernels.w4a8", types.SimpleNamespace(w4a8_linear=w4a8_linear))
    mod = layer(64, 32, QuantScheme(**w4a8(act_fmt)))
    x = torch.randn(3, 64, dtype=torch.float16)
    mod._forward_cuda(x)
    mod._forward_cuda(x)
    (x1, w1, b1, f1), (_, w2, _, _) = calls
    assert x1 is x and b1 is mod.bias and f1 == kernel_fmt and isinstance(w1, W4A16Weight) and w2 is w1
    assert torch.equal(w1.qweight, mod.qweight) and w1.bits == 4 and w1.group_size == 32


@pytest.mark.parametrize("act_fmt", ["int", "fp8"])
@pytest.mark.parametrize("group_size, sym", [(32, True), (-1, False)])
def test_the_kernel_path_agrees_with_the_simulation(act_fmt, group_size, sym):
    """The module's CUDA branch through the real kernel family (Triton's interpreter on CPU machines) and its CPU
    simulation see the same quantized operands: outputs within one fp16 rounding of the simulated fp32 result."""
    pytest.importorskip("quantkit.kernels.w4a8")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    scheme = QuantScheme(**w4a8(act_fmt, group_size, sym))
    g = torch.Generator().manual_seed(4)
    mod = W4A8Linear.from_quantized(rtn(torch.randn(48, 64, generator=g), scheme), torch.randn(48, generator=g),
                                    torch.float16).to(device)  # fmt: skip
    x = torch.randn(5, 64, generator=g).half().to(device)
    y = mod._forward_cuda(x)
    assert y.dtype == torch.float16 and y.shape == (5, 48)
    want = mod._forward_simulated(x.float())
    torch.testing.assert_close(y.float(), want, rtol=2**-10, atol=1e-3)


def test_a_missing_kernel_is_one_clear_error_not_a_fallback(monkeypatch):
    monkeypatch.setitem(sys.modules, "quantkit.kernels.w4a8", None)  # the import fails
    mod = layer(64, 32, QuantScheme(**w4a8()))
    with pytest.raises(QuantkitError) as err:
        mod._forward_cuda(torch.randn(2, 64, dtype=torch.float16))
    assert "W4A8 on CUDA needs the Triton kernel quantkit.kernels.w4a8.w4a8_linear" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(QuantkitError, match=r"takes float16 or bfloat16 activations, got torch\.float32"):
        mod._forward_cuda(torch.randn(2, 64))


# -- quantization, checkpoints, hook ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "recipe",
    [
        {"scheme": w4a8("int", 32), "stages": [{"method": "rtn"}]},
        {"scheme": w4a8("fp8", -1, sym=False), "stages": [{"method": "gptq"}]},
        preset_recipe("w4a8", {"group_size": 32}).to_dict(),
    ],
    ids=["rtn-int8-g32", "gptq-fp8-pc-asym", "preset-w4a8"],
)
def test_quantize_save_load_and_hook_give_identical_logits(tmp_path, recipe):
    model = quantized_tiny(recipe)
    mods = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(mods) == 14 and all(type(m) is W4A8Linear for m in mods)
    name = mods[0].scheme.name
    folder = quantkit.save_quantized(model, tmp_path / "q", tokenizer=tiny_tokenizer(320))
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["module_layouts"] == {name: "gptq_v2"} and qc["schemes"][name]["act_bits"] == 8
    loaded = quantkit.load_quantized(folder)
    hooked = AutoModelForCausalLM.from_pretrained(folder)  # the hook: `import quantkit` registered it
    assert type(hooked.model.layers[1].mlp.down_proj) is W4A8Linear
    assert torch.equal(logits(loaded), logits(model)) and torch.equal(logits(hooked), logits(model))
    report = json.loads((folder / "quant_report.json").read_text())["layers"]
    assert {rec["scheme"] for rec in report.values() if "scheme" in rec} == {name}


def test_smoothquant_error_fakes_the_4_bit_grid_and_the_activation_format():
    from quantkit.algorithms.smoothquant import w8a8_error

    g = torch.Generator().manual_seed(3)
    x, w, s = torch.randn(16, 64, generator=g), torch.randn(24, 64, generator=g), torch.rand(64, generator=g) + 0.5
    scheme = QuantScheme(**w4a8("fp8", 32))
    qa, a_scale = quantize_activations_reference(x / s, "fp8")
    y, yq = x @ w.t(), (qa.float() * a_scale[:, None]) @ rtn(w * s, scheme).dequantize().t()
    want = (yq - y).pow(2).sum().item() / y.pow(2).sum().item()
    assert w8a8_error([x], [w], s, scheme) == pytest.approx(want, rel=1e-6)


def test_smoothquant_searches_alpha_against_the_w4a8_numerics():
    model = quantized_tiny(preset_recipe("w4a8", {"group_size": 32}).to_dict())
    searches = [rec["smoothquant"]["search"] for rec in model.quantkit.layers.values() if "smoothquant" in rec]
    assert searches and all(s["scheme"] == "w4a8-int8-g32-sym" for s in searches)


# -- export and import ---------------------------------------------------------------------------------------------


@needs_compressed_tensors
@pytest.mark.parametrize("act_fmt, kind, preset", [("int", "int", "W4A8"), ("fp8", "float", "W4AFP8")])
def test_compressed_tensors_export_says_w4a8_and_imports_back_bit_for_bit(tmp_path, act_fmt, kind, preset):
    """The config group is compressed-tensors' own W4A8 / W4AFP8 preset (4-bit groups, 8-bit dynamic per-token
    input activations), its weights pack-quantized as W4A16's are; the library's decompressor reads the weights,
    and the import restores every tensor and the scheme exactly."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    model = quantized_tiny({"scheme": w4a8(act_fmt, 32), "stages": [{"method": "rtn"}]})
    q = quantkit.save_quantized(model, tmp_path / "q", tokenizer=tiny_tokenizer(320))
    done = export_checkpoint(q, tmp_path / "ct", "compressed-tensors")
    qc = json.loads((done.path / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert qc["format"] == group["format"] == "pack-quantized"
    library = preset_name_to_scheme(preset, ["Linear"]).input_activations
    config = QuantizationConfig.model_validate(qc)
    (parsed,) = config.config_groups.values()
    got = parsed.input_activations
    assert (got.num_bits, got.type, got.strategy, got.dynamic, got.symmetric) == (
        library.num_bits, library.type, library.strategy, library.dynamic, library.symmetric,
    ) and got.type == kind  # fmt: skip
    stored = load_file(done.path / "model.safetensors")
    for name, mod in model.named_modules():
        if isinstance(mod, W4A8Linear):
            local = {k.removeprefix(f"{name}."): v for k, v in stored.items() if k.startswith(f"{name}.weight")}
            local["weight_scale"] = local["weight_scale"].float()
            weight = PackedQuantizationCompressor.decompress(local, parsed)["weight"]
            torch.testing.assert_close(weight.float(), mod.dequantize_weight(), rtol=1e-6, atol=0)
    back = import_checkpoint(done.path, tmp_path / "back")
    original, restored = load_file(q / "model.safetensors"), load_file(back.path / "model.safetensors")
    assert original.keys() == restored.keys() and all(torch.equal(original[k], restored[k]) for k in original)
    qc_back = json.loads((back.path / "config.json").read_text())["quantization_config"]
    assert qc_back["schemes"] == json.loads((q / "config.json").read_text())["quantization_config"]["schemes"]
    assert torch.equal(logits(quantkit.load_quantized(back.path)), logits(model))


def _library_w4a8_folder(tmp_path, inputs: dict):
    """A tiny Llama whose down_proj of layer 1 compressed-tensors' own int-quantized compressor wrote with the
    library's W4A8 preset (the format 0.20.1 infers for it: one signed 4-bit code per int8), ``inputs`` over the
    preset's input activations; returns (folder, layer name, the library's compressed tensors, its scheme)."""
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from safetensors.torch import save_file

    model = tiny_model("llama")
    folder = tmp_path / "llmc"
    model.save_pretrained(folder)
    tiny_tokenizer(320).save_pretrained(folder)
    name = "model.layers.1.mlp.down_proj"
    preset = preset_name_to_scheme("W4A8", [name]).model_dump(mode="json")
    preset["weights"]["group_size"] = 32
    preset["input_activations"].update(inputs)
    qc = {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
          "config_groups": {"group_0": {**preset, "format": "int-quantized"}}, "ignore": []}  # fmt: skip
    (group,) = QuantizationConfig.model_validate(qc).config_groups.values()
    w = model.get_submodule(name).weight.detach()  # [64, 96]
    scale = (w.view(64, 3, 32).abs().amax(-1) / 7).half().float()  # fp16 values, as quantkit keeps them
    compressed = IntQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, group)
    tensors = load_file(folder / "model.safetensors")
    del tensors[f"{name}.weight"]
    tensors.update({f"{name}.{k}": v.contiguous() for k, v in compressed.items()})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return folder, name, compressed, group


@needs_compressed_tensors
def test_a_w4a8_layer_written_by_compressed_tensors_imports_as_that_library_decodes_it(tmp_path):
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor

    folder, name, compressed, group = _library_w4a8_folder(tmp_path, {})
    done = import_checkpoint(folder, tmp_path / "back")
    mod = quantkit.load_quantized(done.path).get_submodule(name)
    assert type(mod) is W4A8Linear and mod.scheme.name == "w4a8-int8-g32-sym"
    want = IntQuantizationCompressor.decompress(compressed, group)["weight"]
    torch.testing.assert_close(mod.dequantize_weight(), want.float(), rtol=1e-6, atol=0)


@needs_compressed_tensors
def test_w4a8_activations_quantkit_cannot_run_are_refused_in_one_line(tmp_path):
    folder, name, _, _ = _library_w4a8_folder(tmp_path, {"dynamic": False, "strategy": "tensor", "observer": "minmax"})
    with pytest.raises(QuantkitError) as err:
        import_checkpoint(folder, tmp_path / "back")
    assert str(err.value) == (f"{name}: 4-bit weights import with 8-bit activations quantized per token at run time "
                              "(W4A8), not 8-bit int by tensor, static")  # fmt: skip
    assert not (tmp_path / "back").exists()


def test_formats_that_cannot_say_w4a8_refuse_in_one_line(tmp_path):
    model = quantized_tiny({"scheme": w4a8("int", 32), "stages": [{"method": "rtn"}]})
    q = quantkit.save_quantized(model, tmp_path / "q")
    reasons = export_formats(q)
    assert reasons["compressed-tensors"] is None
    for fmt, what in (("gptq", "GPTQ"), ("awq", "AWQ"), ("fp8", "fp8 (DeepSeek-V3's layout)")):
        assert reasons[fmt] == (f"{what} cannot declare the 8-bit per-token activations of w4a8-int8-g32-sym (a "
                                "reader would run it as W4A16): export it as compressed-tensors")  # fmt: skip
        with pytest.raises(QuantkitError):
            export_checkpoint(q, tmp_path / fmt, fmt)
        assert not (tmp_path / fmt).exists()


# -- the CLI and the runtime ---------------------------------------------------------------------------------------


def test_cli_quantize_method_w4a8_then_eval(tmp_path):
    tiny = tiny_model_dir(tmp_path / "tiny")
    out = tmp_path / "q"
    args = ["quantize", "--model", tiny, "--method", "w4a8", "--group-size", "32", "--act-fmt", "fp8",
            "--nsamples", "4", "--seqlen", "32", "--out", out]  # fmt: skip
    r = CliRunner().invoke(cli, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert set(qc["schemes"]) == {"w4a8-fp8-g32-sym"} and [s["method"] for s in qc["recipe"]["stages"]] == [
        "smoothquant",
        "gptq",
    ]
    r = CliRunner().invoke(cli, ["eval", "--model", str(out), "--baseline", str(tiny), "--windows", "2",
                                 "--seqlen", "32", "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["perplexity"] > 1 and 0 <= res["top1_agreement"] <= 1
    bad = CliRunner().invoke(cli, ["quantize", "--model", str(tiny), "--method", "gptq", "--act-fmt", "fp8",
                                   "--out", str(tmp_path / "bad")])  # fmt: skip
    assert bad.exit_code == 2 and "act_fmt is the format of quantized activations" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "bad").exists()


@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused-qkv-gate-up"])
def test_runtime_serves_a_w4a8_checkpoint_with_the_hook_models_greedy_tokens(tmp_path, fuse):
    from quantkit.runtime import LLM, SamplingParams
    from quantkit.runtime.model import fuse_projections

    model = sharpen(tiny_model("qwen2"))  # q/k/v biases
    quantkit.quantize(model, {"scheme": w4a8("int", 32), "stages": [{"method": "rtn"}]})
    folder = quantkit.save_quantized(model, tmp_path / "q")
    hooked = AutoModelForCausalLM.from_pretrained(folder)
    prompts = random_prompts([7, 30, 2], COMMON["vocab_size"], seed=5)
    reference = hf_greedy(hooked, prompts, 12)
    llm = LLM(str(folder), device="cpu", num_kv_blocks=32, max_num_batched_tokens=16)
    assert type(llm.model.model.layers[0].mlp.down_proj) is W4A8Linear
    if fuse:
        assert fuse_projections(llm.model) == 2 * COMMON["num_hidden_layers"]
        assert type(llm.model.model.layers[0].self_attn.qkv_proj) is W4A8Linear
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12))
    assert [o.completions[0].token_ids for o in outputs] == reference
