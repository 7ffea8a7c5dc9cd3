"""Decode graphs that prefetch weights into L2 on a side stream (``runtime.prefetch``, ``kernels.l2_prefetch``)."""

import os

import pytest
import torch
from quantkit.kernels.l2_prefetch import buffer_lines, load_buffers_l2, prefetch_buffers_l2

from quantkit.errors import QuantkitError
from quantkit.runtime import LLM, SamplingParams
from quantkit.runtime.config import EngineConfig
from quantkit.runtime.model import fuse_projections
from quantkit.runtime.prefetch import weight_buffers
from tests.runtime.helpers import random_prompts, record_logits, sharpen
from tests.tiny_models import COMMON, tiny_model

VOCAB = COMMON["vocab_size"]
interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@interpreter
@pytest.mark.parametrize("programs, num_warps", [(1, 1), (5, 1), (132, 2)])
def test_every_line_of_every_buffer_is_named_once(programs, num_warps):
    """Lines of up to four buffers of any dtype and length (a partial last line, an empty buffer) are each asked
    for exactly once, whatever the grid."""
    buffers = [torch.zeros(1000, dtype=torch.int32), torch.zeros(77, dtype=torch.float16),
               torch.zeros(0, dtype=torch.int32), torch.zeros(5000, dtype=torch.bfloat16)]  # fmt: skip
    for n in (1, 2, 4):
        touched = [torch.zeros(buffer_lines(b), dtype=torch.int32) for b in buffers[:n]]
        prefetch_buffers_l2(buffers[:n], programs=programs, num_warps=num_warps, touched=touched)
        assert [t.numel() for t in touched] == [32, 2, 0, 79][:n]
        assert all(bool((t == 1).all()) for t in touched)


@interpreter
def test_plain_loads_read_every_word_and_write_only_on_the_magic_sum():
    sink = torch.zeros(1, dtype=torch.int32)
    load_buffers_l2([torch.ones(10000, dtype=torch.int32), torch.zeros(154, dtype=torch.float16)], sink)
    assert sink.item() == 0
    words = torch.zeros(9000, dtype=torch.int32)
    words[8999] = 0x5EED  # the third chunk of 4096 words sums to the magic value: proof that its last word was read
    load_buffers_l2([torch.zeros(2, dtype=torch.int32), words], sink)
    assert sink.item() == 0x5EED
    with pytest.raises(ValueError, match="32-bit words"):
        load_buffers_l2([torch.zeros(3, dtype=torch.float16)], sink)


def test_launcher_checks():
    x = torch.zeros(64)
    with pytest.raises(ValueError, match="1 to 4 buffers"):
        prefetch_buffers_l2([x] * 5)
    with pytest.raises(ValueError, match="contiguous"):
        prefetch_buffers_l2([torch.zeros(8, 8).t()])
    with pytest.raises(ValueError, match="CUDA"):
        prefetch_buffers_l2([x])
    with pytest.raises(ValueError, match="one \\[lines\\] counter"):
        prefetch_buffers_l2([x], touched=[torch.zeros(3, dtype=torch.int32)])


def test_config_names_known_points_only():
    assert EngineConfig(decode_l2_prefetch="attention, down").prefetch_points == ("attention", "down")
    assert EngineConfig().prefetch_points == ()
    with pytest.raises(QuantkitError, match="unknown point 'mlp'"):
        EngineConfig(decode_l2_prefetch="attention,mlp")


def test_weight_buffers_of_each_kind():
    import quantkit
    from quantkit.nn.qlinear import QuantLinear
    from quantkit.recipe import Recipe

    model = tiny_model("llama")
    attn = model.model.layers[0].self_attn
    assert [t.data_ptr() for t in weight_buffers(attn.q_proj)] == [attn.q_proj.weight.data_ptr()]
    quantkit.quantize(model, Recipe.from_dict({"scheme": {"bits": 4, "group_size": 32}, "stages": [{"method": "rtn"}]}))
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, QuantLinear)
    assert [t.data_ptr() for t in weight_buffers(q)] == [q.qweight.data_ptr(), q.scales.data_ptr(), q.qzeros.data_ptr()]


def test_plan_fetches_o_proj_and_the_next_qkv():
    from quantkit.runtime.prefetch import WeightPrefetcher

    model = LLM(tiny_model("llama"), device="cpu", num_kv_blocks=16).model
    layers = model.model.layers
    n = len(layers)
    assert n > 1
    for fused in (False, True):
        if fused:
            fuse_projections(model)
        plan = WeightPrefetcher(layers, ("attention", "down")).plan
        assert [plan[(i, "attention")] for i in range(n)] == [layer.self_attn.o_proj for layer in layers]
        qkv = [layer.self_attn.qkv_proj if fused else layer.self_attn.q_proj for layer in layers[1:]]
        assert [plan[(i, "down")] for i in range(n - 1)] == qkv
        assert (n - 1, "down") not in plan
    assert set(WeightPrefetcher(layers).plan) == {(i, "attention") for i in range(n)}
    with pytest.raises(QuantkitError, match="unknown prefetch point"):
        WeightPrefetcher(layers, ("qkv",))


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["prefetch", "load"])
@pytest.mark.parametrize("scheme", [None, {"bits": 4, "group_size": 128, "sym": True},
                                    {"bits": 8, "group_size": -1, "sym": True, "act_bits": 8}])  # fmt: skip
def test_prefetching_graphs_change_no_bit(scheme, mode, monkeypatch):
    """Decode graphs that prefetch at every point give exactly the logits and tokens of graphs that do not: bf16
    float, W4A16 and W8A8 layers, one sequence (graphs of batch 1) and four of different lengths."""
    import quantkit
    import quantkit.runtime.prefetch as P
    from quantkit.recipe import Recipe

    monkeypatch.setattr(P, "MODE", mode)
    model = sharpen(tiny_model("llama", dtype=torch.bfloat16))
    if scheme is not None:
        quantkit.quantize(model, Recipe.from_dict({"scheme": scheme, "stages": [{"method": "rtn"}]}))
    model = model.cuda()
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    results = {}
    for points in ("", "attention,down"):
        llm = LLM(model, num_kv_blocks=64, decode_l2_prefetch=points)
        rows = record_logits(llm)
        tokens = [
            [o.completions[0].token_ids for o in llm.generate(prompts, params)]
            for prompts in (random_prompts([9], VOCAB, seed=4), random_prompts([3, 17, 40, 8], VOCAB, seed=5))
        ]
        results[points] = (tokens, [torch.stack(rows[r]) for r in sorted(rows)])
    assert results[""][0] == results["attention,down"][0]
    for a, b in zip(results[""][1], results["attention,down"][1], strict=True):
        assert torch.equal(a, b)
