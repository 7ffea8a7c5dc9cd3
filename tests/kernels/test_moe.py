"""Fused MoE kernels (``kernels/moe``) against their PyTorch references and transformers' routers (Triton's
interpreter on CPU machines, CUDA where present).

Routing: expert ids equal the reference's exactly (random scores have no ties closer than a few fp32 ulps, and the
tie rule, lower index first, is tested on exact ties); weights within 4 fp32 ulps (the kernel's softmax sums in
another order). Alignment: the kernel's layout equals the reference's bit for bit, and the reference's satisfies
the layout's invariants. Experts: against float64 from the same operands (x and W rounded to the activation dtype
as the layer defines them), the kernel's error is at most twice the PyTorch reference's plus 2**-20 * max|y|
(flash-attn's rule); fp8_block experts, whose activations are re-quantized between the projections, are compared
with the reference itself: both form the same B-long fp32 partial sums from the same codes, and a one-ulp
difference of an intermediate fp16 value may flip one e4m3 code of one tile, so 4 fp16 ulps of max|y|.

Every buffer the launchers allocate is poisoned first (floats NaN, integers a huge value), and the routing outputs
too, so an element no kernel writes shows up.
"""

from __future__ import annotations

import pytest
import torch
from quantkit.kernels import moe as M
from quantkit.kernels.moe import configs as C
from quantkit.kernels.moe import routing as R
from quantkit.kernels.moe.experts import ExpertWeights
from quantkit.kernels.w4a16 import prepare_gptq_weight

from quantkit.algorithms.fp8 import quantize_fp8
from quantkit.quant import QuantizedWeight, QuantScheme
from quantkit.quant.tensor import group_index

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
H, INTER, E = 64, 64, 8  # hidden, expert width, experts: tiny, the interpreter is slow


@pytest.fixture(autouse=True)
def poisoned_empty(monkeypatch):
    """torch.empty returns NaN-filled float tensors and huge-valued integer ones for the duration of a test."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype in (torch.int32, torch.int64):
            t.fill_(2**30)
        return t

    monkeypatch.setattr(torch, "empty", empty)


# -- routing -----------------------------------------------------------------------------------------------------


def assert_same_routing(got, want):
    (w, i), (rw, ri) = got, want
    assert torch.equal(i.cpu(), ri)
    # the GPU's exp (ex2.approx) and its sum order differ from PyTorch's by a few ulps; the interpreter's do not
    ulps = 16 if DEVICE == "cuda" else 4
    assert torch.allclose(w.cpu(), rw, rtol=ulps * torch.finfo(torch.float32).eps, atol=0)


@pytest.mark.parametrize(
    ("t", "e", "k", "renorm", "scaling"), [(5, 8, 2, True, 1.0), (9, 60, 4, False, 1.0), (3, 128, 8, True, 1.5)]
)
def test_softmax_routing_matches_reference(t, e, k, renorm, scaling):
    logits = torch.randn(t, e) * 3
    args = (k, "softmax", renorm, None, 1, 1, scaling)
    assert_same_routing(M.route(logits.to(DEVICE), *args), M.route_reference(logits, *args))


@pytest.mark.parametrize(
    ("t", "e", "k", "n_group", "topk_group"), [(7, 16, 4, 4, 2), (4, 32, 6, 8, 3), (5, 8, 2, 1, 1)]
)
def test_sigmoid_group_routing_matches_reference(t, e, k, n_group, topk_group):
    logits, bias = torch.randn(t, e), torch.randn(e) * 0.3
    args = (k, "sigmoid", True, bias, n_group, topk_group, 2.5)
    got = M.route(logits.to(DEVICE), *args[:3], bias.to(DEVICE), *args[4:])
    assert_same_routing(got, M.route_reference(logits, *args))
    w, ids = got
    kept = ids.cpu().long() // (e // n_group)  # every chosen expert lies in one of topk_group groups
    assert all(len(set(row.tolist())) <= topk_group for row in kept)
    assert torch.allclose(w.sum(1).cpu(), torch.full((t,), 2.5))  # renormalised, then scaled


def test_routing_ties_go_to_the_lower_expert_and_group():
    logits = torch.zeros(3, 16)
    logits[1, [3, 9, 12]] = 2.0  # three equal best experts, two are chosen
    w, ids = M.route(logits.to(DEVICE), 2)
    assert ids.cpu().tolist() == [[0, 1], [3, 9], [0, 1]]
    assert torch.equal(w.cpu(), torch.full((3, 2), 0.5))
    # sigmoid: all groups tie, so groups 0 and 1 are kept; inside them experts 0..3 tie, so 0, 1, 2 are chosen
    _, ids = M.route(torch.zeros(2, 16, device=DEVICE), 3, "sigmoid", True, None, 4, 2)
    assert ids.cpu().tolist() == [[0, 1, 2], [0, 1, 2]]
    assert torch.equal(M.route_reference(torch.zeros(2, 16), 3, "sigmoid", True, None, 4, 2)[1], ids.cpu())


def test_routers_match_transformers():
    """The references (hence the kernels) are transformers' routers: Mixtral, Qwen3-MoE, DeepSeek-V3."""
    from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(0)
    x = torch.randn(6, 32)
    qwen = Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False)
    cases = [
        (MixtralTopKRouter(MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2)), {}),
        (Qwen3MoeTopKRouter(qwen), {"renormalize": False}),
    ]
    dcfg = DeepseekV3Config(hidden_size=32, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4)
    router = DeepseekV3TopkRouter(dcfg)
    router.e_score_correction_bias.copy_(torch.randn(16) * 0.2)
    sig = {"score": "sigmoid", "bias": router.e_score_correction_bias, "n_group": 4, "topk_group": 2, "scaling": 2.5}
    cases.append((router, sig))
    for mod, kw in cases:
        torch.nn.init.normal_(mod.weight)
        with torch.no_grad():
            logits, hw, hi = mod(x)
        w, ids = M.route_reference(logits, hi.shape[1], **kw)
        order = hi.argsort(dim=1)  # DeepSeek-V3's torch.topk is unsorted: compare expert by expert
        assert torch.equal(hi.gather(1, order), ids.long().gather(1, ids.long().argsort(dim=1)))
        assert torch.allclose(hw.float().gather(1, order), w.gather(1, ids.long().argsort(dim=1)), rtol=1e-6)


# -- alignment ---------------------------------------------------------------------------------------------------


def check_layout(sorted_pairs, block_expert, ids, e, block_m):
    """Every pair once, in its expert's run, ascending; runs padded with the sentinel; blocks name their expert."""
    flat = ids.reshape(-1).long()
    p = flat.numel()
    assert sorted_pairs.numel() == block_expert.numel() * block_m == R.max_blocks(p, e, block_m) * block_m
    rows = sorted_pairs.view(-1, block_m).long()
    used = block_expert >= 0
    assert (rows[~used] == p).all() and torch.equal(used, torch.arange(len(used)) < used.sum())  # used blocks first
    real = rows[used]
    assert sorted(real[real < p].tolist()) == list(range(p))
    for b in range(int(used.sum())):
        pairs = rows[b][rows[b] < p]
        assert (flat[pairs] == block_expert[b]).all() and (pairs.diff() > 0).all()
    assert (block_expert[used].diff() >= 0).all()


@pytest.mark.parametrize(("t", "k", "e", "block_m"), [(1, 2, 8, 16), (7, 2, 8, 4), (33, 4, 16, 8), (5, 1, 3, 2)])
def test_align_kernel_equals_reference_and_keeps_the_invariants(t, k, e, block_m):
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).int()
    ids[ids == e - 1] = 0  # the last expert gets no pair
    ref = R.align_reference(ids, e, block_m)
    check_layout(*ref, ids, e, block_m)
    got = R.align(ids.to(DEVICE), e, block_m)
    assert torch.equal(got[0].cpu(), ref[0]) and torch.equal(got[1].cpu(), ref[1])


@pytest.mark.parametrize(
    ("t", "e", "k", "block_m", "sigmoid"),
    [(1, 128, 8, 16, False), (5, 8, 2, 4, False), (16, 16, 4, 8, True), (40, 8, 2, 16, False)],  # 40: two launches
)
def test_route_and_align_equals_route_then_align(t, e, k, block_m, sigmoid):
    """One launch routes and aligns up to 16 tokens; the same bits as route, then the alignment reference."""
    logits, bias = torch.randn(t, e) * 2, torch.randn(e) * 0.3
    opts = {"score": "sigmoid", "bias": bias.to(DEVICE), "n_group": 4, "topk_group": 2} if sigmoid else {}
    w, ids, pairs, block_expert = M.route_and_align(logits.to(DEVICE), k, block_m, **opts)
    rw, rids = M.route(logits.to(DEVICE), k, **opts)
    assert torch.equal(w, rw) and torch.equal(ids, rids)
    ref = R.align_reference(ids.cpu(), e, block_m)
    assert torch.equal(pairs.cpu(), ref[0]) and torch.equal(block_expert.cpu(), ref[1])


# -- experts -----------------------------------------------------------------------------------------------------


def w4a16_experts(n, k, bits, group, g, act_order=False):
    """Random 4/8-bit experts; act-order shuffles each expert's g_idx its own way (groups keep their sizes)."""
    scheme = QuantScheme(bits=bits, group_size=group)
    out, dequantized = [], []
    for _ in range(E):
        n_g = scheme.n_groups(k)
        g_idx = group_index(k, scheme)
        if act_order:
            g_idx = g_idx[torch.randperm(k, generator=g)]
        qw = QuantizedWeight(
            q=torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8),
            scales=(torch.rand(n, n_g, generator=g) * 0.2 / 2**bits + 1e-3).half().float(),
            zeros=torch.randint(0, 2**bits, (n, n_g), generator=g, dtype=torch.int32),
            g_idx=g_idx,
            scheme=scheme,
        )
        b = {name: t.to(DEVICE) for name, t in qw.pack().items()}
        out.append(prepare_gptq_weight(b["qweight"], b["qzeros"], b["scales"], b["g_idx"], bits, group))
        dequantized.append(qw.dequantize())
    w = ExpertWeights.from_w4a16(out)
    assert (w.perm is not None) == (act_order and k > group)  # one group: nothing to sort
    assert all(torch.equal(w.dequantize(e).cpu(), dequantized[e]) for e in range(E))  # the checkpoint weight
    return w


def make_experts(fmt, dtype, g, inter=INTER):
    if fmt == "float":
        ws = [[torch.randn(n, k, generator=g) * k**-0.5 for _ in range(E)] for n, k in ((2 * inter, H), (H, inter))]
        return [ExpertWeights.from_float([w.to(dtype).to(DEVICE) for w in p]) for p in ws]
    if fmt.startswith("w4a16"):
        bits, act = (8 if fmt.endswith("8") else 4), fmt.endswith("act")
        group = -1 if fmt.endswith("pc") else 32  # pc: one group per output channel
        return w4a16_experts(2 * inter, H, bits, group, g, act), w4a16_experts(H, inter, bits, group, g, act)
    out = []
    for n, k in ((2 * INTER, H), (H, INTER)):
        # B = 32: 8-bit tensor-core products need K tiles of 32 or more on the GPU
        q = [quantize_fp8(torch.randn(n, k, generator=g) * k**-0.5, "block", 32) for _ in range(E)]
        out.append(ExpertWeights.from_fp8_block([a.to(DEVICE) for a, _ in q], [s.to(DEVICE) for _, s in q], 32))
    return out


def exact(x, w13, w2, weights, ids):
    """float64 of the layer from x and the experts' weights as the layer rounds them (no intermediate rounding)."""
    t, k = ids.shape
    y = torch.zeros(t, x.shape[1], dtype=torch.float64)
    for tok in range(t):
        for j in range(k):
            e = int(ids[tok, j])
            gu = x[tok].double() @ w13.dequantize(e).to(x.dtype).double().cpu().t()
            g, u = gu.chunk(2)
            a = g * torch.sigmoid(g) * u
            y[tok] += (a @ w2.dequantize(e).to(x.dtype).double().cpu().t()) * float(weights[tok, j])
    return y


def routed(t, k, g, skip=()):
    logits = torch.randn(t, E, generator=g) * 2
    logits[:, list(skip)] = -30.0  # experts that receive no token
    return M.route_reference(logits, k, renormalize=True)


CASES = [  # (format, dtype, T, k, experts without tokens)
    ("float", torch.float16, 7, 2, (2, 5)),
    ("float", torch.bfloat16, 9, 3, ()),
    ("float", torch.float32, 1, 2, ()),
    ("w4a16", torch.float16, 5, 2, (0,)),
    ("w4a16_8", torch.bfloat16, 3, 2, ()),
    ("w4a16_act", torch.float16, 6, 2, (1,)),  # act-order: every expert gathers x's columns in its own order
    ("fp8_block", torch.float16, 6, 2, (7,)),
]


def check_layer(fmt, dtype, t, k, skip, config, out_dtype=None, inter=INTER):
    g = torch.Generator().manual_seed(t * 10 + k)
    w13, w2 = make_experts(fmt, dtype, g, inter)
    x = torch.randn(t, H, generator=g).to(dtype)
    weights, ids = routed(t, k, g, skip)
    y = M.fused_moe(x.to(DEVICE), w13, w2, weights.to(DEVICE), ids.to(DEVICE), out_dtype, config).cpu()
    ref = M.fused_moe_reference(x.to(DEVICE), w13, w2, weights.to(DEVICE), ids.to(DEVICE)).cpu()
    assert y.dtype == (out_dtype or dtype) and not y.isnan().any()
    if fmt == "fp8_block":
        assert (y.float() - ref.float()).abs().max() <= 4 * 2**-10 * ref.float().abs().max()
        return
    want = exact(x, w13, w2, weights, ids)
    err, ref_err = (y.double() - want).abs().max(), (ref.double() - want).abs().max()
    assert err <= 2 * ref_err + 2**-20 * want.abs().max(), (err, ref_err)


@pytest.mark.parametrize(("fmt", "dtype", "t", "k", "skip"), CASES)
def test_fused_moe_matches_reference(fmt, dtype, t, k, skip):
    check_layer(fmt, dtype, t, k, skip, SMALL)


SWAP = {**SMALL, "SWAP_AB": 1}
CONFIG_CASES = [  # (format, dtype, config, out_dtype): the tile options a tuned table may pick
    ("float", torch.bfloat16, SWAP, None),
    ("float", torch.float16, {**SMALL, "BLOCK_K": 16, "BLOCK_M": 32}, torch.float32),
    ("float", torch.float32, SWAP, None),
    ("w4a16", torch.float16, SWAP, None),
    ("w4a16_8", torch.bfloat16, {**SWAP, "BLOCK_N": 64}, None),
    ("w4a16_act", torch.bfloat16, {**SMALL, "BLOCK_K": 32}, torch.float32),
    ("fp8_block", torch.float16, {**SWAP, "BLOCK_K": 32}, None),
    ("w4a16", torch.float16, {**SWAP, "SCALE_TILE": 1}, None),  # tile-scaled: W itself is never rounded
    ("w4a16_8", torch.bfloat16, {**SMALL, "SCALE_TILE": 1}, None),
]


@pytest.mark.parametrize(("fmt", "dtype", "config", "out_dtype"), CONFIG_CASES)
def test_fused_moe_tile_options_match_reference(fmt, dtype, config, out_dtype):
    """The weight tile as the MMA's M side (SWAP_AB), other K tiles, an fp32 output (the sum over k unrounded)."""
    check_layer(fmt, dtype, 5, 2, (3,), config, out_dtype)


@pytest.mark.parametrize("swap", [False, True])
def test_gate_up_tiles_past_the_expert_width_are_masked(swap):
    """I = 40: the last gate/up tile (16 gate and 16 up columns) holds 8 columns of each."""
    check_layer("float", torch.float16, 4, 2, (), {**SMALL, "SWAP_AB": int(swap)}, inter=40)


DECODE = {"DECODE": 1, "BLOCK_M": 1}
DECODE_CASES = [  # (format, dtype, T, k, experts without tokens, config): the GEMV path of a few tokens per expert
    ("float", torch.float16, 7, 2, (2, 5), None),  # None: chosen by T (layer_config), K unsplit: SiLU in the epilogue
    ("float", torch.bfloat16, 9, 3, (), {**DECODE, "SPLIT_K": 2, "BLOCK_N": 8, "FIXUP": 0}),  # the GLU sum launch
    ("float", torch.float32, 1, 2, (), None),
    ("w4a16", torch.float16, 5, 2, (0,), None),  # K split in two: gate/up fixed up by its last split
    ("w4a16", torch.bfloat16, 16, 2, (6,), {"DECODE": 1, "BLOCK_M": 4}),  # four rows of one expert per program
    ("w4a16", torch.float16, 4, 2, (), {**DECODE, "SPLIT_K": 1, "HOIST": 0}),  # unsplit: SiLU in the epilogue
    ("w4a16_8", torch.bfloat16, 3, 2, (), {"DECODE": 1, "BLOCK_M": 2}),
    ("w4a16_act", torch.float16, 6, 2, (1,), None),  # act-order: each expert's own column order
    ("w4a16_act", torch.bfloat16, 1, 2, (), {**DECODE, "SPLIT_K": 1}),
]


@pytest.mark.parametrize(("fmt", "dtype", "t", "k", "skip", "config"), DECODE_CASES)
def test_decode_path_matches_reference(fmt, dtype, t, k, skip, config):
    """Float and W4A16 experts on the GEMV path: K split or not, 1-4 rows per program, experts without tokens."""
    check_layer(fmt, dtype, t, k, skip, config)


@pytest.mark.parametrize(("dtype", "out_dtype"), [(torch.float16, None), (torch.bfloat16, torch.float32)])
def test_decode_path_ragged_sizes(dtype, out_dtype):
    """I = 40 and H = 64: gate/up columns past the expert width masked, K not a multiple of the tile (float);
    W4A16 with I = 96 in one group per channel: K tiles of 128 over K = 64 and 96, N = 192 over tiles of 128."""
    check_layer("float", dtype, 6, 2, (4,), {"DECODE": 1, "BLOCK_M": 2, "BLOCK_N": 16}, out_dtype, inter=40)
    check_layer("w4a16_pc", dtype, 3, 2, (), {"DECODE": 1, "BLOCK_M": 1}, out_dtype, inter=96)


def test_layer_config_picks_the_decode_path_by_tokens(monkeypatch):
    # the thresholds measured on the H100: W4A16 at 1 token, up to 16 on Qwen3-30B-A3B's shape; float never
    assert C.layer_config(1, 2, 8, "w4a16", 4096, 14336, None)["DECODE"] == 1
    assert C.layer_config(2, 2, 8, "w4a16", 4096, 14336, None)["DECODE"] == 0
    assert C.layer_config(16, 8, 128, "w4a16", 2048, 768, None)["DECODE"] == 1
    assert C.layer_config(17, 8, 128, "w4a16", 2048, 768, None)["DECODE"] == 0
    assert C.layer_config(1, 2, 8, "float", 4096, 14336, None)["DECODE"] == 0
    monkeypatch.setattr(C, "DECODE_MAX_TOKENS", {"float": 16, "w4a16": 16})
    most = C.DECODE_MAX_TOKENS["w4a16"]
    assert C.layer_config(most, 8, 128, "w4a16", 2048, 768, None) == {"DECODE": 1, "BLOCK_M": 1}
    assert C.layer_config(16, 2, 8, "float", 4096, 14336, None)["BLOCK_M"] == 4  # 4 rows per expert
    assert C.layer_config(most + 1, 8, 128, "w4a16", 2048, 768, None)["DECODE"] == 0
    assert C.layer_config(1, 8, 128, "fp8_block", 2048, 768, None)["DECODE"] == 0  # not served by the GEMV path
    assert C.layer_config(1, 2, 8, "float", 64, 64, SMALL) == {**SMALL, "DECODE": 0}  # a tile config stays one
    with pytest.raises(ValueError, match="decode path serves"):
        C.layer_config(1, 2, 8, "fp8_block", 64, 64, {"DECODE": 1})
    monkeypatch.setitem(C.TUNED_DECODE_MAX_TOKENS, ("float", 4096, 14336, 8, 2), 0)  # a shape's measured threshold
    assert C.layer_config(1, 2, 8, "float", 4096, 14336, None)["DECODE"] == 0
    assert C.layer_config(1, 2, 8, "w4a16", 4096, 14336, None)["DECODE"] == 1


@pytest.mark.parametrize(
    ("fmt", "n", "k", "blocks", "want"),
    [  # H100 (132 SMs), batch 1: (BLOCK_N, BLOCK_K, warps, K tiles per split, splits)
        ("w4a16", 1536, 2048, 8, (256, 128, 2, 1, 16)),  # Qwen3-30B-A3B gate/up: 8 experts x 6 row tiles of W13
        ("w4a16", 2048, 768, 8, (256, 128, 2, 1, 6)),  # Qwen3-30B-A3B down
        ("w4a16", 28672, 4096, 2, (512, 128, 4, 8, 4)),  # Mixtral-8x7B gate/up
        ("w4a16", 4096, 14336, 2, (512, 128, 4, 5, 23)),  # Mixtral-8x7B down
        ("float", 1536, 2048, 8, (16, 256, 2, 4, 2)),  # Qwen3-30B-A3B bf16 gate/up
    ],
)
def test_decode_plan_splits_k_until_the_device_is_busy(fmt, n, k, blocks, want):
    assert C.decode_plan({"DECODE": 1, "BLOCK_M": 1}, fmt, n, k, 128, blocks, 2, 132) == want
    with pytest.raises(ValueError, match="BLOCK_M must be a power of two up to 4"):
        C.decode_plan({"DECODE": 1, "BLOCK_M": 8}, fmt, n, k, 128, blocks, 2, 132)


def test_bad_decode_configs_are_one_line_errors():
    """A float gate/up tile of one row has no up half (it divided by zero in the kernel's setup), and a warp count
    that is not a power of two was reported as a BLOCK_N error."""
    g = torch.Generator().manual_seed(5)
    w13, w2 = make_experts("float", torch.float16, g)
    x = torch.randn(2, H, generator=g).half().to(DEVICE)
    weights, ids = (t.to(DEVICE) for t in routed(2, 2, g))
    for bad, match in [({"BLOCK_N": 1}, "BLOCK_N must be a power of two from 2"), ({"num_warps": 3}, "num_warps")]:
        with pytest.raises(ValueError, match=match):
            M.fused_moe(x, w13, w2, weights, ids, config={**DECODE, **bad})


def test_decode_path_is_deterministic_and_reads_only_chosen_experts():
    """K split in two (gate/up fixed up in the launch): the same bits on a second run (the semaphores were reset),
    and experts no token chose, their scales NaN, are never read."""
    g = torch.Generator().manual_seed(4)
    w13, w2 = make_experts("w4a16", torch.float16, g)
    x = torch.randn(2, H, generator=g).half().to(DEVICE)
    weights, ids = routed(2, 2, g)
    args = (x, w13, w2, weights.to(DEVICE), ids.to(DEVICE))
    for e in set(range(E)) - set(ids.flatten().tolist()):
        w13.scales[e] = float("nan")
        w2.scales[e] = float("nan")
    y = M.fused_moe(*args, config={**DECODE, "SPLIT_K": 2})
    assert not w13.locks.any() and not y.isnan().any()
    assert torch.equal(y, M.fused_moe(*args, config={**DECODE, "SPLIT_K": 2}))


@pytest.mark.skipif(DEVICE == "cuda", reason="meta tensors stand in for the operands under the interpreter only")
def test_decode_partials_past_32_bit_offsets_are_a_one_line_error():
    """K split s ways multiplies the partials [S, T * k, N] past what the operand check bounds (T * k * N < 2**31):
    with int32 offsets they would wrap, so the launcher refuses them (meta tensors: nothing allocated or run)."""
    h, inter, p = 1024, 4096, 2**18 - 1
    w13 = ExpertWeights("float", torch.empty(1, 2 * inter, h, dtype=torch.float16, device="meta"), h, 2 * inter)
    w2 = ExpertWeights("float", torch.empty(1, h, inter, dtype=torch.float16, device="meta"), inter, h)
    x = torch.empty(p, h, dtype=torch.float16, device="meta")
    ids = torch.zeros(p, 1, dtype=torch.int32, device="meta")
    weights = torch.ones(p, 1, device="meta")
    aligned = tuple(torch.empty(p + 1, dtype=torch.int32, device="meta") for _ in range(2))  # align(ids, 1, 1)
    with pytest.raises(ValueError, match=r"2\*\*31"):
        M.fused_moe(x, w13, w2, weights, ids, config={"DECODE": 1, "BLOCK_M": 1, "BLOCK_N": 1024}, aligned=aligned)


def test_moe_config_takes_the_tuned_entry_of_a_shape_else_the_format_default(monkeypatch):
    tuned = [(1, {**SMALL, "SWAP_AB": 1}), (float("inf"), {**SMALL, "BLOCK_M": 64})]
    monkeypatch.setattr(C, "TUNED_CONFIGS", {("w4a16", 2048, 768, 128, 8): tuned})
    assert M.moe_config(1, 8, 128, "w4a16", 2048, 768)["SWAP_AB"] == 1
    assert M.moe_config(2, 8, 128, "w4a16", 2048, 768)["BLOCK_M"] == 64
    default = C.DEFAULT_CONFIGS["float"]
    assert M.moe_config(1, 8, 128, "float", 2048, 768) == default[0][1]  # not tuned: by rows per expert
    assert M.moe_config(4096, 2, 8, "w4a16", 4096, 14336) == C.DEFAULT_CONFIGS["w4a16"][-1][1]
    assert M.moe_config(1, 8, 128, "w4a16", 2048, 768, act_bytes=4) == C.DEFAULT_CONFIGS["w4a16"][0][1]  # fp32 x
    M.moe_config(1, 8, 128, "float")["BLOCK_M"] = 0  # a copy: the table is not changed
    assert M.moe_config(1, 8, 128, "float") == default[0][1]


def test_a_tuned_w4a16_k_tile_serves_the_group_it_was_timed_with():
    tuned = {"BLOCK_K": 128, "TUNED_GROUP": 128}
    assert C.block_k("w4a16", 128, tuned) == 128
    assert C.block_k("w4a16", 64, tuned) == C.block_k("w4a16", 64, {})  # another group: the format's default
    with pytest.raises(ValueError, match="divid"):  # a K tile asked for without TUNED_GROUP is checked as before
        C.block_k("w4a16", 64, {"BLOCK_K": 128})


@pytest.mark.parametrize(("t", "k"), [(0, 2), (3, 0)])
def test_no_pairs_give_zeros_in_the_kernel_and_the_reference(t, k):
    """T = 0 (an empty batch) or k = 0: no pair to route, y is [T, H] zeros (the reference's view of its zero pairs
    as [T, k, -1] was ambiguous and raised)."""
    g = torch.Generator().manual_seed(6)
    w13, w2 = make_experts("float", torch.float16, g)
    x = torch.randn(t, H, generator=g).half().to(DEVICE)
    weights, ids = torch.ones(t, k, device=DEVICE), torch.zeros(t, k, dtype=torch.int64, device=DEVICE)
    for y in (M.fused_moe(x, w13, w2, weights, ids), M.fused_moe_reference(x, w13, w2, weights, ids)):
        assert y.shape == (t, H) and y.dtype == x.dtype and not y.any()


def test_bad_tile_configs_are_one_line_errors():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, H).half().to(DEVICE)
    weights, ids = (t.to(DEVICE) for t in routed(2, 2, g))
    for fmt, block_k, match in [("w4a16", 64, "divid"), ("float", 24, "power of two"), ("fp8_block", 64, "B = 32")]:
        w13, w2 = make_experts(fmt, torch.float16, g)
        with pytest.raises(ValueError, match=match):
            M.fused_moe(x, w13, w2, weights, ids, config={**SMALL, "BLOCK_K": block_k})


def test_fused_moe_is_deterministic_and_reads_only_chosen_experts():
    """Experts no token chose hold NaN weights: the output stays finite (their blocks exit before any load)."""
    g = torch.Generator().manual_seed(3)
    w13, w2 = make_experts("float", torch.float16, g)
    x = torch.randn(1, H, generator=g).half().to(DEVICE)
    weights, ids = routed(1, 2, g)
    args = (x, w13, w2, weights.to(DEVICE), ids.to(DEVICE))
    ref = M.fused_moe_reference(*args)
    for e in set(range(E)) - set(ids.flatten().tolist()):
        w13.weight[e] = float("nan")
        w2.weight[e] = float("nan")
    y = M.fused_moe(*args, config=SMALL)
    assert torch.equal(y, M.fused_moe(*args, config=SMALL)) and not y.isnan().any()
    assert (y.float() - ref.float()).abs().max() <= 2**-10 * ref.float().abs().max()


@pytest.mark.parametrize(("fmt", "t"), [("float", 3), ("w4a16", 20)])  # 20 tokens: route, then align
def test_routed_moe_equals_route_then_fused_moe(fmt, t):
    g = torch.Generator().manual_seed(t)
    w13, w2 = make_experts(fmt, torch.float16, g)
    x, logits = torch.randn(t, H, generator=g).half().to(DEVICE), torch.randn(t, E, generator=g).to(DEVICE)
    y = M.routed_moe(x, logits, w13, w2, 2, config=SMALL)
    assert torch.equal(y, M.fused_moe(x, w13, w2, *M.route(logits, 2), config=SMALL))
    y = M.routed_moe(x, logits, w13, w2, 2)  # the path layer_config picks (by DECODE_MAX_TOKENS)
    assert torch.equal(
        y, M.fused_moe(x, w13, w2, *M.route(logits, 2), config=C.layer_config(t, 2, E, fmt, H, INTER, None))
    )
    with pytest.raises(ValueError, match=r"logits must be \[1, 8\]"):
        M.routed_moe(x[:1], logits, w13, w2, 2)
    with pytest.raises(ValueError, match="aligned must be align"):
        M.fused_moe(x, w13, w2, *M.route(logits, 2), config=SMALL, aligned=R.align(M.route(logits, 2)[1], E, 32))


def test_bad_operands_are_one_line_errors():
    g = torch.Generator().manual_seed(0)
    w13, w2 = make_experts("float", torch.float16, g)
    x = torch.randn(2, H).half().to(DEVICE)
    weights, ids = (t.to(DEVICE) for t in routed(2, 2, g))
    with pytest.raises(ValueError, match=r"float experts must be torch\.float32"):
        M.fused_moe(x.float(), w13, w2, weights, ids)
    with pytest.raises(ValueError, match=r"weights must be fp32"):
        M.fused_moe(x, w13, w2, weights.half(), ids)
    with pytest.raises(ValueError, match=r"need W13"):
        M.fused_moe(x, w2, w13, weights, ids)
    with pytest.raises(ValueError, match="top_k"):
        M.route(torch.randn(2, 4, device=DEVICE), 5)
    with pytest.raises(ValueError, match="groups of two"):
        M.route(torch.randn(2, 6, device=DEVICE), 2, "sigmoid", n_group=4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs)")
@pytest.mark.parametrize("t", [4, 600])  # 600 x 2 pairs: above ALIGN_KERNEL_MAX_PAIRS, the sort path
@pytest.mark.parametrize("routed", [False, True])  # routed_moe: routing and alignment in one launch at t = 4
@pytest.mark.parametrize("config", [None, {"DECODE": 1}], ids=["default", "decode"])
def test_layer_is_captured_in_a_cuda_graph_and_replays_new_routing(t, routed, config):
    """route + fused_moe read nothing back to the host: one capture serves every routing of T tokens."""
    g = torch.Generator().manual_seed(5)
    w13, w2 = make_experts("float", torch.bfloat16, g)
    x = torch.randn(t, H, generator=g).bfloat16().to(DEVICE)
    logits = torch.randn(t, E, generator=g).to(DEVICE)

    def layer():
        if routed:
            return M.routed_moe(x, logits, w13, w2, 2, config=config)
        weights, ids = M.route(logits, 2)
        return M.fused_moe(x, w13, w2, weights, ids, config=config)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer()  # compile off the capture stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer()
    for _ in range(3):
        logits.copy_(torch.randn(t, E, generator=g))
        x.copy_(torch.randn(t, H, generator=g))
        graph.replay()
        assert torch.equal(y, layer())
