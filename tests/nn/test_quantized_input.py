"""W4A8 layers on codes made before them (``takes_quantized_input`` / ``forward_quantized``): which layers take them,
the GEMM's result bit for bit ``forward``'s kernel path, and the programmatic-launch flag ``w4a8_linear`` would use.

The kernels run in Triton's interpreter on CPU tensors (the way the layers' own kernel-path tests run them).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from quantkit.kernels.w4a8 import dispatch as w4a8_dispatch
from quantkit.kernels.w8a8.quant import quantize_activations

from quantkit.algorithms.gptq import gptq
from quantkit.algorithms.rtn import rtn
from quantkit.errors import QuantkitError
from quantkit.nn.progressive import ProgressiveW4A8Linear
from quantkit.nn.w4a8 import W4A8Linear
from quantkit.quant.scheme import QuantScheme

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def scheme(progressive=False, act_fmt="int", group_size=32) -> QuantScheme:
    extra = {"progressive": True} if progressive else {"sym": True, "act_fmt": act_fmt}
    return QuantScheme(bits=4, group_size=group_size, act_bits=8, **extra)


def make(cls, k=96, n=48, act_order=False, bias=True, seed=0, **fields):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.linspace(0.2, 3.0, n)[:, None]
    b = torch.randn(n, generator=g) if bias else None
    s = scheme(cls is ProgressiveW4A8Linear, **fields)
    if act_order:
        x = torch.randn(256, k, generator=g) * (0.2 + 3 * torch.rand(k, generator=g))
        qw, _ = gptq(w, x.t() @ x, s, act_order=True, static_groups=False)
    else:
        qw = rtn(w, s)
    mod = cls.from_quantized(qw, b, torch.float16).to(DEVICE)
    if cls is ProgressiveW4A8Linear:
        mod.weight_scale = mod.weight_scale.float()
    return mod


def on_cuda(dtype=torch.float16):
    """What the predicate reads of x (its device and dtype), standing for a CUDA tensor on CPU-only machines."""
    return types.SimpleNamespace(is_cuda=True, dtype=dtype)


@pytest.mark.parametrize("cls", [ProgressiveW4A8Linear, W4A8Linear])
def test_which_layers_take_quantized_input(cls):
    mod = make(cls)
    assert mod.takes_quantized_input(on_cuda()) and mod.takes_quantized_input(on_cuda(torch.bfloat16))
    assert not mod.takes_quantized_input(on_cuda(torch.float32))  # the simulation's input
    assert not mod.takes_quantized_input(torch.zeros(2, 96, dtype=torch.float16))  # the CPU: the simulation
    permuted = make(cls, 160, 48, act_order=True)  # the kernel reads x's columns in another order
    assert permuted._w4a8_weight().perm is not None and not permuted.takes_quantized_input(on_cuda())
    with pytest.raises(QuantkitError, match="does not take quantized input"):
        permuted.forward_quantized(torch.zeros(1, 160, dtype=torch.int8), torch.ones(1), torch.float16)


def test_fp8_activations_keep_the_quantizing_forward():
    mod = make(W4A8Linear, act_fmt="fp8")
    assert not mod.takes_quantized_input(on_cuda())
    with pytest.raises(QuantkitError, match="does not take quantized input"):
        mod.forward_quantized(torch.zeros(1, 96, dtype=torch.int8), torch.ones(1), torch.float16)


@pytest.mark.parametrize("cls", [ProgressiveW4A8Linear, W4A8Linear])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5])
def test_forward_quantized_is_the_kernel_forward_bit_for_bit(cls, dtype, m):
    mod = make(cls, bias=m == 1)
    if mod.bias is not None:
        mod.bias = mod.bias.to(dtype)
    x = (torch.randn(m, 96, generator=torch.Generator().manual_seed(3)) * 2).to(dtype).to(DEVICE)
    qa, a_scale = quantize_activations(x, "int8")
    y = mod.forward_quantized(qa, a_scale, dtype)
    assert y.dtype == dtype and y.shape == (m, 48)
    assert torch.equal(y, mod._forward_cuda(x))


def test_progressive_pdl_follows_w4a8_linears_rule(monkeypatch):
    """``quantized_input_pdl`` is ``PROGRESSIVE_PDL and use_pdl(x)``, read when called, and ``forward_quantized``
    hands that flag to the GEMM; a plain W4A8 layer never asks for it."""
    calls = []

    def w4a8_matmul(qa, a_scale, w, bias=None, out_dtype=torch.float16, pdl=False):
        calls.append(pdl)
        return torch.zeros(qa.shape[0], w.out_features, dtype=out_dtype)

    mod, plain = make(ProgressiveW4A8Linear), make(W4A8Linear)
    qa = torch.zeros(2, 96, dtype=torch.int8)
    assert not mod.quantized_input_pdl(qa) or DEVICE == "cuda"
    monkeypatch.setattr(w4a8_dispatch, "use_pdl", lambda x: x.shape[0] <= 64)
    assert mod.quantized_input_pdl(qa) and not mod.quantized_input_pdl(torch.zeros(65, 96, dtype=torch.int8))
    assert not plain.quantized_input_pdl(qa)
    monkeypatch.setitem(sys.modules, "quantkit.kernels.w4a8", types.SimpleNamespace(w4a8_matmul=w4a8_matmul))
    mod.forward_quantized(qa, torch.ones(2), torch.float16)
    monkeypatch.setattr(w4a8_dispatch, "PROGRESSIVE_PDL", False)
    assert not mod.quantized_input_pdl(qa)
    mod.forward_quantized(qa, torch.ones(2), torch.float16)
    plain.forward_quantized(qa, torch.ones(2), torch.float16)
    assert calls == [True, False, False]
