"""Launch side of the warp-specialized fp8 GEMM (``ws_kernel.py``, Gluon, sm_90 only): the rule that offers it,
what it cannot take, and the checked launcher.

``dispatch.w8a8_matmul`` asks ``ws_offered`` and ``ws_unsupported_reason`` before its Triton tile configs: fp8 with the
default promoted accumulation, more than ``WS_MIN_M`` rows, no tile config or programmatic dependent launch asked
for, and operands the TMA copies can read. Everything here but the launch runs without a GPU (the CPU tests check
the rule); the Gluon kernel module is imported on the first launch only.
"""

from __future__ import annotations

import torch
from quantkit.kernels._device import GLUON_TRITON, device_of, gluon_unsupported, num_sms
from quantkit.kernels.w8a8.gemm import check_matmul_operands
from quantkit.kernels.w8a8.problem import Plan, Product

# M > 256 (the "large" regime of configs.CONFIGS): on the H200 at M = 1024 / 4096 / 16384 on the six benchmark layers,
# end to end over bf16 cuBLAS, geomean 1.45x against 1.27-1.28x for the Triton promoted config in the same runs; slower
# in no cell (4096 x 4096 at M = 1024: 1.07-1.08x both). At M = 512 it led on every shape (0.73-1.46x against
# 0.66-1.24x); the Triton tiles led on four of six at M = 256 and five of six at M = 128 (128 x 256 tiles leave most SMs
# idle there), so those rows keep them.
WS_MIN_M = 257
KERNEL = "warp-specialized fp8 GEMM (Gluon, w8a8/ws_kernel.py)"
CONFIG_NAME = "ws-m128n256k128s4"  # the kernel's fixed tiles: two 64-row consumer warp groups, 4 stages
WS_TRITON = GLUON_TRITON  # the Gluon API the kernel is written for


def ws_offered(m: int, fmt: str, fp8_fast_accum: bool, pdl: bool) -> bool:
    """Whether the product is one the kernel was measured to serve better: fp8, promoted accumulation (the default),
    at least WS_MIN_M rows, no programmatic dependent launch (which only the Triton kernels take)."""
    return fmt == "fp8" and not fp8_fast_accum and not pdl and m >= WS_MIN_M


def unsupported(p: Product) -> str | None:
    """Why the kernel cannot run this product (None: it can): the device, Triton's version, and the TMA copies'
    alignment (16-byte aligned base addresses and rows, K contiguous: 8-bit operands need K % 16 == 0)."""
    if p.fmt != "fp8":
        return f"float8_e4m3fn operands only, got {p.fmt}"
    if not p.tma_ok:
        return "qa and qw need K contiguous, 16-byte aligned rows and base addresses (TMA; K % 16 == 0)"
    if p.out_col_stride != 1:
        return "out needs unit column stride"
    return gluon_unsupported(p.gpu)


def ws_unsupported_reason(qa: torch.Tensor, qw: torch.Tensor, out: torch.Tensor) -> str | None:
    """``unsupported`` for the product as the tensors are."""
    if qa.dtype != torch.float8_e4m3fn or qw.dtype != torch.float8_e4m3fn:
        return f"float8_e4m3fn operands only, got {qa.dtype} and {qw.dtype}"
    return unsupported(Product.of(qa, qw, out, False, False))


def plan(p: Product) -> Plan | None:
    """The plan when ``w8a8_matmul`` runs this kernel for the product (``ws_offered`` and no ``unsupported``
    reason), else None."""
    if not ws_offered(p.m, p.fmt, p.fp8_fast_accum, p.pdl) or unsupported(p) is not None:
        return None
    return Plan("ws", KERNEL, CONFIG_NAME)


def fp8_ws_matmul(
    qa: torch.Tensor,
    a_scale: torch.Tensor,
    qw: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """qa [M, K] x qw [N, K] (float8_e4m3fn) -> y [M, N] with this kernel at any M (``w8a8_matmul`` uses it from
    WS_MIN_M rows). Operands as ``w8a8_matmul``'s; raises ValueError where ``ws_unsupported_reason`` names one."""
    out = check_matmul_operands(qa, a_scale, qw, w_scale, bias, out_dtype, out)
    reason = ws_unsupported_reason(qa, qw, out)
    if reason:
        raise ValueError(f"fp8_ws_matmul: {reason}")
    return launch(qa, a_scale, qw, w_scale, bias, out)


def launch(qa, a_scale, qw, w_scale, bias, out) -> torch.Tensor:
    """The launch itself, for operands already checked; empty products return ``out`` as it is."""
    from quantkit.kernels.w8a8.ws_kernel import launch as kernel_launch  # Gluon: GPU machines only

    if out.numel() == 0:
        return out
    return kernel_launch(qa, a_scale, qw, w_scale, bias, out, num_sms(qa.device))


def block_unsupported(qa: torch.Tensor, qw: torch.Tensor, out: torch.Tensor, block: int) -> str | None:
    """Why the kernel's block-fp8 variant cannot run this product (None: it can): B must be 128 (tiles one weight
    block wide, one promotion per K step), and the device and TMA conditions of ``unsupported``."""
    if block != 128:
        return f"block size 128 only, got {block}"
    tma_ok = all(t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (qa, qw))
    p = Product(qa.shape[0], qw.shape[0], qa.shape[1], "fp8", torch.bfloat16, device_of(qa.device), tma_ok=tma_ok,
                out_col_stride=out.stride(1))  # fmt: skip
    return unsupported(p)


SCALE_ALIGN = 4  # M-major activation scales: each tile's column of M scales padded to 16 bytes (TMA rows)


def empty_m_major(m: int, kb: int, device) -> torch.Tensor:
    """Uninitialised fp32 scales [m, kb] in the block kernel's layout: a view of [kb, M'] storage (M' = m rounded
    up to SCALE_ALIGN), strides (1, M')."""
    return torch.empty(kb, -(-m // SCALE_ALIGN) * SCALE_ALIGN, dtype=torch.float32, device=device)[:, :m].t()


def m_major_scales(a_scale: torch.Tensor) -> torch.Tensor:
    """a_scale [M, kb] as the block kernel's TMA reads it (``empty_m_major``'s layout): a copy unless it already
    is, as ``block.quantize_tiles(m_major=True)`` returns it."""
    m, kb = a_scale.shape
    st = a_scale.stride()
    if st[0] == 1 and st[1] >= m and st[1] % SCALE_ALIGN == 0 and a_scale.data_ptr() % 16 == 0:
        return a_scale
    return empty_m_major(m, kb, a_scale.device).copy_(a_scale)


def launch_block(qa, a_scale, qw, w_scale, bias, out, consumers: int = 2) -> torch.Tensor:
    """The block-fp8 launch for operands already checked (a_scale in either layout), with 2 or 3 consumer warp
    groups (128 x 128 or 192 x 128 tiles); empty products return ``out`` as it is."""
    from quantkit.kernels.w8a8.ws_kernel import launch_block as kernel_launch  # Gluon: GPU machines only

    if consumers not in (2, 3):
        raise ValueError(f"consumers must be 2 or 3, got {consumers}")
    if out.numel() == 0:
        return out
    return kernel_launch(qa, m_major_scales(a_scale), qw, w_scale, bias, out, num_sms(qa.device), consumers)
