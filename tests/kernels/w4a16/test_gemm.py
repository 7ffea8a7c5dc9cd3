"""W4A16 / W8A16 kernel against a float64 reference of the dequantized weight (Triton's interpreter on CPU).

Tolerance (flash-attn's rule): the kernel's max error against float64 is at most twice PyTorch's own error for the
same product in the same dtype (``F.linear(x, W.to(dtype))``, which rounds W and the output) plus a floor of
2**-20 * max|y| (far below one output ulp) so that an exact PyTorch result cannot make the bound zero. The
dequantize kernel is checked bit for bit: it rounds s * (q - z) from fp32 once, like PyTorch.

Every output buffer is poisoned with NaN first; inputs are fresh random tensors per case.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from quantkit.kernels import w4a16 as K
from quantkit.kernels._device import device_of, gluon_unsupported, interpreting, num_sms
from quantkit.kernels.w4a16 import configs as C
from quantkit.kernels.w4a16 import dispatch, gemm
from quantkit.kernels.w4a16.epilogue import to_act
from quantkit.kernels.w4a16.gemv import reads_x_by_four

from quantkit.nn.dispatch import cuda_weight_only_linear
from quantkit.nn.qlinear import QuantLinear
from quantkit.quant import QuantizedWeight, QuantScheme
from quantkit.quant.tensor import group_index

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the Gluon kernels' tests: a Hopper GPU and the Triton they are written for
hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or gluon_unsupported(device_of(torch.device("cuda"))) is not None,
    reason="needs a Hopper (sm_90) GPU and the Triton the Gluon kernel is written for",
)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SKINNY = K.KernelConfig("fused", 16, 32, 64, 4, 2, split_waves=0)
SPLIT = K.KernelConfig("fused", 16, 32, 64, 4, 2, split_waves=8)  # on CPU 4 "SMs": always splits small shapes
FUSED = K.KernelConfig("fused", 32, 64, 128, 4, 2, fuse_scale=True, split_waves=2)
LARGE = K.KernelConfig("fused", 64, 64, 64, 4, 2, fuse_scale=True, group_m=2)
DEQUANT = K.KernelConfig("dequant")
WIDE = K.KernelConfig("fused", 64, 32, 256, 4, 2, split_waves=1, fuse_scale=True)
SWAP = K.KernelConfig("fused", 16, 64, 64, 4, 1, split_waves=8, fuse_scale=True, swap_ab=True)  # y.T = W.T @ x.T
SWAP_TS = K.KernelConfig("fused", 16, 64, 128, 4, 1, split_waves=0, swap_ab=True)
GEMV = K.KernelConfig("gemv", 1, 64, 128, 2, 1, split_waves=8)  # CUDA-core kernel, split-K on 4 "SMs"
GEMV_M4 = K.KernelConfig("gemv", 4, 32, 64, 1, 1, split_waves=8)  # 4 rows per CTA; M > 4 uses several CTAs
GEMV_PRE = K.KernelConfig("gemv", 2, 64, 128, 2, 3)  # loads pipelined 2 tiles ahead through shared memory
GEMV_FOLD = K.KernelConfig("gemv", 2, 64, 128, 2, 1, split_waves=8, fold_zero=True)  # 4-bit: no FADD per code
GEMV_PREFETCH = K.KernelConfig("gemv", 1, 64, 64, 2, 1, split_waves=8, fold_zero=True, prefetch=True)  # registers
GEMV_VEC = K.KernelConfig("gemv", 2, 64, 64, 2, 1, split_waves=8, fold_zero=True, vector_x=True)  # x 4 per load


def make_layer(n, k, bits=4, group_size=128, sym=False, act_order=False, seed=0):
    """Random codes, fp16-representable scales and zeros; act-order shuffles g_idx (groups keep their sizes)."""
    g = torch.Generator().manual_seed(seed)
    scheme = QuantScheme(bits=bits, group_size=group_size, sym=sym)
    n_g = scheme.n_groups(k)
    g_idx = group_index(k, scheme)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    zeros = torch.randint(0, 2**bits, (n, n_g), generator=g, dtype=torch.int32)
    if sym:
        zeros = torch.full((n, n_g), 2 ** (bits - 1), dtype=torch.int32)
    qw = QuantizedWeight(
        q=torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8),
        scales=(torch.rand(n, n_g, generator=g) * 0.1 / 2**bits + 1e-3).half().float(),
        zeros=zeros,
        g_idx=g_idx,
        scheme=scheme,
    )
    buffers = {name: t.to(DEVICE) for name, t in qw.pack().items()}
    return qw, buffers


def prepared(buffers, bits, group_size):
    return K.prepare_gptq_weight(
        buffers["qweight"], buffers["qzeros"], buffers["scales"], buffers["g_idx"], bits, group_size
    )


def weight(n, k, bits=4, group=128, act_order=False, seed=0):
    """(float64 dequantized weight, prepared ``W4A16Weight``) of a random layer: the Gluon kernels' test operand."""
    qw, buffers = make_layer(n, k, bits, group, act_order=act_order, seed=seed)
    return qw, prepared(buffers, bits, group)


def assert_close_to_float64(y, x, qw, bias):
    w64 = qw.dequantize(torch.float64).to(DEVICE)  # [N, K]
    ref = x.double() @ w64.T
    if bias is not None:
        ref = ref + bias.double()
    torch_y = F.linear(x, w64.to(x.dtype), bias)
    torch_err = (torch_y.double() - ref).abs().max().item()
    err = (y.double() - ref).abs().max().item()
    floor = 2**-20 * ref.abs().max().item()
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert err <= 2 * torch_err + floor, f"kernel error {err:.3g} vs PyTorch's {torch_err:.3g}"


def assert_kernel_case(product, qw, w, m, dtype, with_bias):
    """One GPU case of a split-K kernel: x [M, K] (permuted to the weight's channel order for act-order), optional
    bias, a NaN-poisoned ``out``; ``product(x_kernel, bias, out)`` must fill ``out`` itself, meet the float64 rule
    and leave the weight's split-K counters reset. Returns (x, bias, y)."""
    x = torch.randn(m, w.in_features, device=DEVICE).to(dtype)
    bias = torch.randn(w.out_features, device=DEVICE).to(dtype) if with_bias else None
    x_kernel = x.index_select(1, w.perm) if w.perm is not None else x
    out = torch.full((m, w.out_features), float("nan"), device=DEVICE, dtype=dtype)
    y = product(x_kernel, bias, out)
    assert y.data_ptr() == out.data_ptr()
    assert_close_to_float64(y, x, qw, bias)
    assert not w.locks.any()  # the last CTA of each split tile reset its counter
    return x, bias, y


def assert_split_k_replays(product, w):
    """A split-K kernel is deterministic and replays in a CUDA graph: ``product(out)`` (out None: a new tensor) gives
    the same bits eagerly and in three replays of a graph captured after a warm-up, into a NaN-poisoned ``out``, and
    leaves the weight's split-K counters reset."""
    first = product(None)
    out = torch.full_like(first, float("nan"))
    product(out)  # compile and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        product(out)
    out.fill_(float("nan"))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first) and not w.locks.any()


# (M, N, K, bits, group, sym, dtype, act_order, bias, config): M from 1 to 300, odd N, K off the block, ragged groups
CASES = [
    (1, 77, 576, 4, 128, False, torch.float16, False, True, None),  # ragged last group (576 = 4.5 * 128)
    (1, 64, 256, 4, 128, True, torch.bfloat16, False, False, SPLIT),
    (3, 33, 200, 4, 64, False, torch.float16, False, True, SPLIT),  # K % 32 != 0: padded words
    (5, 96, 512, 4, -1, False, torch.bfloat16, False, True, SKINNY),  # per-channel
    (7, 50, 384, 4, 128, False, torch.float16, True, False, SPLIT),  # act-order
    (16, 40, 320, 4, 32, True, torch.bfloat16, True, True, FUSED),
    (16, 72, 192, 8, 64, False, torch.float16, False, True, SPLIT),  # 8-bit, fp16 magic
    (17, 56, 448, 8, 32, True, torch.bfloat16, False, False, FUSED),  # 8-bit bf16: no 16-bit magic
    (33, 130, 256, 4, 128, False, torch.bfloat16, False, True, None),
    (64, 48, 160, 4, 32, False, torch.float16, True, True, None),
    (100, 24, 128, 8, -1, False, torch.bfloat16, False, True, LARGE),
    (300, 40, 256, 4, 64, False, torch.float16, False, True, LARGE),
    (300, 20, 288, 8, 32, True, torch.bfloat16, True, False, None),
    (129, 33, 256, 4, 128, False, torch.float16, True, True, DEQUANT),
    (2, 66, 130, 4, 64, True, torch.bfloat16, False, True, DEQUANT),
    (9, 48, 384, 8, 128, True, torch.float16, False, False, SKINNY),  # 8-bit fp16: lane pairs of 8-bit codes
    (70, 33, 320, 4, -1, False, torch.bfloat16, False, True, WIDE),
    (4, 40, 200, 4, 64, False, torch.bfloat16, True, True, FUSED),  # bf16 fused scale: fp32 path
    (1, 77, 576, 4, 128, False, torch.float16, False, True, GEMV),  # ragged last group, split K
    (1, 64, 256, 4, -1, True, torch.bfloat16, True, False, GEMV),  # per-channel, act-order
    (3, 33, 200, 4, 64, False, torch.bfloat16, False, True, GEMV_M4),  # K % 32 != 0: masked x, padded words
    (9, 50, 384, 8, 128, False, torch.float16, True, True, GEMV_M4),  # 8-bit, 3 row blocks, last one partial
    (5, 96, 512, 4, 32, True, torch.float16, False, False, GEMV_PRE),
    (2, 40, 130, 8, 64, True, torch.bfloat16, False, True, GEMV_PRE),  # K % 8 != 0
    (1, 96, 1024, 4, 128, False, torch.float16, False, True, GEMV_FOLD),  # offsets folded out: rounding check
    (3, 40, 200, 4, -1, False, torch.bfloat16, True, False, GEMV_FOLD),  # masked K tail, per-channel
    (2, 33, 256, 8, 64, True, torch.float16, False, True, GEMV_FOLD),  # 8-bit: fold_zero does not apply
    (1, 77, 576, 4, 128, False, torch.float16, False, True, GEMV_PREFETCH),  # prefetch across a ragged split
    (3, 40, 200, 4, -1, True, torch.bfloat16, True, False, GEMV_PREFETCH),  # masked K tail, one group
    (2, 33, 256, 8, 32, False, torch.float16, False, True, GEMV_PREFETCH),  # 8-bit, small groups
    (1, 96, 1024, 4, 128, False, torch.float16, False, True, GEMV_VEC),  # x read 4 activations per load
    (3, 40, 512, 4, 64, True, torch.bfloat16, True, False, GEMV_VEC),  # bf16, two row blocks, act-order
    (2, 40, 200, 4, -1, False, torch.float16, False, True, GEMV_VEC),  # K tail: falls back to one per load
    (16, 70, 320, 4, 64, False, torch.float16, True, True, SWAP),
    (3, 33, 200, 4, 128, True, torch.bfloat16, False, True, SWAP),  # bf16 fused scale through fp32
    (20, 96, 384, 4, -1, False, torch.float16, False, True, SWAP_TS),  # tile scale, two row blocks
    (7, 48, 256, 8, 64, False, torch.float16, False, False, SWAP_TS),
]


@pytest.mark.parametrize("m,n,k,bits,group,sym,dtype,act_order,with_bias,config", CASES)
def test_matches_float64_reference(m, n, k, bits, group, sym, dtype, act_order, with_bias, config):
    qw, buffers = make_layer(n, k, bits, group, sym, act_order, seed=m * 1000 + n)
    w = prepared(buffers, bits, group)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype) if with_bias else None
    out = torch.full((m, n), float("nan"), device=DEVICE, dtype=dtype)
    y = K.w4a16_linear(x, w, bias, config=config, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert_close_to_float64(y, x, qw, bias)


def test_vector_x_reads_only_aligned_rows():
    qw, buffers = make_layer(48, 512, 4, 128, False, seed=11)
    w = prepared(buffers, 4, 128)
    wide = torch.randn(2, 520, device=DEVICE).half()
    assert reads_x_by_four(GEMV_VEC, 4, wide[:, :512], 64)
    assert not reads_x_by_four(GEMV_VEC, 4, wide[:, 1:513], 64)  # rows 2 bytes off 8-byte alignment
    assert not reads_x_by_four(GEMV_VEC, 8, wide[:, :512], 64)  # 8-bit codes: the unfolded path
    assert not reads_x_by_four(GEMV_FOLD, 4, wide[:, :512], 64)  # not asked for
    for x in (wide[:, :512], wide[:, 1:513], wide[:, 3:515]):  # both paths give the same, right answer
        assert_close_to_float64(K.w4a16_linear(x, w, config=GEMV_VEC), x, qw, None)


@pytest.mark.parametrize("regime", range(len(K.CONFIG_TABLE)))
def test_committed_table_configs(regime):
    max_m, cfg = K.CONFIG_TABLE[regime]
    m = min(max_m, 200)
    qw, buffers = make_layer(72, 320, 4, 64, False, seed=regime)
    x = torch.randn(m, 320, device=DEVICE).half()
    y = K.w4a16_linear(x, prepared(buffers, 4, 64), config=cfg)
    assert_close_to_float64(y, x, qw, None)


def test_leading_dims_and_default_config():
    qw, buffers = make_layer(40, 256, seed=3)
    x = torch.randn(2, 3, 256, device=DEVICE).half()
    y = K.w4a16_linear(x, prepared(buffers, 4, 128))
    assert y.shape == (2, 3, 40)
    assert_close_to_float64(y.reshape(6, 40), x.reshape(6, 256), qw, None)


@pytest.mark.parametrize("config", [SPLIT, GEMV])
def test_split_k_is_deterministic_and_resets_its_semaphores(config):
    _, buffers = make_layer(64, 512, seed=4)
    w = prepared(buffers, 4, 128)
    x = torch.randn(1, 512, device=DEVICE).half()
    plan = K.plan_launch(config, 1, 64, 512, 128, 4)
    assert plan.split_k > 1
    y1 = K.w4a16_linear(x, w, config=config)
    assert int(w.locks.abs().sum()) == 0
    y2 = K.w4a16_linear(x, w, config=config)
    assert torch.equal(y1, y2)


@pytest.mark.parametrize("config", [SPLIT, GEMV])
def test_split_k_fixup_unroll_leaves_the_sum_alone(config):
    """The fix-up adds the partials in split order whatever it loads per round: 3 (gemv) or 6 (fused) splits
    summed 1, 4 or 8 at a time (a ragged last round, or more than exist: the rest masked) give the same tensor."""
    _, buffers = make_layer(64, 384, seed=5)
    w = prepared(buffers, 4, 128)
    x = torch.randn(1, 384, device=DEVICE).half()
    assert K.plan_launch(config, 1, 64, 384, 128, 4).split_k in (3, 6)
    ys = [K.w4a16_linear(x, w, config=replace(config, fixup_unroll=u)) for u in (1, 4, 8)]
    assert all(torch.equal(ys[0], y) for y in ys[1:])
    assert int(w.locks.abs().sum()) == 0
    with pytest.raises(ValueError, match="fixup_unroll"):
        replace(config, fixup_unroll=3)


@pytest.mark.parametrize(
    "bits,group,dtype", [(4, 128, torch.float16), (4, 64, torch.bfloat16), (8, -1, torch.bfloat16)]
)
def test_dequantize_kernel_is_bit_exact(bits, group, dtype):
    qw, buffers = make_layer(45, 200, bits, group, seed=bits)
    w = prepared(buffers, bits, group)
    got = K.w4a16_dequantize(w, dtype)  # [N, K]
    want = qw.dequantize(torch.float32).to(dtype).to(DEVICE)
    assert torch.equal(got, want)


def test_act_order_prepares_once_and_leaves_the_checkpoint_alone():
    qw, buffers = make_layer(24, 256, 4, 64, act_order=True, seed=5)
    before = {name: t.clone() for name, t in buffers.items()}
    w = prepared(buffers, 4, 64)
    for name, t in buffers.items():
        assert torch.equal(t, before[name]), name
    assert w.perm is not None and w.layout == K.KERNEL_LAYOUT
    assert torch.equal(buffers["g_idx"][w.perm].long().cpu(), torch.arange(256) // 64)
    codes = K.unpack_gptq_codes(w.qweight, 4, 256).cpu()
    assert torch.equal(codes, qw.q.t()[w.perm.cpu()].int())


def test_no_act_order_uses_the_checkpoint_buffers_as_they_are():
    _, buffers = make_layer(24, 256, seed=6)
    w = prepared(buffers, 4, 128)
    assert w.perm is None and w.qweight is buffers["qweight"] and w.group_size == 128


def test_reference_function_matches_quantized_weight():
    qw, buffers = make_layer(30, 200, 4, 64, act_order=True, seed=7)
    x = torch.randn(4, 200, device=DEVICE)
    b = {name: t for name, t in buffers.items()}
    y = K.w4a16_reference(x, b["qweight"], b["qzeros"], b["scales"], b["g_idx"], 4)
    want = x @ qw.dequantize(torch.float32).to(DEVICE).T
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def test_gemv_reference_matches_quantized_weight():
    qw, buffers = make_layer(30, 200, 8, 64, seed=11)
    x = torch.randn(3, 200, device=DEVICE)
    bias = torch.randn(30, device=DEVICE)
    b = {name: t for name, t in buffers.items()}
    y = K.w4a16_gemv_reference(x, b["qweight"], b["qzeros"], b["scales"], 64, 8, bias)
    want = x.double() @ qw.dequantize(torch.float64).to(DEVICE).T + bias.double()
    torch.testing.assert_close(y, want.float(), rtol=1e-6, atol=1e-6)


def test_unsupported_layers_are_named():
    g = torch.arange(256, dtype=torch.int32) // 64
    assert K.unsupported_reason(4, 64, g) is None
    assert "3-bit" in K.unsupported_reason(3, 64, g)
    assert "multiple of 32" in K.unsupported_reason(4, 48, torch.arange(96) // 48)
    uneven = torch.cat([torch.zeros(100), torch.ones(156)]).int()  # two groups of unequal size
    assert "groups of 64" in K.unsupported_reason(4, 64, uneven)


def test_launcher_checks_inputs():
    _, buffers = make_layer(40, 256, seed=8)
    w = prepared(buffers, 4, 128)
    x = torch.randn(2, 256, device=DEVICE).half()
    with pytest.raises(ValueError, match=r"x must be \[M, 256\]"):
        K.w4a16_gemv(x[:, :128], w, GEMV)
    with pytest.raises(ValueError, match="runs the gemv kernel"):
        K.w4a16_gemv(x, w, SPLIT)
    with pytest.raises(ValueError, match="runs the fused kernel"):
        K.w4a16_gemm(x, w, config=GEMV)
    with pytest.raises(ValueError, match=r"x must be \[M, 256\]"):
        K.w4a16_gemm(x[:, :128], w)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        K.w4a16_gemm(x.float(), w)
    with pytest.raises(ValueError, match="out must be"):
        K.w4a16_gemm(x, w, out=torch.empty(2, 40, device=DEVICE))
    with pytest.raises(ValueError, match="bias must be"):
        K.w4a16_gemm(x, w, bias=torch.zeros(41, device=DEVICE))
    with pytest.raises(ValueError, match="prefetch is a gemv option"):
        K.KernelConfig("gemv", 1, 64, 64, 2, 2, prefetch=True)


def test_plan_caps_block_k_by_group_and_fills_the_sms():
    skinny = K.KernelConfig("fused", 16, 128, 128, 4, 4, split_waves=4)
    assert K.plan_launch(skinny, 1, 4096, 4096, 64, 132).block_k == 64  # a K tile never straddles groups
    assert K.plan_launch(K.KernelConfig(block_k=128, fuse_scale=True), 1, 4096, 4096, 96, 132).block_k == 32
    assert K.plan_launch(K.KernelConfig(block_k=128, fuse_scale=True), 1, 4096, 4096, 0, 132).block_k == 128
    plan = K.plan_launch(skinny, 1, 4096, 4096, 128, 132)  # 32 output tiles, 32 K tiles
    assert plan.split_k == 16 and plan.tiles_per_split == 2  # 512 CTAs: ~4 waves of 132
    plan = K.plan_launch(skinny, 1, 4096, 14336, 128, 132)  # 112 K tiles
    assert (plan.split_k - 1) * plan.tiles_per_split < 112 <= plan.split_k * plan.tiles_per_split  # none empty
    plan = K.plan_launch(skinny, 1, 28672, 8192, 128, 132)
    assert plan.split_k == 3 and plan.grid == (224, 3)
    assert K.plan_launch(K.KernelConfig("fused", 128, 256, 64, 8, 3), 4096, 28672, 8192, 128, 132).split_k == 1
    gemv = K.KernelConfig("gemv", 1, 512, 128, 4, 1, split_waves=8)
    assert K.plan_launch(gemv, 1, 4096, 4096, 64, 132).block_k == 64  # a gemv tile never straddles groups
    plan = K.plan_launch(gemv, 1, 28672, 8192, 128, 132)  # 56 column blocks, 64 K tiles
    assert plan.grid == (56, 16) and plan.tiles_per_split == 4
    assert K.plan_launch(gemv, 5, 28672, 8192, 128, 132).grid[0] == 5 * 56  # one row per CTA: 5 row blocks
    plan = K.plan_launch(gemv, 1, 28672, 8192, 64, 132)  # tiles capped to half: twice the CTAs
    assert plan.block_k == 64 and plan.grid == (56, 32) and plan.tiles_per_split == 4


def test_config_table_covers_every_m():
    maxima = [max_m for max_m, _ in K.CONFIG_TABLE]
    assert maxima == sorted(maxima) and maxima[-1] >= 2**31 - 1
    assert K.config_for(1) is K.CONFIG_TABLE[0][1]
    assert K.config_for(10**6) is K.CONFIG_TABLE[-1][1]
    # one row of a wide layer: 64-deep tiles, twice the splits
    assert C.config_for(1, 14336) is C.config_for(1, 28672) is C.WIDE_M1
    assert C.config_for(1, 8192) is C.config_for(1) is K.CONFIG_TABLE[0][1]
    assert C.config_for(2, 28672) is C.config_for(2)
    # 3-4 rows of the widest layers: the m4 regime's kernel, split twice as far (the same compiled variant)
    assert C.config_for(3, 28672) is C.config_for(4, 28672) is C.WIDE_M4
    assert replace(C.config_for(4), split_waves=2 * C.config_for(4).split_waves) == C.WIDE_M4
    assert C.config_for(4, 14336) is C.config_for(4) and C.config_for(5, 28672) is C.config_for(5)


def _quant_linear(bits=4, group=128, act_order=False, bias=True, n=48, k=256, seed=9):
    qw, _ = make_layer(n, k, bits, group, act_order=act_order, seed=seed)
    b = torch.randn(n) if bias else None
    return QuantLinear.from_quantized(qw, b, torch.float16).to(DEVICE), qw


def test_dispatch_caches_the_prepared_weight_and_notices_new_buffers():
    mod, qw = _quant_linear(act_order=True)
    x = torch.randn(5, 256, device=DEVICE).half()
    y = cuda_weight_only_linear(mod, x)
    assert_close_to_float64(y, x, qw, mod.bias)
    state = mod._kernel_state
    assert state[1] is not None and state[1].perm is not None
    cuda_weight_only_linear(mod, x)
    assert mod._kernel_state is state  # reused, not rebuilt
    mod.scales.mul_(2)  # written in place: the cached weight must be rebuilt (its key holds the version)
    y2 = cuda_weight_only_linear(mod, x)
    assert mod._kernel_state is not state
    torch.testing.assert_close(y2 - mod.bias, 2 * (y - mod.bias), rtol=2e-3, atol=2e-3)


def test_dispatch_declines_what_the_kernel_does_not_serve():
    mod, _ = _quant_linear(bits=3)
    x = torch.randn(2, 256, device=DEVICE)
    assert cuda_weight_only_linear(mod, x.half()) is None
    mod4, _ = _quant_linear()
    assert cuda_weight_only_linear(mod4, x) is None  # fp32 activations


@gpu
@pytest.mark.gpu
def test_quant_linear_forward_uses_the_kernel_on_cuda():
    mod, qw = _quant_linear(act_order=True)
    x = torch.randn(3, 7, 256, device="cuda").half()
    y = mod(x)
    assert mod._kernel_state is not None and mod._kernel_state[1] is not None
    assert_close_to_float64(y.reshape(21, 48), x.reshape(21, 256), qw, mod.bias)


@gpu
@pytest.mark.gpu
def test_split_k_replays_inside_a_cuda_graph():
    qw, buffers = make_layer(4096, 4096, seed=10)
    w = prepared(buffers, 4, 128)
    x = torch.randn(1, 4096, device="cuda").half()
    cfg = K.KernelConfig("fused", 16, 128, 128, 4, 4, split_waves=4)
    assert K.plan_launch(cfg, 1, 4096, 4096, 128, num_sms(x.device)).split_k > 1
    out = torch.full((1, 4096), float("nan"), device="cuda", dtype=torch.float16)
    K.w4a16_linear(x, w, config=cfg, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        K.w4a16_linear(x, w, config=cfg, out=out)
    out.fill_(float("nan"))
    graph.replay()
    first = out.clone()
    graph.replay()
    assert torch.equal(first, out)
    assert_close_to_float64(out, x, qw, None)


def test_the_family_exports_its_kernels():
    assert K.w4a16_gemm is gemm.w4a16_gemm and K.w4a16_dequantize is gemm.w4a16_dequantize
    assert K.w4a16_linear is dispatch.w4a16_linear and K.choose is dispatch.choose


# The W4A16 epilogue's cast: fp32 -> bf16 rounded to nearest even by hand where Triton's interpreter truncates.


@triton.jit
def _cast_kernel(x_ptr, y_ptr, N: tl.constexpr, EMULATE_BF16: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, to_act(tl.load(x_ptr + offs), y_ptr.dtype.element_ty, EMULATE_BF16))


@pytest.mark.skipif(DEVICE == "cpu" and not interpreting(), reason="needs CUDA or TRITON_INTERPRET=1")
def test_bf16_rounds_to_nearest_even():
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(256, generator=g) * 100).to(torch.bfloat16).float()
    ulp = (base.to(torch.bfloat16).view(torch.int16) + 1).view(torch.bfloat16).float() - base
    # exact ties (half an ulp: even and odd neighbours both), just below and just above them
    x = torch.cat([base + ulp / 2, base + ulp * 0.49, base + ulp * 0.51, base]).to(DEVICE)
    y = torch.full_like(x, float("nan"), dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, y, N=x.numel(), EMULATE_BF16=interpreting())
    assert torch.equal(y, x.to(torch.bfloat16))
