"""checkpoint/config.py and checkpoint/swap.py: the per-module schemes a quantization_config declares, each
damage to it named, and the swap of float linears for empty quantized modules of those schemes."""

import copy
import re

import pytest
from torch import nn

from quantkit.checkpoint.config import FORMAT_VERSION, QUANT_METHOD, layout_of, module_schemes
from quantkit.checkpoint.swap import swap_in_quantized_modules
from quantkit.errors import QuantkitError
from quantkit.nn.factory import quantized_modules
from quantkit.quant import Layout, QuantScheme
from tests.tiny_models import tiny_model

W4 = QuantScheme(bits=4, group_size=32, sym=False)
W8A8 = QuantScheme(bits=8, group_size=-1, act_bits=8)
QC = {
    "quant_method": QUANT_METHOD,
    "format_version": FORMAT_VERSION,
    "schemes": {W4.name: W4.to_dict(), W8A8.name: W8A8.to_dict()},
    "modules": {"model.layers.0.mlp.up_proj": W4.name, "model.layers.1.self_attn.q_proj": W8A8.name},
    "layouts": {"gptq_v2": 1, "int8_rowmajor": 1},
    "module_layouts": {W4.name: "gptq_v2", W8A8.name: "int8_rowmajor"},
}


def test_layouts_follow_the_scheme():
    assert layout_of(W4) is Layout.GPTQ_V2
    assert layout_of(W8A8) is Layout.INT8_ROWMAJOR
    assert layout_of(QuantScheme(bits=8, group_size=-1, act_bits=8, fmt="fp8")) is Layout.FP8_ROWMAJOR


def test_module_schemes_reads_every_module():
    assert module_schemes(QC) == {"model.layers.0.mlp.up_proj": W4, "model.layers.1.self_attn.q_proj": W8A8}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda qc: qc.update(quant_method="awq"), "not a quantkit checkpoint (quant_method='awq')"),
        (lambda qc: qc.update(format_version=2), "quantkit checkpoint format 2 is not supported"),
        (lambda qc: qc["layouts"].update(gptq_v2=9), "checkpoint layout gptq_v2 v9 is not readable here"),
        (lambda qc: qc["module_layouts"].update({W4.name: "int8_rowmajor"}), "int8_rowmajor v1 is not readable"),
        (lambda qc: qc.pop("modules"), "malformed quantkit quantization_config (missing or bad 'modules')"),
    ],
)
def test_module_schemes_names_the_damage(change, message):
    qc = copy.deepcopy(QC)
    change(qc)
    with pytest.raises(QuantkitError) as exc:
        module_schemes(qc)
    assert message in str(exc.value)


def test_swap_puts_empty_modules_of_each_scheme_in_place_of_the_linears():
    model = tiny_model("llama")
    before = {n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    swap_in_quantized_modules(model, module_schemes(QC), split_experts=False)
    swapped = quantized_modules(model)
    assert sorted(swapped) == sorted(QC["modules"])
    for name, module in swapped.items():
        assert (module.in_features, module.out_features) == before[name]
        assert module.scheme == module_schemes(QC)[name]
    with pytest.raises(QuantkitError, match=re.escape("module model.layers.9.mlp.up_proj that this model")):
        swap_in_quantized_modules(model, {"model.layers.9.mlp.up_proj": W4}, split_experts=False)
    with pytest.raises(QuantkitError, match=re.escape("model.layers.0.mlp is a LlamaMLP, expected Linear")):
        swap_in_quantized_modules(model, {"model.layers.0.mlp": W4}, split_experts=False)
