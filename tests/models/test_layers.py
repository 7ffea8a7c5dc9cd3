"""models/layers.py: the name patterns of the architecture tables resolved against one decoder layer, expert
wildcards bound in index order (10 after 9, not after 1)."""

from torch import nn

from quantkit.models import SmoothGroup, arch_for
from quantkit.models.experts import ExpertMLP, LinearExperts
from quantkit.models.layers import expand_smooth_group, linears, match
from tests.tiny_models import tiny_model


def layer_with_experts(n: int) -> nn.Module:
    layer = nn.Module()
    layer.mlp = nn.Module()
    layer.mlp.experts = LinearExperts(ExpertMLP(8, 4, nn.SiLU()) for _ in range(n))
    layer.mlp.gate = nn.Linear(8, n, bias=False)
    return layer


def test_match_binds_wildcards_in_index_order():
    layer = layer_with_experts(12)
    names = [name for name, _ in match(layer, "mlp.experts.*.up_proj")]
    assert names == [f"mlp.experts.{i}.up_proj" for i in range(12)]
    assert match(layer, "mlp.gate") == [("mlp.gate", layer.mlp.gate)]
    assert match(layer, "mlp.nothing") == [] and match(layer, "mlp.experts.*.nothing") == []


def test_linears_follow_the_pattern_order_and_skip():
    layer = tiny_model("llama").model.layers[0]
    spec = arch_for("LlamaForCausalLM")
    names = [n for n, _ in linears(layer, spec.linear_patterns())]
    assert names == [p for group in spec.sequential for p in group]
    skipped = [n for n, _ in linears(layer, spec.linear_patterns(), skip=("mlp.down_proj",))]
    assert skipped == names[:-1]
    assert linears(layer, ("input_layernorm",)) == []  # a norm is not a linear


def test_smooth_groups_expand_per_expert_or_whole():
    layer = layer_with_experts(3)
    per_expert = SmoothGroup("mlp.experts.*.up_proj", ("mlp.experts.*.down_proj",), block="mlp.experts.*.down_proj")
    assert expand_smooth_group(layer, per_expert) == [
        (f"mlp.experts.{i}.up_proj", [f"mlp.experts.{i}.down_proj"], f"mlp.experts.{i}.down_proj") for i in range(3)
    ]
    whole = SmoothGroup("mlp.gate", ("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj"), block="mlp")
    [(producer, consumers, block)] = expand_smooth_group(layer, whole)
    assert producer == "mlp.gate" and block == "mlp" and len(consumers) == 6
    assert consumers[:3] == [f"mlp.experts.{i}.gate_proj" for i in range(3)]
    assert expand_smooth_group(layer, SmoothGroup("absent", ("mlp.gate",), block="mlp")) == []
