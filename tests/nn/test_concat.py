"""Concatenating quantized linears of one input (q/k/v, gate/up) into one, as the runtime does on CUDA: exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quantkit.algorithms.gptq import gptq
from quantkit.algorithms.rtn import rtn
from quantkit.nn.qlinear import QuantLinear
from quantkit.nn.w8a8 import W8A8Linear, static_input_scale
from quantkit.quant.scheme import QuantScheme


def quant_linears(widths, k, scheme, seed, biases=(True, False, True)):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n, has_bias in zip(widths, biases, strict=False):
        w = torch.randn(n, k, generator=gen)
        bias = torch.randn(n, generator=gen).half() if has_bias else None
        out.append(QuantLinear.from_quantized(rtn(w, scheme), bias, torch.float16))
    return out


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, -1), (8, 64), (3, 32)])
def test_quantlinear_concat_is_exact(bits, group):
    scheme = QuantScheme(bits=bits, group_size=group, sym=False)
    parts = quant_linears([64, 32, 96], 96, scheme, seed=bits)
    fused = QuantLinear.concat(parts)
    assert (fused.in_features, fused.out_features) == (96, 192)
    assert torch.equal(fused.dequantize_weight(), torch.cat([p.dequantize_weight() for p in parts]))
    assert torch.equal(fused.bias[64:96], torch.zeros(32, dtype=torch.float16))  # the part without a bias
    x = torch.randn(5, 96).half()
    y = torch.cat([p(x) for p in parts], dim=-1)
    torch.testing.assert_close(fused(x), y, rtol=1e-3, atol=1e-3)


def test_quantlinear_concat_refuses_what_cannot_share_a_weight():
    scheme = QuantScheme(bits=4, group_size=32, sym=False)
    parts = quant_linears([64, 64], 96, scheme, seed=1)
    with pytest.raises(ValueError, match="one scheme"):
        QuantLinear.concat([parts[0], *quant_linears([64], 96, QuantScheme(bits=4, group_size=32, sym=True), 2)])
    with pytest.raises(ValueError, match="packed zero-point words"):
        QuantLinear.concat([parts[0], *quant_linears([36], 96, scheme, 3)])
    gen = torch.Generator().manual_seed(4)
    ordered = []
    for _ in range(2):  # act-order with two different Hessians: two different permutations
        w, x = torch.randn(64, 96, generator=gen), torch.randn(256, 96, generator=gen) * torch.rand(96, generator=gen)
        qw, _ = gptq(w, x.t() @ x, scheme, act_order=True)
        ordered.append(QuantLinear.from_quantized(qw, None, torch.float16))
    with pytest.raises(ValueError, match="act-order"):
        QuantLinear.concat(ordered)


@pytest.mark.parametrize("dynamic", [True, False])
def test_w8a8_concat_is_exact(dynamic):
    scheme = QuantScheme(bits=8, group_size=-1, sym=True, act_bits=8, act_dynamic=dynamic)
    gen = torch.Generator().manual_seed(5)
    scale = static_input_scale(4.0, scheme) if not dynamic else None
    parts = []
    for n, bias in ((48, True), (16, False)):
        lin = nn.Linear(64, n, bias=bias)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, 64, generator=gen))
        parts.append(W8A8Linear.from_float(lin, scheme, input_scale=scale))
    fused = W8A8Linear.concat(parts)
    assert torch.equal(fused.dequantize_weight(), torch.cat([p.dequantize_weight() for p in parts]))
    x = torch.randn(7, 64, generator=gen)
    torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], dim=-1), rtol=1e-5, atol=1e-5)
    if not dynamic:
        other = W8A8Linear.from_float(nn.Linear(64, 8), scheme, input_scale=static_input_scale(2.0, scheme))
        with pytest.raises(ValueError, match="static input scales differ"):
            W8A8Linear.concat([parts[0], other])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("m", [1, 2, 16, 300])
def test_fused_layers_run_the_cuda_kernels_like_their_parts(m):
    """On CUDA the fused layers go through the W4A16 and W8A8 kernels (every M regime) like their parts."""
    scheme = QuantScheme(bits=4, group_size=128, sym=False)
    parts = [p.cuda() for p in quant_linears([512, 128, 128], 1024, scheme, seed=m)]
    x = torch.randn(m, 1024, device="cuda").half()
    y = torch.cat([p(x) for p in parts], dim=-1)
    torch.testing.assert_close(QuantLinear.concat(parts)(x), y, rtol=1e-2, atol=2e-2)
    w8 = QuantScheme(bits=8, group_size=-1, sym=True, act_bits=8)
    lins = [nn.Linear(1024, n, bias=False).cuda().half() for n in (512, 256)]
    parts8 = [W8A8Linear.from_float(lin, w8) for lin in lins]
    for p in parts8:
        p.execution = "integer"
    y8 = torch.cat([p(x) for p in parts8], dim=-1)
    torch.testing.assert_close(W8A8Linear.concat(parts8)(x), y8, rtol=1e-2, atol=2e-2)
