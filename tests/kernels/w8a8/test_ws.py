"""Warp-specialized fp8 GEMM (Gluon, Hopper only): the dispatch rule and the reference everywhere, the kernel on sm_90.

Gluon has no interpreter mode, so on CPU these tests check which products ``w8a8_matmul`` hands to the kernel
(``ws_offered``, ``ws_unsupported_reason``), that ``w8a8_ws_reference`` models the promoted sum, and that the rows it
would take still run through Triton elsewhere; on the H200 they check the kernel against the float64 product of the
same codes under test_w8a8.py's rule (at most twice PyTorch's own error), with NaN-poisoned outputs, ragged M, N and
K, bias, per-token and per-tensor scales and every output dtype, and that its error is the Triton promoted path's.
"""

from __future__ import annotations

import pytest
import torch
import triton
from quantkit.kernels import w8a8 as K
from quantkit.kernels.w8a8 import ws as WS

from tests.kernels.w8a8.test_gemm import DEVICE, check_gemm, float64_reference, make_layer, poisoned

hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0))
    or not triton.__version__.startswith(WS.WS_TRITON),
    reason="needs a Hopper (sm_90) GPU and the Triton the Gluon kernel is written for",
)


def test_rule_offers_promoted_fp8_above_256_rows_only():
    assert WS.ws_offered(WS.WS_MIN_M, "fp8", fp8_fast_accum=False, pdl=False)
    assert WS.ws_offered(16384, "fp8", fp8_fast_accum=False, pdl=False)
    assert not WS.ws_offered(WS.WS_MIN_M - 1, "fp8", fp8_fast_accum=False, pdl=False)
    assert not WS.ws_offered(4096, "int8", fp8_fast_accum=False, pdl=False)
    assert not WS.ws_offered(4096, "fp8", fp8_fast_accum=True, pdl=False)
    assert not WS.ws_offered(4096, "fp8", fp8_fast_accum=False, pdl=True)
    assert K.m_regime(WS.WS_MIN_M) == "large" and K.m_regime(WS.WS_MIN_M - 1) == "m256"


def test_unsupported_reasons_name_the_operand():
    qa = torch.zeros(300, 144, dtype=torch.float8_e4m3fn)
    qw = torch.zeros(64, 144, dtype=torch.float8_e4m3fn)
    out = torch.empty(300, 64)
    assert "float8_e4m3fn" in WS.ws_unsupported_reason(qa.view(torch.int8), qw.view(torch.int8), out)
    ragged = torch.zeros(300, 100, dtype=torch.float8_e4m3fn)
    assert "TMA" in WS.ws_unsupported_reason(ragged, torch.zeros(64, 100, dtype=torch.float8_e4m3fn), out)
    assert "column stride" in WS.ws_unsupported_reason(qa, qw, torch.empty(64, 300).t())
    reason = WS.ws_unsupported_reason(qa, qw, out)  # CPU tensors: the version or the device
    assert reason is not None and ("Triton" in reason or "CUDA" in reason)
    with pytest.raises(ValueError, match="fp8_ws_matmul"):
        WS.fp8_ws_matmul(qa, torch.ones(300), qw, torch.ones(64))


def test_reference_sums_partials_of_128_in_fp32():
    """Against the float64 product: within fp32 rounding of each partial and of the running sum."""
    torch.manual_seed(0)
    m, n, k = 33, 17, 300  # a K tail of 44
    _, qw, w_scale, bias = make_layer(m, n, k, "fp8", seed=5)
    qa, a_scale = K.quantize_rows_reference(torch.randn(m, k), "fp8")
    qw, w_scale, bias = qw.cpu(), w_scale.cpu(), bias.cpu()
    from quantkit.kernels.w8a8.ws_kernel import w8a8_ws_reference  # Gluon's module imports on CPU too

    ours = w8a8_ws_reference(qa, a_scale, qw, w_scale, bias, torch.float32)
    exact = float64_reference(qa, a_scale, qw, w_scale, bias)
    mag = (qa.double().abs() @ qw.double().abs().t()) * a_scale.double().reshape(-1, 1) * w_scale.double()
    tol = 8 * torch.finfo(torch.float32).eps * (mag + bias.double().abs())
    assert ((ours.double() - exact).abs() <= tol).all()


def test_rows_the_kernel_would_take_run_through_triton_elsewhere():
    if (
        torch.cuda.is_available()
        and WS.ws_unsupported_reason(
            torch.zeros(16, 16, dtype=torch.float8_e4m3fn, device="cuda"),
            torch.zeros(16, 16, dtype=torch.float8_e4m3fn, device="cuda"),
            torch.empty(16, 16, device="cuda"),
        )
        is None
    ):
        pytest.skip("the Gluon kernel serves these rows here (see the GPU tests)")
    m, n, k = WS.WS_MIN_M + 43, 70, 272
    x, qw, w_scale, bias = make_layer(m, n, k, "fp8", seed=7)
    qa, a_scale = K.quantize_activations(x.to(DEVICE), "fp8")
    check_gemm(K.w8a8_matmul(qa, a_scale, qw, w_scale, bias, torch.float32), qa, a_scale, qw, w_scale, bias,
               torch.float32)  # fmt: skip


# -- H200 ---------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "m,n,k,with_bias,static",
    [
        (300, 1000, 4096 + 64, True, False),  # ragged M and N, a K tail (zero-filled by TMA)
        (257, 72, 144, False, False),  # one partial tile of 256 columns, two K steps
        (1000, 3000, 4096, True, True),  # one activation scale for the whole tensor
        (4099, 520, 2048, False, False),  # more tiles than SMs: programs walk several tiles
        (64, 256, 128, True, False),  # fewer rows than a tile (the launcher serves any M)
    ],
)
def test_gpu_kernel_matches_float64(out_dtype, m, n, k, with_bias, static):
    x, qw, w_scale, bias = make_layer(m, n, k, "fp8", seed=m + n, with_bias=with_bias)
    x = x.to(DEVICE, torch.bfloat16)
    input_scale = x.float().abs().amax().reshape(1) / K.E4M3_MAX if static else None
    qa, a_scale = K.quantize_activations(x, "fp8", input_scale)
    out = poisoned((m, n), out_dtype)
    y = WS.fp8_ws_matmul(qa, a_scale, qw, w_scale, bias, out_dtype, out=out)
    assert y is out
    check_gemm(y, qa, a_scale, qw, w_scale, bias, out_dtype)
    # fp32 output: the same sums, rounded once less (test_w8a8.py's 2x-PyTorch rule does not apply there: PyTorch's
    # fp32 product has no reduced-precision partial sums, so the fp8 tensor core's error dominates)
    y32 = WS.fp8_ws_matmul(qa, a_scale, qw, w_scale, bias, torch.float32, out=poisoned((m, n), torch.float32))
    assert torch.equal(y32.to(out_dtype), y)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("m", [WS.WS_MIN_M, 1000, 4096])
def test_gpu_matmul_dispatches_and_errs_like_the_triton_promoted_path(m):
    """From WS_MIN_M rows ``w8a8_matmul``'s default is this kernel (same bits as calling it); its error against the
    float64 product is the Triton promoted kernel's (same promotion interval), within 2x, and far below fast
    accumulation's."""
    n, k = 2048, 8192
    x, qw, w_scale, _ = make_layer(m, n, k, "fp8", seed=m, with_bias=False)
    qa, a_scale = K.quantize_activations(x.to(DEVICE, torch.bfloat16), "fp8")
    y = K.w8a8_matmul(qa, a_scale, qw, w_scale, out_dtype=torch.float32)
    assert torch.equal(y, WS.fp8_ws_matmul(qa, a_scale, qw, w_scale, out_dtype=torch.float32))
    triton_cfg = K.CONFIGS[("fp8", "large")].to_dict()
    y_triton = K.w8a8_matmul(qa, a_scale, qw, w_scale, out_dtype=torch.float32, config=triton_cfg)
    y_fast = K.w8a8_matmul(qa, a_scale, qw, w_scale, out_dtype=torch.float32, fp8_fast_accum=True)
    exact = float64_reference(qa, a_scale, qw, w_scale, None)
    ours, triton_err, fast_err = ((t.double() - exact).abs().max().item() for t in (y, y_triton, y_fast))
    assert ours <= 2 * triton_err and ours < fast_err / 4


@pytest.mark.gpu
@hopper
def test_gpu_linear_in_a_cuda_graph():
    """``w8a8_linear`` at prefill sizes, captured once and replayed on new activations (the runtime's graphs)."""
    m, n, k = 512, 1024, 4096
    x, qw, w_scale, bias = make_layer(m, n, k, "fp8", seed=1)
    x = x.to(DEVICE, torch.bfloat16)
    K.w8a8_linear(x, qw, w_scale, bias)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.w8a8_linear(x, qw, w_scale, bias)
    for _ in range(2):
        x.copy_(x.flip(0))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, K.w8a8_linear(x, qw, w_scale, bias))
