"""Block-wise fp8 GEMM (``kernels/w8a8/block.py``) against its PyTorch reference and a float64 one, in Triton's
interpreter on CPU machines (on CUDA where present).

Tolerances. The tile quantizer is checked bit for bit (the family's row quantizer rounds exactly as the reference).
For the GEMM both sides form each B-long partial sum of e4m3 products in fp32, scale it and add it per tile: against
float64 from the same codes the error is a few fp32 roundings per tile of the accumulated magnitude,
(K/B + 2) * 4 * eps(fp32) * sum |terms| (Higham's bound, per tile), plus one rounding to the output dtype (fp16:
2**-10 relative; the interpreter's dot goes through fp16, exact for e4m3 codes). On a Hopper GPU the tiles of 64 rows
and more form each partial sum in wgmma, whose fp8 adder keeps ~14 mantissa bits (DeepSeek-V3, arXiv 2412.19437,
sec. 3.3.2): there one B-long partial may err by up to B * 2**-14 of its magnitude (``hopper_slack``).
"""

from __future__ import annotations

import pytest
import torch
from quantkit.kernels.w8a8 import block as KB
from quantkit.kernels.w8a8 import ws as WS
from quantkit.kernels.w8a8.ws import block_unsupported, m_major_scales

from quantkit.algorithms.fp8 import dequantize_fp8, quantize_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32_EPS = torch.finfo(torch.float32).eps
SMALL = KB.BlockConfig(16, 32, 1, num_stages=2)
SPLIT = KB.BlockConfig(16, 16, 2, split_waves=8, num_stages=2)  # K split over the 4 "SMs" of the interpreter


def hopper_slack(mag: torch.Tensor, block: int) -> torch.Tensor:
    """What Hopper's fp8 tensor-core adder may lose in B-long partial sums of total magnitude ``mag`` (0 off CUDA)."""
    return mag * (block * 2.0**-14 if DEVICE == "cuda" else 0.0)


def layer(m, n, k, block, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g).add(0.1) * 4
    x[:, :5] *= 30  # an outlier column: only its tile's scale grows
    w = torch.randn(n, k, generator=g) * 0.05
    qw, ws = quantize_fp8(w, "block", block)
    return x, w, qw, ws


@pytest.mark.parametrize("tiles", [None, 2, 4])  # tiles per program; 3 tiles along K: the last program's are ragged
def test_tile_quantizer_matches_reference_bit_for_bit(tiles):
    x = torch.randn(5, 80) * 3
    x[2] = 0
    qa, s = KB.quantize_tiles(x.to(DEVICE), 32, tiles_per_program=tiles)
    rq, rs = KB.quantize_tiles_reference(x, 32)
    assert rs.shape == (5, 3) and torch.equal(s.cpu(), rs)
    assert torch.equal(qa.cpu().view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(rs[2], torch.full((3,), 1e-30 / 448))  # an all-zero row: tiny scales, zero codes, no NaN


@pytest.mark.parametrize(("m", "k", "tiles"), [(5, 80, 1), (9, 64, None), (1027, 224, 4)])
def test_tile_quantizer_writes_m_major_scales_for_the_hopper_kernel(m, k, tiles):
    """M-major: the same values, unit stride along M, each tile's column padded to 16 bytes; ``m_major_scales``
    keeps such a tensor as it is and copies any other into that layout."""
    x = torch.randn(m, k).bfloat16()
    qa, s = KB.quantize_tiles(x.to(DEVICE), 32, m_major=True, tiles_per_program=tiles)
    rq, rs = KB.quantize_tiles_reference(x, 32)
    assert s.shape == rs.shape and s.stride() == (1, -(-m // 4) * 4)
    assert torch.equal(s.cpu(), rs) and torch.equal(qa.cpu().view(torch.uint8), rq.view(torch.uint8))
    assert m_major_scales(s) is s
    again = m_major_scales(rs)
    assert again.stride(0) == 1 and again.stride(1) % 4 == 0 and torch.equal(again, rs)


def test_gemm_reads_either_scale_layout_alike():
    x, _, qw, ws = layer(6, 40, 96, 32, seed=3)
    d = lambda t: t.to(DEVICE)
    qa, rows = KB.quantize_tiles(d(x), 32)
    _, cols = KB.quantize_tiles(d(x), 32, m_major=True)
    y_rows = KB.fp8_block_matmul(qa, rows, d(qw), d(ws), 32, None, torch.float32, config=SMALL)
    y_cols = KB.fp8_block_matmul(qa, cols, d(qw), d(ws), 32, None, torch.float32, config=SMALL)
    assert torch.equal(y_rows, y_cols)


SHAPES = [(1, 40, 64, 16), (5, 70, 80, 32), (33, 48, 96, 32), (3, 16, 16, 16)]  # ragged M, N and K included


@pytest.mark.parametrize("config", [SMALL, SPLIT], ids=["tiles", "split_k"])
@pytest.mark.parametrize(("m", "n", "k", "block"), SHAPES)
def test_gemm_matches_reference(m, n, k, block, config):
    if DEVICE == "cuda" and block < 32:
        pytest.skip("B = 16 is served on the CPU only")
    x, _, qw, ws = layer(m, n, k, block, seed=m + n + k)
    bias = torch.randn(n)
    qa, a_s = KB.quantize_tiles_reference(x, block)
    ref = KB.fp8_block_matmul_reference(qa, a_s, qw, ws, block, bias, torch.float32)
    # float64 from the quantized operands, scaled per (token tile, weight block)
    w64 = dequantize_fp8(qw, ws, torch.float64, block_size=block)
    x64 = qa.double() * a_s.double().repeat_interleave(block, 1)[:, :k]
    exact = x64 @ w64.t() + bias.double()
    mag = x64.abs() @ w64.abs().t() + bias.double().abs()
    bound = mag * (k / block + 2) * 4 * F32_EPS
    assert ((ref.double() - exact).abs() <= bound).all()
    d = lambda t: t.to(DEVICE)
    y = KB.fp8_block_matmul(d(qa), d(a_s), d(qw), d(ws), block, d(bias), torch.float32, config=config).cpu()
    assert not y.isnan().any() and ((y.double() - exact).abs() <= bound).all()
    y16 = KB.fp8_block_linear(d(x.half()), d(qw), d(ws), block, d(bias.half())).cpu()
    qa16, as16 = KB.quantize_tiles_reference(x.half(), block)
    exact16 = KB.fp8_block_matmul_reference(qa16, as16, qw, ws, block, bias.half(), torch.float32)
    assert y16.dtype == torch.float16
    slack = bound.float() + hopper_slack(mag, block).float() + 1e-3  # the default tile at M = 33 has 64 rows
    assert ((y16.float() - exact16).abs() <= exact16.abs() * 2**-10 + slack).all()


@pytest.mark.parametrize("config", [SMALL, SPLIT], ids=["tiles", "split_k"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 96), (7, 70, 80), (16, 48, 160)])  # ragged N and K included
def test_gemm_quantizing_its_own_tiles_gives_the_two_launch_result(m, n, k, config):
    """fp8_block_linear(fuse_quant=True) quantizes the activation tiles inside the GEMM: the same codes and scales as
    quantize_tiles, so the same output bit for bit (and the default, no fusion, gives it too)."""
    block = 32
    x, _, qw, ws = layer(m, n, k, block, seed=m + k)
    d = lambda t: t.to(DEVICE)
    x, qw, ws, bias = d(x.bfloat16()), d(qw), d(ws), d(torch.randn(n).bfloat16())
    qa, a_s = KB.quantize_tiles(x, block, m_major=True)
    two = KB.fp8_block_matmul(qa, a_s, qw, ws, block, bias, torch.bfloat16, config=config)
    fused = KB.fp8_block_linear(x.view(1, m, k), qw, ws, block, bias, config=config, fuse_quant=True)
    assert fused.shape == (1, m, n) and torch.equal(fused[0], two)
    assert torch.equal(KB.fp8_block_linear(x, qw, ws, block, bias, config=config), two)
    with pytest.raises(ValueError, match="fewer than"):
        KB.fp8_block_linear(d(torch.zeros(KB.WS_FROM_M, k)), qw, ws, block, fuse_quant=True)
    empty = KB.fp8_block_linear(d(torch.zeros(2, 0, k)), qw, ws, block, fuse_quant=True)  # no rows: no launch
    assert empty.shape == (2, 0, n)


def test_split_k_plan_and_bf16_output():
    cfg = KB.BlockConfig(16, 64, 1, split_waves=2)
    assert KB.split_for(cfg, 1, 4096, 32, 132) == (5, 7)  # 64 tiles -> 5 splits of 7 K steps (the last one 4)
    assert KB.split_for(cfg, 1, 4096, 3, 132) == (3, 1)  # never more splits than K steps
    assert KB.split_for(KB.BlockConfig(128, 128), 4096, 4096, 32, 132) == (1, 32)  # split_waves 0: never
    assert KB.tile_config(1).split_waves and not KB.tile_config(4096).split_waves
    x, _, qw, ws = layer(3, 48, 256, 32, seed=1)
    qa, a_s = KB.quantize_tiles_reference(x.bfloat16(), 32)
    exact = KB.fp8_block_matmul_reference(qa, a_s, qw, ws, 32, None, torch.float32)
    d = lambda t: t.to(DEVICE)
    for _ in range(2):  # the second launch finds the semaphores reset by the first
        y = KB.fp8_block_matmul(d(qa), d(a_s), d(qw), d(ws), 32, None, torch.bfloat16, config=SPLIT).cpu()
        assert y.dtype == torch.bfloat16 and ((y.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()


def test_block_weights_round_trip_within_e4m3_rounding():
    w = torch.randn(70, 100) * 0.1
    w[3, 7] = 5.0  # one outlier only coarsens its own block
    q, s = quantize_fp8(w, "block", 32)
    assert s.shape == (3, 4) and q.dtype == torch.float8_e4m3fn
    assert s[0, 0] == pytest.approx(5.0 / 448) and s[1, 1] < 0.5 / 448 * 2
    err = (dequantize_fp8(q, s, block_size=32) - w).abs()
    per = s.repeat_interleave(32, 0).repeat_interleave(32, 1)[:70, :100]
    assert (err <= torch.maximum(w.abs() * 2**-4, per * 2**-10) * (1 + 1e-5)).all()


def test_bad_operands_are_refused_with_the_reason():
    _, _, qw, ws = layer(2, 32, 64, 32, seed=0)
    qa, a_s = KB.quantize_tiles_reference(torch.randn(2, 64), 32)
    with pytest.raises(ValueError, match="w_scale must be fp32"):
        KB.fp8_block_matmul(qa, a_s, qw, ws[:, :1].contiguous(), 32)
    with pytest.raises(ValueError, match="block must be one of"):
        KB.fp8_block_matmul(qa, a_s, qw, ws, 48)
    strided = torch.zeros(4, 4)[::2, ::2]  # [2, 2], unit stride along neither M nor K
    with pytest.raises(ValueError, match="unit stride along M or K"):
        KB.fp8_block_matmul(qa, strided, qw, ws, 32)
    with pytest.raises(ValueError, match="unit stride along M or K"):  # one scale broadcast over the K tiles
        KB.fp8_block_matmul(qa, torch.ones(2, 1).expand(2, 2), qw, ws, 32)
    with pytest.raises(ValueError, match="pdl needs a CUDA device of compute capability"):
        KB.quantize_tiles(torch.randn(2, 64), 32, pdl=True)
    with pytest.raises(ValueError, match="pdl needs a CUDA device of compute capability"):
        KB.fp8_block_matmul(qa, a_s, qw, ws, 32, pdl=True)
    for tiles in (0, 3):
        with pytest.raises(ValueError, match="tiles_per_program must be a power of two"):
            KB.quantize_tiles(torch.randn(2, 64).to(DEVICE), 32, tiles_per_program=tiles)


def test_tile_quantizer_reads_row_slices_in_place_and_takes_empty_inputs():
    fused = torch.randn(6, 200)  # e.g. a slice of a fused projection's output: rows 200 apart, 96 columns used
    x = fused[:, 40:136]
    qa, s = KB.quantize_tiles(x.to(DEVICE), 32)
    rq, rs = KB.quantize_tiles_reference(x, 32)
    assert torch.equal(s.cpu(), rs) and torch.equal(qa.cpu().view(torch.uint8), rq.view(torch.uint8))
    q0, s0 = KB.quantize_tiles_reference(torch.randn(0, 70), 32)
    assert q0.shape == (0, 70) and s0.shape == (0, 3)
    expanded = torch.ones(5, 1).expand(5, 3)  # strides (1, 0): reused as is it would give TMA a zero stride
    copy = m_major_scales(expanded)
    assert copy.stride(0) == 1 and copy.stride(1) >= 5 and torch.equal(copy, expanded)


hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs a Hopper GPU"
)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(300, 384, 320), (KB.WS_FROM_M, 4096, 4096), (4099, 520, 2048), (KB.WS_ONE_WAVE_FROM_M, 7168, 1024)],
)  # half tile past N, K tail; one tile row; many; a one-wave tile row below WS_FROM_M
def test_gpu_warp_specialized_kernel_errs_like_the_triton_tiles(m, n, k):
    """From WS_FROM_M rows on Hopper (fewer where the tiles make one wave) the Gluon kernel serves B = 128; its error
    against float64 from the same codes is the Triton tiles' (same promotion interval and scale order), within 2x,
    plus a floor of 2**-20 max|y|."""
    x, _, qw, ws = layer(m, n, k, 128, seed=m)
    bias = torch.randn(n)
    qa, a_s = KB.quantize_tiles_reference(x, 128)
    w64 = dequantize_fp8(qw, ws, torch.float64, block_size=128)
    exact = (qa.double() * a_s.double().repeat_interleave(128, 1)[:, :k]) @ w64.t() + bias.double()
    d = lambda t: t.to(DEVICE)
    assert block_unsupported(d(qa), d(qw), torch.empty(m, n, device=DEVICE), 128) is None
    y = KB.fp8_block_matmul(d(qa), d(a_s), d(qw), d(ws), 128, d(bias), torch.float32).cpu().double()
    tiles = KB.fp8_block_matmul(d(qa), d(a_s), d(qw), d(ws), 128, d(bias), torch.float32, config=KB.tile_config(m))
    err, tiles_err = (y - exact).abs().max(), (tiles.cpu().double() - exact).abs().max()
    assert not y.isnan().any() and err <= 2 * tiles_err + 2**-20 * exact.abs().max()
    cols = m_major_scales(d(a_s))  # the layout quantize_tiles(m_major=True) writes: read as is, the same sums
    assert cols.stride(0) == 1 and m_major_scales(cols) is cols
    y_cols = KB.fp8_block_matmul(d(qa), cols, d(qw), d(ws), 128, d(bias), torch.float32).cpu().double()
    assert torch.equal(y_cols, y)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("m", [1, 16, 64])
def test_gpu_programmatic_dependent_launch_changes_nothing(m):
    """Up to dispatch.PDL_MAX_M rows fp8_block_linear starts the GEMM while the quantizer runs; the GEMM waits for
    the codes before reading them, so the result is the two ordinary launches' bit for bit."""
    x, _, qw, ws = layer(m, 4096, 2048, 128, seed=m)
    x, qw, ws = x.cuda().bfloat16(), qw.cuda(), ws.cuda()
    qa, a_s = KB.quantize_tiles(x, 128, m_major=True)
    plain = KB.fp8_block_matmul(qa, a_s, qw, ws, 128, out_dtype=torch.bfloat16)
    for _ in range(3):
        assert torch.equal(KB.fp8_block_linear(x, qw, ws, 128, pdl=True), plain)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("consumers", [2, 3])
def test_gpu_both_consumer_counts_give_the_same_sums(consumers):
    """128 x 128 and 192 x 128 tiles run the same per-row chains of promoted partial sums: identical outputs (ragged
    M, N and K tail included), equal to the Triton tiles within their error."""
    m, n, k = 1000, 640, 1040
    x, _, qw, ws = layer(m, n, k, 128, seed=5)
    qa, a_s = KB.quantize_tiles(x.cuda(), 128, m_major=True)
    qw, ws = qw.cuda(), ws.cuda()
    out = torch.empty(m, n, device="cuda")
    y = WS.launch_block(qa, a_s, qw, ws, None, out, consumers=consumers).clone()
    other = WS.launch_block(qa, a_s, qw, ws, None, torch.empty_like(out), consumers=5 - consumers)
    assert torch.equal(y, other)
    tiles = KB.fp8_block_matmul(qa, a_s, qw, ws, 128, None, torch.float32, config=KB.tile_config(m))
    assert (y - tiles).abs().max() <= 1e-5 * tiles.abs().max()
