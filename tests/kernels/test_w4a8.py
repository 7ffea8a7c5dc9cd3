"""W4A8 kernel against a float64 reference of its quantized operands (Triton's interpreter on CPU machines).

The reference (``w4a8_reference``) is the exact product of the per-token codes and scales that the quantizer gives
and the exact 4-bit weight s * (q - z), in float64; it is itself checked against ``QuantizedWeight.dequantize``.
The kernel computes the same sum: int8 group sums are exact in int32, fp8 group sums are exact products summed in
fp32, so its error is a few fp32 roundings plus the final rounding to the output dtype. Tolerance (flash-attn's
rule): the kernel's max error is at most twice PyTorch's own error computing the same product in the output dtype
(``F.linear`` on the dequantized activations and weight rounded to that dtype) plus a floor of 2**-20 * max|y|;
also, element by element, at most one unit in the last place of the output dtype plus fp32 slack.

Every output buffer is poisoned with NaN first; inputs are fresh random tensors per case.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from quantkit.kernels import w4a8 as K
from quantkit.kernels.w4a8.progressive import MAX_K, pack_codes, unpack_codes
from quantkit.kernels.w4a16 import prepare_gptq_weight
from quantkit.kernels.w8a8.quant import quantize_activations, quantize_activations_reference

from quantkit.quant import QuantizedWeight, QuantScheme
from quantkit.quant.tensor import group_index

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

SMALL = K.W4A8Config(16, 32, 64, 1, split_waves=8, swap_ab=True)  # the small-M shape, split K on 4 "SMs"
SMALL_ONE = K.W4A8Config(16, 32, 128, 1, split_waves=0, swap_ab=True, num_stages=2)  # no split
TILES = K.W4A8Config(32, 32, 64, 2, num_stages=2)
TILES_SPLIT = K.W4A8Config(16, 64, 32, 1, split_waves=8)  # 32-deep steps, many splits that start mid-group
# the flat-loop kernel (flat.py): swap-AB as FLAT_TABLE's tiles, split K mid-group, plain tiles, word by word
FLAT = K.W4A8Config(16, 32, 64, 1, swap_ab=True, num_stages=2, flat=True)
FLAT_SPLIT = K.W4A8Config(16, 32, 32, 1, split_waves=8, swap_ab=True, flat=True)
FLAT_AB = K.W4A8Config(32, 32, 64, 2, num_stages=2, flat=True)
FLAT_WORDS = replace(FLAT, byte_unpack=False)


def make_layer(n, k, group_size=128, sym=False, act_order=False, seed=0):
    """(QuantizedWeight, prepared W4A16Weight) of random 4-bit codes, zeros and fp16-representable scales."""
    g = torch.Generator().manual_seed(seed)
    scheme = QuantScheme(bits=4, group_size=group_size, sym=sym)
    n_g = scheme.n_groups(k)
    g_idx = group_index(k, scheme)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    if sym:
        zeros = torch.full((n, n_g), 8, dtype=torch.int32)
    else:
        zeros = torch.randint(0, 16, (n, n_g), generator=g, dtype=torch.int32)
    qw = QuantizedWeight(
        q=torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
        scales=(torch.rand(n, n_g, generator=g) * 0.01 + 1e-3).half().float(),
        zeros=zeros,
        g_idx=g_idx,
        scheme=scheme,
    )
    b = {name: t.to(DEVICE) for name, t in qw.pack().items()}
    return qw, prepare_gptq_weight(b["qweight"], b["qzeros"], b["scales"], b["g_idx"], 4, group_size)


def activations(m, k, dtype, seed):
    """x whose rows differ in magnitude (per-token scales matter), with an outlier column."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g).add(0.1) * 4
    x[:, k // 3] *= 8
    return x.to(dtype).to(DEVICE)


def assert_close_to_reference(y, x, qw, w, bias, fmt):
    ref = K.w4a8_reference(x, w, bias, fmt)
    assert y.dtype == x.dtype and y.shape == ref.shape
    x2 = x.reshape(-1, x.shape[-1])
    qa, a_scale = quantize_activations_reference(x2, fmt)  # checkpoint channel order: per-token scales are alike
    x_dq = qa.double() * a_scale.double()[:, None]
    torch_y = F.linear(x_dq.to(x.dtype), qw.dequantize(torch.float64).to(DEVICE).to(x.dtype), bias)
    ref2 = ref.reshape(-1, ref.shape[-1])
    torch_err = (torch_y.double() - ref2).abs().max().item()
    err = (y.double() - ref).abs()
    floor = 2**-20 * ref.abs().max().item()
    assert err.max().item() <= 2 * torch_err + floor, f"kernel error {err.max():.3g} vs PyTorch's {torch_err:.3g}"
    # element by element: one output ulp, plus fp32 slack relative to the sum of |terms|
    codes, scales = K.signed_codes(w)
    terms = (qa.double().abs() @ (codes.double().abs() * scales.double())) * a_scale.double()[:, None]
    if w.perm is not None:  # terms in kernel order: qa must follow the weight's channel order
        qa_k, _ = quantize_activations_reference(x2.index_select(1, w.perm), fmt)
        terms = (qa_k.double().abs() @ (codes.double().abs() * scales.double())) * a_scale.double()[:, None]
    # fp32 slack; fp8 products on a GPU add inside the tensor core with ~14 mantissa bits between promotions
    # (DeepSeek-V3, sec. 3.3.2), which the H100 showed at 1.3e-4 over the fp32 slack on one case
    slack = 2**-13 if fmt == "fp8" and DEVICE == "cuda" else 64 * torch.finfo(torch.float32).eps
    bound = torch.finfo(x.dtype).eps * ref2.abs() + slack * terms
    assert (err.reshape(bound.shape) <= bound).all(), f"max excess {(err.reshape(bound.shape) - bound).max():.3g}"


# (fmt, M, N, K, group, sym, dtype, act_order, bias, config): ragged M/N/K, groups 32/64/128 and per channel
CASES = [
    ("int8", 1, 77, 576, 128, False, torch.float16, False, True, None),  # ragged last group (576 = 4.5 * 128)
    ("fp8", 1, 64, 256, 128, True, torch.bfloat16, False, False, None),
    ("int8", 3, 33, 200, 64, False, torch.bfloat16, False, True, SMALL),  # K % 32 != 0: padded words, masked K
    ("fp8", 3, 33, 200, 64, False, torch.float16, True, True, SMALL),
    ("int8", 5, 96, 512, -1, False, torch.bfloat16, False, True, SMALL),  # per channel, split K
    ("fp8", 7, 50, 384, -1, True, torch.float16, True, False, SMALL_ONE),  # per channel, one split
    ("int8", 2, 48, 200, -1, False, torch.float16, False, True, SMALL),  # per channel, splits, masked K tail
    ("int8", 16, 40, 320, 32, True, torch.float16, True, True, TILES_SPLIT),  # splits start mid-group
    ("fp8", 16, 40, 320, 32, False, torch.bfloat16, False, True, TILES_SPLIT),
    ("int8", 17, 70, 256, 64, False, torch.float16, False, True, None),
    ("fp8", 33, 48, 160, 32, False, torch.bfloat16, True, True, None),
    ("int8", 40, 24, 130, -1, True, torch.bfloat16, False, False, TILES),  # K % 8 != 0, per channel
    ("fp8", 70, 33, 256, 128, False, torch.float16, False, True, TILES),
    ("int8", 100, 40, 256, 64, True, torch.bfloat16, True, True, None),
    ("fp8", 130, 20, 192, 64, False, torch.float16, False, True, None),
]
# the word-by-word unpacking (byte_unpack=False) on the cases that cover its masks and both paths
WORDS = [
    (*case[:-1], replace(case[-1] or K.config_for(case[1]), byte_unpack=False))
    for case in (CASES[2], CASES[3], CASES[7], CASES[11], CASES[12])
]


FLAT_CASES = [
    ("int8", 70, 33, 256, 128, False, torch.float16, False, True, FLAT),  # ragged M and N tiles
    ("int8", 3, 33, 200, 64, False, torch.bfloat16, True, True, FLAT),  # K % 32 != 0: padded words, masked K
    ("fp8", 17, 40, 320, 32, False, torch.bfloat16, False, True, FLAT_SPLIT),  # splits start mid-group
    ("int8", 16, 40, 320, 32, True, torch.float16, True, False, FLAT_SPLIT),
    ("int8", 40, 24, 130, -1, False, torch.bfloat16, False, True, FLAT),  # per channel: one int32 accumulator
    ("int8", 5, 96, 512, -1, True, torch.float16, False, True, FLAT_SPLIT),  # per channel, split K
    ("fp8", 7, 50, 384, -1, False, torch.float16, True, False, FLAT),  # per channel, fp32 chain
    ("int8", 100, 40, 256, 64, True, torch.bfloat16, True, True, FLAT_AB),  # weight tile as the right operand
    ("fp8", 33, 48, 160, 32, False, torch.float16, False, True, FLAT_AB),
    ("int8", 33, 48, 200, 64, False, torch.float16, False, True, FLAT_WORDS),  # word by word, masked K tail
    ("int8", 7, 40, 256, -1, False, torch.bfloat16, False, False, FLAT_WORDS),
]


@pytest.mark.parametrize("fmt,m,n,k,group,sym,dtype,act_order,with_bias,config", CASES + WORDS + FLAT_CASES)
def test_matches_float64_reference(fmt, m, n, k, group, sym, dtype, act_order, with_bias, config):
    qw, w = make_layer(n, k, group, sym, act_order, seed=m * 1000 + n)
    x = activations(m, k, dtype, seed=m + n)
    bias = torch.randn(n, device=DEVICE).to(dtype) if with_bias else None
    x_kernel = x.index_select(1, w.perm) if w.perm is not None else x
    qa, a_scale = quantize_activations(x_kernel, fmt)
    want_qa, want_scale = quantize_activations_reference(x_kernel, fmt)
    assert torch.equal(qa.view(torch.uint8), want_qa.view(torch.uint8)) and torch.equal(a_scale, want_scale)
    out = torch.full((m, n), float("nan"), device=DEVICE, dtype=dtype)
    y = K.w4a8_matmul(qa, a_scale, w, bias, out_dtype=dtype, out=out, config=config)
    assert y.data_ptr() == out.data_ptr() and not y.isnan().any()
    assert not w.locks.any()  # the last split of each tile reset its semaphore
    assert_close_to_reference(y, x, qw, w, bias, fmt)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_linear_entry_point(fmt):
    """w4a8_linear: leading dims, act-order (x permuted inside), bias, x's dtype out; same as the matmul."""
    qw, w = make_layer(36, 256, 64, act_order=True, seed=5)
    x = activations(6, 256, torch.bfloat16, seed=6).reshape(2, 3, 256)
    bias = torch.randn(36, device=DEVICE).to(torch.bfloat16)
    y = K.w4a8_linear(x, w, bias, fmt)
    assert y.shape == (2, 3, 36) and y.dtype == torch.bfloat16
    assert_close_to_reference(y, x, qw, w, bias, fmt)


@pytest.mark.parametrize("config", [None, FLAT, FLAT_AB])
def test_fp32_output_is_the_reference_to_fp32_rounding(config):
    _, w = make_layer(40, 256, 64, seed=14)
    x = activations(5, 256, torch.float16, seed=15)
    bias = torch.randn(40, device=DEVICE)
    qa, a_scale = quantize_activations(x, "int8")
    out = torch.full((5, 40), float("nan"), device=DEVICE)
    y = K.w4a8_matmul(qa, a_scale, w, bias, out_dtype=torch.float32, out=out, config=config)
    ref = K.w4a8_reference(x, w, bias, "int8")
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_reference_is_the_dequantized_product():
    """w4a8_reference (kernel channel order, signed codes) equals the quantized activations times
    ``QuantizedWeight.dequantize`` in checkpoint order, for act-order and per-channel layers."""
    for group, act_order in ((64, True), (-1, False)):
        qw, w = make_layer(30, 192, group, act_order=act_order, seed=7)
        x = activations(4, 192, torch.float16, seed=8)
        bias = torch.randn(30, device=DEVICE)
        for fmt in ("int8", "fp8"):
            qa, a_scale = quantize_activations_reference(x, fmt)
            want = (qa.double() * a_scale.double()[:, None]) @ qw.dequantize(torch.float64).to(DEVICE).T
            got = K.w4a8_reference(x, w, bias, fmt)
            torch.testing.assert_close(got, want + bias.double(), rtol=1e-12, atol=1e-12)


def test_signed_codes_are_8_bit_operands():
    _, w = make_layer(40, 128, 32, sym=False, seed=9)
    codes, _ = K.signed_codes(w)
    assert codes.min() >= -15 and codes.max() <= 15 and codes.min() < -8  # asymmetric: beyond a signed nibble
    _, w = make_layer(40, 128, 32, sym=True, seed=9)
    codes, _ = K.signed_codes(w)
    assert codes.min() == -8 and codes.max() == 7  # symmetric: code - 8


def test_split_k_is_deterministic_and_close_to_one_split():
    _, w = make_layer(64, 512, 128, seed=10)
    x = activations(2, 512, torch.float16, seed=11)
    qa, a_scale = quantize_activations(x, "int8")
    assert K.choose(2, 64, 512, 128, 4, SMALL).launch.split == 8
    y1 = K.w4a8_matmul(qa, a_scale, w, config=SMALL)
    assert torch.equal(y1, K.w4a8_matmul(qa, a_scale, w, config=SMALL)) and not w.locks.any()
    y0 = K.w4a8_matmul(qa, a_scale, w, config=SMALL_ONE)
    torch.testing.assert_close(y1, y0, rtol=2e-3, atol=2e-3)


def test_plans_and_the_table():
    plan = K.plan_launch(K.W4A8Config(16, 64, 128, split_waves=4), 1, 4096, 4096, 32, 132)
    assert plan.block_k == 32 and plan.group_tiles == 1  # BLOCK_K capped to the group
    plan = K.plan_launch(K.W4A8Config(16, 64, 128, split_waves=4), 1, 4096, 4096, 0, 132)
    assert plan.group_tiles == 32 and plan.split * plan.tiles_per_split >= 32  # one group: all K tiles
    assert (plan.split - 1) * plan.tiles_per_split < 32  # no empty split
    assert K.plan_launch(K.W4A8Config(16, 16, 64, split_waves=4), 16, 2**17, 4096, 128, 132).split == 1  # > LOCK_SLOTS
    assert K.choose(16, 4096, 4096, 128, 132).path == "small_m"
    assert K.choose(17, 4096, 4096, 128, 132).path == "tiles"
    bounds = [m for m, _ in K.CONFIG_TABLE]
    assert bounds == sorted(bounds) and K.config_for(10**6) == K.CONFIG_TABLE[-1][1]
    assert "small_m" in K.explain(1, 4096, 4096, 128, "cpu")
    flat = K.config_for(1024)
    assert flat.flat and flat.swap_ab and not K.config_for(1024, K.GROUP_LOOP_TABLE).flat  # the default: flat
    assert "w4a8/flat.py" in str(K.choose(1024, 4096, 4096, 128, 132, flat)) and flat.name.endswith("-flat")
    assert K.config_for(16, K.GROUP_LOOP_TABLE) == K.config_for(16) and K.CONFIG_TABLE is K.FLAT_TABLE


@pytest.mark.parametrize(
    "table,regime", [(t, r) for t in ("GROUP_LOOP_TABLE", "FLAT_TABLE") for r in range(len(getattr(K, t)))]
)
def test_table_configs_run(table, regime):
    max_m, cfg = getattr(K, table)[regime]
    m = min(max_m, 140)
    qw, w = make_layer(40, 256, 128, seed=regime)
    x = activations(m, 256, torch.float16, seed=regime)
    qa, a_scale = quantize_activations(x, "int8")
    out = torch.full((m, 40), float("nan"), device=DEVICE, dtype=torch.float16)
    y = K.w4a8_matmul(qa, a_scale, w, out=out, config=cfg)
    assert_close_to_reference(y, x, qw, w, None, "int8")


def test_bad_operands_are_named():
    _, w = make_layer(16, 64, 32, seed=12)
    x = activations(2, 64, torch.float16, seed=13)
    qa, a_scale = quantize_activations(x, "int8")
    with pytest.raises(ValueError, match="fmt"):
        K.w4a8_linear(x, w, fmt="int4")
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        K.w4a8_linear(x.float(), w)
    with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
        K.w4a8_linear(x[:, :32], w)
    with pytest.raises(ValueError, match="a_scale"):
        K.w4a8_matmul(qa, a_scale[:1], w)
    with pytest.raises(ValueError, match="qa must be int8"):
        K.w4a8_matmul(x, a_scale, w)
    with pytest.raises(ValueError, match="out must be"):
        K.w4a8_matmul(qa, a_scale, w, out=torch.empty(2, 16, dtype=torch.bfloat16, device=DEVICE))
    w.bits = 8
    with pytest.raises(ValueError, match="4-bit"):
        K.w4a8_matmul(qa, a_scale, w)
    assert K.w4a8_matmul(qa[:0], a_scale[:0], make_layer(16, 64, 32)[1]).shape == (0, 16)


# ---------------------------------------------------------------------------------------------------------------
# Progressive weights (kernels/w4a8/progressive.py): int8 d = q * s2 - sz, one int32 accumulator over K
# ---------------------------------------------------------------------------------------------------------------
def progressive_layer(n, k, group_size=128, seed=0):
    """A progressive weight quantized from a random float weight with outlier rows and columns and one-signed
    groups (the RTN's clamps and both ends of the protective range are reached)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[:, k // 2] *= 10  # an outlier input channel
    w[0] = w[0].abs()  # an all-positive row: zero points at 0
    if n > 1:
        w[1] = -w[1].abs()
    return w, K.quantize_progressive(w.to(DEVICE), group_size)


def assert_close_to_progressive_reference(y, x, w, bias):
    ref = K.progressive_reference(x, w, bias)
    assert y.dtype == x.dtype and y.shape == ref.shape
    x2 = x.reshape(-1, x.shape[-1])
    qa, a_scale = quantize_activations_reference(x2, "int8")
    x_dq = qa.double() * a_scale.double()[:, None]
    torch_y = F.linear(x_dq.to(x.dtype), K.dequantize(w, torch.float64).to(x.dtype), bias)
    ref2 = ref.reshape(-1, ref.shape[-1])
    torch_err = (torch_y.double() - ref2).abs().max().item()
    err = (y.double() - ref).abs().reshape(ref2.shape)
    floor = 2**-20 * ref.abs().max().item()
    assert err.max().item() <= 2 * torch_err + floor, f"kernel error {err.max():.3g} vs PyTorch's {torch_err:.3g}"
    # element by element: one output ulp plus fp32 slack on the sum of |terms| (the int32 sum itself is exact)
    qa_k = qa if w.perm is None else quantize_activations_reference(x2.index_select(1, w.perm), "int8")[0]
    terms = (qa_k.double().abs() @ K.int8_weight(w).double().abs().t()) * a_scale.double()[:, None]
    bound = torch.finfo(x.dtype).eps * ref2.abs() + 8 * torch.finfo(torch.float32).eps * terms * w.s1.double()
    assert (err <= bound).all(), f"max excess {(err - bound).max():.3g}"


PROG_SWAP = K.W4A8Config(16, 32, 64, 1, swap_ab=True, num_stages=2, flat=True)
PROG_SPLIT = K.W4A8Config(16, 32, 32, 1, split_waves=8, swap_ab=True, flat=True)  # 32-deep steps, splits mid-group
PROG_AB = K.W4A8Config(32, 32, 64, 2, num_stages=2, flat=True)  # the weight tile as the right operand
# (M, N, K, group, dtype, bias, config): ragged M / N / K (K % 32 != 0: padded chunk, masked K), per channel (0)
PROGRESSIVE_CASES = [
    (1, 77, 576, 128, torch.float16, True, None),  # ragged last group, the small-M table entry with split-K
    (3, 33, 200, 64, torch.bfloat16, True, PROG_SWAP),
    (70, 33, 256, 128, torch.float16, False, PROG_SWAP),
    (17, 40, 320, 32, torch.bfloat16, True, PROG_SPLIT),
    (5, 96, 512, 0, torch.float16, True, PROG_SPLIT),  # one group, split K
    (40, 24, 130, 0, torch.bfloat16, False, PROG_AB),
    (100, 40, 256, 64, torch.bfloat16, True, PROG_AB),
    (33, 48, 200, 64, torch.float16, True, None),
]


def test_progressive_packing_round_trips():
    g = torch.Generator().manual_seed(20)
    for k in (32, 200, 256):
        q = torch.randint(0, 16, (24, k), generator=g, dtype=torch.uint8)
        packed = pack_codes(q)
        assert packed.dtype == torch.int32 and packed.shape == (-(-k // 32) * 4, 24)
        assert torch.equal(unpack_codes(packed, k), q)
    q = torch.arange(32, dtype=torch.uint8).remainder(16).reshape(1, 32)  # word c: k = 4c + j (low), 16 + 4c + j
    byte = pack_codes(q).view(torch.uint8).reshape(4, 4)  # [c, j]
    assert torch.equal(byte & 15, torch.arange(16).reshape(4, 4).to(torch.uint8))
    assert torch.equal(byte >> 4, torch.arange(16).reshape(4, 4).to(torch.uint8))  # 16 + 4c + j, mod 16


def test_progressive_rtn_keeps_d_in_int8_and_is_as_good_as_one_level_rtn():
    w, pw = progressive_layer(64, 384, 128, seed=21)
    d = K.int8_weight(pw)
    assert d.abs().max() <= 126 and d.abs().max() >= 110  # the protective range is reached, never passed
    assert pw.s2.min() >= 1 and pw.s2.max() <= 15 and int(pw.sz.max()) <= 121
    assert bool((pw.sz.int() % pw.s2.int() == 0).all()) and bool((pw.sz.int() // pw.s2.int() <= 15).all())
    assert (pw.sz[:, 0] == 0).all()  # the all-positive row: zero point 0
    # one-level asymmetric 4-bit RTN in groups of 128 (0 in range, float scale): the two-level grid within 25%
    wg = w.reshape(64, 3, 128)
    lo, hi = wg.amin(-1, keepdim=True).clamp(max=0), wg.amax(-1, keepdim=True).clamp(min=0)
    s = (hi - lo) / 15
    z = (-lo / s).round()
    one_level = (((wg / s).round() + z).clamp(0, 15) - z) * s
    err1 = (one_level.reshape(64, 384) - w).norm()
    err2 = (K.dequantize(pw).cpu() - w).norm()
    assert err2 <= 1.25 * err1, f"progressive RTN error {err2:.4g} vs one-level {err1:.4g}"


def test_progressive_grid_decodes_every_code_into_int8():
    """The format's invariant, by enumeration: for every integer range [lo, hi] within the protective range
    [-116, 116], every code 0..15 of ``group_grid``'s grid decodes to d = s2 * (q - z) in [-121, 126]; at 117 the
    code 15 of some grid decodes past 127 (116 is the largest range with the property)."""
    for limit, holds in ((116, True), (117, False)):
        lo = torch.arange(-limit, 1).repeat_interleave(limit + 1)
        hi = torch.arange(0, limit + 1).repeat(limit + 1)
        s2, z = K.progressive.group_grid(lo, hi)
        d_min, d_max = (-s2 * z).min().item(), (s2 * (15 - z)).max().item()
        assert (d_min >= -128 and d_max <= 127) == holds, (limit, d_min, d_max)
        if holds:
            assert (d_min, d_max) == (-121, 126) and s2.max() == 15


def test_progressive_packed_arithmetic_is_exact():
    """The PTX's word arithmetic, here on int64: x * s2 + (0x80808080 - sz * 0x01010101) mod 2**32, XOR 0x80808080,
    gives per byte the int8 q * s2 - sz, for every (s2, z) and four codes whose d lie in [-127, 127]."""
    g = torch.Generator().manual_seed(22)
    s2 = torch.arange(1, 17).repeat_interleave(16)  # every s2 and z
    z = torch.arange(16).repeat(16)
    for _ in range(20):
        q = torch.randint(0, 16, (256, 4), generator=g)
        d = s2[:, None] * (q - z[:, None])
        q = torch.where(d.abs() <= 127, q, z[:, None])  # codes outside the int8 range are never stored
        d = s2[:, None] * (q - z[:, None])
        x = (q << torch.tensor([0, 8, 16, 24])).sum(1)
        word = (x * s2 + (0x80808080 - z * s2 * 0x01010101)) % 2**32 ^ 0x80808080
        got = ((word[:, None] >> (8 * torch.arange(4))) & 255).to(torch.uint8).view(torch.int8)
        assert torch.equal(got.long(), d)


@pytest.mark.parametrize("m,n,k,group,dtype,with_bias,config", PROGRESSIVE_CASES)
def test_progressive_matches_float64_reference(m, n, k, group, dtype, with_bias, config):
    _, w = progressive_layer(n, k, group, seed=m * 1000 + n)
    x = activations(m, k, dtype, seed=m + n)
    bias = torch.randn(n, device=DEVICE).to(dtype) if with_bias else None
    qa, a_scale = quantize_activations(x, "int8")
    out = torch.full((m, n), float("nan"), device=DEVICE, dtype=dtype)
    y = K.w4a8_matmul(qa, a_scale, w, bias, out_dtype=dtype, out=out, config=config)
    assert y.data_ptr() == out.data_ptr() and not y.isnan().any()
    assert not w.locks.any()  # the last split of each tile reset its semaphore
    assert_close_to_progressive_reference(y, x, w, bias)


def test_progressive_linear_act_order_and_fp32_output():
    """w4a8_linear on a progressive weight with a channel permutation: x permuted inside, leading dims kept; fp32
    output is the reference to fp32 rounding."""
    _, w = progressive_layer(36, 256, 64, seed=23)
    w.perm = torch.randperm(256, generator=torch.Generator().manual_seed(24)).to(DEVICE)
    x = activations(6, 256, torch.bfloat16, seed=25).reshape(2, 3, 256)
    bias = torch.randn(36, device=DEVICE).to(torch.bfloat16)
    y = K.w4a8_linear(x, w, bias)
    assert y.shape == (2, 3, 36) and y.dtype == torch.bfloat16
    assert_close_to_progressive_reference(y, x, w, bias)
    qa, a_scale = quantize_activations(x.reshape(6, 256).index_select(1, w.perm), "int8")
    y32 = K.w4a8_matmul(qa, a_scale, w, out_dtype=torch.float32, config=PROG_AB)
    ref = K.progressive_reference(x.reshape(6, 256), w)
    torch.testing.assert_close(y32.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert "w4a8/progressive.py" in K.explain(1024, 4096, 4096, 128, "cpu", progressive=True)


@pytest.mark.parametrize("regime", range(len(K.PROGRESSIVE_TABLE)))
def test_progressive_table_configs_run(regime):
    max_m, cfg = K.PROGRESSIVE_TABLE[regime]
    m = min(max_m, 140)
    _, w = progressive_layer(40, 256, 128, seed=regime)
    x = activations(m, 256, torch.float16, seed=regime)
    qa, a_scale = quantize_activations(x, "int8")
    out = torch.full((m, 40), float("nan"), device=DEVICE, dtype=torch.float16)
    assert_close_to_progressive_reference(K.w4a8_matmul(qa, a_scale, w, out=out, config=cfg), x, w, None)


def test_progressive_split_k_is_deterministic_and_bad_operands_are_named():
    _, w = progressive_layer(64, 512, 128, seed=26)
    x = activations(2, 512, torch.float16, seed=27)
    qa, a_scale = quantize_activations(x, "int8")
    assert K.choose(2, 64, 512, 128, 4, PROG_SPLIT, progressive=True).launch.split > 1
    y1 = K.w4a8_matmul(qa, a_scale, w, config=PROG_SPLIT)
    assert torch.equal(y1, K.w4a8_matmul(qa, a_scale, w, config=PROG_SPLIT)) and not w.locks.any()
    with pytest.raises(ValueError, match="int8 for a progressive"):
        K.w4a8_linear(x, w, fmt="fp8")
    with pytest.raises(ValueError, match="group_size"):
        K.quantize_progressive(torch.randn(4, 64), 48)
    with pytest.raises(ValueError, match="s2 must be"):
        K.w4a8_matmul(qa, a_scale, replace(w, s2=w.s2.int()))
    big = replace(w, in_features=MAX_K + 32)
    with pytest.raises(ValueError, match="int32 accumulator"):
        K.w4a8_matmul(torch.zeros(1, big.in_features, dtype=torch.int8, device=DEVICE), a_scale[:1], big)


@pytest.mark.skipif(DEVICE != "cuda", reason="programmatic dependent launch needs a GPU")
@pytest.mark.parametrize("m", [1, 16, 64])
def test_progressive_pdl_matches_the_plain_launch(m):
    """Under programmatic dependent launch (the quantizer still running when the GEMM starts) the output is the
    plain launch's, bit for bit, split-K included."""
    _, w = progressive_layer(512, 1024, 128, seed=m)
    x = activations(m, 1024, torch.bfloat16, seed=m + 1)
    plain = K.w4a8_linear(x, w, pdl=False)
    assert torch.equal(K.w4a8_linear(x, w, pdl=True), plain) and not w.locks.any()
    assert_close_to_progressive_reference(plain, x, w, None)
    if m == 1:  # the GEMV too
        gemv = K.w4a8_linear(x, w, pdl=False, gemv=True)
        assert torch.equal(K.w4a8_linear(x, w, pdl=True, gemv=True), gemv) and not w.locks.any()


def test_pdl_is_refused_where_it_cannot_run():
    _, w = progressive_layer(64, 256, 128, seed=28)
    x = activations(2, 256, torch.float16, seed=29)
    if DEVICE != "cuda":
        with pytest.raises(ValueError, match="pdl needs a CUDA device of compute capability 9"):
            K.w4a8_linear(x, w, pdl=True)
    qa, a_scale = quantize_activations(x, "int8")
    if DEVICE != "cuda":
        with pytest.raises(ValueError, match="pdl needs a CUDA device of compute capability 9"):
            K.w4a8_matmul(qa, a_scale, w, pdl=True)
    with pytest.raises(ValueError, match="pdl is only for progressive"):
        K.w4a8_matmul(qa, a_scale, make_layer(64, 256)[1], pdl=True)


@pytest.mark.parametrize(
    "n,k,group,dtype,with_bias",
    [
        (77, 576, 128, torch.float16, True),  # ragged last group, split K
        (1030, 512, 0, torch.bfloat16, False),  # one group, a second column tile past N
        (33, 200, 64, torch.bfloat16, True),  # K not a multiple of 32: the last chunk's activation words masked
        (40, 4096, 32, torch.float16, False),  # many splits
    ],
)
def test_progressive_gemv_matches_float64_reference(n, k, group, dtype, with_bias):
    """The dp4a GEMV (``gemv.py``) at one row: the reference's value, and the tile kernel's to fp32 rounding of
    the split sums (both exact int32 sums scaled once)."""
    _, w = progressive_layer(n, k, group, seed=n + k)
    x = activations(1, k, dtype, seed=n)
    bias = torch.randn(n, device=DEVICE).to(dtype) if with_bias else None
    qa, a_scale = quantize_activations(x, "int8")
    out = torch.full((1, n), float("nan"), device=DEVICE, dtype=dtype)
    y = K.w4a8_matmul(qa, a_scale, w, bias, out_dtype=dtype, out=out, gemv=True)
    assert y.data_ptr() == out.data_ptr() and not y.isnan().any() and not w.locks.any()
    assert_close_to_progressive_reference(y, x, w, bias)
    y32 = K.w4a8_matmul(qa, a_scale, w, out_dtype=torch.float32, gemv=True)
    tiles = K.w4a8_matmul(qa, a_scale, w, out_dtype=torch.float32, gemv=False)
    torch.testing.assert_close(y32, tiles, rtol=1e-6, atol=1e-6 * tiles.abs().max().item())


def test_progressive_gemv_is_refused_where_it_cannot_run():
    _, w = progressive_layer(64, 256, 128, seed=30)
    qa, a_scale = quantize_activations(activations(2, 256, torch.float16, seed=31), "int8")
    with pytest.raises(ValueError, match="gemv needs a progressive weight, one contiguous row"):
        K.w4a8_matmul(qa, a_scale, w, gemv=True)
    with pytest.raises(ValueError, match="gemv needs a progressive weight"):
        K.w4a8_matmul(qa[:1], a_scale[:1], make_layer(64, 256)[1], gemv=True)
    _, odd = progressive_layer(64, 258, 0, seed=32)
    qa, a_scale = quantize_activations(activations(1, 258, torch.float16, seed=33), "int8")
    with pytest.raises(ValueError, match="K a multiple of 4"):
        K.w4a8_matmul(qa, a_scale, odd, gemv=True)
    assert torch.equal(K.w4a8_matmul(qa, a_scale, odd), K.w4a8_matmul(qa, a_scale, odd, gemv=False))
