"""W8A8 kernels against float64 references of the quantized operands (Triton's interpreter on CPU machines).

Tolerances. Quantization is checked bit for bit: the kernels round explicitly (half to even) in fp32 exactly as the
PyTorch reference does. For the GEMM, int8 accumulation is exact, so the only errors are three fp32 roundings in the
epilogue and the final rounding to the output dtype: |y - ref| <= eps(out) * |ref| (one unit in the last place)
plus fp32 slack. fp8 accumulates in fp32, adding at most K * eps(fp32) * sum_k |qa * qw| * scales (Higham's
worst-case bound for a length-K dot product). Both are far tighter than flash-attn's rule (at most 2x PyTorch's
own error computing in the output dtype), which is asserted as well.

fp8 runs in the interpreter too (its fp8 dot upcasts to fp16 and accumulates in fp32); the tensor-core path on
sm_90 is covered by the GPU-only tests at the bottom, which add the tensor core's reduced-precision accumulation
within each promoted partial sum (HOPPER_FP8_PARTIAL) to the bound. The interpreter casts fp32 to bf16 by
truncation (not to nearest), which the one-ulp bound also covers.
"""

from __future__ import annotations

import pytest
import torch
from quantkit.kernels import w8a8 as K
from quantkit.kernels._device import interpreting
from quantkit.kernels.w8a8 import configs as KC
from quantkit.kernels.w8a8.gemm import tma_compatible
from quantkit.kernels.w8a8.quant import quantize_launch_params

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FMTS = ["int8", "fp8"]
F32_EPS = torch.finfo(torch.float32).eps
# Hopper's fp8 tensor cores keep ~14 mantissa bits while accumulating (DeepSeek-V3, arXiv 2412.19437, sec. 3.3.2);
# the kernel promotes every BLOCK_K <= 256 products, so one partial sum may err by up to 256 * 2**-14 of its magnitude
HOPPER_FP8_PARTIAL = 256 * 2.0**-14

# ragged everywhere: M, N, K not multiples of any block; plus tiny and exactly-one-tile cases
SHAPES = [(1, 16, 64), (3, 33, 100), (17, 70, 129), (64, 64, 256), (70, 40, 48)]
SMALL_TILES = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "num_warps": 4, "num_stages": 2}


def poisoned(shape, dtype) -> torch.Tensor:
    """An output buffer full of garbage: NaN for floats, a fixed non-zero byte pattern for 8-bit codes."""
    if dtype.is_floating_point and dtype.itemsize > 1:
        return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    return torch.full(shape, 0x5A, dtype=torch.uint8, device=DEVICE).view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def make_layer(m, n, k, fmt, seed, with_bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g).add(0.1) * 4  # per-row magnitudes differ
    w = torch.randn(n, k, generator=g) * 0.05
    qw, w_scale = K.quantize_rows_reference(w, fmt)
    bias = torch.randn(n, generator=g) if with_bias else None
    return x, qw.to(DEVICE), w_scale.to(DEVICE), None if bias is None else bias.to(DEVICE)


def float64_reference(qa, a_scale, qw, w_scale, bias):
    """y = (qa @ qw^T) * a_scale[m] * w_scale[n] + bias, all in float64 from the quantized operands."""
    acc = qa.double() @ qw.double().t()
    y = acc * a_scale.double().reshape(-1, 1) * w_scale.double().reshape(1, -1)
    return y + bias.double() if bias is not None else y


def check_gemm(y, qa, a_scale, qw, w_scale, bias, out_dtype):
    ref = float64_reference(qa, a_scale, qw, w_scale, bias)
    err = (y.double() - ref).abs()
    assert torch.isfinite(y).all(), "output has NaN/inf (poisoned entries left unwritten?)"
    mag = (qa.double().abs() @ qw.double().abs().t()) * a_scale.double().reshape(-1, 1) * w_scale.double()
    fp32_slack = 4 * F32_EPS * (mag + (bias.double().abs() if bias is not None else 0))
    if qa.dtype == torch.float8_e4m3fn:
        fp32_slack = fp32_slack + qa.shape[1] * F32_EPS * mag
    if qa.dtype == torch.float8_e4m3fn and qa.is_cuda:
        fp32_slack = fp32_slack + HOPPER_FP8_PARTIAL * mag
    tol = torch.finfo(out_dtype).eps * ref.abs() + fp32_slack + torch.finfo(out_dtype).tiny
    assert (err <= tol).all(), f"max error {err.max().item():.3g}, worst excess {(err - tol).max().item():.3g}"
    # flash-attn's rule: no worse than 2x PyTorch computing from the same operands in the output dtype
    x_deq = (qa.float() * a_scale.float().reshape(-1, 1)).to(out_dtype)
    w_deq = (qw.float() * w_scale.float().reshape(-1, 1)).to(out_dtype)
    torch_y = torch.nn.functional.linear(x_deq, w_deq, None if bias is None else bias.to(out_dtype))
    torch_err = (torch_y.double() - ref).abs().max().item()
    assert err.max().item() <= 2 * torch_err + torch.finfo(out_dtype).tiny


# -- activation quantizer ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k,block_k", [(1, 64, None), (5, 100, None), (4, 300, 64), (3, 129, 128)])
def test_quantize_activations_dynamic_matches_reference(fmt, dtype, m, k, block_k):
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-3, 2, m).reshape(m, 1)).to(dtype)
    x[-1] = 0  # an all-zero row: zero codes, finite scale
    q, scale = K.quantize_activations(
        x.to(DEVICE), fmt, out=poisoned((m, k), K.DTYPE_OF_FORMAT[fmt]), out_scale=poisoned((m,), torch.float32)
    )
    q_ref, scale_ref = K.quantize_activations_reference(x, fmt)
    assert same_bits(q.cpu(), q_ref)
    assert torch.equal(scale.cpu(), scale_ref)
    assert not q_ref[-1].float().any()


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("block_k", [None, 32])
def test_quantize_activations_static_saturates_like_reference(fmt, block_k):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(6, 90, generator=g) * 3).to(torch.float16)
    input_scale = torch.tensor([0.01], device=DEVICE)  # |x| / 0.01 far above QMAX: many values saturate
    q, scale = K.quantize_activations(x.to(DEVICE), fmt, input_scale, out=poisoned((6, 90), K.DTYPE_OF_FORMAT[fmt]))
    q_ref, _ = K.quantize_activations_reference(x, fmt, input_scale.cpu())
    assert same_bits(q.cpu(), q_ref)
    assert scale is input_scale
    assert q_ref.float().abs().max().item() == K.QMAX_OF_FORMAT[fmt]


def test_int8_rounding_is_half_to_even():
    # row abs-max 127 makes QMAX / amax == 1, so x itself is rounded: ties go to the even integer
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.0]], dtype=torch.float16)
    q, scale = K.quantize_activations(x.to(DEVICE), "int8")
    assert q.cpu().tolist() == [[0, 2, 2, 0, -2, -2, 126, 127]]
    assert scale.item() == 1.0


def test_fp8_rounding_matches_torch_on_every_tie():
    # every positive e4m3 value, every midpoint between neighbours (ties) and points just off the midpoints
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448, NaN excluded
    mid = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([grid, mid, mid * (1 + 2**-20), mid * (1 - 2**-20)])
    x = torch.cat([vals, -vals]).reshape(1, -1)
    q, _ = K.quantize_activations(x.to(DEVICE), "fp8", torch.ones(1, device=DEVICE))
    assert same_bits(q.cpu(), x.to(torch.float8_e4m3fn))


# -- GEMM --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_matmul_matches_float64(fmt, out_dtype, m, n, k):
    x, qw, w_scale, bias = make_layer(m, n, k, fmt, seed=m + n + k)
    qa, a_scale = K.quantize_activations_reference(x.to(DEVICE), fmt)
    y = K.w8a8_matmul(qa, a_scale, qw, w_scale, bias, out_dtype, out=poisoned((m, n), out_dtype))
    check_gemm(y, qa, a_scale, qw, w_scale, bias, out_dtype)


@pytest.mark.parametrize("m,n,k", [(3, 33, 100), (70, 40, 48), (300, 70, 272)])  # 300 rows: the large-M config
def test_fp8_fast_accumulation_matches_float64(m, n, k):
    """In the interpreter fast accumulation is plain fp32 accumulation; on sm_90 the GPU test below bounds it."""
    x, qw, w_scale, bias = make_layer(m, n, k, "fp8", seed=m + k)
    qa, a_scale = K.quantize_activations_reference(x.to(DEVICE), "fp8")
    out = poisoned((m, n), torch.bfloat16)
    y = K.w8a8_matmul(qa, a_scale, qw, w_scale, bias, torch.bfloat16, out=out, fp8_fast_accum=True)
    if qa.is_cuda:  # the error bound of the whole K in Hopper's adder: test_gpu_fp8_fast_accumulation_is_as_close...
        assert torch.isfinite(y).all(), "poisoned outputs left unwritten"
    else:
        check_gemm(y, qa, a_scale, qw, w_scale, bias, torch.bfloat16)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("use_tma", [0, 1, 2, 3])  # pointer loads, TMA, persistent (one / two programs per SM)
@pytest.mark.parametrize("k", [96, 112, 100])  # K % BLOCK_K == 0; a K tail (TMA zero-fills it); K % 16 != 0
def test_matmul_small_tiles_grouped_order(fmt, use_tma, k):
    m, n = 40, 70  # 3 x 3 tiles of 16 x 32, GROUP_M=2 leaves a ragged last group
    x, qw, w_scale, bias = make_layer(m, n, k, fmt, seed=k)
    qa, a_scale = K.quantize_activations_reference(x.to(DEVICE), fmt)
    assert tma_compatible(qa, qw) == (k % 16 == 0)  # K=100 takes the pointer kernel even when TMA is asked for
    out = poisoned((m, n), torch.float16)
    y = K.w8a8_matmul(
        qa, a_scale, qw, w_scale, bias, torch.float16, out=out, config={**SMALL_TILES, "USE_TMA": use_tma}
    )
    check_gemm(y, qa, a_scale, qw, w_scale, bias, torch.float16)


@pytest.mark.parametrize("fmt", FMTS)
def test_linear_static_scale_no_bias_3d_input(fmt):
    x, qw, w_scale, _ = make_layer(10, 24, 80, fmt, seed=3, with_bias=False)
    x3 = x.reshape(2, 5, 80).to(torch.bfloat16).to(DEVICE)
    input_scale = torch.tensor([0.02], device=DEVICE)
    y = K.w8a8_linear(x3, qw, w_scale, None, input_scale)
    assert y.shape == (2, 5, 24) and y.dtype == torch.bfloat16
    qa, a_scale = K.quantize_activations_reference(x3.reshape(10, 80), fmt, input_scale)
    check_gemm(y.reshape(10, 24), qa, a_scale, qw, w_scale, None, torch.bfloat16)


def test_int8_extreme_codes_accumulate_exactly():
    # every product is (-128)(-127) or 127 * 127: large sums stay exact in the int32 accumulator
    m, n, k = 4, 20, 512
    qa = torch.full((m, k), -127, dtype=torch.int8, device=DEVICE)
    qa[1] = 127
    qw = torch.full((n, k), -128, dtype=torch.int8, device=DEVICE)
    qw[::2] = 127
    ones_m = torch.ones(m, device=DEVICE)
    y = K.w8a8_matmul(qa, ones_m, qw, torch.ones(n, device=DEVICE), out_dtype=torch.float32)
    assert torch.equal(y.cpu().double(), float64_reference(qa.cpu(), ones_m.cpu(), qw.cpu(), torch.ones(n), None))


def test_launcher_rejects_bad_operands():
    qa = torch.zeros(4, 32, dtype=torch.int8, device=DEVICE)
    qw = torch.zeros(8, 32, dtype=torch.int8, device=DEVICE)
    sa, sw = torch.ones(4, device=DEVICE), torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="share a dtype"):
        K.w8a8_matmul(qa, sa, qw.view(torch.float8_e4m3fn), sw)
    with pytest.raises(ValueError, match=r"qw must be \[N, K=32\]"):
        K.w8a8_matmul(qa, sa, qw[:, :16], sw)
    with pytest.raises(ValueError, match="contiguous along K"):
        K.w8a8_matmul(qa, sa, torch.zeros(32, 8, dtype=torch.int8, device=DEVICE).t(), sw)
    with pytest.raises(ValueError, match="a_scale must be"):
        K.w8a8_matmul(qa, torch.ones(3, device=DEVICE), qw, sw)
    with pytest.raises(ValueError, match="w_scale must be"):
        K.w8a8_matmul(qa, sa, qw, sw.half())
    with pytest.raises(ValueError, match="config keys"):
        K.w8a8_matmul(qa, sa, qw, sw, config={"BLOCK_M": 16})
    with pytest.raises(ValueError, match="USE_TMA must be one of"):
        K.w8a8_matmul(qa, sa, qw, sw, config={**SMALL_TILES, "USE_TMA": 5})
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        K.quantize_activations(qa, "int8")
    with pytest.raises(ValueError, match="fmt must be"):
        K.quantize_activations(sa.reshape(2, 2), "int4")


def test_pdl_options_checked():
    qa = torch.zeros(4, 32, dtype=torch.int8, device=DEVICE)
    qw = torch.zeros(8, 32, dtype=torch.int8, device=DEVICE)
    sa, sw = torch.ones(4, device=DEVICE), torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="prefetch_k must be"):
        K.w8a8_matmul(qa, sa, qw, sw, pdl=True, prefetch_k=384)
    with pytest.raises(ValueError, match="prefetch_k must be"):
        K.w8a8_matmul(qa, sa, qw, sw, prefetch_k=1024)  # a prefetch only happens before the PDL wait
    with pytest.raises(ValueError, match="l2_ahead must be"):
        K.w8a8_matmul(qa, sa, qw, sw, l2_ahead=9)
    if not qa.is_cuda or interpreting():
        with pytest.raises(ValueError, match="pdl needs a CUDA device"):
            K.w8a8_matmul(qa, sa, qw, sw, pdl=True)


def test_fp8_fast_accumulation_has_its_own_large_config():
    assert K.pick_config(4096, "fp8", fp8_fast_accum=True) == KC.FP8_FAST_LARGE.to_dict()
    assert K.pick_config(4096, "fp8") == K.CONFIGS[("fp8", "large")].to_dict()
    assert K.pick_config(64, "fp8", fp8_fast_accum=True) == K.pick_config(64, "fp8")
    assert K.pick_config(4096, "int8", fp8_fast_accum=True) == K.pick_config(4096, "int8")
    # int8, M <= 16: wide layers (more than 2 x 132 tiles of the m16 config) take two persistent programs per SM
    narrow = K.CONFIGS[("int8", "m16")].to_dict()
    wide = KC.INT8_WIDE_SKINNY.to_dict()
    assert K.pick_config(16, "int8", n=8192) == narrow
    assert K.pick_config(1, "int8", n=14336) == K.pick_config(16, "int8", n=28672) == wide
    assert K.pick_config(17, "int8", n=28672) == K.CONFIGS[("int8", "m64")].to_dict()
    assert K.pick_config(16, "fp8", n=28672) == K.pick_config(16, "fp8")


@pytest.mark.parametrize("fmt", FMTS)
def test_upper_half_of_m64_runs_persistent(fmt):
    upper = KC.UPPER_M64.to_dict()
    assert K.pick_config(KC.UPPER_M64_FROM, fmt) == K.pick_config(64, fmt, n=28672) == upper
    assert upper["USE_TMA"] == 2 and upper["BLOCK_M"] == 64
    assert K.pick_config(KC.UPPER_M64_FROM - 1, fmt) == K.CONFIGS[(fmt, "m64")].to_dict()


def test_l2_prefetch_rule():
    assert [K.l2_ahead_for(m) for m in (1, 16, 17, 64, 65, 4096)] == [0, 0, KC.L2_AHEAD_M64, KC.L2_AHEAD_M64, 0, 0]


def test_m_regimes_cover_every_m():
    assert [K.m_regime(m) for m in (1, 16, 17, 64, 65, 256, 257, 16384)] == [
        "m16",
        "m16",
        "m64",
        "m64",
        "m256",
        "m256",
        "large",
        "large",
    ]
    assert {key for key in K.CONFIGS} == {(f, r) for f in FMTS for r, _ in K.M_REGIMES}


# -- GPU only: tensor-core paths and real sizes ------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m", [1, 16, 64, 256, 1000])
def test_gpu_linear_every_regime(fmt, m):
    n, k = 1000, 4096 + 64
    x, qw, w_scale, bias = make_layer(m, n, k, fmt, seed=m)
    x = x.to(DEVICE, torch.bfloat16)
    y = K.w8a8_linear(x, qw, w_scale, bias)
    qa, a_scale = K.quantize_activations_reference(x, fmt)
    qa_kernel, _ = K.quantize_activations(x, fmt)
    assert same_bits(qa_kernel, qa)
    check_gemm(y, qa, a_scale, qw, w_scale, bias, torch.bfloat16)


@pytest.mark.gpu
@gpu
def test_gpu_fp8_agrees_with_scaled_mm():
    m, n, k = 256, 512, 2048
    x, qw, w_scale, _ = make_layer(m, n, k, "fp8", seed=11, with_bias=False)
    qa, a_scale = K.quantize_activations(x.to(DEVICE, torch.bfloat16), "fp8")
    y = K.w8a8_matmul(qa, a_scale, qw, w_scale, out_dtype=torch.bfloat16)
    ref = torch._scaled_mm(
        qa, qw.t(), scale_a=a_scale.reshape(-1, 1), scale_b=w_scale.reshape(1, -1), out_dtype=torch.bfloat16
    )
    exact = float64_reference(qa, a_scale, qw, w_scale, None)
    ours, theirs = (y.double() - exact).abs().max().item(), (ref.double() - exact).abs().max().item()
    assert ours <= 2 * theirs + 1e-6


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [64, 1000])
def test_gpu_fp8_fast_accumulation_is_as_close_as_cublas_fast(m):
    """Fast accumulation (the whole K loop in Hopper's reduced-precision adder) against cuBLAS doing the same
    (``_scaled_mm(use_fast_accum=True)``): no worse than 2x its error from the float64 product."""
    n, k = 512, 4096 + 128
    x, qw, w_scale, _ = make_layer(m, n, k, "fp8", seed=13, with_bias=False)
    qa, a_scale = K.quantize_activations(x.to(DEVICE, torch.bfloat16), "fp8")
    y = K.w8a8_matmul(qa, a_scale, qw, w_scale, out_dtype=torch.bfloat16, fp8_fast_accum=True)
    ref = torch._scaled_mm(
        qa, qw.t(), scale_a=a_scale.reshape(-1, 1), scale_b=w_scale.reshape(1, -1), out_dtype=torch.bfloat16,
        use_fast_accum=True,
    )  # fmt: skip
    exact = float64_reference(qa, a_scale, qw, w_scale, None)
    ours, theirs = (y.double() - exact).abs().max().item(), (ref.double() - exact).abs().max().item()
    assert ours <= 2 * theirs + 1e-6


@pytest.mark.parametrize(
    "k,fmt,m,want",
    [
        (4096, "int8", 1, (4096, True, 8)),
        (14336, "int8", 1, (16384, True, 16)),
        (14336, "fp8", 1, (16384, True, 32)),  # fp8's rounding spills at 16 warps
        (28672, "int8", 16, (32768, True, 32)),  # few int8 rows: one read
        (28672, "int8", 1024, (8192, False, 16)),  # many rows: two sweeps over L2
        (28672, "fp8", 1, (8192, False, 16)),
    ],
)
def test_quantizer_launch_rule(k, fmt, m, want):
    assert quantize_launch_params(k, None, fmt, m) == want
    assert quantize_launch_params(k, 64, fmt, m)[:2] == (64, False)  # an explicit block is kept


@pytest.mark.gpu
@gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs sm_90")
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m", [1, 16, 64, 300])  # 300: int8 runs the persistent kernel there
@pytest.mark.parametrize("prefetch_k", [0, 1024])
@pytest.mark.parametrize("n", [1000, 9000])  # 9000: int8 M <= 16 takes INT8_WIDE_SKINNY (persistent, 2 per SM)
def test_gpu_pdl_launch_is_bit_identical(fmt, m, prefetch_k, n):
    """Quantizer then GEMM under programmatic dependent launch: the GEMM may start early but must wait for the
    codes; the output is bit for bit that of plain launches, also inside a CUDA graph (how decode runs)."""
    k = 4096 + 64
    x, qw, w_scale, bias = make_layer(m, n, k, fmt, seed=m)
    x = x.to(DEVICE, torch.bfloat16)
    want = K.w8a8_linear(x, qw, w_scale, bias, pdl=False)
    if fmt == "int8":  # integer sums: every tile config gives the same bits, the narrow one-tile-per-program too
        narrow = K.CONFIGS[("int8", K.m_regime(m))].to_dict()
        assert torch.equal(K.w8a8_linear(x, qw, w_scale, bias, config=narrow, pdl=False), want)

    def pdl():
        qa, a_scale = K.quantize_activations(x, fmt, pdl=True)
        return K.w8a8_matmul(qa, a_scale, qw, w_scale, bias, out_dtype=x.dtype, pdl=True, prefetch_k=prefetch_k)

    assert torch.equal(pdl(), want)
    assert torch.equal(K.w8a8_linear(x, qw, w_scale, bias), want)  # the default rule (PDL up to 64 rows)
    pdl()  # compiled and warm outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pdl()
    for _ in range(3):
        x.copy_(x.flip(0))
        want = K.w8a8_linear(x, qw, w_scale, bias, pdl=False)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


@pytest.mark.gpu
@gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs sm_90")
@pytest.mark.parametrize("fmt,fast", [("int8", False), ("fp8", False), ("fp8", True)])
def test_gpu_fp32_output_of_the_large_configs(fmt, fast):
    """fp32 output at M > 256: the persistent configs' shared memory does not fit an fp32 tile beside their stages,
    so those launches run one tile per program; same sums in the same order, so rounding the fp32 result to bf16
    gives the bf16 launch's bits."""
    m, n, k = 1000, 3000, 4096
    x, qw, w_scale, bias = make_layer(m, n, k, fmt, seed=3)
    qa, a_scale = K.quantize_activations(x.to(DEVICE, torch.bfloat16), fmt)
    y32 = K.w8a8_matmul(qa, a_scale, qw, w_scale, bias, torch.float32, fp8_fast_accum=fast)
    y16 = K.w8a8_matmul(qa, a_scale, qw, w_scale, bias, torch.bfloat16, fp8_fast_accum=fast)
    assert torch.equal(y32.to(torch.bfloat16), y16)
    if fmt == "int8":  # exact integer sums: fp32's own rounding is the whole error
        check_gemm(y32, qa, a_scale, qw, w_scale, bias, torch.float32)


@pytest.mark.gpu
@gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs sm_90")
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m", [1, 16, 64, 300])
@pytest.mark.parametrize("ahead", [1, 2, 4])
def test_gpu_l2_prefetch_is_bit_identical(fmt, m, ahead):
    """Asking L2 for the weight tile a few K steps ahead changes no bit, on ragged N and K (addresses clamped at the
    edges), for the pointer-load, TMA and persistent kernels."""
    n, k = 1000 + 8, 4096 + 64
    x, qw, w_scale, bias = make_layer(m, n, k, fmt, seed=m + ahead)
    qa, a_scale = K.quantize_activations(x.to(DEVICE, torch.bfloat16), fmt)
    for use_tma in (0, 1, 2):
        cfg = K.CONFIGS[(fmt, K.m_regime(m))].to_dict() | {"USE_TMA": use_tma}
        want = K.w8a8_matmul(qa, a_scale, qw, w_scale, bias, config=cfg, l2_ahead=0)  # the rule prefetches at M = 64
        assert torch.equal(K.w8a8_matmul(qa, a_scale, qw, w_scale, bias, config=cfg, l2_ahead=ahead), want)


@pytest.mark.gpu
@gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs sm_90")
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("tiles", [(128, 256, 8, 3), (256, 128, 8, 3), (64, 64, 4, 4), (16, 32, 4, 6)])
@pytest.mark.parametrize("mode", [2, 3])
def test_gpu_persistent_kernel_matches_the_tma_kernel(fmt, tiles, mode):
    """Persistent programs (USE_TMA 2: one per SM, 3: two) sum the same tiles in the same order as the
    one-tile-per-program TMA kernel: the outputs agree bit for bit, on ragged M and N and with more tiles than
    programs."""
    block_m, block_n, warps, stages = tiles
    m, n, k = 1000, 3000 + 8, 1024 + 128
    x, qw, w_scale, bias = make_layer(m, n, k, fmt, seed=5)
    qa, a_scale = K.quantize_activations(x.to(DEVICE, torch.bfloat16), fmt)
    cfg = {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": 128,
        "GROUP_M": 8,
        "num_warps": warps,
        "num_stages": stages,
    }
    want = K.w8a8_matmul(qa, a_scale, qw, w_scale, bias, torch.bfloat16, config={**cfg, "USE_TMA": 1})
    check_gemm(want, qa, a_scale, qw, w_scale, bias, torch.bfloat16)
    out = poisoned((m, n), torch.bfloat16)
    got = K.w8a8_matmul(qa, a_scale, qw, w_scale, bias, torch.bfloat16, out=out, config={**cfg, "USE_TMA": mode})
    assert torch.equal(got, want)
