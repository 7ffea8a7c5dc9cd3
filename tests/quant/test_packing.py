import pytest
import torch

from quantkit.nn.qlinear import QuantLinear, unpack_codes_fast
from quantkit.quant import QuantizedWeight, QuantScheme, pack_rows, unpack_rows
from quantkit.quant.packing import pack_cols, packed_rows, unpack_cols
from quantkit.quant.tensor import group_index


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("k", [1, 31, 32, 64, 96, 576, 1000])
def test_pack_rows_round_trip(bits, k):
    g = torch.Generator().manual_seed(k * 10 + bits)
    codes = torch.randint(0, 2**bits, (k, 7), generator=g)
    words = pack_rows(codes, bits)
    assert words.dtype == torch.int32
    assert words.shape == (packed_rows(k, bits), 7)
    assert torch.equal(unpack_rows(words, bits, k).long(), codes)
    assert torch.equal(unpack_codes_fast(words, bits, k).long(), codes)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_cols_round_trip(bits):
    codes = torch.randint(0, 2**bits, (5, 77))
    assert torch.equal(unpack_cols(pack_cols(codes, bits), bits, 77).long(), codes)


def test_gptq_word_order_4bit():
    # the GPTQ layout: qweight[r, n] = sum_j q[r*8 + j, n] << (4*j), lowest bits first
    codes = torch.arange(8).view(8, 1) % 16
    word = pack_rows(codes, 4)[0, 0].item() & 0xFFFFFFFF
    assert word == sum(j << (4 * j) for j in range(8))
    # symmetric 4-bit zero 8 everywhere packs to 0x88888888 (v2 stores the zero itself)
    z = pack_cols(torch.full((1, 8), 8), 4)[0, 0].item() & 0xFFFFFFFF
    assert z == 0x88888888


def test_3bit_straddles_words_like_gptq():
    codes = torch.zeros(32, 1, dtype=torch.long)
    codes[10] = 0b111  # bits 30..32: two bits in word 0, one bit in word 1
    words = pack_rows(codes, 3)[:, 0].long() & 0xFFFFFFFF
    assert words[0].item() == 0b11 << 30
    assert words[1].item() == 1


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [-1, 32, 128])
@pytest.mark.parametrize("sym", [True, False])
def test_quantized_weight_pack_unpack(bits, group_size, sym):
    n, k = 40, 576  # 576 = 4*128 + 64: a ragged last group at group 128
    scheme = QuantScheme(bits=bits, group_size=group_size, sym=sym)
    n_g = scheme.n_groups(k)
    qw = QuantizedWeight(
        q=torch.randint(0, 2**bits, (n, k), dtype=torch.uint8),
        scales=(torch.rand(n, n_g) + 0.01).half().float(),
        zeros=torch.randint(0, 2**bits, (n, n_g), dtype=torch.int32),
        g_idx=group_index(k, scheme),
        scheme=scheme,
    )
    back = QuantizedWeight.unpack(qw.pack(), scheme, k, n)
    for name in ("q", "scales", "zeros", "g_idx"):
        assert torch.equal(getattr(back, name), getattr(qw, name)), name
    mod = QuantLinear.from_quantized(qw, bias=None, dtype=torch.float32)
    torch.testing.assert_close(mod.dequantize_weight(), qw.dequantize(), rtol=0, atol=0)
