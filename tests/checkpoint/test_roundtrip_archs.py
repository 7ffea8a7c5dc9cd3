import pytest
import torch
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
