"""checkpoint/hf.py: after ``import quantkit``, transformers' from_pretrained builds the same quantized model as
load_quantized, and refuses what the hook cannot load in one line."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

import quantkit
from quantkit.checkpoint.hf import QuantkitConfig, QuantkitHfQuantizer, register
from quantkit.errors import QuantkitError

IDS = torch.randint(3, 320, (2, 12), generator=torch.Generator().manual_seed(0))


def test_the_hook_is_registered_once_under_quant_method_quantkit():
    register()
    register()  # a second call changes nothing (transformers refuses a name registered twice)
    assert AUTO_QUANTIZER_MAPPING["quantkit"] is QuantkitHfQuantizer
    assert AUTO_QUANTIZATION_CONFIG_MAPPING["quantkit"] is QuantkitConfig


def test_from_pretrained_gives_the_model_that_was_saved(rtn_checkpoint):
    folder, model = rtn_checkpoint
    hooked = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        expected = model(IDS).logits
        torch.testing.assert_close(hooked(IDS).logits, expected, rtol=0, atol=0)
        torch.testing.assert_close(quantkit.load_quantized(folder)(IDS).logits, expected, rtol=0, atol=0)
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert QuantkitConfig(**qc).to_dict() == qc  # kept as it is, so save_pretrained writes it back unchanged


def test_a_config_that_disagrees_with_the_tensors_is_named(rtn_checkpoint, tmp_path):
    folder, _ = rtn_checkpoint
    shutil.copytree(folder, tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    qc = config["quantization_config"]
    qc["schemes"]["w4a16-g32-asym"]["group_size"] = 64  # copied from another checkpoint, say
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantkitError, match=r"corrupt checkpoint .* is stored as \[.*\], but the scheme"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "q")
