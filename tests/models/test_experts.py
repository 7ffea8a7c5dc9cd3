"""models/experts.py: the per-expert linears compute what the fused experts module of transformers computes, for
the same routing, and the whole model's output is unchanged by the split."""

import torch

from quantkit.models.arch import arch_for
from quantkit.models.experts import LinearExperts, is_fused_experts, split_all_fused_experts, split_fused_experts
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
