"""Kernel-ready W4A16/W8A16 weights: GPTQ-v2 buffers checked, act-order sorted into contiguous groups, once.
Also the operand checks every W4A16 launcher runs (``check_operands``).

The kernels (``quantkit.kernels.w4a16``) need each group's input channels to be contiguous along K. Checkpoints
quantized with act-order (``desc_act``) store a non-monotonic ``g_idx``; ``prepare_gptq_weight`` sorts K by group
at load time, repacks the codes in that order and keeps the permutation, which the launcher applies to x's columns.
The result is the in-memory layout ``KERNEL_LAYOUT`` (version ``KERNEL_LAYOUT_VERSION``); checkpoints keep gptq_v2.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from quantkit.kernels._device import interpreting
from quantkit.kernels.w4a16.configs import LOCK_SLOTS

KERNEL_LAYOUT = "gptq_v2_sorted_groups"
KERNEL_LAYOUT_VERSION = 1
SUPPORTED_BITS = (4, 8)
ACT_DTYPES = (torch.float16, torch.bfloat16)


def unpack_gptq_codes(qweight: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """int32 [ceil(K/32)*b, N] -> int32 codes [K, N] (4 or 8 bits)."""
    pf = 32 // bits
    shifts = torch.arange(0, 32, bits, device=qweight.device, dtype=torch.int32)
    codes = (qweight.unsqueeze(1) >> shifts.view(1, pf, 1)) & (2**bits - 1)  # [rows, pf, N]
    return codes.reshape(-1, qweight.shape[1])[:k]


@dataclass
class W4A16Weight:
    """GPTQ-v2 buffers in the kernel layout (``KERNEL_LAYOUT``): groups contiguous along K.

    ``perm`` int64 [K] (act-order only): kernel input channel i is checkpoint channel perm[i], so the kernel reads
    ``x[:, perm]``. ``group_size`` is the contiguous group length, 0 for a single group. ``locks`` int32
    [LOCK_SLOTS] zeros: split-K semaphores, reset by the kernel itself after every use.
    """

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    bits: int
    group_size: int
    in_features: int
    out_features: int
    perm: torch.Tensor | None = None
    layout: str = KERNEL_LAYOUT
    layout_version: int = KERNEL_LAYOUT_VERSION
    locks: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.locks = torch.zeros(LOCK_SLOTS, dtype=torch.int32, device=self.qweight.device)


def _group_order(g_idx: torch.Tensor, group: int) -> tuple[torch.Tensor | None, bool]:
    """(perm that makes the groups contiguous or None if they already are, whether that is possible)."""
    contiguous = torch.arange(g_idx.numel(), device=g_idx.device) // group
    if torch.equal(g_idx.long(), contiguous):
        return None, True
    perm = torch.argsort(g_idx.long(), stable=True)
    return perm, torch.equal(g_idx.long()[perm], contiguous)


def unsupported_reason(bits: int, group_size: int, g_idx: torch.Tensor) -> str | None:
    """Why the kernel cannot serve this layer, or None. ``group_size`` is the scheme's (-1 = per-channel)."""
    k = g_idx.numel()
    if bits not in SUPPORTED_BITS:
        return f"{bits}-bit weights (the kernel serves {SUPPORTED_BITS})"
    if group_size != -1 and group_size < k and group_size % 32:
        return f"group size {group_size} is not a multiple of 32"
    group = k if group_size == -1 else min(group_size, k)
    if not _group_order(g_idx, group)[1]:
        return f"g_idx does not hold groups of {group} channels (last one shorter): cannot sort it into groups"
    return None


def prepare_gptq_weight(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    group_size: int,
) -> W4A16Weight:
    """Kernel-ready weight from GPTQ-v2 buffers; ``unsupported_reason`` must have returned None for them.

    Act-order (non-monotonic ``g_idx``): sort K by group once, repack the codes in that order and keep the
    permutation. The buffers passed in are not modified; without act-order they are used as they are.
    """
    reason = unsupported_reason(bits, group_size, g_idx)
    if reason:
        raise ValueError(f"W4A16 kernel: unsupported layer: {reason}")
    k, n = g_idx.numel(), qweight.shape[1]
    group = k if group_size == -1 else min(group_size, k)
    perm, _ = _group_order(g_idx, group)
    if perm is not None:
        codes = unpack_gptq_codes(qweight, bits, k)[perm]  # [K, N] in kernel order
        qweight = _pack_gptq_codes(codes, bits)
    return W4A16Weight(qweight, qzeros, scales, bits, 0 if group >= k else group, k, n, perm)


def _pack_gptq_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int codes [K, N] -> int32 [ceil(K/32)*b, N], the inverse of ``unpack_gptq_codes``."""
    k, n = codes.shape
    pf = 32 // bits
    padded = torch.zeros(-(-k // 32) * 32, n, dtype=torch.int64, device=codes.device)
    padded[:k] = codes.long()
    shifts = torch.arange(0, 32, bits, device=codes.device, dtype=torch.int64).view(1, pf, 1)
    words = (padded.view(-1, pf, n) << shifts).sum(dim=1)  # disjoint bit fields: the sum is an OR
    return as_int32_words(words)


def as_int32_words(words: torch.Tensor) -> torch.Tensor:
    """int64 tensor of 32-bit patterns (0 <= w < 2**32) -> int32 holding the same bits (the high half read as
    the sign)."""
    return (words - ((words >> 31) << 32)).to(torch.int32)


def check_operands(x: torch.Tensor, w: W4A16Weight, bias: torch.Tensor | None, out: torch.Tensor | None) -> None:
    """Shapes, dtypes and devices of one product x [M, K] @ W.T (+ bias) into out [M, N]; raises ValueError."""
    k, n, b = w.in_features, w.out_features, w.bits
    rows = -(-k // 32) * b
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    if x.dtype not in ACT_DTYPES:
        raise ValueError(f"x must be float16 or bfloat16, got {x.dtype}")
    if not (x.is_cuda or interpreting()):
        raise ValueError("x must be a CUDA tensor (or set TRITON_INTERPRET=1 to run the kernel on CPU)")
    if w.qweight.dtype != torch.int32 or tuple(w.qweight.shape) != (rows, n):
        raise ValueError(f"qweight must be int32 [{rows}, {n}], got {w.qweight.dtype} {tuple(w.qweight.shape)}")
    n_g = w.scales.shape[0]
    zcols = -(-n // 32) * b
    if w.qzeros.dtype != torch.int32 or tuple(w.qzeros.shape) != (n_g, zcols):
        raise ValueError(f"qzeros must be int32 [{n_g}, {zcols}], got {w.qzeros.dtype} {tuple(w.qzeros.shape)}")
    if w.scales.dtype != torch.float16 or w.scales.shape[1] != n:
        raise ValueError(f"scales must be float16 [n_groups, {n}], got {w.scales.dtype} {tuple(w.scales.shape)}")
    if bias is not None and (bias.shape != (n,) or not bias.is_floating_point()):
        raise ValueError(f"bias must be a float tensor [{n}], got {bias.dtype} {tuple(bias.shape)}")
    if out is not None and (tuple(out.shape) != (x.shape[0], n) or out.dtype != x.dtype):
        raise ValueError(f"out must be {x.dtype} [{x.shape[0]}, {n}], got {out.dtype} {tuple(out.shape)}")
    for t in (x, w.qweight, w.scales, out):
        if t is not None and t.numel() >= 2**31:
            raise ValueError("tensors of 2**31 elements or more need 64-bit offsets, which the kernel does not use")
    devices = {t.device for t in (x, w.qweight, w.qzeros, w.scales, bias, out) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
