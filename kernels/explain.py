"""``explain(m, n, k, scheme, device)``: which kernel and config serve a product of M rows on an [N, K] layer.

The answer comes from the families' own dispatch tables (``w4a16.dispatch.choose``, ``w8a8.dispatch.choose``,
``w4a8.dispatch.choose``) and
rules (``w4a16.weight.unsupported_reason``, ``dense.gemv.serves``), asked about a ``Product`` built from the sizes,
so it is what ``w4a16_linear``, ``w8a8_linear``, ``w4a8_linear`` and the runtime's float layers would run for
contiguous operands.

``scheme``: a ``QuantScheme`` or any object with its fields (``bits``, ``group_size``, ``fmt``, ``act_bits``), or a
short string: "w4a16-g128" (also "w8a16-g64", "w4a16-pc" or "w4a16-g-1" for one group per output channel, and
``QuantScheme.name``'s "-sym" / "-asym" suffixes), "w8a8-int8", "w8a8-fp8" (a "-fast" suffix: fp8 with fast
accumulation), "w4a8-int8-g128" / "w4a8-fp8-g128" (W4A8; "-pc" per channel, "-progressive": QServe's format,
int8 only), or "float". ``device``: "cpu", "cuda" (the current GPU; "cuda:1" another), a ``torch.device``, or a
``GPU`` description (compute capability, SM count), so that a CPU machine can ask about a GPU it does not have.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from quantkit.kernels._device import GPU, device_of

# The families are imported when a product of theirs is explained: ``quantkit.kernels`` exports ``explain``, and its
# import stays as light as ``_device`` (the W4A16 family loads its Gluon modules).

_WEIGHT_ONLY = re.compile(r"w(\d+)a16(?:-(?:g(-?\d+)|pc))?(?:-(?:sym|asym))?")
_W8A8 = re.compile(r"w8a8-(int8|fp8)(?:-(?:dynamic|static))?(-fast)?")
_W4A8 = re.compile(r"w4a8-(int8|fp8)(?:-(?:g(-?\d+)|pc))?(?:-(sym|asym|progressive))?")


@dataclass(frozen=True)
class _Scheme:
    kind: str  # "float", "weight_only", "w8a8" or "w4a8"
    bits: int = 16
    group_size: int = -1  # -1: one group per output channel
    fmt: str = "int8"  # w8a8 and w4a8 activations: "int8" or "fp8"
    fast: bool = False
    name: str = "float"
    progressive: bool = False  # w4a8: QServe's two-level weights


def _scheme(scheme) -> _Scheme:
    if isinstance(scheme, str):
        text = scheme.strip().lower()
        if text in ("float", "fp16", "bf16", "none", "w16a16"):
            return _Scheme("float")
        if match := _W8A8.fullmatch(text):
            return _Scheme("w8a8", 8, -1, match[1], bool(match[2]), f"w8a8-{match[1]}" + ("-fast" if match[2] else ""))
        if match := _W4A8.fullmatch(text):
            group = -1 if match[2] is None and "-pc" in text else int(match[2] or 128)
            progressive = match[3] == "progressive"
            if progressive and match[1] != "int8":
                raise ValueError(f"scheme {scheme!r}: progressive W4A8 takes int8 activations")
            name = f"w4a8-{match[1]}-" + ("pc" if group == -1 else f"g{group}") + ("-progressive" * progressive)
            return _Scheme("w4a8", 4, group, match[1], progressive=progressive, name=name)
        if match := _WEIGHT_ONLY.fullmatch(text):
            group = -1 if match[2] is None and "-pc" in text else int(match[2] or 128)
            name = f"w{match[1]}a16-" + ("pc" if group == -1 else f"g{group}")
            return _Scheme("weight_only", int(match[1]), group, name=name)
        raise ValueError(
            f"scheme {scheme!r}: expected 'w4a16-g128' (w<bits>a16-g<group> or -pc), 'w8a8-int8', 'w8a8-fp8', "
            "'w4a8-int8-g128' (w4a8-<int8|fp8>-g<group>[-progressive]) or 'float', or a QuantScheme"
        )
    try:
        bits, group, act_bits = scheme.bits, scheme.group_size, scheme.act_bits
        fmt = getattr(scheme, "fmt", "int")
    except AttributeError as err:
        raise ValueError(f"scheme must be a string or QuantScheme-like (bits, group_size, act_bits): {err}") from None
    name = getattr(scheme, "name", None) or type(scheme).__name__
    if act_bits is not None and bits == 4:
        act = "fp8" if getattr(scheme, "act_fmt", "int") == "fp8" else "int8"
        return _Scheme("w4a8", 4, group, act, progressive=bool(getattr(scheme, "progressive", False)), name=name)
    if act_bits is not None:
        return _Scheme("w8a8", 8, -1, "fp8" if fmt == "fp8" else "int8", name=name)
    if fmt == "fp8":
        return _Scheme("weight_only", 8, group, "fp8", name=name)
    return _Scheme("weight_only", bits, group, name=name)


def _device(device) -> GPU | None:
    if isinstance(device, GPU) or device is None:
        return device
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be 'cpu', 'cuda', a torch.device or a GPU description, got {device!r}") from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda': no CUDA device here; pass a GPU description, e.g. GPU((9, 0), 132)")
    return device_of(dev)


def explain(m: int, n: int, k: int, scheme, device="cuda", dtype: torch.dtype = torch.float16) -> str:
    """One line: the kernel (dispatch path) and config that serve x [m, k] (``dtype``) @ W.T for W [n, k] quantized
    with ``scheme`` on ``device``, as the layers of quantkit run it."""
    if min(m, n, k) < 1:
        raise ValueError(f"M, N and K must be positive, got {m}, {n}, {k}")
    s, gpu = _scheme(scheme), _device(device)
    where = str(gpu) if gpu is not None else "the CPU"
    head = f"{s.name}, M = {m} on a {n} x {k} layer (N x K), {str(dtype).removeprefix('torch.')}, on {where}: "
    if s.kind == "float":
        return head + _float(m, n, dtype, gpu)
    if s.kind == "w8a8":
        return head + _w8a8(m, n, k, s, dtype, gpu)
    if s.kind == "w4a8":
        return head + _w4a8(m, n, k, s, gpu)
    return head + _weight_only(m, n, k, s, dtype, gpu)


def _float(m: int, n: int, dtype: torch.dtype, gpu: GPU | None) -> str:
    from quantkit.kernels.dense.gemv import serves as dense_gemv_serves

    if dense_gemv_serves(m, n, dtype, dtype, gpu is not None):
        return "one-row float GEMV (Triton, dense/gemv.py) in the runtime; F.linear (cuBLAS) in plain PyTorch modules"
    return "F.linear (cuBLAS)" if gpu is not None else "F.linear (PyTorch on the CPU)"


def _weight_only(m: int, n: int, k: int, s: _Scheme, dtype: torch.dtype, gpu: GPU | None) -> str:
    from quantkit.kernels.w4a16.dispatch import choose
    from quantkit.kernels.w4a16.problem import Product
    from quantkit.kernels.w4a16.weight import ACT_DTYPES, unsupported_reason

    fallback = "QuantLinear dequantizes W to x's dtype and runs F.linear"
    if gpu is None:
        return f"{fallback} (PyTorch; the Triton kernels run on the CPU only under TRITON_INTERPRET=1, for tests)"
    if s.fmt == "fp8":
        return f"no weight-only fp8 kernel: {fallback} (cuBLAS)"
    if dtype not in ACT_DTYPES:
        return f"no kernel for {dtype} activations (fp16 or bf16): {fallback} (cuBLAS)"
    group = k if s.group_size == -1 else min(s.group_size, k)
    reason = unsupported_reason(s.bits, s.group_size, torch.arange(k) // group)
    if reason:
        return f"no kernel ({reason}): {fallback} (cuBLAS)"
    return str(choose(Product.dense(m, n, k, s.bits, 0 if group >= k else group, dtype, gpu)))


def _w8a8(m: int, n: int, k: int, s: _Scheme, dtype: torch.dtype, gpu: GPU | None) -> str:
    from quantkit.kernels.w8a8.configs import l2_ahead_for
    from quantkit.kernels.w8a8.dispatch import choose, pdl_rule
    from quantkit.kernels.w8a8.problem import Product

    if gpu is None:
        integer = "torch._int_mm and the fp32 epilogue" if s.fmt == "int8" else "no CPU path for fp8"
        return (
            "W8A8Linear's default execution 'simulated' (reference quantizer, fp32 matmul of the dequantized "
            f"operands); execution 'integer': {integer}"
        )
    pdl = pdl_rule(m, gpu)
    plan = choose(Product.dense(m, n, k, s.fmt, dtype, gpu, s.fast, pdl))
    ahead = l2_ahead_for(m)
    extras = ", programmatic dependent launch after the quantizer" if pdl else ""
    extras += f", L2 prefetch {ahead} K tiles ahead" if ahead and plan.path == "tiles" else ""
    return f"activations quantized per token (Triton, w8a8/quant.py), then {plan}{extras} (execution 'integer')"


def _w4a8(m: int, n: int, k: int, s: _Scheme, gpu: GPU | None) -> str:
    from quantkit.kernels.w4a8.dispatch import choose

    layer = "ProgressiveW4A8Linear" if s.progressive else "W4A8Linear"
    if gpu is None:
        return (f"{layer} simulated (reference per-token quantizer, fp32 matmul of the dequantized operands; the "
                "Triton kernels run on the CPU only under TRITON_INTERPRET=1, for tests)")  # fmt: skip
    group = 0 if s.group_size == -1 or s.group_size >= k else s.group_size
    plan = choose(m, n, k, group, gpu.sms, progressive=s.progressive)
    return f"activations quantized per token to {s.fmt} (Triton, w8a8/quant.py), then {plan}"
