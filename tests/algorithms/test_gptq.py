"""GPTQ (quantkit.algorithms.gptq): exactness against a one-column-at-a-time OBS reference, gains over RTN,
groups, act-order, dead inputs, dampening retries, and one real SmolLM2 layer (slow)."""

import logging

import pytest
import torch

from quantkit.algorithms.gptq import block_bounds, choose_grid, gptq, reconstruction_loss
from quantkit.algorithms.rtn import group_qparams, rtn
from quantkit.errors import QuantkitError
from quantkit.nn.qlinear import QuantLinear
from quantkit.quant import QuantScheme
from quantkit.quant.tensor import compute_qparams, quantize_with_qparams


def correlated_problem(n_out=64, k=96, n_tokens=2048, seed=0):
    """W [n_out, k] and H = 2 X^T X / n for inputs X with strongly correlated, unevenly scaled channels
    (what real activations look like: a few large channels, low effective rank)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5
    x = torch.randn(n_tokens, k, generator=g) @ mix + 0.05 * torch.randn(n_tokens, k, generator=g)
    x = x * (0.2 + 3 * torch.rand(k, generator=g))  # uneven channel scales
    w = 0.05 * torch.randn(n_out, k, generator=g)
    return w, 2 * x.t() @ x / n_tokens


def obs_reference(w, h, scheme, damp, act_order, static_groups):
    """GPTQ without its two tricks, in float64: explicit inverse Hessian, one column at a time (paper eq. 2-3,
    with the OBS downdate H^-1 <- H^-1 - H^-1[:, q] H^-1[q, :] / H^-1[q, q] after each column). Returns the
    dequantized Q [N, K] in original column order."""
    w, h = w.double().clone(), h.double().clone()
    k = w.shape[1]
    dead = h.diagonal() == 0
    h.diagonal()[dead] = 1
    w[:, dead] = 0
    g = scheme.group_of(k)
    static = static_groups or scheme.n_groups(k) == 1
    if static:
        s_static, z_static = group_qparams(w.float(), scheme)
    perm = torch.argsort(h.diagonal(), descending=True) if act_order else torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    h.diagonal().add_(damp * h.diagonal().mean())
    hinv = torch.linalg.inv(h)
    q_out = torch.zeros_like(w)
    for j in range(k):
        if static:
            s, z = s_static[:, perm[j] // g].double(), z_static[:, perm[j] // g].double()
        elif j % g == 0:
            s, z = compute_qparams(w[:, j : j + g].float(), scheme.bits, scheme.sym)
            s, z = s.double(), z.double()
        q = (quantize_with_qparams(w[:, j], s, z, scheme.maxq) - z) * s
        q_out[:, j] = q
        err = (w[:, j] - q) / hinv[j, j]
        w[:, j:] -= err[:, None] * hinv[j, j:][None, :]
        hinv = hinv - hinv[:, j : j + 1] @ hinv[j : j + 1, :] / hinv[j, j]
    return q_out[:, torch.argsort(perm)].float()


CASES = [  # (bits, group, act_order, static_groups, block_size)
    (4, -1, False, False, 128),
    (4, 32, False, False, 128),
    (4, 32, False, False, 20),  # blocks cut at group starts: 0,20,32,40,64,...
    (3, 40, True, False, 16),  # ragged: 96 = 2*40 + 16
    (3, 40, True, True, 16),
    (2, 32, True, False, 64),
    (4, -1, True, False, 32),
]


@pytest.mark.parametrize(("bits", "group", "act_order", "static", "block"), CASES)
@pytest.mark.parametrize("sym", [True, False])
def test_matches_one_column_at_a_time_reference(bits, group, act_order, static, block, sym):
    """Cholesky + lazy batch updates compute the same Q as the textbook update. fp32 vs fp64 can flip a code at
    an exact rounding tie, after which the two runs legitimately diverge a little, so require near-equality."""
    w, h = correlated_problem()
    scheme = QuantScheme(bits=bits, group_size=group, sym=sym)
    qw, info = gptq(w, h, scheme, damp=0.01, block_size=block, act_order=act_order, static_groups=static)
    ref = obs_reference(w, h, scheme, 0.01, act_order, static)
    same = (qw.dequantize() - ref).abs() <= 1e-5 * ref.abs().max()
    assert same.float().mean() > 0.99
    assert info["loss"] == pytest.approx(reconstruction_loss(w, ref, h), rel=0.02)


def test_dequantize_is_exactly_the_algorithms_q():
    """The returned QuantizedWeight, and the packed module built from it, reproduce the Q that GPTQ scored."""
    w, h = correlated_problem(k=100)
    scheme = QuantScheme(bits=4, group_size=32, sym=False)
    qw, info = gptq(w, h, scheme, act_order=True)
    assert reconstruction_loss(w, qw.dequantize(), h) == info["loss"]
    module = QuantLinear.from_quantized(qw, None, torch.float32)
    assert torch.equal(module.dequantize_weight(), qw.dequantize())


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group", [-1, 64, 32])
@pytest.mark.parametrize("act_order", [False, True])
def test_beats_rtn_on_correlated_inputs(bits, group, act_order):
    """On correlated inputs GPTQ's output error is well below RTN's: at most 0.7x at 3-4 bits (measured 0.31-0.58x),
    0.9x at 2 bits where small groups leave less to compensate (measured 0.42-0.82x)."""
    w, h = correlated_problem(seed=bits)
    scheme = QuantScheme(bits=bits, group_size=group, sym=False)
    _, info = gptq(w, h, scheme, act_order=act_order)
    rtn_loss = reconstruction_loss(w, rtn(w, scheme).dequantize(), h)
    assert info["loss"] < (0.9 if bits == 2 else 0.7) * rtn_loss


def test_diagonal_hessian_gives_rtn():
    """With independent inputs (H diagonal) there is nothing to compensate: GPTQ must round exactly like RTN."""
    w = torch.randn(32, 100, generator=torch.Generator().manual_seed(0))
    h = torch.diag(torch.rand(100, generator=torch.Generator().manual_seed(1)) + 0.5)
    scheme = QuantScheme(bits=3, group_size=32, sym=False)
    qw, _ = gptq(w, h, scheme, damp=0.0)
    ref = rtn(w, scheme)
    assert torch.equal(qw.q, ref.q) and torch.equal(qw.scales, ref.scales) and torch.equal(qw.zeros, ref.zeros)


def test_act_order_g_idx():
    """Plain act-order: columns taken by decreasing diag(H), groups are runs of G in that order, so g_idx maps
    each original column to (its rank) // G -- non-monotonic, every group full except the ragged last one."""
    w, h = correlated_problem(k=100)
    scheme = QuantScheme(bits=4, group_size=32)
    qw, _ = gptq(w, h, scheme, act_order=True)
    rank = torch.empty(100, dtype=torch.long)
    rank[torch.argsort(h.diagonal(), descending=True)] = torch.arange(100)
    assert torch.equal(qw.g_idx.long(), rank // 32)
    assert bool((qw.g_idx[1:] < qw.g_idx[:-1]).any()), "act-order g_idx should not be monotonic here"
    assert torch.bincount(qw.g_idx.long()).tolist() == [32, 32, 32, 4]
    assert qw.scales.shape == (64, 4)
    # the first group holds the largest-diag(H) columns
    assert set(qw.g_idx.eq(0).nonzero().flatten().tolist()) == set(h.diagonal().topk(32).indices.tolist())


def test_static_groups_keep_contiguous_groups_and_rtn_grid():
    """Static groups: grids computed up front from the original W, g_idx = k // G even with act-order."""
    w, h = correlated_problem(k=100)
    scheme = QuantScheme(bits=3, group_size=32, sym=False)
    for act_order in (False, True):
        qw, _ = gptq(w, h, scheme, act_order=act_order, static_groups=True)
        assert torch.equal(qw.g_idx, torch.arange(100, dtype=torch.int32) // 32)
        scales, zeros = group_qparams(w, scheme)
        assert torch.equal(qw.scales, scales) and torch.equal(qw.zeros, zeros.to(torch.int32))


def test_ragged_last_group_576_by_128():
    """SmolLM2's K = 576 with G = 128: five groups, the last one of 64 columns, in both orders."""
    w, h = correlated_problem(n_out=16, k=576, n_tokens=4096)
    scheme = QuantScheme(bits=4, group_size=128)
    for act_order in (False, True):
        qw, info = gptq(w, h, scheme, act_order=act_order)
        assert qw.scales.shape == (16, 5)
        assert torch.bincount(qw.g_idx.long()).tolist() == [128, 128, 128, 128, 64]
        assert info["loss"] < reconstruction_loss(w, rtn(w, scheme).dequantize(), h)
    assert block_bounds(576, 128, 128)[-1] == (512, 576)


def test_dead_inputs_get_zero_weights():
    w, h = correlated_problem(k=64)
    dead = torch.tensor([3, 17, 40])
    h[dead, :] = 0
    h[:, dead] = 0
    qw, info = gptq(w, h, QuantScheme(bits=4, group_size=32, sym=False), act_order=True)
    deq = qw.dequantize()
    assert info["dead_columns"] == 3
    assert torch.equal(deq[:, dead], torch.zeros(64, 3))
    assert torch.isfinite(deq).all()
    assert info["loss"] < reconstruction_loss(w, rtn(w, QuantScheme(bits=4, group_size=32, sym=False)).dequantize(), h)


def test_cholesky_failure_retries_with_more_dampening(caplog):
    """An indefinite H (smallest eigenvalue -5% of the mean diagonal) fails with damp 0.01 and succeeds after
    one retry at 0.1; the retry is logged and reported, and the result is still GPTQ (not RTN)."""
    w, h = correlated_problem(k=64)
    eig, vec = torch.linalg.eigh(h.double())
    eig[0] = -0.05 * h.diagonal().mean()
    bad = (vec * eig) @ vec.t()
    bad = ((bad + bad.t()) / 2).float()
    assert torch.linalg.cholesky_ex(bad + 0.01 * bad.diagonal().mean() * torch.eye(64)).info > 0
    scheme = QuantScheme(bits=4, group_size=-1)
    with caplog.at_level(logging.WARNING, logger="quantkit.algorithms.gptq"):
        qw, info = gptq(w, bad, scheme, damp=0.01)
    assert info["retries"] == 1
    assert info["damp"] == pytest.approx(0.1)
    assert "retrying with damp 0.1" in caplog.text
    assert not torch.equal(qw.q, rtn(w, scheme).q)


def test_hopeless_hessians_raise():
    w = torch.randn(8, 16)
    scheme = QuantScheme(bits=4, group_size=-1)
    with pytest.raises(QuantkitError, match="not positive definite"):
        gptq(w, -torch.eye(16), scheme)  # dampening a negative diagonal only makes it worse
    with pytest.raises(QuantkitError, match="NaN"):
        gptq(w, torch.full((16, 16), float("nan")), scheme)
    with pytest.raises(QuantkitError, match="all zero"):
        gptq(w, torch.zeros(16, 16), scheme)
    with pytest.raises(QuantkitError, match="integer"):
        gptq(w, torch.eye(16), QuantScheme(bits=8, group_size=-1, fmt="fp8"))


@pytest.mark.slow
def test_beats_rtn_on_a_real_smollm2_layer():
    """Real weights, real text: layer 3 of SmolLM2-135M, Hessians from 16 Brown windows of 512 tokens, scored on
    those tokens and on 8 held-out windows. Attention inputs have a low effective rank: GPTQ's gain carries over
    to held-out tokens (measured 0.38-0.46x RTN on both). down_proj's inputs (K = 1536, effective rank ~450) need
    more data: with 16 windows the gain is clear on the calibration tokens (0.64x) but gone on held-out ones
    (~1.07x; with 64 windows 0.90x), so only a bound against blowing up is asserted there."""
    import quantkit
    from quantkit.calib.data import calibration_windows
    from quantkit.calib.runner import LayerContext, capture_layer_inputs, decoder_layers
    from quantkit.models.arch import arch_for

    model, tokenizer, _ = quantkit.load_model("smollm2-135m")
    arch = arch_for(model)
    layers = decoder_layers(model, arch)
    windows, _ = calibration_windows(tokenizer, "brown", 24, 512, seed=0)
    target = 3
    names = ("self_attn.q_proj", "mlp.down_proj")
    hessians = []
    for split in (windows[:16], windows[16:]):
        hidden, kwargs = capture_layer_inputs(model, arch, list(split.split(4)), torch.device("cpu"))
        for i in range(target):
            hidden = LayerContext(i, "", layers[i], arch, hidden, kwargs[i], torch.device("cpu")).forward()
        ctx = LayerContext(target, "", layers[target], arch, hidden, kwargs[target], torch.device("cpu"))
        stats = ctx.collect({n: layers[target].get_submodule(n) for n in names})
        hessians.append({n: stats[n].hessian() for n in names})
    calib_h, held_h = hessians
    cases = [  # (linear, scheme, max GPTQ/RTN on calibration tokens, max on held-out tokens)
        ("self_attn.q_proj", QuantScheme(bits=4, group_size=128, sym=False), 0.6, 0.6),  # ragged 576 = 4*128 + 64
        ("self_attn.q_proj", QuantScheme(bits=3, group_size=64, sym=False), 0.6, 0.6),
        ("mlp.down_proj", QuantScheme(bits=4, group_size=-1, sym=False), 0.8, 1.25),
    ]
    for name, scheme, max_calib, max_held in cases:
        w = layers[target].get_submodule(name).weight.data
        qw, info = gptq(w, calib_h[name], scheme)
        ref = rtn(w, scheme).dequantize()
        ratio_calib = info["loss"] / reconstruction_loss(w, ref, calib_h[name])
        ratio_held = reconstruction_loss(w, qw.dequantize(), held_h[name]) / reconstruction_loss(w, ref, held_h[name])
        print(f"{name} {scheme.name}: GPTQ/RTN {ratio_calib:.3f} calibration, {ratio_held:.3f} held-out")
        assert ratio_calib < max_calib, (name, scheme.name, ratio_calib)
        assert ratio_held < max_held, (name, scheme.name, ratio_held)


@pytest.mark.parametrize("group", [-1, 32])
def test_mse_grids_lower_the_output_error_with_outliers(group):
    """With a few outlying weights per row, clipped grids (mse=True) leave GPTQ a lower output error."""
    w, h = correlated_problem(seed=7)
    w[:, ::23] *= 6
    scheme = QuantScheme(bits=4, group_size=group, sym=False)
    _, plain = gptq(w, h, scheme)
    _, clipped = gptq(w, h, scheme, mse=True)
    assert clipped["loss"] < plain["loss"]


def held_out_problem(seed: int, n_fit: int = 2048, n_held: int = 1024):
    """W [64, 96] and the Hessians of two disjoint sets of correlated inputs from one distribution (fit, held)."""
    g = torch.Generator().manual_seed(seed)
    k = 96
    mix = torch.randn(k, k, generator=g) / k**0.5
    x = torch.randn(n_fit + n_held, k, generator=g) @ mix * (0.2 + 3 * torch.rand(k, generator=g))
    w = 0.05 * torch.randn(64, k, generator=g)
    fit, held = x[:n_fit], x[n_fit:]
    return w, 2 * fit.t() @ fit / n_fit, 2 * held.t() @ held / n_held


def test_choose_grid_picks_the_grid_with_the_lower_held_out_error():
    """choose_grid fits GPTQ with both grids on one Hessian and judges them on the other: its answer is the
    grid whose held-out output error is lower, and it reports both errors."""
    scheme = QuantScheme(bits=4, group_size=-1, sym=False)
    w, h_fit, h_held = held_out_problem(7)
    w[:, ::23] *= 6
    mse, losses = choose_grid(w, h_fit, h_held, scheme)
    assert set(losses) == {"minmax", "mse"} and mse is (losses["mse"] < losses["minmax"])
    for grid, flag in (("minmax", False), ("mse", True)):
        q, _ = gptq(w, h_fit, scheme, mse=flag)
        assert losses[grid] == pytest.approx(reconstruction_loss(w, q.dequantize(), h_held), rel=1e-6)
    assert mse, "per-channel 4-bit with outlying weights: clipping lowers the held-out error"


def test_choose_grid_prefers_min_max_on_a_tie():
    """Weights on the 4-bit grid of step 1/64 with both ends present in every group: min-max reproduces them
    exactly (error 0), clipping cannot do better, so both held-out errors are 0 and min-max wins the tie."""
    scheme = QuantScheme(bits=4, group_size=32, sym=False)
    _, h_fit, h_held = held_out_problem(3)
    w = (torch.randint(0, 16, (64, 96), generator=torch.Generator().manual_seed(0)) - 8) / 64
    w[:, ::32], w[:, 1::32] = -8 / 64, 7 / 64  # every group spans the whole grid
    mse, losses = choose_grid(w, h_fit, h_held, scheme)
    assert losses == {"minmax": 0.0, "mse": 0.0} and not mse
