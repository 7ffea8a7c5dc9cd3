"""Every shipped recipe runs end to end on a tiny model (quantize, save, reload with equal logits)."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import quantkit
from quantkit.checkpoint.export import export_formats
from quantkit.checkpoint.verify import verify_checkpoint
from quantkit.errors import QuantkitError
from quantkit.nn.factory import quantized_modules
from quantkit.recipe import load_recipe, shipped_recipes
from tests.tiny_models import tiny_model


def test_every_recipe_of_the_repository_is_shipped():
    """What the installed package lists (package data) is the repository's recipes/ folder, file for file."""
    in_repository = sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))
    assert shipped_recipes() == in_repository and "default" in in_repository


@pytest.mark.parametrize("name", shipped_recipes())
def test_shipped_recipe_runs(name, tmp_path):
    recipe = load_recipe(name)
    model = tiny_model("llama")
    calib = torch.randint(3, 320, (8, 48), generator=torch.Generator().manual_seed(0))
    quantkit.quantize(model, recipe, calib)
    assert quantized_modules(model)
    ids = torch.randint(3, 320, (1, 16))
    with torch.no_grad():
        before = model(ids).logits
    folder = quantkit.save_quantized(model, tmp_path / name)
    reloaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, before, rtol=0, atol=0)


@pytest.mark.parametrize("name", shipped_recipes())
def test_quantkit_verify_passes_every_shipped_recipes_output_and_export(name, tmp_path):
    """On a Llama whose widths hold groups of 128, so that weight-only recipes export too."""
    import transformers as T

    from tests.tiny_models import COMMON

    torch.manual_seed(0)
    config = T.LlamaConfig(**{**COMMON, "hidden_size": 256, "intermediate_size": 512})
    model = T.AutoModelForCausalLM.from_config(config).eval()
    calib = torch.randint(3, 320, (4, 32), generator=torch.Generator().manual_seed(0))
    quantkit.quantize(model, load_recipe(name), calib)
    folders = [quantkit.save_quantized(model, tmp_path / name)]
    for fmt, reason in export_formats(folders[0]).items():
        if reason is None:
            folders.append(quantkit.export_checkpoint(folders[0], tmp_path / fmt, fmt).path)
    assert len(folders) > 1  # something to export to
    for folder in folders:
        verdict = verify_checkpoint(folder)
        assert verdict.ok, verdict.line()


def test_awq_then_gptq_presets_do_not_clip_before_gptq():
    """AWQ's clip ranges are searched for round-to-nearest; before GPTQ they only cost accuracy (see presets)."""
    from quantkit.presets import preset_recipe
    from quantkit.recipe import load_recipe

    preset = preset_recipe("awq+gptq")
    assert [s.method for s in preset.stages] == ["awq", "gptq"] and preset.stages[0].params.clip is False
    assert preset_recipe("awq").stages[0].params.clip is True  # AWQ + RTN keeps its clip search
    assert preset_recipe("awq+gptq", params={"clip": True}).stages[0].params.clip is True  # still a choice
    assert load_recipe("awq-gptq-w4g128").stages[0].params.clip is False


def test_gptq_presets_and_recipes_say_which_gptq_they_run():
    """--method gptq takes the stage's defaults (groups static at 4 and 8 bits: exportable; grid chosen on held-out
    windows);
    awq+gptq and the recipes whose descriptions cite figures keep the GPTQ those figures were measured with."""
    from quantkit.presets import preset_recipe
    from quantkit.recipe import load_recipe

    gptq = preset_recipe("gptq").stages[0].params
    assert (gptq.act_order, gptq.static_groups, gptq.mse) == (True, "auto", "auto")
    awq_gptq = preset_recipe("awq+gptq").stages[1].params
    assert (awq_gptq.act_order, awq_gptq.static_groups, awq_gptq.mse) == (True, False, True)
    for name in ("awq-gptq-w4g128", "gptq-w3g64", "gptq-w4g128-actorder", "gptq-w4g128"):
        params = next(s.params for s in load_recipe(name).stages if s.method == "gptq")
        assert (params.static_groups, params.mse) == (False, True), name


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("scheme: {bits: 4.0}\nstages: [{method: rtn}]\n", "scheme bits must be an integer"),
        ("scheme: {bits: '4'}\nstages: [{method: rtn}]\n", "scheme bits must be an integer"),
        ("scheme: {group_size: abc}\nstages: [{method: rtn}]\n", "scheme group_size must be an integer"),
        ("scheme: {group_size: 64.5}\nstages: [{method: rtn}]\n", "scheme group_size must be an integer"),
        ("scheme: {sym: 'no'}\nstages: [{method: rtn}]\n", "scheme sym must be true or false"),
        ("calibration: {nsamples: '10'}\nscheme: {bits: 4}\nstages: [{method: gptq}]\n", "nsamples must be an integer"),
        ("calibration: {bos: 'yes'}\nscheme: {bits: 4}\nstages: [{method: gptq}]\n", "bos must be auto, true or false"),
        (
            "calibration: {chat_template: 1}\nscheme: {bits: 4}\nstages: [{method: gptq}]\n",
            "chat_template must be true or false",
        ),
        (
            "calibration: {chat: true}\nscheme: {bits: 4}\nstages: [{method: gptq}]\n",
            "allowed: batch_size, bos, chat_template, nsamples",
        ),
        (
            "scheme: {bits: 4}\nstages: [{method: gptq, params: {mse: sometimes}}]\n",
            "gptq mse must be auto, true or false",
        ),
        ("stages: [{method: rtn, targets: ['re:[unclosed']}]\n", "bad regular expression"),
        ("stages: [{method: rtn, overrides: [{match: 're:(', scheme: {bits: 8}}]}]\n", "bad regular expression"),
        (
            "scheme: {bits: 4}\nstages: [{method: rtn, overrides: [{match: 're:.*down', scheme: {bits: 7}}]}]\n",
            "overrides[0].scheme",
        ),
    ],
)
def test_recipe_values_of_the_wrong_type_fail_when_read(tmp_path, text, fragment):
    """Types and patterns are checked when the recipe is read, not when the first module meets them."""
    from quantkit.errors import QuantkitError

    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(QuantkitError) as exc:
        load_recipe(str(path))
    assert fragment in str(exc.value) and "\n" not in str(exc.value)


def test_merge_keys_override_and_a_repeated_key_is_refused(tmp_path):
    """ "<<" merges may be overridden, also when a merged mapping merges another (PyYAML rewrites it in place before
    it is read itself); a key written twice in one mapping is an error."""
    nested = tmp_path / "nested.yaml"
    nested.write_text(
        "scheme: &base {bits: 4, group_size: 128, sym: false}\n"
        "stages:\n"
        "  - method: rtn\n"
        "    overrides:\n"
        '      - match: "re:.*down_proj"\n'
        "        scheme: &hi\n"
        "          <<: *base\n"
        "          bits: 8\n"
        "  - method: rtn\n"
        "    scheme: {<<: *hi, group_size: 64}\n"
    )
    recipe = load_recipe(nested)
    assert recipe.stages[0].overrides[0].scheme == {"bits": 8, "group_size": 128, "sym": False}
    assert (recipe.stages[1].scheme.bits, recipe.stages[1].scheme.group_size) == (8, 64)
    twice = tmp_path / "twice.yaml"
    twice.write_text("scheme: {bits: 4, bits: 8}\nstages: [{method: rtn}]\n")
    with pytest.raises(QuantkitError, match="line 1, column 19: key 'bits' given twice"):
        load_recipe(twice)


def test_calibration_bos_and_chat_template_round_trip(tmp_path):
    """The calibration section's bos (auto / true / false) and chat_template keys are read and written back."""
    path = tmp_path / "r.yaml"
    path.write_text("calibration: {bos: false, chat_template: true}\nscheme: {bits: 4}\nstages: [{method: gptq}]\n")
    recipe = load_recipe(str(path))
    assert (recipe.calibration.bos, recipe.calibration.chat_template) == (False, True)
    assert load_recipe(str(path)).to_dict()["calibration"]["bos"] is False
    assert load_recipe("default").calibration.bos == "auto"
