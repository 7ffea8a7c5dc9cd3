"""W8A8Linear: buffers, RTN construction, and the agreement of its simulated and integer execution paths.

Both paths quantize the activations identically (checked bit for bit through the shared reference quantizer) and
differ only in fp32 arithmetic before the final rounding to the output dtype: the integer path accumulates exactly
and scales afterwards; the simulated path multiplies fake-quantized fp32 operands, each product and partial sum
rounded. So each output is within one output-dtype ulp (eps * |ref|, from the two final roundings) plus the
fp32 dot-product bound K * eps(fp32) * sum_k |x_fq * w_dq| of the float64 result, which is the tolerance used.
"""

from __future__ import annotations

import pytest
import torch
from quantkit.kernels import w8a8 as K
from torch import nn
from transformers import AutoModelForCausalLM

import quantkit
from quantkit.algorithms.fp8 import dequantize_fp8, quantize_fp8
from quantkit.algorithms.rtn import rtn
from quantkit.errors import QuantkitError
from quantkit.nn.w8a8 import Execution, W8A8Linear, set_execution, static_input_scale
from quantkit.presets import preset_recipe
from quantkit.quant.packing import Layout
from quantkit.quant.scheme import QuantScheme
from tests.tiny_models import tiny_model

F32_EPS = torch.finfo(torch.float32).eps


def scheme(fmt="int", dynamic=True) -> QuantScheme:
    return QuantScheme(bits=8, group_size=-1, sym=True, fmt=fmt, act_bits=8, act_dynamic=dynamic)


def make_linear(k, n, bias=True, dtype=torch.float32, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(torch.linspace(0.2, 3.0, n)[:, None])  # channels of different ranges
    return lin.to(dtype)


def build(fmt, dynamic, k=96, n=40, bias=True, dtype=torch.float32, seed=0) -> W8A8Linear:
    lin = make_linear(k, n, bias, dtype, seed)
    input_scale = None if dynamic else static_input_scale(4.0, scheme(fmt, dynamic))
    return W8A8Linear.from_float(lin, scheme(fmt, dynamic), input_scale)


def exact_output(mod: W8A8Linear, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 output from the module's quantized operands, and the magnitude sum_k |x_fq * w_dq| per output."""
    qa, a_scale = mod.quantize_input(x2)
    x_fq = qa.double() * a_scale.double().reshape(-1, 1)
    w_dq = mod.weight.double() * mod.weight_scale.double()[:, None]
    y = x_fq @ w_dq.t()
    if mod.bias is not None:
        y = y + mod.bias.double()
    return y, x_fq.abs() @ w_dq.abs().t()


def assert_within_contract(y: torch.Tensor, mod: W8A8Linear, x2: torch.Tensor) -> None:
    ref, mag = exact_output(mod, x2)
    k = x2.shape[1]
    tol = torch.finfo(y.dtype).eps * ref.abs() + (k + 4) * F32_EPS * mag + torch.finfo(y.dtype).tiny
    if y.is_cuda and mod.fmt == "fp8":  # Hopper fp8 tensor cores: ~14-bit accumulation within each BLOCK_K <= 256
        tol = tol + (k if mod.fp8_fast_accum else 256) * 2.0**-14 * mag  # fast: the whole K in that adder
    err = (y.double() - ref).abs()
    assert (err <= tol).all(), f"max error {err.max().item():.3g} exceeds the stated tolerance"


@pytest.mark.parametrize("fmt", ["int", "fp8"])
@pytest.mark.parametrize("dynamic", [True, False])
def test_buffers_shapes_dtypes_and_layout(fmt, dynamic):
    mod = build(fmt, dynamic)
    assert mod.layout == (Layout.INT8_ROWMAJOR if fmt == "int" else Layout.FP8_ROWMAJOR)
    assert W8A8Linear.layout == Layout.INT8_ROWMAJOR
    assert mod.weight.shape == (40, 96)
    assert mod.weight.dtype == (torch.int8 if fmt == "int" else torch.float8_e4m3fn)
    assert mod.weight_scale.shape == (40,) and mod.weight_scale.dtype == torch.float32
    assert mod.bias.shape == (40,)
    names = set(dict(mod.named_buffers()))
    assert names == {"weight", "weight_scale", "bias"} | (set() if dynamic else {"input_scale"})
    if not dynamic:
        assert mod.input_scale.shape == (1,)
        assert mod.input_scale.item() == pytest.approx(4.0 / K.QMAX_OF_FORMAT[mod.fmt])
    fresh = W8A8Linear(96, 40, scheme(fmt, dynamic), bias=True, dtype=torch.float32)
    fresh.load_state_dict(mod.state_dict())
    assert torch.equal(fresh.dequantize_weight(), mod.dequantize_weight())


def test_int8_rtn_error_is_at_most_half_a_step():
    lin = make_linear(96, 40, bias=False)
    mod = W8A8Linear.from_float(lin, scheme("int"))
    w = lin.weight.detach()
    step = w.abs().amax(1) / 127  # [N]
    assert mod.weight.abs().max().item() == 127  # the abs-max of every row maps to +-127
    err = (mod.dequantize_weight() - w).abs()
    assert (err <= step[:, None] / 2 * (1 + 1e-5)).all()


def test_fp8_quantizer_is_the_module_grid_and_round_trips():
    lin = make_linear(96, 40, bias=False)
    mod = W8A8Linear.from_float(lin, scheme("fp8"))
    q, s = quantize_fp8(lin.weight.detach())
    assert torch.equal(q.view(torch.uint8), mod.weight.view(torch.uint8)) and torch.equal(s, mod.weight_scale)
    w = lin.weight.detach()
    # e4m3: 3 mantissa bits, so rounding to nearest errs by at most 2**-4 relative (normals) and by half the
    # subnormal spacing 2**-10 of the scale below the smallest normal 2**-6
    err = (dequantize_fp8(q, s) - w).abs()
    assert (err <= torch.maximum(w.abs() * 2**-4, s[:, None] * 2**-10) * (1 + 1e-5)).all()
    qt, st = quantize_fp8(w, granularity="tensor")
    assert st.shape == (1,) and st.item() == pytest.approx(w.abs().max().item() / 448)
    assert (dequantize_fp8(qt, st) - w).abs().max() <= w.abs().max() * 2**-4
    with pytest.raises(ValueError, match="granularity"):
        quantize_fp8(w, granularity="row")
    with pytest.raises(ValueError, match="block_size"):
        quantize_fp8(w, granularity="block", block_size=0)


def test_zero_rows_quantize_to_zero_without_nan():
    lin = make_linear(32, 8, bias=False)
    with torch.no_grad():
        lin.weight[3] = 0
    mod = W8A8Linear.from_float(lin, scheme("int"))
    mod.execution = "integer"
    x = torch.randn(4, 32)
    x[1] = 0
    y = mod(x)
    assert torch.isfinite(y).all() and not y[1].any() and not y[:, 3].any()


@pytest.mark.parametrize("dynamic", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k,n", [(1, 96, 40), (7, 100, 33), (33, 257, 70)])
def test_int8_simulated_and_integer_paths_agree(dynamic, dtype, m, k, n):
    mod = build("int", dynamic, k=k, n=n, dtype=dtype, seed=m)
    x = (torch.randn(m, k) * 2).to(dtype)
    y_sim = mod(x)
    mod.execution = Execution.INTEGER
    y_int = mod(x)
    assert y_sim.dtype == y_int.dtype == dtype
    assert_within_contract(y_sim, mod, x)
    assert_within_contract(y_int, mod, x)
    # the integer path's only fp32 work is the epilogue: it meets the same bound with no K term
    ref, mag = exact_output(mod, x)
    tight = torch.finfo(dtype).eps * ref.abs() + 4 * F32_EPS * mag + torch.finfo(dtype).tiny
    assert ((y_int.double() - ref).abs() <= tight).all()


@pytest.mark.parametrize("dynamic", [True, False])
def test_fp8_simulated_path_and_missing_cpu_integer_path(dynamic):
    mod = build("fp8", dynamic, dtype=torch.bfloat16)
    x = torch.randn(2, 3, 96, dtype=torch.bfloat16)
    y = mod(x)
    assert y.shape == (2, 3, 40)
    assert_within_contract(y.reshape(6, 40), mod, x.reshape(6, 96))
    mod.execution = "integer"
    with pytest.raises(QuantkitError, match="no integer fp8 W8A8 path for a cpu input"):
        mod(x)


def test_quantized_output_stays_close_to_float():
    # a sanity bound, not a numerics contract: 8-bit per-token x per-channel on Gaussian data loses < 2%
    lin = make_linear(256, 64, bias=True)
    x = torch.randn(16, 256)
    ref = lin(x).detach()
    for fmt in ("int", "fp8"):
        y = W8A8Linear.from_float(lin, scheme(fmt))(x)
        assert ((y - ref).norm() / ref.norm()).item() < (0.01 if fmt == "int" else 0.05)


def test_from_quantized_takes_gptq_style_codes():
    lin = make_linear(64, 16, bias=False)
    qw = rtn(lin.weight.detach(), scheme("int"))  # codes in [0, 255], zero point 128, one group per channel
    mod = W8A8Linear.from_quantized(qw, None, torch.float32)
    assert mod.weight.dtype == torch.int8
    assert torch.equal(mod.dequantize_weight(), qw.dequantize())


def test_configuration_errors_are_clear():
    lin = make_linear(32, 8)
    with pytest.raises(QuantkitError, match="need a calibrated input_scale"):
        W8A8Linear.from_float(lin, scheme("int", dynamic=False))
    with pytest.raises(QuantkitError, match="only for static activations"):
        W8A8Linear.from_float(lin, scheme("int"), input_scale=0.1)
    with pytest.raises(QuantkitError, match="one positive number"):
        W8A8Linear.from_float(lin, scheme("int", dynamic=False), input_scale=-1.0)
    with pytest.raises(QuantkitError, match="act_bits=8"):
        W8A8Linear(32, 8, QuantScheme(bits=8, group_size=-1))
    mod = W8A8Linear.from_float(lin, scheme("int"))
    with pytest.raises(QuantkitError, match="execution must be one of"):
        mod.execution = "fast"
    model = nn.Sequential(mod, nn.ReLU(), W8A8Linear.from_float(make_linear(8, 4), scheme("fp8")))
    assert set_execution(model, "integer") == 2 and model[2].execution is Execution.INTEGER


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_fp8_fast_accumulation_setting():
    model = nn.Sequential(build("fp8", True), build("fp8", True), nn.Linear(4, 4))
    assert set_execution(model, "integer", fp8_fast_accum=True) == 2
    assert all(m.fp8_fast_accum for m in model[:2]) and "fp8_fast_accum=True" in repr(model[0])
    set_execution(model, "simulated")  # None leaves the setting alone
    assert model[0].fp8_fast_accum and model[0].execution is Execution.SIMULATED
    model[1].fp8_fast_accum = False
    with pytest.raises(ValueError, match="one scheme, input width, dtype and execution"):
        W8A8Linear.concat([model[0], model[1]])
    model[1].fp8_fast_accum = True
    assert W8A8Linear.concat([model[0], model[1]]).fp8_fast_accum


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt,fast", [("int", False), ("fp8", False), ("fp8", True)])
@pytest.mark.parametrize("dynamic", [True, False])
def test_gpu_triton_integer_path_agrees_with_simulated(fmt, fast, dynamic):
    mod = build(fmt, dynamic, k=4096 + 32, n=520, dtype=torch.bfloat16).cuda()
    x = torch.randn(3, 37, 4096 + 32, dtype=torch.bfloat16, device="cuda")
    y_sim = mod(x)
    set_execution(mod, "integer", fp8_fast_accum=fast)
    y_int = mod(x)
    x2 = x.reshape(-1, x.shape[-1])
    assert_within_contract(y_sim.reshape(x2.shape[0], -1), mod, x2)
    assert_within_contract(y_int.reshape(x2.shape[0], -1), mod, x2)


# W8A8 through the pipeline: int8 and fp8, dynamic and static activations, saved and reloaded.


@pytest.mark.parametrize("fmt", ["int", "fp8"])
@pytest.mark.parametrize("dynamic", [True, False])
def test_w8a8_quantize_save_reload(fmt, dynamic, tmp_path):
    model = tiny_model("qwen2")
    ids = torch.randint(3, 320, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    calib = torch.randint(3, 320, (4, 32), generator=torch.Generator().manual_seed(1))
    recipe = preset_recipe("w8a8", {"fmt": fmt, "act_dynamic": dynamic})
    quantkit.quantize(model, recipe, calib if recipe.needs_calibration else None)
    layers = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    assert len(layers) == 14 and all(m.scheme.fmt == fmt for m in layers)
    assert all((m.input_scale is None) == dynamic for m in layers)
    with torch.no_grad():
        out = model(ids).logits
    assert (out - ref).abs().mean() < 0.05 * ref.abs().mean()  # 8-bit weights and activations stay close
    reloaded = AutoModelForCausalLM.from_pretrained(quantkit.save_quantized(model, tmp_path / "q")).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, out, rtol=0, atol=0)


def test_block_fp8_module_paths_agree_and_track_the_float_layer():
    lin = make_linear(160, 70, bias=True)
    mod = W8A8Linear.from_float(lin, QuantScheme(bits=8, group_size=-1, fmt="fp8", act_bits=8, block_size=32))
    assert mod.scheme.name == "w8a8-fp8-block32" and mod.weight_scale.shape == (3, 5)
    q, s = quantize_fp8(lin.weight.detach(), "block", 32)
    assert torch.equal(q.view(torch.uint8), mod.weight.view(torch.uint8)) and torch.equal(s, mod.weight_scale)
    x = torch.randn(6, 160)
    y_sim = mod(x)
    mod.execution = "integer"
    y_int = mod(x)
    # the same codes in both paths: they differ by fp32 summation order only
    assert torch.allclose(y_sim, y_int, rtol=1e-5, atol=1e-5)
    ref = lin(x)
    assert ((y_int - ref).norm() / ref.norm()) < 0.05  # e4m3 rounding of both operands: ~3-4% RMS
    even = W8A8Linear.from_float(make_linear(160, 64, seed=1), mod.scheme)
    even.execution = "integer"
    both = W8A8Linear.concat([even, mod])  # a ragged last part is fine: its blocks stay its own
    assert torch.allclose(both(x), torch.cat([even(x), y_int], dim=1))
    with pytest.raises(ValueError, match="whole 32-row blocks"):
        W8A8Linear.concat([mod, even])


@pytest.mark.parametrize(
    "changes, fragment",
    [({"block_size": 100}, "power of two from 16 to 512"), ({"block_size": 128, "fmt": "int"}, "block_size is for fp8"),
     ({"block_size": 128, "act_dynamic": False}, "block_size is for fp8"), ({"block_size": True}, "power of two")],
)  # fmt: skip
def test_block_scheme_refuses_what_the_block_gemm_cannot_run(changes, fragment):
    base = {"bits": 8, "group_size": -1, "fmt": "fp8", "act_bits": 8}
    with pytest.raises(QuantkitError, match=fragment):
        QuantScheme.from_dict({**base, **changes})
    assert QuantScheme.from_dict({**base, "block_size": 128}).name == "w8a8-fp8-block"
    assert "block_size" not in QuantScheme.from_dict(base).to_dict()  # per-channel configs read as before
