"""The gptq recipe stage on tiny models: parameters, true-sequential, MoE experts without tokens, and act-order
checkpoints that reload with identical logits."""

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

import quantkit
from quantkit.algorithms.rtn import rtn
from quantkit.errors import QuantkitError
from quantkit.nn.factory import quantized_modules
from quantkit.quant import QuantScheme
from quantkit.recipe import Recipe
from quantkit.stages import parse_params, stage_class
from quantkit.stages.gptq import GPTQStage
from tests.tiny_models import tiny_model

SCHEME = {"bits": 4, "group_size": 32, "sym": False}


def gptq_recipe(bits: int = 4, **params) -> Recipe:
    scheme = {**SCHEME, "bits": bits}
    return Recipe.from_dict({"scheme": scheme, "stages": [{"method": "gptq", "params": params}]})


def calib_ids(n=16, length=32, seed=0) -> torch.Tensor:
    return torch.randint(3, 160, (n, length), generator=torch.Generator().manual_seed(seed))


def test_params_defaults_and_validation():
    p = parse_params("gptq", None, "params")
    assert stage_class("gptq") is GPTQStage and isinstance(p, GPTQStage.Params)  # registered under its method name
    assert (p.damp, p.block_size, p.act_order, p.static_groups, p.true_sequential, p.mse) == (
        0.01, 128, True, "auto", True, "auto"
    )  # fmt: skip
    bad = [
        ({"damp": -0.1}, "damp"),
        ({"damp": float("nan")}, "damp"),
        ({"damp": "0.01"}, "damp"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": 64.0}, "block_size"),
        ({"act_order": "yes"}, "act_order"),
        ({"static_groups": 1}, "static_groups must be auto, true or false"),
        ({"true_sequential": None}, "true_sequential"),
        ({"mse": "on"}, "mse must be auto, true or false"),
        ({"mse": 1}, "mse must be auto, true or false"),
        ({"desc_act": True}, "unknown key 'desc_act'"),
    ]
    for data, message in bad:
        with pytest.raises(QuantkitError, match=message):
            parse_params("gptq", data, "params")


@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen3_moe"])
def test_act_order_checkpoint_reloads_with_identical_logits(arch, tmp_path):
    model = tiny_model(arch)
    ids = calib_ids(2, 12, seed=1)
    with torch.no_grad():
        float_logits = model(ids).logits
    result = quantkit.quantize(model, gptq_recipe(act_order=True, static_groups=False, block_size=16), calib_ids())
    report = result.layers
    assert all(r["method"] == "gptq" and r["loss"] >= 0 and r["damp"] == 0.01 for r in report.values())
    modules = quantized_modules(model)
    assert len(modules) == len(report)
    non_monotonic = [n for n, m in modules.items() if bool((m.g_idx[1:] < m.g_idx[:-1]).any())]
    assert len(non_monotonic) > len(modules) // 2, "act-order should permute most layers' groups"
    with torch.no_grad():
        q_logits = model(ids).logits
    assert not torch.equal(q_logits, float_logits)
    assert (q_logits - float_logits).abs().mean() < 0.5 * float_logits.abs().mean()

    out = quantkit.save_quantized(model, tmp_path / "q")
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    reloaded_modules = quantized_modules(reloaded)
    assert set(reloaded_modules) == set(modules)
    for name in non_monotonic:
        assert torch.equal(reloaded_modules[name].g_idx, modules[name].g_idx)
    with torch.no_grad():
        r_logits = reloaded(ids).logits
    torch.testing.assert_close(r_logits, q_logits, rtol=0, atol=0)


def test_true_sequential_calibrates_on_quantized_outputs():
    """q/k/v see the same float inputs either way; o_proj's inputs depend on whether q/k/v were quantized first."""
    reports = {}
    for seq in (True, False):
        model = tiny_model("llama")
        reports[seq] = quantkit.quantize(model, gptq_recipe(true_sequential=seq), calib_ids()).layers
    q, o = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"
    assert reports[True][q]["loss"] == reports[False][q]["loss"]
    assert reports[True][o]["loss"] != reports[False][o]["loss"]


@pytest.mark.parametrize("arch", ["llama", "gemma2", "opt", "mixtral", "qwen2_moe"])
def test_replaying_settled_blocks_changes_nothing(arch):
    """Replaying the quantized attention block's outputs for the MLP's groups and the pass that feeds the next layer
    (instead of running it again) gives the very same checkpoint and report, and runs the attention block fewer
    times."""
    import quantkit.stages.weights as weights

    def quantize(replay: bool):
        model = tiny_model(arch)
        attn = model.get_submodule("model.decoder.layers.0" if arch == "opt" else "model.layers.0").self_attn
        calls = []
        run = type(attn).forward

        def counted(self, *args, **kwargs):
            calls.append(1)
            return run(self, *args, **kwargs)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(type(attn), "forward", counted)
            if not replay:
                mp.setattr(weights, "settled_children", lambda done, to_do: set())
            report = quantkit.quantize(model, gptq_recipe(), calib_ids(n=12), device="cpu").layers  # CPU only
        return model.state_dict(), report, len(calls)

    (state, report, calls), (state0, report0, calls0) = quantize(True), quantize(False)
    assert state.keys() == state0.keys()
    for key in state:
        assert torch.equal(state[key], state0[key]), key
    assert report == {n: {**r, "seconds": report[n]["seconds"]} for n, r in report0.items()}
    assert calls < calls0


def starve_expert(model, expert: int) -> None:
    """Make layer 0's router never pick ``expert``: hidden channel 0 is a positive constant entering layer 0's MLP
    (embedding column set, attention output row zeroed) and the expert's router row reads -100 x channel 0.
    The other embedding channels get unit scale so that tokens still differ and route to all other experts."""
    layer = model.model.layers[0]
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.copy_(torch.randn(emb.shape, generator=torch.Generator().manual_seed(0)))
        emb[:, 0] = 3.0
        layer.self_attn.o_proj.weight[0] = 0.0
        layer.post_attention_layernorm.weight[0] = 1.0
        layer.mlp.gate.weight[expert] = 0.0
        layer.mlp.gate.weight[expert, 0] = -100.0


def test_moe_expert_without_tokens_is_rtn_and_reported(caplog):
    model = tiny_model("mixtral")
    starve_expert(model, 3)
    with caplog.at_level(logging.WARNING, logger="quantkit.stages.gptq"):
        result = quantkit.quantize(model, gptq_recipe(), calib_ids())
    starved = [n for n, r in result.layers.items() if r.get("tokens") == 0]
    prefix = "model.layers.0.mlp.experts.3."
    assert sorted(starved) == [prefix + p for p in ("down_proj", "gate_proj", "up_proj")]
    for name in starved:
        assert result.layers[name]["fallback"].startswith("rtn")
        assert "loss" not in result.layers[name]
        assert f"{name} received no calibration tokens" in caplog.text
    others = [r for n, r in result.layers.items() if n not in starved]
    assert all(r["tokens"] > 0 and "fallback" not in r for r in others)

    fresh = tiny_model("mixtral")
    starve_expert(fresh, 3)
    quantkit.pipeline.prepare_model(fresh)
    expected = rtn(fresh.model.layers[0].mlp.experts[3].up_proj.weight, QuantScheme(**SCHEME)).dequantize()
    got = model.model.layers[0].mlp.experts[3].up_proj.dequantize_weight()
    assert torch.equal(got, expected)


def test_act_order_with_static_groups_reloads_with_identical_logits(tmp_path):
    """desc_act with static groups: columns processed by decreasing diag(H), but g_idx stays k // G."""
    model = tiny_model("llama")
    ids = calib_ids(2, 12, seed=1)
    quantkit.quantize(model, gptq_recipe(act_order=True, static_groups=True, block_size=16), calib_ids())
    modules = quantized_modules(model)
    for m in modules.values():
        k = m.g_idx.shape[0]
        assert torch.equal(m.g_idx.cpu(), (torch.arange(k) // SCHEME["group_size"]).to(m.g_idx.dtype))
    with torch.no_grad():
        q_logits = model(ids).logits
    reloaded = AutoModelForCausalLM.from_pretrained(quantkit.save_quantized(model, tmp_path / "q")).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, q_logits, rtol=0, atol=0)


def test_default_grid_is_chosen_per_linear_on_held_out_windows():
    """mse "auto": every 4th calibration window judges min-max against MSE-clipped grids; the report says which
    won and by how much, and the linear is quantized with the winner on all windows: the weights of a run that
    fixes that grid (compared in layer 0 without true-sequential, where every linear sees the float inputs)."""
    model = tiny_model("llama")
    report = quantkit.quantize(model, gptq_recipe(block_size=16, true_sequential=False), calib_ids(16, 32)).layers
    assert all(r["tokens"] == 16 * 32 and r["heldout_tokens"] == 4 * 32 for r in report.values())
    for r in report.values():
        losses = r["heldout_loss"]
        assert r["grid"] == ("mse" if losses["mse"] < losses["minmax"] else "minmax")
    chosen = {n: r["grid"] == "mse" for n, r in report.items() if n.startswith("model.layers.0.")}
    assert sum(chosen.values()) > 0, "random weights with 4-bit groups of 32: clipping helps some linears"
    for grid in (False, True):
        fixed = tiny_model("llama")
        quantkit.quantize(fixed, gptq_recipe(block_size=16, true_sequential=False, mse=grid), calib_ids(16, 32))
        fixed_modules = quantized_modules(fixed)
        for name, m in quantized_modules(model).items():
            if chosen.get(name) == grid:
                assert torch.equal(m.qweight, fixed_modules[name].qweight), name


def test_default_grid_holds_out_every_fourth_window_whatever_the_batch_size():
    """Windows are numbered across batches: batches of 2 hold out windows 3 and 7 of 8; fewer than four windows in
    all hold none out: min-max, and the report says why."""
    recipe = Recipe.from_dict({"scheme": SCHEME, "calibration": {"batch_size": 2}, "stages": [{"method": "gptq"}]})
    report = quantkit.quantize(tiny_model("llama"), recipe, calib_ids(8, 32)).layers
    assert {r["heldout_tokens"] for r in report.values()} == {2 * 32}
    report = quantkit.quantize(tiny_model("llama"), recipe, calib_ids(3, 32)).layers
    assert {r["grid"] for r in report.values()} == {"minmax"}
    assert {r["grid_reason"] for r in report.values()} == {"no held-out calibration windows"}


def test_default_checkpoint_exports_to_compressed_tensors_and_reads_back_bit_identically(tmp_path):
    """Static groups by default: g_idx is k // G, so the checkpoint exports to compressed-tensors (which has no
    g_idx) and imports back as the same integers and the same logits."""
    import importlib.util

    from safetensors.torch import load_file

    from quantkit.checkpoint.export import export_checkpoint
    from quantkit.checkpoint.foreign import import_checkpoint

    if importlib.util.find_spec("compressed_tensors") is None:
        pytest.skip("needs the compressed-tensors package")
    model = tiny_model("llama")
    quantkit.quantize(model, Recipe.from_dict({"scheme": SCHEME, "stages": [{"method": "gptq"}]}), calib_ids())
    q = quantkit.save_quantized(model, tmp_path / "q")
    exported = export_checkpoint(q, tmp_path / "ct", "compressed-tensors")
    back = import_checkpoint(exported.path, tmp_path / "back")
    assert back.method == "compressed-tensors" and back.scale_change == 0.0

    def tensors(folder):
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            out.update(load_file(f))
        return out

    original, again = tensors(q), tensors(back.path)
    assert set(original) == set(again)
    for name, t in original.items():
        assert t.dtype == again[name].dtype and torch.equal(t, again[name]), name
    ids = calib_ids(2, 12, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(
            quantkit.load_quantized(back.path)(ids).logits, quantkit.load_quantized(q)(ids).logits, rtol=0, atol=0
        )


def held_out_output_error(float_model, model, ids) -> float:
    """Mean over quantized linears of ||X (W - Q)^T||^2 / ||X W^T||^2, X the float model's inputs on ``ids``."""
    inputs = {}
    linears = {n: m for n, m in float_model.named_modules() if isinstance(m, torch.nn.Linear)}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: inputs.setdefault(n, a[0])) for n, m in linears.items()]
    with torch.no_grad():
        float_model(ids)
    for h in hooks:
        h.remove()
    errors = []
    for name, q in quantized_modules(model).items():
        w, x = linears[name].weight.detach(), inputs[name].reshape(-1, inputs[name].shape[-1])
        errors.append(float(((x @ (w - q.dequantize_weight()).t()) ** 2).sum() / ((x @ w.t()) ** 2).sum()))
    return sum(errors) / len(errors)


@pytest.mark.parametrize("bits,bound", [(4, 1.05), (3, 1.0)])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "mistral", "phi3", "opt"])
def test_default_against_the_old_default_on_held_out_output_error(arch, bits, bound):
    """The default (at 4 bits static groups and grids chosen on held-out windows; at 3 bits act-order groups and MSE
    grids) against the old one (act-order groups, MSE grids everywhere) on random-weight models, judged on windows
    neither saw. Act-order groups fit random Gaussian weights better: at 4 bits static groups cost up to 3.8% of
    this error on these families (measured 1.007x-1.038x, g32, two model seeds), the price of checkpoints that vLLM
    serves from compressed-tensors; at 3 bits the default is the old one. The default must beat min-max grids
    everywhere (random weights have tails that clipping helps)."""
    base = tiny_model(arch)
    calib, held = calib_ids(32, 64, seed=100), calib_ids(16, 64, seed=200)
    errors = {}
    for label, params in (("old", {"static_groups": False, "mse": True}), ("new", {}), ("minmax", {"mse": False})):
        model = tiny_model(arch)
        result = quantkit.quantize(model, gptq_recipe(bits, **params), calib)
        errors[label] = held_out_output_error(base, model, held)
        if label == "new":
            groups = {rec["groups"] for rec in result.layers.values() if "groups" in rec}
            assert groups == {"static" if bits == 4 else "act-order"}, groups
            if bits == 3:
                assert {(r["grid"], r["grid_reason"]) for r in result.layers.values()} == {
                    ("mse", "3-bit: clipped grids")
                }
    assert errors["new"] <= bound * errors["old"], errors
    assert errors["new"] < errors["minmax"], errors
