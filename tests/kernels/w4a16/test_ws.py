"""Warp-specialized W4A16 kernel (Gluon, Hopper only): the dispatch rules everywhere, the kernel on an sm_90 GPU.

Gluon has no interpreter mode, so on CPU these tests check which products the kernel is offered (``ws_config_for``,
``ws_split``, ``ws_unsupported_reason``) and that ``w4a16_linear`` keeps serving the rest through Triton; on the H200
they check the kernel against a float64 reference under test_w4a16.py's rule (at most twice PyTorch's own error),
with NaN-poisoned outputs, ragged M and N, both dtypes, act-order, bias, group 64 and 128, and forced split-K.
"""

from __future__ import annotations

import pytest
import torch
import triton
from quantkit.kernels import w4a16 as K
from quantkit.kernels.w4a16 import rega as R
from quantkit.kernels.w4a16 import ws as WS
from quantkit.kernels.w4a16.problem import Product

from tests.kernels.w4a16.test_gemm import (
    DEVICE,
    assert_close_to_float64,
    assert_kernel_case,
    assert_split_k_replays,
    hopper,
    weight,
)


def test_config_rule_covers_the_measured_rows_only():
    assert WS.ws_config_for(WS.WS_MIN_M - 1, 128) is None
    assert WS.ws_config_for(WS.WS_MIN_M, 128) == WS.WS_TABLE[0][1]
    for max_m, cfg in WS.WS_TABLE:
        assert WS.ws_config_for(max_m, 128) == cfg
    assert WS.ws_config_for(WS.WS_TABLE[-1][0] + 1, 128) is None


def test_group_64_takes_64_deep_steps():
    deep = next(cfg for _, cfg in WS.WS_TABLE if cfg.block_k == 128)
    fitted = WS.fit_group(deep, 64)
    assert fitted.block_k == 64 and fitted.stages == deep.stages + 1
    assert WS.fit_group(deep, 128) is deep


@pytest.mark.parametrize("m,n,k,group", [(256, 4096, 4096, 128), (256, 8192, 28672, 128), (128, 4096, 14336, 64),
                                         (512, 28672, 8192, 128), (100, 256, 512, 128), (128, 4096, 11008, 128),
                                         (256, 5120, 13824, 128), (100, 3584, 18944, 64)])  # fmt: skip
def test_split_fills_the_gpu_with_parts_of_whole_groups(m, n, k, group):
    cfg = WS.ws_config_for(m, group)
    split = WS.ws_split(cfg, m, n, k, group, 132)
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    groups = k // group
    assert 1 <= split <= WS.WS_MAX_SPLIT and split & (split - 1) == 0
    assert groups // split * group >= 2 * cfg.block_k  # the shortest part keeps two steps
    doubled = split * 2
    can_double = doubled <= WS.WS_MAX_SPLIT and groups // doubled * group >= 2 * cfg.block_k
    assert tiles * split >= WS.WS_FILL * 132 or not can_double  # it stops only when full or unable to split


def test_split_of_an_odd_number_of_groups_fills_the_gpu():
    """K = 11008 is 86 groups of 128: whole halves allowed a split of 2 at M = 128 (64 CTAs); parts as even as they
    go (21-22 groups) reach 4."""
    cfg = WS.ws_config_for(128, 128)
    assert WS.ws_split(cfg, 128, 4096, 11008, 128, 132) == 4
    assert WS.ws_split(cfg, 128, 4096, 4096, 128, 132) == 4  # an even K of the same width: the same split


def test_short_k_slices_of_256_row_tiles_go_to_the_table():
    wide = WS.ws_config_for(256, 128)
    assert not WS.ws_offered(wide, 256, 4096, 4096, 128, 132)  # 32 tiles x 4 slices of 1024: measured slower
    assert WS.ws_offered(wide, 256, 8192, 8192, 128, 132)  # 64 tiles x 2 slices of 4096
    narrow = WS.ws_config_for(128, 128)
    assert WS.ws_offered(narrow, 128, 4096, 4096, 128, 132)  # the Triton tile is slower at any slice there
    assert not WS.ws_offered(None, 256, 8192, 8192, 128, 132)


@pytest.mark.parametrize(
    "bits,group,n,x_offset,reason",
    [(8, 128, 64, 0, "4-bit"), (4, 32, 64, 0, "groups of 64 or 128"), (4, -1, 64, 0, "groups of 64 or 128"),
     (4, 128, 66, 0, "multiple of 4"), (4, 128, 64, 1, "16-byte aligned")],
)  # fmt: skip
def test_unsupported_products_are_named(bits, group, n, x_offset, reason):
    _, w = weight(n, 256, bits, group)
    x = torch.randn(100, 256 + x_offset, device=DEVICE).half()[:, x_offset:]
    cfg = WS.ws_config_for(100, 128)
    assert reason in WS.ws_unsupported_reason(x, w, None, cfg)


def test_other_tritons_are_named(monkeypatch):
    _, w = weight(64, 256)
    x = torch.randn(100, 256, device=DEVICE).half()
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    assert "found Triton 3.9.0" in WS.ws_unsupported_reason(x, w, None, WS.ws_config_for(100, 128))


def test_cpu_products_in_its_rows_run_the_triton_path():
    qw, w = weight(64, 256)
    x = torch.randn(100, 256, device=DEVICE).half()
    if not x.is_cuda:
        reason = WS.ws_unsupported_reason(x, w, None, WS.ws_config_for(100, 128))
        assert "compute capability 9.0" in reason or "Triton" in reason
        assert WS.plan(Product.of(x, w)) is None
    out = torch.full((100, 64), float("nan"), device=DEVICE, dtype=torch.float16)
    assert_close_to_float64(K.w4a16_linear(x, w, out=out), x, qw, None)


# (M, N, K, group, dtype, act_order, bias, split): ragged M and N, both configs of WS_TABLE, forced splits
GPU_CASES = [
    (65, 260, 1024, 128, torch.float16, False, True, None),
    (128, 4096, 4096, 128, torch.bfloat16, False, False, None),
    (100, 132, 512, 64, torch.float16, True, True, 2),
    (200, 1000, 2048, 128, torch.bfloat16, True, True, None),
    (300, 516, 1024, 64, torch.float16, False, False, 4),
    (512, 2048, 4096, 128, torch.float16, False, True, 8),
    (257, 4096, 8192, 128, torch.bfloat16, False, True, None),
    # parts of unequal length: 11 groups in 4 parts (2-3 groups), 7 groups of 64 in 3, 3 groups in 2
    (128, 512, 1408, 128, torch.float16, False, True, 4),
    (300, 260, 448, 64, torch.bfloat16, True, False, 3),
    (96, 1024, 384, 128, torch.float16, False, False, 2),
]


@hopper
@pytest.mark.parametrize("m,n,k,group,dtype,act_order,with_bias,split", GPU_CASES)
def test_kernel_matches_float64_reference(m, n, k, group, dtype, act_order, with_bias, split):
    qw, w = weight(n, k, 4, group, act_order, seed=m + n)
    x, bias, y = assert_kernel_case(lambda x, b, o: WS.w4a16_ws_gemm(x, w, b, o, split=split), qw, w, m, dtype,
                                    with_bias)  # fmt: skip
    via_linear = K.w4a16_linear(x, w, bias)  # the default dispatch: this kernel where its rule offers it and the
    # register-A kernel's (M <= 128, asked first) does not
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if (
        split is None
        and WS.ws_offered(WS.ws_config_for(m, group), m, n, k, group, sms)
        and not R.plan(Product.of(x, w))
    ):
        assert torch.equal(via_linear, y)
    else:
        assert_close_to_float64(via_linear, x, qw, bias)


@hopper
def test_split_k_is_deterministic_and_replays_in_a_cuda_graph():
    _, w = weight(1024, 4096, seed=3)
    x = torch.randn(256, 4096, device="cuda").half()
    assert_split_k_replays(lambda out: WS.w4a16_ws_gemm(x, w, out=out, split=4), w)


@hopper
def test_unaligned_rows_are_served_by_the_triton_path():
    qw, w = weight(256, 512, seed=5)
    x = torch.randn(130, 513, device="cuda").half()[:, 1:]  # 2-byte offset: no TMA
    assert WS.ws_unsupported_reason(x, w, None, WS.ws_config_for(130, 128)) is not None
    assert_close_to_float64(K.w4a16_linear(x, w), x, qw, None)


@hopper
def test_launcher_rejects_more_parts_than_groups():
    _, w = weight(256, 384, seed=6)  # three groups of 128
    x = torch.randn(128, 384, device="cuda").half()
    with pytest.raises(ValueError, match="needs 1 to 3 parts"):
        WS.w4a16_ws_gemm(x, w, split=4)
