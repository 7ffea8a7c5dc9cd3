"""Register-A wgmma W4A16 kernel (Gluon, Hopper only): the dispatch rules and the x permutation everywhere, the
kernel on an sm_90 GPU.

Gluon has no interpreter mode, so on CPU these tests check which products the kernel is offered (``rega_config_for``,
``rega_split``, ``rega_unsupported_reason``), that ``permute_x`` is the order the kernel's fragments need, and that
``w4a16_linear`` keeps serving those rows through Triton; on the H200 they check the kernel against a float64
reference under test_w4a16.py's rule (at most twice PyTorch's own error), with NaN-poisoned outputs, M from 1 to 128,
both dtypes, act-order, bias, groups of 128 and 64 and one group per column, forced split-K, repeated calls (the
register hazard the kernel works around showed as wrong results at M > 16 only some of the time) and CUDA-graph replay.
"""

from __future__ import annotations

import pytest
import torch
import triton
from quantkit.kernels import w4a16 as K
from quantkit.kernels.w4a16 import rega as R
from quantkit.kernels.w4a16.problem import Product
from quantkit.kernels.w4a16.weight import unpack_gptq_codes

from tests.kernels.w4a16.test_gemm import (
    DEVICE,
    assert_close_to_float64,
    assert_kernel_case,
    assert_split_k_replays,
    hopper,
    weight,
)


@pytest.mark.parametrize(
    "m,n,k,group,expected",
    [(16, 28672, 8192, 128, None), (17, 28672, 8192, 128, R.REGA_M32), (32, 6144, 4096, 128, R.REGA_M32),
     (32, 4096, 14336, 128, None), (33, 28672, 8192, 128, R.REGA_M64), (64, 14336, 4096, 128, R.REGA_M64),
     (64, 8192, 8192, 128, R.REGA_M64), (64, 4096, 14336, 128, R.REGA_M64_NARROW),
     (64, 4096, 4096, 128, R.REGA_M64_NARROW), (64, 2048, 4096, 128, None), (65, 28672, 8192, 128, R.REGA_M128),
     (128, 6144, 4096, 128, R.REGA_M128), (96, 4096, 14336, 128, None), (129, 28672, 8192, 128, None),
     (64, 28672, 8192, 64, R.REGA_M64_G64), (33, 6144, 4096, 64, R.REGA_M64_G64), (64, 4096, 4096, 64, None),
     (32, 28672, 8192, 64, R.REGA_M32_G64), (17, 6144, 4096, 64, R.REGA_M32_G64), (24, 4096, 4096, 64, None),
     (65, 28672, 8192, 64, R.REGA_M64_G64), (128, 14336, 4096, 64, R.REGA_M128_G64),
     (100, 4096, 14336, 64, R.REGA_M128_G64), (16, 28672, 8192, 64, None), (64, 28672, 8192, 32, None),
     (48, 8192, 8192, 0, R.REGA_M64)],
)  # fmt: skip
def test_config_rule_follows_the_measured_cells(m, n, k, group, expected):
    assert R.rega_config_for(m, n, k, group) == expected


@pytest.mark.parametrize("n,k,cfg", [(4096, 14336, R.REGA_M32), (8192, 8192, R.REGA_M64), (28672, 8192, R.REGA_M64),
                                     (14336, 4096, R.REGA_M64_NARROW), (8192, 512, R.REGA_M32),
                                     (28672, 8192, R.REGA_M64_G64), (4096, 11008, R.REGA_M64_NARROW),
                                     (6144, 13824, R.REGA_M32), (3584, 18944, R.REGA_M64_NARROW)])  # fmt: skip
def test_split_fills_the_gpu_in_whole_pairs_of_tiles(n, k, cfg):
    split = R.rega_split(cfg, n, k, 132)
    pairs = k // (2 * cfg.block_k)
    assert 1 <= split <= R.REGA_MAX_SPLIT and split & (split - 1) == 0
    assert split == 1 or pairs // split * 2 * cfg.block_k >= 512  # the shortest part keeps 512 of K
    doubled = split * 2
    can_double = doubled <= R.REGA_MAX_SPLIT and pairs // doubled * 2 * cfg.block_k >= 512
    assert n // cfg.block_n * split >= cfg.split_waves * 132 or not can_double


def test_an_odd_number_of_tiles_is_taken_with_a_zero_tile_past_k():
    """Qwen2.5-72B's down projection: K = 29568 = 231 tiles of 128, 116 pairs (the last one half past K)."""
    _, w = weight(128, 384)  # three tiles of 128
    x = torch.randn(40, 384, device=DEVICE).half()
    reason = R.rega_unsupported_reason(x, w, None, R.REGA_M64)
    assert reason is None or "compute capability 9.0" in reason or "Triton" in reason
    assert R.rega_split(R.REGA_M64, 8192, 29568, 132) == 4  # 64 column tiles: parts of 29 pairs
    # measured: faster than what served before on the 242 M-weight layer at M 17-128, slower on a small one
    assert all(R.rega_config_for(m, 8192, 29568, 128) is not None for m in (17, 32, 48, 64, 96, 128))
    assert R.rega_config_for(32, 9728, 896, 128) is None
    assert R.rega_config_for(32, 9728, 1024, 128) == R.REGA_M32  # an even tile count: the rule as before


def test_split_of_an_odd_number_of_pairs_fills_the_gpu():
    """K = 11008 is 43 pairs of 128-deep tiles: the old rule (whole halves only) kept 64 CTAs at M = 64; parts
    as even as they go (10-11 pairs) reach the power of two that fills the GPU."""
    assert R.rega_split(R.REGA_M64_NARROW, 4096, 11008, 132) == 4
    assert R.rega_split(R.REGA_M64_NARROW, 4096, 14336, 132) == 4  # the even K it was measured on: unchanged


def test_permute_x_puts_each_words_codes_where_its_fragment_registers_take_them():
    """Thread c of a quad takes word c of each 32-block; its fragment register (k-step t, half h) holds codes
    (j, j + 4), j = 2t + h, at logical positions 16t + 8h + 2c + e. The permuted x must hold, there, the physical
    position of that code: 8c + 4e + j."""
    m, k = 3, 96
    x = torch.arange(m * k, dtype=torch.float32).reshape(m, k)
    xp = R.permute_x(x)
    assert xp.is_contiguous() and xp.shape == x.shape
    padded = R.permute_x(x, 8)
    assert padded.shape == (8, k) and torch.equal(padded[:m], xp) and not padded[m:].any()
    for b in range(k // 32):
        for t, h, c, e in [(t, h, c, e) for t in range(2) for h in range(2) for c in range(4) for e in range(2)]:
            logical, physical = 32 * b + 16 * t + 8 * h + 2 * c + e, 32 * b + 8 * c + 4 * e + 2 * t + h
            assert torch.equal(xp[:, logical], x[:, physical])


def test_permuted_product_is_the_product():
    """The sum over K in the permuted order, with each thread's codes read the kernel's way, is x @ W.T."""
    _, w = weight(64, 256, seed=1)
    x = torch.randn(5, 256, dtype=torch.float64)
    codes = unpack_gptq_codes(w.qweight.cpu(), 4, 256).double()  # [K, N], physical order
    xp = R.permute_x(x)
    k = torch.arange(256)
    b, r = k // 32, k % 32
    t, h, c, e = r // 16, (r // 8) % 2, (r // 2) % 4, r % 2
    physical = 32 * b + 8 * c + 4 * e + 2 * t + h  # the code a logical position meets
    assert torch.allclose(xp @ codes[physical], x @ codes)


@pytest.mark.parametrize(
    "bits,group,n,k,m,reason",
    [(8, 128, 64, 256, 32, "4-bit"), (4, 64, 64, 256, 32, "multiple of 128"), (4, 128, 64, 320, 32, "multiple of 128"),
     (4, 128, 96, 256, 32, "multiple of 64"), (4, 128, 64, 256, 129, "1..128")],
)  # fmt: skip
def test_unsupported_products_are_named(bits, group, n, k, m, reason):
    _, w = weight(n, k, bits, group)
    x = torch.randn(m, k, device=DEVICE).half()
    assert reason in R.rega_unsupported_reason(x, w, None, R.REGA_M32)


def test_loading_more_than_two_tiles_ahead_is_refused():
    _, w = weight(64, 256)
    x = torch.randn(32, 256, device=DEVICE).half()
    assert "ahead=3" in R.rega_unsupported_reason(x, w, None, R.RegaConfig(ahead=3))


def test_other_tritons_are_named(monkeypatch):
    _, w = weight(64, 256)
    x = torch.randn(32, 256, device=DEVICE).half()
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    assert "found Triton 3.9.0" in R.rega_unsupported_reason(x, w, None, R.REGA_M32)


def test_cpu_products_in_its_rows_run_the_triton_path():
    qw, w = weight(128, 256)
    x = torch.randn(40, 256, device=DEVICE).half()
    if not x.is_cuda:
        assert R.plan(Product.of(x, w)) is None
        with pytest.raises(ValueError, match=r"compute capability 9\.0|Triton"):
            R.w4a16_rega_gemm(x, w, config=R.REGA_M64)
    out = torch.full((40, 128), float("nan"), device=DEVICE, dtype=torch.float16)
    assert_close_to_float64(K.w4a16_linear(x, w, out=out), x, qw, None)


# (M, N, K, group, dtype, act_order, bias, config, split): every wgmma N (16 / 32 / 64 / 128 rows), every config
GPU_CASES = [
    (1, 256, 512, 128, torch.float16, False, False, R.REGA_M32, None),
    (17, 512, 1024, 128, torch.float16, False, True, R.REGA_M32, None),
    (24, 1024, 2048, 128, torch.bfloat16, True, True, R.REGA_M32, 2),
    (32, 384, 1024, -1, torch.float16, False, False, R.REGA_M32, 4),
    (33, 1024, 2048, 128, torch.float16, False, True, R.REGA_M64, None),
    (48, 512, 4096, 128, torch.bfloat16, False, False, R.REGA_M64, 8),
    (64, 2048, 1024, 128, torch.bfloat16, True, False, R.REGA_M64_NARROW, None),
    (64, 1024, 2048, 128, torch.float16, False, True, R.REGA_M64_NARROW, 2),
    (40, 1024, 2048, 64, torch.float16, False, True, R.REGA_M64_G64, None),
    (64, 512, 4096, 64, torch.bfloat16, True, False, R.REGA_M64_G64, 4),
    (20, 512, 2048, 64, torch.float16, True, True, R.REGA_M32_G64, None),
    (128, 1024, 2048, 64, torch.bfloat16, False, True, R.REGA_M128_G64, 2),
    (96, 512, 1024, 64, torch.float16, False, False, R.REGA_M64_G64, None),
    (100, 512, 1024, 128, torch.float16, False, True, R.REGA_M128, None),
    (128, 1024, 2048, 128, torch.bfloat16, True, False, R.REGA_M128, 2),
    # parts of unequal length: 11 pairs in 4 parts (2-3 pairs), 7 pairs in 3, 3 pairs in 2 with one group per column
    (64, 512, 2816, 128, torch.float16, False, True, R.REGA_M64_NARROW, 4),
    (24, 512, 1792, 128, torch.bfloat16, True, False, R.REGA_M32, 3),
    (40, 256, 768, -1, torch.float16, False, True, R.REGA_M64, 2),
    (96, 512, 1408, 64, torch.bfloat16, False, False, R.REGA_M128_G64, 8),
    # an odd number of tiles (the last pair's second tile past K): a part of one real tile (3 tiles in 2 parts),
    # 7 in 2, 9 in 3, 7 whole; operands loaded at use (M32, M64), two tiles ahead (M64_NARROW, M128_G64)
    (40, 256, 384, 128, torch.float16, False, True, R.REGA_M64, 2),
    (24, 512, 896, 128, torch.bfloat16, True, False, R.REGA_M32, 2),
    (64, 512, 1152, 128, torch.float16, False, True, R.REGA_M64_NARROW, 3),
    (100, 512, 448, 64, torch.bfloat16, False, True, R.REGA_M128_G64, None),
]


@hopper
@pytest.mark.parametrize("m,n,k,group,dtype,act_order,with_bias,cfg,split", GPU_CASES)
def test_kernel_matches_float64_reference(m, n, k, group, dtype, act_order, with_bias, cfg, split):
    qw, w = weight(n, k, 4, group, act_order, seed=m + n)
    assert_kernel_case(
        lambda x, b, o: R.w4a16_rega_gemm(x, w, b, o, config=cfg, split=split), qw, w, m, dtype, with_bias
    )


@hopper
@pytest.mark.parametrize("m,group", [(33, 128), (64, 128), (64, 64)])
def test_repeated_calls_through_the_dispatch_stay_right(m, group, monkeypatch):
    """Fifteen fresh inputs through ``w4a16_linear`` (the weight thresholds lowered so that a small layer takes this
    kernel): the fragment registers of an in-flight wgmma are never rewritten (without the keep-alive, 15 of 15 such
    calls were wrong on the H200)."""
    monkeypatch.setattr(R, "REGA_M64_MIN_WEIGHTS", 0)
    monkeypatch.setattr(R, "REGA_G64_MIN_WEIGHTS", 0)
    qw, w = weight(1024, 8192, group=group, seed=m)
    x = torch.randn(m, 8192, device="cuda").half()
    assert R.plan(Product.of(x, w)) is not None
    assert torch.equal(K.w4a16_linear(x, w), R.w4a16_rega_gemm(x, w))
    for _ in range(15):
        x = torch.randn(m, 8192, device="cuda").half()
        assert_close_to_float64(K.w4a16_linear(x, w), x, qw, None)


@hopper
def test_split_k_is_deterministic_and_replays_in_a_cuda_graph():
    _, w = weight(1024, 4096, seed=3)
    x = torch.randn(40, 4096, device="cuda").half()
    assert_split_k_replays(lambda out: R.w4a16_rega_gemm(x, w, out=out, config=R.REGA_M64, split=4), w)


@hopper
def test_launcher_rejects_more_parts_than_pairs_of_tiles():
    _, w = weight(256, 768, seed=6)  # three pairs of 128-deep tiles
    x = torch.randn(40, 768, device="cuda").half()
    with pytest.raises(ValueError, match="at least one per part"):
        R.w4a16_rega_gemm(x, w, config=R.REGA_M64, split=4)
