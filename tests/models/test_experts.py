"""models/experts.py: the per-expert linears compute what the fused experts module of transformers computes, for
the same routing, and the whole model's output is unchanged by the split."""

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.models.arch import arch_for
from quantkit.models.experts import (
    ExpertCalibration,
    LinearExperts,
    is_fused_experts,
    split_all_fused_experts,
    split_fused_experts,
)
from quantkit.recipe import Recipe
from tests.tiny_models import tiny_model

IDS = torch.randint(3, 320, (2, 10), generator=torch.Generator().manual_seed(0))


def fused_experts(arch: str):
    model = tiny_model(arch)
    spec = arch_for(model)
    layer = model.get_submodule(spec.layers)[0]
    return model, spec, layer.get_submodule(spec.fused_experts)


def test_split_experts_match_the_fused_module_on_the_same_routing():
    _, _, fused = fused_experts("mixtral")
    assert is_fused_experts(fused) and not is_fused_experts(torch.nn.Linear(2, 2))
    split = split_fused_experts(fused)
    assert isinstance(split, LinearExperts) and len(split) == fused.gate_up_proj.shape[0] == 4
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(12, 64, generator=gen)
    index = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(12)])  # 2 distinct experts per token
    weights = torch.rand(12, 2, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(split(x, index, weights), fused(x, index, weights), rtol=1e-5, atol=1e-6)
    meta = split_fused_experts(fused, materialize=False)
    assert all(p.is_meta for p in meta.parameters())


def test_splitting_every_layer_keeps_the_model_output():
    model, spec, _ = fused_experts("qwen3_moe")
    with torch.no_grad():
        before = model(IDS).logits
        layers = model.get_submodule(spec.layers)
        assert split_all_fused_experts(model, layers, spec.fused_experts) == len(layers) == 2
        assert split_all_fused_experts(model, layers, spec.fused_experts) == 0  # nothing fused is left
        torch.testing.assert_close(model(IDS).logits, before, rtol=1e-5, atol=1e-5)


def test_calibration_modes_keep_the_output_and_choose_what_the_hooks_see():
    """``all``: every token reaches an expert's linears, ``unobserved``: none does; the output is the routed one."""
    _, _, fused = fused_experts("mixtral")
    split = split_fused_experts(fused)
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(2))
    index = torch.tensor([[0, 1]] * 6 + [[1, 2]] * 6)  # expert 3 gets no token, expert 0 six
    weights = torch.rand(12, 2, generator=torch.Generator().manual_seed(3))
    seen = [0] * 4
    for e, expert in enumerate(split):
        expert.gate_proj.register_forward_pre_hook(lambda m, a, e=e: seen.__setitem__(e, seen[e] + a[0].shape[0]))
    with torch.no_grad():
        want = split(x, index, weights)
        assert seen == [6, 12, 6, 0]
        split.calibration = ["all", "routed", "unobserved", "all"]
        torch.testing.assert_close(split(x, index, weights), want, rtol=1e-6, atol=1e-7)
    assert seen == [6 + 12, 12 + 12, 6, 12]


def test_expert_calibration_rule():
    rule = ExpertCalibration(min_tokens=8, below_min="rtn")
    assert [rule.mode(n) for n in (0, 7, 8)] == ["unobserved", "unobserved", "routed"]
    assert ExpertCalibration(min_tokens=8).mode(3) == "all" and ExpertCalibration(statistics="all").mode(99) == "all"
    for bad, fragment in (({"statistics": "most"}, "statistics must be"), ({"min_tokens": -1}, "min_tokens"),
                          ({"below_min": "skip"}, "below_min must be")):  # fmt: skip
        with pytest.raises(QuantkitError, match=fragment):
            ExpertCalibration(**bad)
    with pytest.raises(QuantkitError, match=r"unknown key 'min' in recipe\.experts"):
        Recipe.from_dict({"scheme": {"bits": 4}, "stages": [{"method": "rtn"}], "experts": {"min": 3}})
    recipe = Recipe.from_dict({"scheme": {"bits": 4}, "stages": [{"method": "rtn"}], "experts": {"min_tokens": 4}})
    assert Recipe.from_dict(recipe.to_dict()).experts == ExpertCalibration(min_tokens=4)
