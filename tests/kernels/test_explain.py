"""``quantkit.kernels.explain``: what it names comes from the families' dispatch tables, for any described GPU."""

from __future__ import annotations

import pytest
import torch
import triton
from quantkit.kernels import GPU, explain
from quantkit.kernels.w4a8 import dispatch as w4a8_dispatch
from quantkit.kernels.w4a16 import dispatch as w4a16_dispatch
from quantkit.kernels.w4a16.problem import Product as W4A16Product
from quantkit.kernels.w8a8 import dispatch as w8a8_dispatch
from quantkit.kernels.w8a8.problem import Product as W8A8Product

from quantkit.quant import QuantScheme

H200 = GPU((9, 0), 132, name="H200")


@pytest.fixture
def triton_36(monkeypatch):
    monkeypatch.setattr(triton, "__version__", "3.6.0")  # the Triton the Gluon kernels are written for


def test_the_package_exports_the_function():
    import quantkit.kernels

    assert quantkit.kernels.explain is explain and callable(explain)


@pytest.mark.parametrize("m", [1, 4, 16, 32, 64, 128, 256, 1024])
def test_w4a16_names_the_dispatch_tables_plan(triton_36, m):
    plan = w4a16_dispatch.choose(W4A16Product.dense(m, 8192, 8192, 4, 128, torch.float16, H200))
    text = explain(m, 8192, 8192, "w4a16-g128", H200)
    assert text.endswith(str(plan)) and plan.config.name in text
    assert f"M = {m} on a 8192 x 8192 layer" in text and "H200 (sm_90, 132 SMs)" in text


def test_the_choice_follows_the_table_not_a_copy(triton_36, monkeypatch):
    assert "[mma_gemv:" in explain(1, 4096, 4096, "w4a16-g128", H200)
    monkeypatch.setattr(w4a16_dispatch, "PATHS", w4a16_dispatch.PATHS[-1:])
    assert "[table: gemv-" in explain(1, 4096, 4096, "w4a16-g128", H200)
    assert "[ws:" in explain(4096, 4096, 4096, "w8a8-fp8", H200)
    monkeypatch.setattr(w8a8_dispatch, "PATHS", w8a8_dispatch.PATHS[-1:])
    assert "[tiles:" in explain(4096, 4096, 4096, "w8a8-fp8", H200)


def test_other_devices_and_tritons_take_the_triton_kernels(monkeypatch):
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    assert "[table: gemv-" in explain(1, 4096, 4096, "w4a16-g128", H200)
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert "[table:" in explain(64, 8192, 8192, "w4a16-g128", GPU((8, 0), 108))


def test_w8a8_names_config_fetch_and_launch_options(triton_36):
    plan = w8a8_dispatch.choose(W8A8Product.dense(32, 4096, 4096, "int8", torch.float16, H200, pdl=True))
    text = explain(32, 4096, 4096, "w8a8-int8", H200)
    assert str(plan) in text and "programmatic dependent launch" in text and "L2 prefetch 4 K tiles ahead" in text
    assert "programmatic" not in explain(512, 4096, 4096, "w8a8-int8", H200)
    assert "fast" in explain(4096, 4096, 4096, "w8a8-fp8-fast", H200) and "[tiles:" in explain(
        4096, 4096, 4096, "w8a8-fp8-fast", H200
    )


def test_schemes_as_quantschemes_and_strings(triton_36):
    by_object = explain(16, 4096, 4096, QuantScheme(bits=4, group_size=64), H200)
    assert by_object.split(": ", 1)[1] == explain(16, 4096, 4096, "w4a16-g64", H200).split(": ", 1)[1]
    w8a8 = QuantScheme(bits=8, group_size=-1, act_bits=8, fmt="fp8")
    assert (
        explain(4096, 4096, 4096, w8a8, H200).split(": ", 1)[1]
        == explain(4096, 4096, 4096, "w8a8-fp8", H200).split(": ", 1)[1]
    )
    assert "w4a16-pc" in explain(1, 4096, 4096, "w4a16-pc", H200)
    assert (
        explain(1, 4096, 4096, "w4a16-g-1", H200).split(": ", 1)[1]
        == explain(1, 4096, 4096, "w4a16-pc", H200).split(": ", 1)[1]
    )
    assert "no kernel (3-bit" in explain(1, 4096, 4096, QuantScheme(bits=3), H200)
    assert "not a multiple of 32" in explain(1, 4096, 4096, "w4a16-g48", H200)
    with pytest.raises(ValueError, match="expected 'w4a16-g128'"):
        explain(1, 64, 64, "int4", H200)
    with pytest.raises(ValueError, match="QuantScheme-like"):
        explain(1, 64, 64, object(), H200)


def test_cpu_and_float_answers():
    assert "dequantizes W" in explain(1, 4096, 4096, "w4a16-g128", "cpu")
    assert "simulated" in explain(8, 4096, 4096, "w8a8-fp8", "cpu") and "no CPU path" in explain(
        8, 4096, 4096, "w8a8-fp8", "cpu"
    )
    assert "torch._int_mm" in explain(8, 4096, 4096, "w8a8-int8", torch.device("cpu"))
    assert "float GEMV" in explain(1, 4096, 4096, "float", H200, torch.bfloat16)
    assert explain(2, 4096, 4096, "float", H200).split(": ", 1)[1] == "F.linear (cuBLAS)"
    assert explain(1, 128256, 4096, "float", H200).split(": ", 1)[1] == "F.linear (cuBLAS)"  # the lm_head
    with pytest.raises(ValueError, match="positive"):
        explain(0, 64, 64, "float", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA on a machine without it")
def test_cuda_without_a_gpu_says_how_to_ask():
    with pytest.raises(ValueError, match="GPU description"):
        explain(1, 64, 64, "float", "cuda")


@pytest.mark.parametrize("m", [1, 16, 256, 4096])
@pytest.mark.parametrize("progressive", [False, True])
def test_w4a8_names_its_own_dispatch_plan(m, progressive):
    """W4A8 layers (8-bit activations, 4-bit weights) are W4A8's plan, not W8A8's; progressive weights its table."""
    plan = w4a8_dispatch.choose(m, 8192, 8192, 128, H200.sms, progressive=progressive)
    name = "w4a8-int8-g128" + ("-progressive" if progressive else "")
    text = explain(m, 8192, 8192, name, H200)
    assert text.startswith(name + ",") and text.endswith(str(plan)) and "per token to int8" in text
    scheme = QuantScheme(bits=4, group_size=128, act_bits=8, progressive=progressive)
    assert explain(m, 8192, 8192, scheme, H200).split(": ", 1)[1] == text.split(": ", 1)[1]


def test_w4a8_strings_and_cpu_answers():
    assert "per token to fp8" in explain(64, 4096, 4096, QuantScheme(bits=4, act_bits=8, act_fmt="fp8"), H200)
    pc = explain(1, 4096, 4096, "w4a8-int8-pc", H200)
    assert pc.split(": ", 1)[1] == explain(1, 4096, 4096, "w4a8-int8-g4096", H200).split(": ", 1)[1]
    assert "W4A8Linear simulated" in explain(8, 4096, 4096, "w4a8-fp8-g128-sym", "cpu")
    assert "ProgressiveW4A8Linear simulated" in explain(8, 4096, 4096, "w4a8-int8-g128-progressive", "cpu")
    with pytest.raises(ValueError, match="int8 activations"):
        explain(1, 64, 64, "w4a8-fp8-g128-progressive", H200)
