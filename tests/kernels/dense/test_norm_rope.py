"""The runtime's fused element-wise kernels against their PyTorch references (interpreter on CPU, GPU on the H200).

Each kernel rounds to the output dtype from fp32 (the add of add_rms_norm is exact in fp32 then rounded, like
a 16-bit add; the norm rounds twice, like the module), so results agree with the references to a unit in the last
place of the output dtype -- two in Triton's interpreter, whose fp32 -> bf16 cast truncates -- plus fp32 slack for
reductions done in another order.
"""

from __future__ import annotations

import pytest
import torch
import triton
from quantkit.kernels.dense import norm_rope as K

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def close(got, ref, dtype):
    ulp = 2 * torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5
    return bool(((got.float() - ref.float()).abs() <= ulp * ref.float().abs() + 1e-5).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "n"), [(1, 64), (5, 100), (3, 576)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(dtype, t, n, with_residual):
    x = torch.randn(t, n, device=DEVICE).to(dtype)
    r = torch.randn(t, n, device=DEVICE).to(dtype) if with_residual else None
    w = (torch.rand(n, device=DEVICE) + 0.5).to(dtype)
    y, h = K.add_rms_norm(x, w, 1e-5, r)
    h_ref = K.add_rms_norm_reference(x, w, 1e-5, r)[1]
    if DEVICE == "cuda" or dtype != torch.bfloat16:  # the sum is rounded once, to nearest, like a 16-bit add
        assert torch.equal(h, h_ref)
    else:  # the interpreter's bf16 cast truncates
        assert close(h, h_ref, dtype)
    assert close(y, K.add_rms_norm_reference(h, w, 1e-5)[0], dtype)  # the norm of the sum the kernel made


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "hq", "hkv", "d"), [(1, 4, 2, 16), (7, 9, 3, 64), (2, 20, 4, 128)])
def test_rotary(dtype, t, hq, hkv, d):
    q = torch.randn(t, hq, d, device=DEVICE).to(dtype)
    k = torch.randn(t, hkv, d, device=DEVICE).to(dtype)
    angle = torch.rand(t, d // 2, device=DEVICE) * 6
    cos = torch.cat((angle.cos(), angle.cos()), -1).to(dtype)
    sin = torch.cat((angle.sin(), angle.sin()), -1).to(dtype)
    q_ref, k_ref = q.clone(), k.clone()
    K.rotary_reference_(q_ref, k_ref, cos, sin)
    K.rotary_(q, k, cos, sin)
    assert close(q, q_ref, dtype) and close(k, k_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "hq", "hkv", "d"), [(1, 4, 2, 16), (5, 32, 8, 128)])
def test_rotary_of_fused_qkv_views_is_one_launch(dtype, t, hq, hkv, d, monkeypatch):
    """q and k as the fused q/k/v projection's split views (k's heads right after q's): rotated in one launch, v
    untouched; q and k of separate tensors (or in another order) still take one launch each."""
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEVICE).to(dtype)
    q, k, v = (p.view(t, -1, d) for p in qkv.split((hq * d, hkv * d, hkv * d), dim=-1))
    angle = torch.rand(t, d // 2, device=DEVICE) * 6
    cos = torch.cat((angle.cos(), angle.cos()), -1).to(dtype)
    sin = torch.cat((angle.sin(), angle.sin()), -1).to(dtype)
    q_ref, k_ref, v_ref = q.clone(), k.clone(), v.clone()
    K.rotary_reference_(q_ref, k_ref, cos, sin)
    launches = []
    kernel = K._rotary_kernel
    monkeypatch.setattr(
        K, "_rotary_kernel", type("Spy", (), {"__getitem__": lambda _, g: launches.append(g) or kernel[g]})()
    )
    K.rotary_(q, k, cos, sin)
    assert len(launches) == 1 and launches[0][1] == triton.cdiv(hq + hkv, min(16, triton.next_power_of_2(hq + hkv)))
    assert close(q, q_ref, dtype) and close(k, k_ref, dtype) and torch.equal(v, v_ref)
    K.rotary_(k.clone(), q.clone(), cos, sin)  # separate tensors: one launch each
    K.rotary_(q.clone(), k.clone(), cos, sin)
    assert len(launches) == 5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "n"), [(1, 64), (3, 3000)])
def test_silu_mul(dtype, t, n):
    g = (torch.randn(t, n, device=DEVICE) * 4).to(dtype)
    u = torch.randn(t, n, device=DEVICE).to(dtype)
    assert close(K.silu_mul(g, u), K.silu_mul_reference(g, u), dtype)


def test_shape_errors():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        K.add_rms_norm(x, torch.ones(7, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        K.add_rms_norm(x, torch.ones(8, device=DEVICE), 1e-5, torch.randn(3, 8, device=DEVICE))
    with pytest.raises(ValueError, match="power of two"):
        K.rotary_(torch.randn(2, 1, 6, device=DEVICE), torch.randn(2, 1, 6, device=DEVICE), x[:, :6], x[:, :6])
    with pytest.raises(ValueError, match="equal"):
        K.silu_mul(x, x[:1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "hq", "hkv", "d", "page"), [(1, 4, 2, 16, 4), (6, 9, 3, 64, 16), (3, 32, 8, 128, 16)])
def test_rotary_store_rotates_and_fills_the_cache_in_one_launch(dtype, t, hq, hkv, d, page, monkeypatch):
    """On the fused q/k/v views: q and k rotated in place as rotary_ does, the rotated k and v written into exactly
    the mapped cache slots (padding rows, slot -1, store nothing) as store_kv does, v untouched, one launch."""
    from quantkit.kernels.attention.paged import store_kv_reference

    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEVICE).to(dtype)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    angle = torch.rand(t, d // 2, device=DEVICE) * 6
    cos = torch.cat((angle.cos(), angle.cos()), -1).to(dtype)
    sin = torch.cat((angle.sin(), angle.sin()), -1).to(dtype)
    blocks = 2 * t // page + 2
    poison = torch.full((blocks, page, hkv, d), 7.0, device=DEVICE, dtype=dtype)
    slots = torch.randperm(blocks * page, device=DEVICE)[:t].to(torch.int32)
    slots[t // 2] = -1  # a padding row
    q_ref, k_ref, v_ref = q.clone(), k.clone(), v.clone()
    K.rotary_reference_(q_ref, k_ref, cos, sin)
    kc_ref, vc_ref = poison.clone(), poison.clone()
    store_kv_reference(k, v, kc_ref, vc_ref, slots)  # unrotated k: only the slots matter here
    kc, vc = poison.clone(), poison.clone()
    launches = []
    real = K._rotary_store_kernel
    monkeypatch.setattr(K, "_rotary_store_kernel", type("Spy", (), {"__getitem__": lambda s, g: launches.append(g)
                                                                    or real[g]})())  # fmt: skip
    assert K.rotary_store_(q, k, v, cos, sin, kc, vc, slots)
    assert len(launches) == 1
    assert close(q, q_ref, dtype) and close(k, k_ref, dtype) and torch.equal(v, v_ref)
    keep = slots >= 0
    filled = torch.zeros(blocks * page, dtype=torch.bool, device=DEVICE)
    filled[slots[keep].long()] = True
    assert torch.equal(kc.view(-1, hkv, d)[~filled], poison.view(-1, hkv, d)[~filled])  # nothing else written
    assert torch.equal(vc, vc_ref)
    assert torch.equal(kc.view(-1, hkv, d)[slots[keep].long()], k[keep])  # the rotated k, as the kernel left it


def test_rotary_store_declines_separate_tensors():
    q = torch.randn(2, 4, 16, device=DEVICE)
    k = torch.randn(2, 2, 16, device=DEVICE)
    v = torch.randn(2, 2, 16, device=DEVICE)
    cos = sin = torch.ones(2, 16, device=DEVICE)
    cache = torch.zeros(4, 4, 2, 16, device=DEVICE)
    slots = torch.arange(2, device=DEVICE, dtype=torch.int32)
    before = q.clone()
    assert not K.rotary_store_(q, k, v, cos, sin, cache, cache.clone(), slots)
    assert torch.equal(q, before) and not cache.any()
    with pytest.raises(ValueError, match="disagree"):
        K.rotary_store_(q, k, v[:1], cos, sin, cache, cache.clone(), slots)


def test_rotary_keeps_adjacent_allocations_apart():
    """q and k allocated apart but back to back in memory (as Qwen3's q/k norm outputs often are on the GPU) are
    two operands, never one view reaching past q's storage; k and v after them are not taken for a fused row."""
    import numpy as np

    memory = np.random.default_rng(0).standard_normal(1 * (4 + 2 + 2) * 16).astype(np.float32)
    q, k, v = (torch.from_numpy(memory[a:b]).view(1, -1, 16) for a, b in ((0, 64), (64, 96), (96, 128)))
    assert k.data_ptr() == q.data_ptr() + q.numel() * 4  # adjacent, yet separate storages
    assert len(K._rotary_operands(q, k)) == 2
    cache = torch.zeros(4, 4, 2, 16)
    assert not K.rotary_store_(q, k, v, torch.ones(1, 16), torch.ones(1, 16), cache, cache.clone(),
                               torch.zeros(1, dtype=torch.int32))  # fmt: skip
    fused = torch.from_numpy(memory).view(1, 8, 16)
    assert len(K._rotary_operands(fused[:, :4], fused[:, 4:6])) == 1  # views of one buffer: one launch
