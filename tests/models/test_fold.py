import pytest
import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.models.arch import arch_for
from quantkit.models.fold import bind_smooth_groups, fold_group, fold_scales, repeated_heads_map
from quantkit.pipeline import prepare_model
from tests.tiny_models import CONFIGS, tiny_model


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_folding_random_scales_into_every_group_keeps_logits(arch):
    """Scales spanning 1/8..8 into every smoothing group of every layer: the float function must not change.
    fp32 with O(1) logits gives differences ~1e-6; 1e-5 relative leaves room for the (1 + w) / s - 1 of Gemma."""
    model = tiny_model(arch)
    prepare_model(model)
    spec = arch_for(model)
    ids = torch.randint(3, 160, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    gen = torch.Generator().manual_seed(1)
    n_groups = 0
    for layer in model.get_submodule(spec.layers):
        for group in bind_smooth_groups(layer, spec):
            producer = layer.get_submodule(group.producer)
            c = group.channel_map.max().item() + 1 if group.channel_map is not None else None
            c = c or layer.get_submodule(group.consumers[0]).in_features
            s = torch.exp2(torch.rand(c, generator=gen) * 6 - 3)
            old = producer.weight.detach().clone()
            fold_group(layer, group, s, spec.norm)
            assert not torch.equal(producer.weight, old)
            n_groups += 1
    assert n_groups >= 2 * len(spec.smooth) - 2  # MoE tables list groups that only some layers have
    with torch.no_grad():
        after = model(ids).logits
    rel = (after - before).norm() / before.norm()
    assert rel < 1e-5, rel


def test_gqa_map_and_moe_readers_are_bound():
    model = tiny_model("qwen2_moe")  # 4 query heads / 2 KV heads, routers and a shared-expert gate
    prepare_model(model)
    layer = model.model.layers[0]
    groups = {g.producer: g for g in bind_smooth_groups(layer, arch_for(model))}
    vo = groups["self_attn.v_proj"]
    assert vo.channel_map.tolist() == [*range(16), *range(16), *range(16, 32), *range(16, 32)]
    assert groups["post_attention_layernorm"].readers == ["mlp.gate", "mlp.shared_expert_gate"]
    assert groups["input_layernorm"].readers == [] and groups["input_layernorm"].channel_map is None


def test_repeated_heads_map_matches_repeat_kv():
    v = torch.randn(5, 3 * 8)  # 3 KV heads of 8
    repeated = v.reshape(5, 3, 1, 8).expand(5, 3, 2, 8).reshape(5, 48)  # HF repeat_kv, n_rep 2
    assert torch.equal(v[:, repeated_heads_map(24, 48, 8)], repeated)


def test_fold_refuses_bad_scales_and_embeddings():
    lin, cons = nn.Linear(4, 6), nn.Linear(6, 3)
    with pytest.raises(QuantkitError, match="positive"):
        fold_scales(lin, [cons], torch.tensor([1.0, 0, 1, 1, 1, 1]), "rms")
    with pytest.raises(QuantkitError, match="one scale per producer channel"):
        fold_scales(lin, [cons], torch.ones(5), "rms")
    with pytest.raises(QuantkitError, match="embedding"):
        fold_scales(nn.Embedding(10, 6), [cons], torch.ones(6), "rms")
    with pytest.raises(QuantkitError, match="columns"):
        fold_scales(lin, [nn.Linear(5, 3)], torch.ones(6), "rms")
