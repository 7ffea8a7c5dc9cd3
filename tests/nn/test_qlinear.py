"""nn/qlinear.py and nn/factory.py: a QuantLinear holds exactly the quantized weight it was made from, and its
forward (CPU) is the float product with that dequantized weight."""

import pytest
import torch

from quantkit.algorithms.rtn import rtn
from quantkit.nn import QuantLinear
from quantkit.nn.factory import empty_quantized_linear, make_quantized_linear, quantized_modules
from quantkit.nn.w8a8 import W8A8Linear
from quantkit.quant import QuantScheme


@pytest.mark.parametrize("bits,group_size,sym", [(4, 32, False), (3, 64, True), (8, -1, True)])
def test_pack_unpack_and_forward_agree_with_the_quantized_weight(bits, group_size, sym):
    gen = torch.Generator().manual_seed(bits)
    w, bias = torch.randn(48, 96, generator=gen), torch.randn(48, generator=gen)
    qw = rtn(w, QuantScheme(bits=bits, group_size=group_size, sym=sym))
    module = make_quantized_linear(qw, bias, torch.float32)
    assert isinstance(module, QuantLinear)
    back = module.quantized_weight()
    assert torch.equal(back.q, qw.q) and torch.equal(back.zeros, qw.zeros)
    torch.testing.assert_close(back.scales, qw.scales.half().float(), rtol=0, atol=0)  # stored as fp16
    reference = (qw.q.float() - qw.zeros.float()[:, qw.g_idx.long()]) * qw.scales.half().float()[:, qw.g_idx.long()]
    torch.testing.assert_close(module.dequantize_weight(), reference, rtol=0, atol=0)
    x = torch.randn(5, 96, generator=gen)
    torch.testing.assert_close(module(x), x @ reference.t() + bias, rtol=1e-5, atol=1e-5)


def test_the_factory_builds_the_module_of_each_scheme():
    w4, w8a8 = QuantScheme(bits=4, group_size=32), QuantScheme(bits=8, group_size=-1, act_bits=8)
    empty = empty_quantized_linear(64, 32, w4, bias=False, dtype=torch.float16)
    assert isinstance(empty, QuantLinear) and empty.qweight.shape == (4 * 64 // 32, 32)  # [K/32 * bits, N]
    assert isinstance(empty_quantized_linear(64, 32, w8a8, bias=True, dtype=torch.float16), W8A8Linear)
    model = torch.nn.Sequential(empty, torch.nn.Linear(4, 4))
    assert list(quantized_modules(model)) == ["0"]
