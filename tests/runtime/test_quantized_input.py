"""The runtime's norms and SiLU gate quantizing for the W4A8 projection after them (``kernels.dense.norm_quant``).

On CPU the runtime never takes the fused path (its W4A8 layers run the simulation); the layer-level tests stand
the predicate's CUDA test aside and run the fused kernels and the layers' kernel path in Triton's interpreter
against the unfused kernels, bit for bit. On CUDA the whole model runs both ways and the logits must be equal.
"""

from __future__ import annotations

import types

import pytest
import torch
from quantkit.kernels.dense import norm_quant as NQ
from quantkit.kernels.dense.norm_rope import add_rms_norm, silu_mul
from quantkit.kernels.w4a8 import dispatch as w4a8_dispatch
from transformers import AutoConfig

import quantkit.runtime.model as M
from quantkit.algorithms.rtn import rtn
from quantkit.nn.progressive import ProgressiveW4A8Linear
from quantkit.nn.w4a8 import KernelOrSimulated
from quantkit.quant.scheme import QuantScheme
from tests.runtime.helpers import random_prompts
from tests.tiny_models import COMMON

SCHEME = QuantScheme(bits=4, group_size=32, act_bits=8, progressive=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def progressive_model(dtype, device="cpu", seed=0) -> M.CausalLM:
    """The tiny Llama with progressive W4A8 decoder linears (RTN of random weights), random norm weights, q/k/v and
    gate/up fused."""
    gen = torch.Generator().manual_seed(seed)

    def linear(name, n_in, n_out, bias):
        if not name.startswith("model.layers."):
            return M.FloatLinear(n_in, n_out, bias=bias, dtype=dtype)
        w = torch.randn(n_out, n_in, generator=gen) * n_in**-0.5
        return ProgressiveW4A8Linear.from_quantized(rtn(w, SCHEME), None, dtype)

    config = AutoConfig.for_model("llama", **COMMON)
    model = M.CausalLM(config, linear, dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5 if "norm" in name else torch.randn(p.shape, generator=gen))
    assert M.fuse_projections(model) == 2 * COMMON["num_hidden_layers"]
    return model.to(device)


def on_cuda(monkeypatch):
    """The predicate as on CUDA (the interpreter runs the kernels on CPU tensors); the rest of it unchanged. The
    programmatic-launch flag stays what the device gives (off in the interpreter)."""
    real = KernelOrSimulated.takes_quantized_input
    fake = lambda self, x: real(self, types.SimpleNamespace(is_cuda=True, dtype=x.dtype))
    monkeypatch.setattr(KernelOrSimulated, "takes_quantized_input", fake)


def no_quantizer_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the layer quantized its input itself")

    monkeypatch.setattr(w4a8_dispatch, "quantize_activations", refuse)


def test_cpu_keeps_the_unfused_path(monkeypatch):
    """On CPU no projection takes codes: the norms return tensors and the fused kernels are never launched."""
    model = progressive_model(torch.float16)
    layer = model.model.layers[0]
    for name in ("add_rms_norm_quant", "silu_mul_quant"):
        monkeypatch.setattr(M, name, lambda *a, **k: pytest.fail("a fused kernel ran on CPU"))
    x = torch.randn(3, COMMON["hidden_size"], dtype=torch.float16)
    h, _ = layer.input_layernorm.add_forward(x, None, layer.self_attn.qkv_proj)
    assert isinstance(h, torch.Tensor) and not M.takes_codes(layer.self_attn.qkv_proj, x)
    assert layer.mlp(h).shape == x.shape
    assert not M.takes_codes(M.FloatLinear(4, 4), x.cuda() if torch.cuda.is_available() else x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 5])
def test_fused_norm_and_mlp_equal_the_unfused_kernels(monkeypatch, dtype, t):
    """norm -> gate/up -> SiLU gate -> down with the quantizer fused into the norm and the gate: the result of the
    norm kernel, the layers' own quantizing kernel path and the SiLU kernel, bit for bit; no quantizer launched."""
    model = progressive_model(dtype, DEVICE)
    layer = model.model.layers[1]
    norm, mlp = layer.post_attention_layernorm, layer.mlp
    gen = torch.Generator().manual_seed(t)
    x, r = (torch.randn(t, COMMON["hidden_size"], generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    y, h_want = add_rms_norm(x, norm.weight, norm.eps, r)
    g, u = mlp.gate_up_proj._forward_cuda(y).split(mlp.inter, dim=-1)
    want = mlp.down_proj._forward_cuda(silu_mul(g, u))
    qkv_want = layer.self_attn.qkv_proj._forward_cuda(y)
    on_cuda(monkeypatch)
    no_quantizer_launch(monkeypatch)
    fused_gates = []
    real_silu = M.silu_mul_quant
    monkeypatch.setattr(M, "silu_mul_quant", lambda *a, **k: fused_gates.append(1) or real_silu(*a, **k))
    rows, h = norm.add_forward(x, r, mlp.gate_up_proj)
    assert isinstance(rows, M.QuantizedRows) and rows.dtype == dtype and torch.equal(h, h_want)
    assert torch.equal(mlp(rows), want) and fused_gates == [1]  # the down projection took the gate's codes
    rows, _ = norm.add_forward(x, r, layer.self_attn.qkv_proj)
    assert torch.equal(M.project(layer.self_attn.qkv_proj, rows), qkv_want)


def test_a_gate_wider_than_silu_quant_max_keeps_two_launches(monkeypatch):
    model = progressive_model(torch.float16, DEVICE)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, COMMON["hidden_size"], dtype=torch.float16, device=DEVICE)
    on_cuda(monkeypatch)
    monkeypatch.setattr(NQ, "SILU_QUANT_MAX", mlp.inter - 1)  # read by silu_quant_pays
    monkeypatch.setattr(M, "silu_mul_quant", lambda *a, **k: pytest.fail("fused above SILU_QUANT_MAX"))
    assert mlp(x).shape == x.shape


def test_decoder_layer_hands_each_norm_its_projection(monkeypatch):
    """The input norm is offered the fused q/k/v projection, the post-attention norm the fused gate/up one."""
    model = progressive_model(torch.float16)
    layer = model.model.layers[0]
    offered = []
    real = M.RMSNorm.add_forward
    monkeypatch.setattr(M.RMSNorm, "add_forward", lambda self, x, r, c=None: offered.append(c) or real(self, x, r, c))
    monkeypatch.setattr(M.Attention, "forward", lambda self, x, *a: x)
    x = torch.randn(2, COMMON["hidden_size"], dtype=torch.float16)
    layer(x, None, None, None, None, None)
    assert offered == [layer.self_attn.qkv_proj, layer.mlp.gate_up_proj]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_quantizers_give_the_unfused_logits_on_cuda(monkeypatch, dtype):
    """The engine (CUDA graphs, programmatic dependent launch at decode on sm_90) with and without the fusion: the
    fused kernels run (two norms for each SiLU gate, counted on the eager passes: graph replays skip Python) and
    every logit is equal."""
    from quantkit.runtime import LLM, SamplingParams
    from quantkit.runtime.loader import LoadedModel
    from tests.runtime.helpers import record_logits

    prompts = random_prompts([7, 30, 1, 12], COMMON["vocab_size"], seed=6)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    logits, launches = {}, []
    real_norm, real_silu = M.add_rms_norm_quant, M.silu_mul_quant
    monkeypatch.setattr(M, "add_rms_norm_quant", lambda *a, **k: launches.append("norm") or real_norm(*a, **k))
    monkeypatch.setattr(M, "silu_mul_quant", lambda *a, **k: launches.append("silu") or real_silu(*a, **k))
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(KernelOrSimulated, "takes_quantized_input", lambda self, x: False)
        model = progressive_model(dtype, "cuda")
        llm = LLM(LoadedModel(model, None, (COMMON["eos_token_id"],)), device="cuda", num_kv_blocks=32)
        assert llm.runner.graphs
        launches.clear()
        rows = record_logits(llm)
        llm.generate(prompts, params)
        assert bool(launches) == fused and launches.count("norm") == 2 * launches.count("silu")
        logits[fused] = [torch.stack(rows[k]) for k in sorted(rows)]
    assert len(logits[True]) == len(logits[False]) == len(prompts)
    for a, b in zip(logits[True], logits[False], strict=True):
        assert a.shape == (params.max_tokens, COMMON["vocab_size"]) and torch.equal(a, b)
