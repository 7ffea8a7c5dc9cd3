"""Progressive W4A8 (QServe's two-level 4-bit weights, int8 per-token activations): the scheme, the module against
``progressive_reference``, its CUDA path's call into the kernel family, concatenation, the preset, checkpoints and
the HF hook, verification, refusals (export, AWQ's clip search), the CLI and the runtime.

The module's fp32 simulation multiplies fake-quantized activations (int8 codes times an fp32 scale: one rounding) by
s1 * d rounded once to fp32; against ``progressive_reference``'s float64 product of the same operands, each output is
within ``2 * K * eps(fp32) * sum_k |x_fq * w|`` (the fp32 dot-product bound with those roundings) plus one rounding.
"""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from click.testing import CliRunner
from quantkit.kernels.w4a8.progressive import ProgressiveWeight, progressive_reference
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import quantkit
from quantkit.algorithms.gptq import gptq
from quantkit.algorithms.rtn import rtn
from quantkit.checkpoint.export import export_checkpoint, export_formats
from quantkit.checkpoint.verify import verify_checkpoint
from quantkit.cli.main import cli
from quantkit.errors import QuantkitError
from quantkit.nn.progressive import ProgressiveW4A8Linear
from quantkit.plan import quantized_bytes
from quantkit.presets import preset_recipe
from quantkit.quant.scheme import QuantScheme
from quantkit.recipe import Recipe
from tests.runtime.helpers import hf_greedy, random_prompts, sharpen
from tests.tiny_models import COMMON, tiny_model, tiny_model_dir, tiny_tokenizer

F32_EPS = torch.finfo(torch.float32).eps
IDS = torch.randint(3, 320, (2, 12), generator=torch.Generator().manual_seed(0))
CALIB = torch.randint(3, 320, (4, 32), generator=torch.Generator().manual_seed(1))
NAME = "w4a8-int8-g32-progressive"


def progressive(group_size=32, **fields) -> dict:
    return {"bits": 4, "group_size": group_size, "act_bits": 8, "progressive": True, **fields}


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


# -- the scheme ----------------------------------------------------------------------------------------------------


def test_scheme_name_dict_and_symmetry():
    s = QuantScheme(**progressive(128, sym=True))
    assert s.name == "w4a8-int8-g128-progressive" and s.w4a8 and s.progressive and not s.packed
    assert not s.sym and s.act_fmt == "int"  # level 2 is asymmetric: sym is set false
    assert s.to_dict()["progressive"] is True and QuantScheme.from_dict(s.to_dict()) == s
    assert "progressive" not in QuantScheme(bits=4, group_size=128, act_bits=8).to_dict()  # others read as before


GROUPS_OF_32 = "progressive W4A8 needs a group_size that is a positive multiple of 32 (the kernel's K tiles), got"
NOT_W4A8 = "progressive is a W4A8 weight format (bits 4, act_bits 8), not for"


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            progressive(act_fmt="fp8"),
            "progressive W4A8 takes int8 activations (act_fmt int): its kernel sums int8 products in one int32 "
            "accumulator",
        ),
        ({"bits": 4, "progressive": True}, f"{NOT_W4A8} w4a16-g128-sym"),
        ({"bits": 8, "group_size": -1, "act_bits": 8, "progressive": True}, f"{NOT_W4A8} w8a8-int8-dynamic"),
        (progressive(48), f"{GROUPS_OF_32} 48"),
        (progressive(-1), f"{GROUPS_OF_32} -1"),
        (progressive(progressive="yes"), "scheme progressive must be true or false, got 'yes'"),
    ],
)
def test_impossible_schemes_are_one_line_errors(fields, message):
    with pytest.raises(QuantkitError) as err:
        QuantScheme(**fields)
    assert str(err.value) == message


# -- the module ----------------------------------------------------------------------------------------------------


def layer(k, n, group_size=32, act_order=False, bias=True, seed=0) -> ProgressiveW4A8Linear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.linspace(0.2, 3.0, n)[:, None]
    b = torch.randn(n, generator=g) if bias else None
    scheme = QuantScheme(**progressive(group_size))
    if act_order:
        x = torch.randn(256, k, generator=g) * (0.2 + 3 * torch.rand(k, generator=g))
        qw, _ = gptq(w, x.t() @ x, scheme, act_order=True, static_groups=False)
    else:
        qw = rtn(w, scheme)
    return ProgressiveW4A8Linear.from_quantized(qw, b, torch.float32)


@pytest.mark.parametrize("k, n, group_size, act_order", [(96, 40, 32, False), (80, 33, 32, False),
                                                         (160, 48, 64, True)])  # fmt: skip
def test_forward_equals_progressive_reference(k, n, group_size, act_order):
    """Ragged groups (80 = 2 x 32 + 16), odd widths, act-order (a channel permutation), outlier input channels."""
    mod = layer(k, n, group_size, act_order)
    assert (mod.kernel_weight().perm is not None) == act_order
    x = torch.randn(3, 5, k, generator=torch.Generator().manual_seed(1))
    x[..., :3] *= 30
    y = mod(x)
    assert y.shape == (3, 5, n) and y.dtype == torch.float32
    ref = progressive_reference(x, mod.kernel_weight(), mod.bias).reshape(-1, n)
    qa, a_scale = mod.quantize_input(x.reshape(-1, k))
    x_fq, w = qa.double() * a_scale.double()[:, None], mod.dequantize_weight(torch.float64)
    bound = 2 * k * F32_EPS * (x_fq.abs() @ w.abs().t()) + F32_EPS * ref.abs()
    assert bool(((y.reshape(-1, n).double() - ref).abs() <= bound).all())


@pytest.mark.parametrize("act_order", [False, True])
def test_buffers_round_trip_the_quantized_weight(act_order):
    """Buffers as documented; ``quantized_weight`` gives back the codes, grids and group map it was built from."""
    mod = layer(160, 48, 64, act_order)
    k, n = 160, 48
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in mod.state_dict().items()}
    assert shapes == {"qweight": ((20, n), torch.int32), "weight_scale": ((n,), torch.float32),
                      "group_scale": ((3, n), torch.uint8), "group_zero": ((3, n), torch.uint8),
                      "perm": ((k,), torch.int32), "bias": ((n,), torch.float32)}  # fmt: skip
    stored = sum(t.numel() * t.element_size() for name, t in mod.state_dict().items() if name != "bias")
    assert quantized_bytes(mod.scheme, n, k) == stored  # the plan's estimate of a checkpoint's size
    again = ProgressiveW4A8Linear.from_quantized(mod.quantized_weight(), mod.bias, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(mod.state_dict().values(), again.state_dict().values(), strict=True))
    assert torch.equal(mod.dequantize_weight(), mod.quantized_weight().dequantize())


def test_a_weight_off_the_progressive_grid_is_refused():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    with pytest.raises(QuantkitError, match="ProgressiveW4A8Linear needs a progressive W4A8 scheme"):
        ProgressiveW4A8Linear.from_quantized(rtn(w, QuantScheme(bits=4, group_size=32, act_bits=8)), None,
                                             torch.float32)  # fmt: skip
    qw = rtn(w, QuantScheme(**progressive()))
    qw.scales = qw.scales * 20  # level-2 scales of 20 and more: codes decode past int8
    with pytest.raises(QuantkitError, match="it is not on the progressive grid"):
        ProgressiveW4A8Linear.from_quantized(qw, None, torch.float32)


def test_cuda_path_hands_a_cached_progressive_weight_to_w4a8_linear(monkeypatch):
    """The CUDA branch (run here on CPU tensors) calls ``w4a8_linear(x, w, bias, fmt="int8")`` with the buffers as a
    ``ProgressiveWeight`` (sz = z * s2), built once and rebuilt when a buffer changes."""
    calls = []

    def w4a8_linear(x, w, bias=None, fmt="int8"):
        calls.append((x, w, bias, fmt))
        return torch.zeros(x.shape[0], w.out_features, dtype=x.dtype)

    monkeypatch.setitem(sys.modules, "quantkit.kernels.w4a8", types.SimpleNamespace(w4a8_linear=w4a8_linear))
    mod = layer(64, 32)
    x = torch.randn(3, 64, dtype=torch.float16)
    mod._forward_cuda(x)
    mod._forward_cuda(x)
    (x1, w1, b1, f1), (_, w2, _, _) = calls
    assert x1 is x and b1 is mod.bias and f1 == "int8" and isinstance(w1, ProgressiveWeight) and w2 is w1
    assert torch.equal(w1.qweight, mod.qweight) and w1.s1 is mod.weight_scale and w1.perm is None
    assert torch.equal(w1.sz, (mod.group_zero.int() * mod.group_scale.int()).to(torch.uint8))
    mod.weight_scale.mul_(2)
    mod._forward_cuda(x)
    assert calls[2][1] is not w1
    with pytest.raises(QuantkitError, match=r"takes float16 or bfloat16 activations, got torch\.float32"):
        mod._forward_cuda(torch.randn(2, 64))


@pytest.mark.parametrize("act_order", [False, True])
def test_the_kernel_path_agrees_with_the_simulation(act_order):
    """The CUDA branch through the real progressive kernel (Triton's interpreter on CPU machines) and the CPU
    simulation see the same quantized operands: outputs within one fp16 rounding of the simulated fp32 result."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mod = layer(96, 48, 32, act_order).half().to(device)
    mod.weight_scale = mod.weight_scale.float()  # .half() converts every float buffer
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(4)).half().to(device)
    y = mod._forward_cuda(x)
    assert y.dtype == torch.float16 and y.shape == (5, 48)
    torch.testing.assert_close(y.float(), mod._forward_simulated(x.float()), rtol=2**-10, atol=1e-3)


def test_concat_is_exact_and_refuses_different_channel_orders():
    parts = [layer(96, n, seed=i, bias=i != 1) for i, n in enumerate((64, 32, 32))]
    fused = ProgressiveW4A8Linear.concat(parts)
    assert (fused.in_features, fused.out_features) == (96, 128) and torch.equal(fused.bias[64:96], torch.zeros(32))
    assert torch.equal(fused.dequantize_weight(), torch.cat([p.dequantize_weight() for p in parts]))
    x = torch.randn(5, 96)
    torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], dim=-1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="act-order"):
        ProgressiveW4A8Linear.concat([layer(96, 32, act_order=True, seed=1), layer(96, 32, act_order=True, seed=2)])


# -- quantization, checkpoints, hook, verification -----------------------------------------------------------------


@pytest.mark.parametrize(
    "recipe",
    [
        {"scheme": progressive(), "stages": [{"method": "rtn"}]},
        {"scheme": progressive(), "stages": [{"method": "gptq", "params": {"static_groups": False}}]},
        preset_recipe("w4a8-progressive", {"group_size": 32}).to_dict(),
    ],
    ids=["rtn", "gptq-act-order", "preset"],
)
def test_quantize_save_load_and_hook_give_identical_logits(tmp_path, recipe):
    model = tiny_model("llama")
    quantkit.quantize(model, recipe, calib=None if recipe["stages"][0]["method"] == "rtn" else CALIB)
    mods = [m for m in model.modules() if isinstance(m, ProgressiveW4A8Linear)]
    assert len(mods) == 14 and {m.scheme.name for m in mods} == {NAME}
    folder = quantkit.save_quantized(model, tmp_path / "q", tokenizer=tiny_tokenizer(320))
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["module_layouts"] == {NAME: "progressive_w4a8"} and qc["schemes"][NAME]["progressive"] is True
    loaded = quantkit.load_quantized(folder)
    hooked = AutoModelForCausalLM.from_pretrained(folder)  # the hook: `import quantkit` registered it
    assert type(hooked.model.layers[1].mlp.down_proj) is ProgressiveW4A8Linear
    saved, reloaded = model.state_dict(), loaded.state_dict()
    assert all(torch.equal(saved[k], reloaded[k]) for k in saved if "layers" in k)  # bit-identical buffers
    assert torch.equal(logits(loaded), logits(model)) and torch.equal(logits(hooked), logits(model))
    report = json.loads((folder / "quant_report.json").read_text())["layers"]
    assert {rec["scheme"] for rec in report.values() if "scheme" in rec} == {NAME}
    assert verify_checkpoint(folder).ok


UP = "model.layers.0.mlp.up_proj"


def damaged_checkpoint(tmp_path, damage):
    """A tiny progressive RTN checkpoint whose tensors ``damage`` edits in place."""
    model = tiny_model("llama")
    quantkit.quantize(model, {"scheme": progressive(), "stages": [{"method": "rtn"}]})
    folder = quantkit.save_quantized(model, tmp_path / "q")
    tensors = load_file(folder / "model.safetensors")
    damage(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_verify_names_a_group_scale_off_the_grid(tmp_path):
    folder = damaged_checkpoint(tmp_path, _set("group_scale", (0, 0), 16))
    problems = verify_checkpoint(folder).problems
    assert problems["scales"] == [f"{UP}.group_scale holds scales outside [1, 15]"]


def _set(key, index, value):
    def damage(tensors):
        tensors[f"{UP}.{key}"][index] = value

    return damage


def _cast(key, dtype):
    def damage(tensors):
        tensors[f"{UP}.{key}"] = tensors[f"{UP}.{key}"].to(dtype)

    return damage


@pytest.mark.parametrize(
    "damage, message",
    [
        (_set("group_scale", (0, 0), 0), "group_scale holds scales outside [1, 15]"),
        (_set("group_scale", (0, 0), 200), "group_scale holds scales outside [1, 15]"),
        (_set("group_zero", (0, 0), 200), "group_zero holds zero points outside [0, 15]"),
        (_set("perm", 0, 1), "perm is not a permutation of its 64 inputs"),
        (_set("perm", 0, 10_000), "perm is not a permutation of its 64 inputs"),
        (_set("perm", 0, -1), "perm is not a permutation of its 64 inputs"),
        (_cast("group_scale", torch.int32), "group_scale is stored as I32, expected U8"),
        (_cast("group_zero", torch.int8), "group_zero is stored as I8, expected U8"),
        (_cast("perm", torch.int64), "perm is stored as I64, expected I32"),
        (_cast("qweight", torch.uint8), "qweight is stored as U8, expected I32"),
    ],
    ids=[
        "s2-0",
        "s2-200",
        "z-200",
        "perm-repeats",
        "perm-past-k",
        "perm-negative",
        "s2-int32",
        "z-int8",
        "perm-int64",
        "qweight-uint8",
    ],
)
def test_loading_refuses_buffers_off_the_grid_or_of_another_dtype(tmp_path, damage, message):
    """Unchecked, such a checkpoint loads and runs on wrong weights (the CUDA kernel wrapping past int8) or fails at
    its first forward with an IndexError. transformers keeps an integer tensor's stored dtype, so the dtype is
    checked against the layer's before the weights load."""
    folder = damaged_checkpoint(tmp_path, damage)
    for load in (quantkit.load_quantized, AutoModelForCausalLM.from_pretrained):  # the hook checks as much
        with pytest.raises(QuantkitError) as err:
            load(folder)
        assert str(err.value) == f"corrupt checkpoint {folder}: {UP}.{message}"


def test_the_hook_refuses_a_missing_buffer(tmp_path):
    """transformers leaves a buffer the checkpoint lacks uninitialised (a warning): the hook names it."""
    folder = damaged_checkpoint(tmp_path, lambda tensors: tensors.pop(f"{UP}.perm"))
    with pytest.raises(QuantkitError) as err:
        AutoModelForCausalLM.from_pretrained(folder)
    assert str(err.value) == f"corrupt checkpoint {folder}: 1 tensors missing, e.g. {UP}.perm"


def test_loading_refuses_codes_that_decode_outside_int8(tmp_path):
    """Scales and zero points each in range, yet s2 * (q - z) past int8 for some code of the group."""

    def damage(tensors):
        tensors[f"{UP}.group_scale"][0, 0], tensors[f"{UP}.group_zero"][0, 0] = 15, 15
        tensors[f"{UP}.qweight"][:4, 0] = 0  # codes 0 of the first 32 inputs of output 0: d = 15 * (0 - 15) = -225

    folder = damaged_checkpoint(tmp_path, damage)
    from quantkit.runtime import LLM

    serve = lambda f: LLM(str(f), device="cpu", num_kv_blocks=32)  # the runtime's own loader
    for load in (quantkit.load_quantized, AutoModelForCausalLM.from_pretrained, serve):
        with pytest.raises(QuantkitError) as err:
            load(folder)
        assert str(err.value).endswith(f"{UP}.qweight: codes decode outside int8 [-128, 127] (s2 * (q - z))")


def test_every_export_format_refuses_the_two_level_grid_in_one_line(tmp_path):
    model = tiny_model("llama")
    quantkit.quantize(model, {"scheme": progressive(), "stages": [{"method": "rtn"}]})
    q = quantkit.save_quantized(model, tmp_path / "q")
    reasons = export_formats(q)
    for fmt, what in (("compressed-tensors", "compressed-tensors"), ("gptq", "GPTQ"), ("awq", "AWQ"), ("fp8", "fp8")):
        assert reasons[fmt] == (f"{what} cannot hold {NAME}'s two-level grid (integer group scales and zeros under "
                                "a per-channel scale, QServe's format): it stays a quantkit checkpoint")  # fmt: skip
        with pytest.raises(QuantkitError) as err:
            export_checkpoint(q, tmp_path / fmt, fmt)
        assert "two-level grid" in str(err.value) and not (tmp_path / fmt).exists()


def test_awq_refuses_progressive_as_every_w4a8_scheme():
    """AWQ's scale and clip searches are for weight-only schemes; SmoothQuant is W4A8's migration."""
    with pytest.raises(QuantkitError) as err:
        quantkit.quantize(tiny_model("llama"), {"scheme": progressive(), "stages": [{"method": "awq"}]}, calib=CALIB)
    assert str(err.value).endswith(f": awq searches for weight-only integer schemes, got {NAME}")


@pytest.mark.parametrize("where", ["stage", "override"])
def test_gptq_clipped_grids_are_refused_when_the_recipe_is_read(where):
    """mse: true with a progressive scheme (the stage's, or one an override makes) fails before any model loads."""
    recipe = {"scheme": progressive(), "stages": [{"method": "gptq", "params": {"mse": True}}]}
    if where == "override":
        override = {"match": "re:.*down_proj", "scheme": {"progressive": True}}
        stage = {"method": "gptq", "params": {"mse": True}, "overrides": [override]}
        recipe = {"scheme": {**progressive(), "progressive": False}, "stages": [stage]}
    with pytest.raises(QuantkitError, match=r"stages\[0\]: gptq mse: true clips grids, but .* takes QServe's min-max"):
        Recipe.from_dict(recipe)


# -- the CLI and the runtime ---------------------------------------------------------------------------------------


def test_cli_quantize_method_w4a8_progressive_then_inspect(tmp_path):
    tiny = tiny_model_dir(tmp_path / "tiny")
    out = tmp_path / "q"
    args = ["quantize", "--model", tiny, "--method", "w4a8-progressive", "--group-size", "32",
            "--nsamples", "4", "--seqlen", "32", "--out", out]  # fmt: skip
    r = CliRunner().invoke(cli, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert set(qc["schemes"]) == {NAME} and [s["method"] for s in qc["recipe"]["stages"]] == ["smoothquant", "gptq"]
    r = CliRunner().invoke(cli, ["inspect", str(out), "--json"])
    assert r.exit_code == 0, r.output
    assert {m["scheme"] for m in json.loads(r.stdout)["modules"]} == {NAME}
    bad = CliRunner().invoke(cli, ["quantize", "--model", str(tiny), "--method", "w4a8-progressive", "--act-fmt",
                                   "fp8", "--out", str(tmp_path / "bad")])  # fmt: skip
    assert bad.exit_code == 2 and "progressive W4A8 takes int8 activations" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "bad").exists()


@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused-qkv-gate-up"])
def test_runtime_serves_a_progressive_checkpoint_with_the_hook_models_greedy_tokens(tmp_path, fuse):
    from quantkit.runtime import LLM, SamplingParams
    from quantkit.runtime.model import fuse_projections

    model = sharpen(tiny_model("qwen2"))  # q/k/v biases
    quantkit.quantize(model, {"scheme": progressive(), "stages": [{"method": "rtn"}]})
    folder = quantkit.save_quantized(model, tmp_path / "q")
    hooked = AutoModelForCausalLM.from_pretrained(folder)
    prompts = random_prompts([7, 30, 2], COMMON["vocab_size"], seed=5)
    reference = hf_greedy(hooked, prompts, 12)
    llm = LLM(str(folder), device="cpu", num_kv_blocks=32, max_num_batched_tokens=16)
    assert type(llm.model.model.layers[0].mlp.down_proj) is ProgressiveW4A8Linear
    if fuse:
        assert fuse_projections(llm.model) == 2 * COMMON["num_hidden_layers"]
        assert type(llm.model.model.layers[0].self_attn.qkv_proj) is ProgressiveW4A8Linear
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12))
    assert [o.completions[0].token_ids for o in outputs] == reference
