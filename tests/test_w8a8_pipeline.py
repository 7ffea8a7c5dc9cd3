"""W8A8 through the pipeline: int8 and fp8, dynamic and static activations, saved and reloaded."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import quantkit
from quantkit.nn.w8a8 import W8A8Linear
from quantkit.presets import preset_recipe
from tests.tiny_models import tiny_model


@pytest.mark.parametrize("fmt", ["int", "fp8"])
@pytest.mark.parametrize("dynamic", [True, False])
def test_w8a8_quantize_save_reload(fmt, dynamic, tmp_path):
    model = tiny_model("qwen2")
    ids = torch.randint(3, 320, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    calib = torch.randint(3, 320, (4, 32), generator=torch.Generator().manual_seed(1))
    recipe = preset_recipe("w8a8", {"fmt": fmt, "act_dynamic": dynamic})
    quantkit.quantize(model, recipe, calib if recipe.needs_calibration else None)
    layers = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    assert len(layers) == 14 and all(m.scheme.fmt == fmt for m in layers)
    assert all((m.input_scale is None) == dynamic for m in layers)
    with torch.no_grad():
        out = model(ids).logits
    assert (out - ref).abs().mean() < 0.05 * ref.abs().mean()  # 8-bit weights and activations stay close
    reloaded = AutoModelForCausalLM.from_pretrained(quantkit.save_quantized(model, tmp_path / "q")).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, out, rtol=0, atol=0)
