import copy
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import quantkit
from quantkit.algorithms.smoothquant import search_alpha, smoothing_scales, w8a8_error, weight_absmax
from quantkit.calib.stats import StatsCollector
from quantkit.checkpoint.smoothing import outlier_markdown, outlier_rows
from quantkit.errors import QuantkitError
from quantkit.models.arch import arch_for
from quantkit.models.fold import bind_smooth_groups
from quantkit.nn.factory import quantized_modules
from quantkit.nn.w8a8 import W8A8Linear, set_execution, static_input_scale
from quantkit.presets import preset_recipe
from quantkit.quant.scheme import QuantScheme
from quantkit.recipe import Recipe, load_recipe
from quantkit.stages.smoothquant import SmoothQuantParams
from tests.tiny_models import CONFIGS, tiny_model

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
W8A8_DYNAMIC = QuantScheme(bits=8, group_size=-1, sym=True, act_bits=8, act_dynamic=True)
W8A8_STATIC = W8A8_DYNAMIC.replace(act_dynamic=False)
SMOOTH_ONLY = Recipe.from_dict({"stages": [{"method": "smoothquant", "params": {"alpha": 0.5}}]})


def calib_ids(n=8, seqlen=32, seed=0):
    return torch.randint(3, 160, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def outlier_layer(seed=0, t=512, k=96, n=(80, 48), n_outliers=3, magnitude=60.0):
    """A group's inputs x [t, k] with a few large channels (as in LLM activations) and consumer weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g)
    x[:, :n_outliers] *= magnitude
    weights = [torch.randn(rows, k, generator=g) * 0.05 for rows in n]
    return x, weights


# -- the math -------------------------------------------------------------------------------------------------


def test_smoothing_scales_follow_eq4_with_guards():
    act = torch.tensor([4.0, 1.0, 0.0, 9.0, 2.0], dtype=torch.float64)
    w = torch.tensor([1.0, 4.0, 2.0, 0.0, 0.5], dtype=torch.float64)
    s = smoothing_scales(act, w, 0.5)
    # sqrt(4)/sqrt(1), sqrt(1)/sqrt(4); channels with no activation or no weight are left alone
    torch.testing.assert_close(s, torch.tensor([2.0, 0.5, 1.0, 1.0, 2.0]), rtol=1e-6, atol=0)
    torch.testing.assert_close(smoothing_scales(act, w, 0.75)[:2], torch.tensor([4**0.75, 4**-0.25]), rtol=1e-6, atol=0)
    # alpha 1 puts the whole range on the weights: the smoothed activations all have abs-max 1
    live = smoothing_scales(act, w, 1.0)[[0, 1, 4]]
    torch.testing.assert_close(live, act[[0, 1, 4]].float())


@pytest.mark.parametrize("scheme", [W8A8_DYNAMIC, W8A8_STATIC], ids=["dynamic", "static"])
def test_smoothing_beats_plain_w8a8_on_outlier_channels(scheme):
    x, weights = outlier_layer()
    amax = [x.abs().amax(0)] * len(weights)
    s = smoothing_scales(x.abs().amax(0), weight_absmax(weights), 0.5)
    plain = w8a8_error([x] * 2, weights, torch.ones(x.shape[1]), scheme, amax)
    smooth = w8a8_error([x] * 2, weights, s, scheme, amax)
    # outliers 60x the other channels: int8 steps are 60x too coarse for the rest; s = sqrt(ratio) gains >= 5x
    assert smooth < plain / 5, (smooth, plain)


def reference_group_error(x, weights, s, scheme):
    """The same error measured through the deployed module: fold s into the weights, build the W8A8Linear the
    rtn stage builds (static: input scale from the smoothed calibration abs-max) and run its simulated path."""
    xs = x / s
    num = den = 0.0
    for w in weights:
        input_scale = None if scheme.act_dynamic else static_input_scale(xs.abs().max(), scheme)
        linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data = w * s
        layer = W8A8Linear.from_float(linear, scheme, input_scale)
        y = x @ w.t()
        num += (layer(xs) - y).pow(2).sum().item()
        den += y.pow(2).sum().item()
    return num / den


@pytest.mark.parametrize(
    "scheme",
    [W8A8_DYNAMIC, W8A8_STATIC, W8A8_DYNAMIC.replace(fmt="fp8"), W8A8_STATIC.replace(fmt="fp8")],
    ids=lambda s: s.name,
)
def test_alpha_search_picks_a_grid_point_no_worse_than_half(scheme):
    x, weights = outlier_layer(seed=3, magnitude=25.0)
    act = x.abs().amax(0)
    grid = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    found = search_alpha([x, x], weights, act, grid, scheme, input_absmax=[act, act])
    assert found.alpha in grid
    # the search's own objective is what the deployed W8A8Linear computes (fp32 summation order aside)
    for a, err in zip(grid, found.errors, strict=True):
        ref = reference_group_error(x, weights, smoothing_scales(act, weight_absmax(weights), a), scheme)
        assert abs(err - ref) <= 1e-5 * ref, (a, err, ref)
    chosen = reference_group_error(x, weights, found.scales, scheme)
    half = reference_group_error(x, weights, smoothing_scales(act, weight_absmax(weights), 0.5), scheme)
    assert chosen <= half * (1 + 1e-6)
    assert chosen < found.error_unsmoothed


# -- the stage on tiny models of every architecture -----------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_smoothing_leaves_float_logits_unchanged(arch):
    model = tiny_model(arch)
    ids = calib_ids(2, 16, seed=1)
    with torch.no_grad():
        before = model(ids).logits
    norms_before = {n: p.detach().clone() for n, p in model.named_parameters() if "norm" in n}
    result = quantkit.quantize(model, SMOOTH_ONLY, calib_ids())
    with torch.no_grad():
        after = model(ids).logits
    rel = ((after - before).norm() / before.norm()).item()
    assert rel < 1e-5, rel
    spec = arch_for(model)
    n_groups = sum(len(bind_smooth_groups(layer, spec)) for layer in model.get_submodule(spec.layers))
    assert len(outlier_rows(result.layers)) == n_groups > 0
    changed = [n for n, p in model.named_parameters() if n in norms_before and not torch.equal(p, norms_before[n])]
    assert changed, "no norm was rescaled"
    assert not quantized_modules(model), "a transform stage quantized something"


def test_smoothing_lowers_the_outlier_ratio_it_reports():
    model = tiny_model("llama")
    with torch.no_grad():  # give two channels of the attention input real outliers
        model.model.layers[0].input_layernorm.weight[:2] *= 40
    result = quantkit.quantize(model, SMOOTH_ONLY, calib_ids())
    row = next(r for r in outlier_rows(result.layers) if r["producer"] == "model.layers.0.input_layernorm")
    assert row["outlier_before"] > 20 and row["outlier_after"] < row["outlier_before"] / 4, row
    # measured independently on the smoothed model: q_proj's inputs now have the reported ratio
    q = model.model.layers[0].self_attn.q_proj
    with StatsCollector({"q": q}, hessian=False) as st, torch.no_grad():
        model(calib_ids())
    a = st.stats["q"].absmax
    assert (a.max() / a.median()).item() == pytest.approx(row["outlier_after"], rel=0.02)
    table = outlier_markdown([row])
    assert "| model.layers.0.input_layernorm | self_attn.q_proj, self_attn.k_proj, self_attn.v_proj | 0.50 |" in table


def test_alpha_search_stage_records_grid_errors_and_beats_no_smoothing():
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight[:2] *= 40
    recipe = preset_recipe("smoothquant", params={"alpha_search": True, "alpha_grid": [0.4, 0.5, 0.6, 0.8]})
    result = quantkit.quantize(model, recipe, calib_ids())
    sq = result.layers["model.layers.0.input_layernorm"]["smoothquant"]
    assert sq["alpha"] in (0.4, 0.5, 0.6, 0.8)
    assert sq["search"]["grid"] == [0.4, 0.5, 0.6, 0.8] and len(sq["search"]["errors"]) == 4
    assert min(sq["search"]["errors"]) < sq["search"]["error_unsmoothed"] / 2
    assert isinstance(model.model.layers[0].self_attn.q_proj, W8A8Linear)


@pytest.mark.parametrize("arch", ["llama", "opt", "phi3", "qwen2_moe"])
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_simulated_and_integer_paths_agree(arch, dynamic):
    """Both paths see identical int8 operands and differ only by fp32 rounding (~1e-7 relative). Once in a while
    that rounding moves a next-layer activation across an int8 rounding boundary (one code step), which later
    layers carry along: on these models that stays below 1e-3 of the logits and 5% of what W8A8 itself changes."""
    model = tiny_model(arch)
    ids = calib_ids(4, 32, seed=1)
    with torch.no_grad():
        float_logits = model(ids).logits
    recipe = preset_recipe("smoothquant", {"act_dynamic": dynamic}, params={"alpha": 0.5})  # the bound's alpha
    quantkit.quantize(model, recipe, calib_ids())
    with torch.no_grad():
        simulated = model(ids).logits
        assert set_execution(model, "integer") == len(quantized_modules(model)) > 0
        integer = model(ids).logits
    q_err = (simulated - float_logits).norm()
    diff = (integer - simulated).norm()
    assert q_err > 1e-3 * float_logits.norm()  # W8A8 did change the model
    assert diff < 1e-3 * float_logits.norm() and diff < 0.05 * q_err, (diff, q_err)


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_w8a8_checkpoint_reloads_with_equal_logits(dynamic, tmp_path):
    model = tiny_model("llama")
    ids = calib_ids(2, 16, seed=1)
    recipe = preset_recipe("smoothquant", {"act_dynamic": dynamic}, params={"alpha": 0.6})
    quantkit.quantize(model, recipe, calib_ids())
    with torch.no_grad():
        logits = model(ids).logits
    out = quantkit.save_quantized(model, tmp_path / "q")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    name = "w8a8-int8-dynamic" if dynamic else "w8a8-int8-static"
    assert set(qc["schemes"]) == {name} and set(qc["modules"].values()) == {name}
    assert qc["recipe"]["stages"][0]["method"] == "smoothquant" and qc["recipe"]["stages"][0]["params"]["alpha"] == 0.6
    report = json.loads((out / "quant_report.json").read_text())["layers"]
    assert len(outlier_rows(report)) == 2 * len(arch_for(model).smooth)
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    q = reloaded.model.layers[1].mlp.down_proj
    assert isinstance(q, W8A8Linear) and q.weight.dtype == torch.int8 and (q.input_scale is None) == dynamic
    # the smoothing is in the saved float norms: they differ from a fresh model's
    assert not torch.equal(
        reloaded.model.layers[0].input_layernorm.weight, tiny_model("llama").model.layers[0].input_layernorm.weight
    )
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, logits, rtol=0, atol=0)
    # the outlier script reads the saved report
    script = Path(__file__).resolve().parents[2] / "scripts" / "smoothquant_outliers.py"
    done = subprocess.run(
        [sys.executable, str(script), str(out), "--layers", "1", "--out", str(tmp_path / "o.md")],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("| model.layers.")]
    assert len(lines) == len(arch_for(model).smooth) and all("layers.1." in line for line in lines)
    assert json.loads((tmp_path / "o.json").read_text())[0]["alpha"] == 0.6


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_smoothquant_then_gptq_composes(arch, tmp_path):
    """W8A8 GPTQ on the smoothed weights: GPTQ minimises the layer output error on the calibration tokens, so on
    those tokens it beats RTN on the same smoothed weights (measured 0.6-0.86x on tiny models; asserted < 0.95x)."""
    calib = calib_ids(16, 64)
    errors, models = {}, {}
    for method in ("smoothquant", "smoothquant+gptq"):
        model = tiny_model(arch)
        with torch.no_grad():
            float_logits = model(calib).logits
        result = quantkit.quantize(model, preset_recipe(method), calib)
        with torch.no_grad():
            errors[method] = ((model(calib).logits - float_logits).norm() / float_logits.norm()).item()
        models[method] = model
    assert errors["smoothquant+gptq"] < 0.95 * errors["smoothquant"], errors
    layers = result.layers
    assert len(outlier_rows(layers)) == 2 * len(arch_for(model).smooth)
    linears = [rec for rec in layers.values() if "method" in rec]
    assert linears and all(rec["method"] == "gptq" and rec["scheme"] == "w8a8-int8-dynamic" for rec in linears)
    model = models["smoothquant+gptq"]
    out = quantkit.save_quantized(model, tmp_path / "q")
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(calib[:2]).logits, model(calib[:2]).logits, rtol=0, atol=0)


# -- parameters and shipped recipes ----------------------------------------------------------------------------


def test_params_are_validated_and_overridable():
    p = SmoothQuantParams(alpha_grid=[0.5, 0.7])
    assert p.alpha_grid == (0.5, 0.7)
    for bad in (
        {"alpha": 1.5},
        {"alpha": True},
        {"alpha_grid": []},
        {"alpha_grid": [0.2, 2]},
        {"alpha_search": "yes"},
        {"search_tokens": 0},
        {"producers": "linears"},
    ):
        with pytest.raises(QuantkitError, match="smoothquant"):
            SmoothQuantParams(**bad)
    with pytest.raises(QuantkitError, match="unknown key 'alpah'"):
        Recipe.from_dict({"stages": [{"method": "smoothquant", "params": {"alpah": 0.5}}]})
    recipe = preset_recipe("smoothquant", {"act_dynamic": False}, params={"alpha": 0.7, "alpha_search": True})
    sq, rtn_stage = recipe.stages
    assert (sq.params.alpha, sq.params.alpha_search) == (0.7, True)
    assert rtn_stage.scheme.name == "w8a8-int8-static"
    assert Recipe.from_dict(json.loads(json.dumps(recipe.to_dict()))).stages[0].params == sq.params


def test_smoothing_after_quantization_is_refused():
    recipe = Recipe.from_dict(
        {"scheme": W8A8_DYNAMIC.to_dict(), "stages": [{"method": "rtn"}, {"method": "smoothquant"}]}
    )
    with pytest.raises(QuantkitError, match="before the weight stage"):
        quantkit.quantize(tiny_model("llama"), recipe, calib_ids())


SHIPPED = sorted(p.stem for p in RECIPES.glob("smoothquant-*.yaml"))


def test_smoothquant_recipes_are_shipped():
    assert SHIPPED == ["smoothquant-alpha-search", "smoothquant-dynamic", "smoothquant-gptq", "smoothquant-static"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipe_runs(name):
    recipe = load_recipe(name)
    recipe = recipe.with_overrides(calibration={"nsamples": 8, "seqlen": 32})
    model = tiny_model("llama")
    ids = calib_ids(2, 16, seed=1)
    with torch.no_grad():
        float_logits = model(ids).logits
    result = quantkit.quantize(model, recipe, calib_ids())
    modules = quantized_modules(model)
    assert modules and all(isinstance(m, W8A8Linear) for m in modules.values())
    static = recipe.stages[-1].scheme.act_dynamic is False
    assert all((m.input_scale is not None) == static for m in modules.values())
    rows = outlier_rows(result.layers)
    assert len(rows) == 2 * len(arch_for(model).smooth)
    search = recipe.stages[0].params.search
    assert all(("search" in result.layers[r["producer"]]["smoothquant"]) == search for r in rows)
    with torch.no_grad():
        logits = model(ids).logits
    assert ((logits - float_logits).norm() / float_logits.norm()) < 0.05


# -- real model ------------------------------------------------------------------------------------------------


def _consumer_absmax(model, layers, calib):
    """Per smoothing group of ``layers``, the first consumer's input abs-max measured with hooks."""
    spec = arch_for(model)
    modules = {}
    for i in layers:
        layer = model.get_submodule(spec.layers)[i]
        for g in bind_smooth_groups(layer, spec):
            modules[f"{spec.layers}.{i}.{g.producer}"] = layer.get_submodule(g.consumers[0])
    with StatsCollector(modules, hessian=False) as st, torch.no_grad():
        for batch in calib.split(4):
            model(batch)
    return {n: s.absmax for n, s in st.stats.items()}


@pytest.fixture(scope="module")
def smollm2():
    from quantkit.calib.data import calibration_windows

    model, tokenizer, _ = quantkit.load_model("smollm2-135m")
    calib, _ = calibration_windows(tokenizer, "brown", 4, 128)
    return model, calib


@pytest.mark.slow
def test_smoothing_smollm2_keeps_logits_and_reduces_outlier_ratio(smollm2):
    """Measured with hooks, independently of the stage: on SmolLM2 the worst group of the layers looked at falls
    from ~90 to ~21 (alpha 0.5 takes about the square root of a ratio dominated by the activations) and the median
    group to about half; groups with mild outliers (ratio < 4, v_proj -> o_proj) may rise a little."""
    model, calib = smollm2
    model = copy.deepcopy(model)
    ids = calib[:2, :64]
    layers = (0, 1, 15, 29)
    with torch.no_grad():
        before_logits = model(ids).logits
    before = _consumer_absmax(model, layers, calib)
    result = quantkit.quantize(model, SMOOTH_ONLY, calib)
    with torch.no_grad():
        after_logits = model(ids).logits
    rel = ((after_logits - before_logits).norm() / before_logits.norm()).item()
    assert rel < 1e-5, rel
    after = _consumer_absmax(model, layers, calib)
    ratio = {n: ((a.max() / a.median()).item(), (after[n].max() / after[n].median()).item()) for n, a in before.items()}
    assert len(ratio) == 4 * len(layers)
    worst_before, worst_after = max(b for b, _ in ratio.values()), max(a for _, a in ratio.values())
    assert worst_after < worst_before / 3, ratio
    assert statistics.median(a / b for b, a in ratio.values()) < 0.7, ratio
    for name, (b, a) in ratio.items():
        assert a < b or (b < 4 and a < 1.25 * b), (name, b, a)
    reported = {r["producer"]: r for r in outlier_rows(result.layers)}
    for name, (b, a) in ratio.items():  # the report says what hooks measure on the smoothed model
        assert reported[name]["outlier_before"] == pytest.approx(b, rel=1e-3, abs=0.006)  # stored to 0.01
        assert reported[name]["outlier_after"] == pytest.approx(a, rel=1e-3, abs=0.006)


@pytest.mark.slow
def test_smollm2_w8a8_paths_agree(smollm2):
    """Layer by layer on SmolLM2's real (smoothed) activations the two paths agree to fp32 rounding (measured
    ~2e-7 relative; asserted 1e-5). End to end they cannot agree that well: a 1-ulp difference occasionally moves
    an activation across an int8 rounding boundary, and 30 layers amplify such flips (a massive-activation token
    has a coarse per-token step) until they reach the size of the quantization noise itself. The quantized model
    does the same to a 1e-7 relative perturbation of its own input, so that is the yardstick: the paths must not
    differ by more than 2x what that perturbation does (measured 0.96x), and be equally accurate against float."""
    model, calib = smollm2
    model = copy.deepcopy(model)
    ids = calib[:2, :64]
    with torch.no_grad():
        float_logits = model(ids).logits
    quantkit.quantize(model, preset_recipe("smoothquant"), calib)
    layers = {n: m for n, m in quantized_modules(model).items() if isinstance(m, W8A8Linear)}
    assert len(layers) == 7 * 30
    inputs = {}
    handles = [m.register_forward_pre_hook(lambda m, a, n=n: inputs.setdefault(n, a[0])) for n, m in layers.items()]
    noise = {"eps": 0.0}
    gen = torch.Generator().manual_seed(0)
    handles.append(
        model.model.embed_tokens.register_forward_hook(
            lambda m, a, out: out * (1 + noise["eps"] * torch.randn(out.shape, generator=gen))
        )
    )
    with torch.no_grad():
        simulated = model(ids).logits
        for h in handles[:-1]:
            h.remove()
        for name, m in layers.items():
            y_sim = m(inputs[name])
            m.execution = "integer"
            y_int = m(inputs[name])
            assert ((y_int - y_sim).norm() / y_sim.norm()).item() < 1e-5, name
        integer = model(ids).logits
        set_execution(model, "simulated")
        noise["eps"] = 1e-7
        perturbed = model(ids).logits

    def kl(p, q):
        return (p.softmax(-1) * (p.log_softmax(-1) - q.log_softmax(-1))).sum(-1).mean().item()

    floor = (perturbed - simulated).norm()
    assert (integer - simulated).norm() < 2 * floor, ((integer - simulated).norm(), floor)
    kl_sim, kl_int = kl(float_logits, simulated), kl(float_logits, integer)
    assert abs(kl_int - kl_sim) < 0.25 * kl_sim, (kl_sim, kl_int)


@pytest.mark.slow
def test_smollm2_static_checkpoint_reloads_with_equal_logits(smollm2, tmp_path):
    model, calib = smollm2
    model = copy.deepcopy(model)
    ids = calib[:1, :64]
    quantkit.quantize(model, load_recipe("smoothquant-static"), calib[:2])  # 2 x 128 tokens: static costs 6 passes
    with torch.no_grad():
        logits = model(ids).logits
    out = quantkit.save_quantized(model, tmp_path / "q")
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    layers = quantized_modules(reloaded)
    assert len(layers) == 7 * 30
    assert all(m.input_scale is not None and m.weight.dtype == torch.int8 for m in layers.values())
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()  # still tied
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, logits, rtol=0, atol=0)
