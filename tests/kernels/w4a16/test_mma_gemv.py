"""mma.sync W4A16 gemv (Gluon, GPU only): its launch rules everywhere, the kernel on a CUDA sm_90 GPU.

Gluon has no interpreter mode, so on CPU these tests check what the kernel declines (``mma_gemv_unsupported_reason``),
the split-K rule and the PTX it is built from; on the H200 they check the kernel against a float64 reference under
test_w4a16.py's rule (at most twice PyTorch's own error), with NaN-poisoned outputs, M from 1 to 16 (one and two
mma row blocks), N off the CTA width, both dtypes, act-order, bias, groups 32 / 64 / 128 / one per column, and
forced split-K (deterministic, replayable in a CUDA graph).
"""

from __future__ import annotations

import re

import pytest
import torch
import triton
from quantkit.kernels import w4a16 as K
from quantkit.kernels._device import num_sms
from quantkit.kernels.w4a16 import mma_gemv as MK
from quantkit.kernels.w4a16 import mma_gemv_configs as MG
from quantkit.kernels.w4a16.problem import Product

from tests.kernels.w4a16.test_gemm import (
    DEVICE,
    assert_close_to_float64,
    assert_kernel_case,
    assert_split_k_replays,
    weight,
)

sm90 = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0))
    or not triton.__version__.startswith(MG.MMA_TRITON),
    reason="needs a CUDA sm_90+ GPU and the Triton the Gluon kernel is written for",
)


@pytest.mark.parametrize(
    "bits,group,n,k,m,reason",
    [(8, 128, 64, 256, 1, "4-bit"), (4, 128, 64, 256, 17, "at most 16"), (4, 128, 64, 200, 1, "multiple of 128"),
     (4, 96, 64, 384, 1, "group size 96"), (4, 128, 66, 256, 1, "multiple of 4")],
)  # fmt: skip
def test_unsupported_products_are_named(bits, group, n, k, m, reason):
    _, w = weight(n, k, group=group, bits=bits)
    x = torch.randn(m, k, device=DEVICE).half()
    assert reason in MG.mma_gemv_unsupported_reason(x, w, None, MG.MmaGemvConfig())


def test_other_tritons_and_devices_are_named(monkeypatch):
    _, w = weight(64, 256)
    x = torch.randn(1, 256, device=DEVICE).half()
    if not x.is_cuda:
        assert "compute capability" in MG.mma_gemv_unsupported_reason(x, w, None, MG.MmaGemvConfig()) or (
            "Triton" in MG.mma_gemv_unsupported_reason(x, w, None, MG.MmaGemvConfig())
        )
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    assert "found Triton 3.9.0" in MG.mma_gemv_unsupported_reason(x, w, None, MG.MmaGemvConfig())


CONFIGS = [MG.MMA_DEFAULT, MG.MMA_PREFETCH, MG.MMA_STEPS2, MG.MMA_STEPS2_M1, MG.MMA_TWO_BLOCKS]
SPLIT_CONFIGS = CONFIGS  # doubling rules (MMA_PREFETCH_WAVE's divisor rule has a test of its own)


@pytest.mark.parametrize("n,k", [(4096, 4096), (28672, 8192), (8192, 28672), (256, 512), (4096, 11008), (3584, 18944)])
@pytest.mark.parametrize("cfg", SPLIT_CONFIGS, ids=lambda c: c.name)
def test_split_fills_the_gpu_with_whole_iterations(n, k, cfg):
    split = MG.mma_gemv_split(cfg, n, k, 132)
    ctas = -(-n // cfg.block_n)
    iters = k // (32 * cfg.steps)

    def depth(s):  # K rows of the shortest part
        return iters // s * 32 * cfg.steps

    assert 1 <= split <= min(cfg.max_split, iters) and split & (split - 1) == 0
    assert cfg.uneven or iters % split == 0
    assert split != cfg.skip_split or split == 1
    assert not cfg.wave or split == 1 or ctas * split <= cfg.wave * 132  # one wave of resident CTAs
    assert not cfg.min_depth or split == 1 or depth(split) >= cfg.min_depth
    doubled = split * 2
    assert (
        ctas * split >= cfg.fill * 132
        or doubled > min(cfg.max_split, iters)
        or (not cfg.uneven and iters % doubled)
        or (cfg.wave and ctas * doubled > cfg.wave * 132)
        or (cfg.min_depth and depth(doubled) < cfg.min_depth)
        or doubled == cfg.skip_split  # stepped back from the skipped split
    )


def test_two_row_blocks_split_odd_k_layers_unevenly():
    """K = 11008 is 86 iterations of 128: whole halves stopped the doubling at 2 (64 CTAs x 2); parts of 5-6
    iterations reach the 16 the fill rule asks for."""
    assert MG.mma_gemv_split(MG.MMA_TWO_BLOCKS, 4096, 11008, 132) == 16
    assert MG.mma_gemv_split(MG.MMA_TWO_BLOCKS, 8192, 29568, 132) == 8


# the fastest split of every timed one at M = 16, groups of 128 (docs/results/w4a16.md)
TWO_BLOCK_BEST = {(28672, 8192): 2, (8192, 28672): 8, (8192, 8192): 8, (14336, 4096): 4, (4096, 14336): 16,
                  (4096, 4096): 8, (6144, 4096): 8, (28672, 4096): 2}  # fmt: skip


@pytest.mark.parametrize("n,k", list(TWO_BLOCK_BEST))
def test_two_row_blocks_split_as_measured(n, k):
    assert MG.mma_config_for(n, k, 128, 132, 16) == MG.MMA_TWO_BLOCKS
    assert MG.mma_gemv_split(MG.MMA_TWO_BLOCKS, n, k, 132) == TWO_BLOCK_BEST[n, k]


@pytest.mark.parametrize("n,k,prefetch", [(28672, 8192, True), (4096, 14336, True), (14336, 4096, True),
                                          (4096, 4096, True), (8192, 8192, False), (8192, 28672, False)])  # fmt: skip
def test_prefetch_is_chosen_where_its_grid_keeps_the_warps(n, k, prefetch):
    cfg = MG.mma_config_for(n, k, 128, 132, 2)  # M = 1, and 33-64 column tiles: the two-step loop, below
    assert (cfg == MG.MMA_PREFETCH) == prefetch
    assert MG.mma_config_for(n, k, 64, 132) == MG.MMA_STEPS2_M1  # prefetch held 76 registers with groups of 64
    assert MG.mma_config_for(n, k, 32, 132) == MG.MMA_DEFAULT
    warps = MG.grid_warps(MG.MMA_PREFETCH, n, k, 132), MG.grid_warps(MG.MMA_DEFAULT, n, k, 132)
    assert (warps[0] >= warps[1]) == prefetch


@pytest.mark.parametrize("bf16,mb", [(False, 1), (True, 1), (False, 2), (True, 2)])
def test_ptx_feeds_each_word_to_two_mma_per_row_block(bf16, mb):
    asm = MK.mma_step_asm(bf16, mb)
    kind = "bf16" if bf16 else "f16"
    assert asm.count(f"m16n8k16.row.col.f32.{kind}.{kind}.f32") == 4 * mb  # 2 row blocks x 2 k16 steps
    assert asm.count("lop3.b32") == 16  # four per word
    assert asm.count("shr.u32") == (12 if bf16 else 4)  # fp16 reads odd codes at bit 4 (one FMA by 1/16)
    operands = MK.mma_step_constraints(mb).split(",")
    assert max(int(i) for i in re.findall(r"\$(\d+)", asm)) == len(operands) - 1  # pack=4: 4 registers each


# (M, N, K, group, dtype, act_order, bias, split): one and two mma row blocks, N off the CTA width, forced splits
GPU_CASES = [
    (1, 4096, 4096, 128, torch.float16, False, False, None),
    (1, 260, 1024, 128, torch.bfloat16, False, True, None),
    (2, 1000, 2048, 64, torch.float16, True, True, 2),
    (5, 516, 512, 32, torch.bfloat16, False, False, 4),
    (8, 2048, 4096, -1, torch.float16, False, True, None),
    (9, 132, 1024, 128, torch.float16, True, False, None),
    (13, 4100, 2048, 64, torch.bfloat16, False, True, 8),
    (16, 8192, 8192, 128, torch.bfloat16, False, False, None),
    (1, 520, 7 * 512, 128, torch.bfloat16, False, True, 14),  # a split that is no power of two, N off the width
    (3, 4096, 7 * 512, 128, torch.float16, True, False, 7),
    # parts of unequal length: 7 / 14 iterations in 3, 20 / 40 in 8, and a Llama-2 down projection through the rule
    (4, 300, 896, 128, torch.float16, False, True, 3),
    (12, 520, 2560, 128, torch.bfloat16, True, False, 8),
    (16, 4096, 11008, 128, torch.bfloat16, False, True, None),
]


@sm90
@pytest.mark.parametrize("cfg", [*CONFIGS, MG.MMA_PREFETCH_WAVE], ids=lambda c: c.name)
@pytest.mark.parametrize("m,n,k,group,dtype,act_order,with_bias,split", GPU_CASES)
def test_kernel_matches_float64_reference(m, n, k, group, dtype, act_order, with_bias, split, cfg):
    qw, w = weight(n, k, group=group, act_order=act_order, seed=m + n)
    assert_kernel_case(lambda x, b, o: MK.w4a16_mma_gemv(x, w, b, o, config=cfg, split=split), qw, w, m, dtype,
                       with_bias)  # fmt: skip


@sm90
def test_split_k_is_deterministic_and_replays_in_a_cuda_graph():
    _, w = weight(1024, 4096, seed=3)
    x = torch.randn(3, 4096, device="cuda").half()
    assert_split_k_replays(lambda out: MK.w4a16_mma_gemv(x, w, out=out, split=8), w)


@sm90
def test_launcher_rejects_more_parts_than_iterations():
    _, w = weight(256, 384, seed=6)  # three 128-deep iterations
    x = torch.randn(1, 384, device="cuda").half()
    with pytest.raises(ValueError, match="at least one per part"):
        MK.w4a16_mma_gemv(x, w, config=MG.MMA_DEFAULT, split=4)


@pytest.mark.parametrize("n,k,steps2_at_4", [(28672, 8192, False), (14336, 4096, False), (8192, 28672, True),
                                             (4096, 4096, True)])  # fmt: skip
def test_groups_of_64_take_two_steps_at_one_row_or_the_deepest_split(n, k, steps2_at_4):
    assert MG.mma_config_for(n, k, 64, 132, 1) == MG.MMA_STEPS2_M1
    assert (MG.mma_config_for(n, k, 64, 132, 4) == MG.MMA_STEPS2) == steps2_at_4
    assert (MG.mma_gemv_split(MG.MMA_STEPS2, n, k, 132) == MG.MMA_STEPS2.max_split) == steps2_at_4


# M = 1, groups of 64, the two-step loop: the fastest split of every timed one on the H200 in both runs of
# docs/results/w4a16.md (4096 x 4096: 16 and 32 within 1%)
STEPS2_M1_BEST = {(28672, 8192): 4, (8192, 28672): 16, (8192, 8192): 16, (14336, 4096): 16, (4096, 14336): 32,
                  (4096, 4096): 32, (6144, 4096): 16, (28672, 4096): 4}  # fmt: skip


@pytest.mark.parametrize("n,k", list(STEPS2_M1_BEST))
def test_one_row_groups_of_64_split_as_measured(n, k):
    cfg = MG.mma_config_for(n, k, 64, 132, 1)
    assert cfg == MG.MMA_STEPS2_M1 and cfg.steps == MG.MMA_STEPS2.steps
    assert MG.mma_gemv_split(cfg, n, k, 132) == STEPS2_M1_BEST[n, k]


# M = 1, groups of 128: the two-step loop where it was faster in both runs (layers of N <= 8192), else the prefetch
# or default choice (docs/results/w4a16.md)
G128_M1_STEPS2 = {(28672, 8192): False, (8192, 28672): False, (8192, 8192): True, (14336, 4096): False,
                  (4096, 14336): False, (4096, 4096): True, (6144, 4096): True, (28672, 4096): False}  # fmt: skip
# ... except where the prefetch loop's one-wave split is no power of two (K = 7 x 2^j): the fastest split timed
# (docs/results/w4a16.md); None: not taken
G128_M1_WAVE = {(28672, 8192): None, (8192, 28672): 14, (8192, 8192): None, (14336, 4096): None, (4096, 14336): 28,
                (4096, 4096): None, (6144, 4096): None, (28672, 4096): None, (4096, 12288): None}  # fmt: skip


@pytest.mark.parametrize("n,k", list(G128_M1_WAVE))
def test_one_row_groups_of_128_fill_one_wave_where_no_doubling_can(n, k):
    """24 of 32 slices of 4096 x 12288 fill only 83% of the wave: the doubling rules keep it."""
    for group in (128, 0, 256):
        cfg = MG.mma_config_for(n, k, group, 132, 1)
        assert (cfg == MG.MMA_PREFETCH_WAVE) == (G128_M1_WAVE[n, k] is not None)
        if G128_M1_WAVE[n, k]:
            assert MG.mma_gemv_split(cfg, n, k, 132) == G128_M1_WAVE[n, k]
    assert MG.mma_config_for(n, k, 64, 132, 1) != MG.MMA_PREFETCH_WAVE  # lost with groups of 64
    assert MG.mma_config_for(n, k, 128, 132, 2) != MG.MMA_PREFETCH_WAVE  # M = 2-8: not timed


@pytest.mark.parametrize("n,k", [(8192, 28672), (4096, 14336), (256, 7 * 128), (100, 384), (4096, 4096)])
def test_wave_divisor_split_is_the_largest_whole_divisor_in_one_wave(n, k):
    cfg = MG.MMA_PREFETCH_WAVE
    split = MG.mma_gemv_split(cfg, n, k, 132)
    ctas, iters = -(-n // cfg.block_n), k // (32 * cfg.steps)
    assert iters % split == 0 and split <= cfg.max_split and ctas * split <= cfg.wave * 132
    assert all(iters % s or ctas * s > cfg.wave * 132 for s in range(split + 1, cfg.max_split + 1))


@pytest.mark.parametrize("n,k", list(G128_M1_STEPS2))
def test_one_row_groups_of_128_take_two_steps_on_narrow_layers(n, k):
    assert (MG.mma_config_for(n, k, 128, 132, 1) == MG.MMA_STEPS2_M1) == G128_M1_STEPS2[n, k]
    assert (MG.mma_config_for(n, k, 0, 132, 1) == MG.MMA_STEPS2_M1) == G128_M1_STEPS2[n, k]  # one group alike
    assert MG.mma_config_for(n, k, 128, 132, 2) != MG.MMA_STEPS2_M1  # M = 2-8 keep their rule
    assert MG.mma_config_for(n, k, 32, 132, 1) == MG.MMA_DEFAULT


# M = 2-8, groups of 128: the two-step loop where it led in both runs (33-64 column tiles), else as before
G128_M2_8_STEPS2 = {(28672, 8192): False, (8192, 28672): True, (8192, 8192): True, (14336, 4096): False,
                    (4096, 14336): False, (4096, 4096): False, (6144, 4096): True, (28672, 4096): False}  # fmt: skip


@pytest.mark.parametrize("n,k", list(G128_M2_8_STEPS2))
@pytest.mark.parametrize("m", [2, 4, 8])
def test_two_to_eight_rows_groups_of_128_take_two_steps_on_33_to_64_tiles(n, k, m):
    assert (MG.mma_config_for(n, k, 128, 132, m) == MG.MMA_STEPS2) == G128_M2_8_STEPS2[n, k]


@pytest.mark.parametrize("group,runs_here", [(128, True), (64, True), (-1, True), (32, False)])
def test_rows_9_to_16_run_here_only_for_groups_where_it_won(group, runs_here):
    assert (MG.mma_config_for(4096, 4096, max(group, 0), 132, 9) is not None) == runs_here
    assert MG.mma_config_for(4096, 4096, max(group, 0), 132, 8) is not None  # M <= 8: every group


def test_dispatch_rule_takes_only_cuda_products_of_up_to_16_rows():
    _, w = weight(256, 512)
    for m in (1, 8, 9, 16, 17):
        x = torch.randn(m, 512, device=DEVICE).half()
        plan = MG.plan(Product.of(x, w))
        cfg = MG.mma_config_for(256, 512, 128, num_sms(x.device), m) if x.is_cuda else None
        if x.is_cuda and m <= MG.MMA_DISPATCH_M and MG.mma_gemv_unsupported_reason(x, w, None, cfg) is None:
            assert (plan.config, plan.split) == (cfg, MG.mma_gemv_split(cfg, 256, 512, num_sms(x.device)))
            narrow = MG.MMA_STEPS2_M1 if m == 1 else MG.mma_config_for(256, 512, 128, num_sms(x.device), 2)
            assert cfg == (MG.MMA_TWO_BLOCKS if m > 8 else narrow)
        else:
            assert plan is None


@sm90
@pytest.mark.parametrize("m,group,dtype", [(1, 128, torch.float16), (3, 64, torch.bfloat16), (8, 128, torch.float16),
                                           (12, 64, torch.float16), (16, 128, torch.bfloat16)])  # fmt: skip
def test_w4a16_linear_runs_this_kernel_up_to_16_rows(m, group, dtype):
    qw, w = weight(4096, 4096, group=group, seed=m)
    x = torch.randn(m, 4096, device="cuda").to(dtype)
    bias = torch.randn(4096, device="cuda").to(dtype)
    y = K.w4a16_linear(x, w, bias)
    assert torch.equal(y, MK.w4a16_mma_gemv(x, w, bias))
    assert_close_to_float64(y, x, qw, bias)


# Layers whose K is no power of two, groups of 128: the plan of every cell timed on the H200 after the fallback for
# under-filled grids (docs/results/w4a16.md)
ODD_K_PLANS = {
    (4096, 11008, 1): (MG.MMA_DEFAULT_WAVE, 43), (4096, 11008, 4): (MG.MMA_DEFAULT_WAVE, 43),
    (5120, 13824, 1): (MG.MMA_PREFETCH_WAVE, 18), (5120, 13824, 2): (MG.MMA_PREFETCH_WAVE, 18),
    (5120, 13824, 8): (MG.MMA_PREFETCH_WAVE, 18), (3584, 18944, 1): (MG.MMA_DEFAULT_WAVE, 37),
    (3584, 18944, 4): (MG.MMA_DEFAULT_WAVE, 37), (5120, 27648, 1): (MG.MMA_PREFETCH_WAVE, 18),
    (8192, 29568, 1): (MG.MMA_PREFETCH_WAVE, 11), (8192, 29568, 4): (MG.MMA_PREFETCH_WAVE, 11),
    (3584, 3584, 1): (MG.MMA_PREFETCH_WAVE, 28), (3584, 3584, 4): (MG.MMA_PREFETCH_WAVE, 28),
    (4608, 3584, 1): (MG.MMA_DEFAULT_WAVE, 28), (4608, 3584, 4): (MG.MMA_DEFAULT_WAVE, 28),
    (2048, 5632, 1): (MG.MMA_DEFAULT_WAVE, 44), (2048, 5632, 4): (MG.MMA_DEFAULT_WAVE, 44),
}  # fmt: skip
# ... and cells where the doubling rule keeps its plan: half a wave or more at M = 2-8 (4096 x 14336 lost with the
# one-wave split there), or K a power of two
KEPT = [(4096, 14336, 2), (4096, 14336, 4), (4096, 14336, 8), (4096, 12288, 4), (5120, 27648, 4), (4096, 4096, 4),
        (4096, 1024, 1), (6144, 4096, 1)]  # fmt: skip


@pytest.mark.parametrize("n,k,m", list(ODD_K_PLANS))
def test_under_filled_odd_k_layers_take_the_measured_plan(n, k, m):
    cfg, split = ODD_K_PLANS[n, k, m]
    assert MG.mma_config_for(n, k, 128, 132, m) == cfg
    assert MG.mma_gemv_split(cfg, n, k, 132) == split
    assert MG.under_filled(MG.doubling_config(n, k, 128, 132, m), n, k, 132, m)
    assert MG.mma_config_for(n, k, 64, 132, m) == MG.doubling_config(n, k, 64, 132, m)  # groups of 64: not timed


@pytest.mark.parametrize("n,k,m", KEPT)
def test_filled_or_power_of_two_layers_keep_the_doubling_plan(n, k, m):
    assert MG.mma_config_for(n, k, 128, 132, m) == MG.doubling_config(n, k, 128, 132, m)


def test_wave_divisor_goes_past_the_wave_only_when_no_divisor_fills_half():
    cfg = MG.MMA_DEFAULT_WAVE
    assert MG.mma_gemv_split(cfg, 4096, 11008, 132) == 43  # divisors 1, 2, 43 of 86: 2 fills 6%, 43 is 1.3 waves
    assert MG.mma_gemv_split(cfg, 3584, 18944, 132) == 37  # 28 x 37 = 1036 CTAs: inside the wave of 1056
    assert MG.mma_gemv_split(cfg, 4096, 4096, 132) == 32  # a power of two when it fills the wave
