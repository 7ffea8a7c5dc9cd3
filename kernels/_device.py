"""Device helpers shared by the kernel families: what the device is, Triton's interpreter, exact rounding, the
precision of attention's dot products and software prefetch into L2.

``GPU`` describes a CUDA device by what the dispatch rules read (compute capability, SM count, shared memory per
block), so that a rule can also be asked about a GPU this machine does not have (``quantkit.kernels.explain``).
``device_of`` describes a real device: a ``GPU`` for a CUDA device, None for any other (the CPU, where the kernels
run only under Triton's interpreter). ``num_sms`` is what the launchers size their grids by: 4 off CUDA, so that the
small shapes of the interpreter's tests still split K.

L2 prefetch
    ``prefetch_l2(ptrs, on)`` asks L2 for the line holding each address of ``ptrs`` where ``on`` is non-zero
    (PTX ``prefetch.global.L2``, one 128-byte line each). Nothing is written to a register and nothing waits for it:
    the line travels from DRAM to L2 while the kernel goes on. ``prefetch_block_l2`` covers a [ROWS, COLS] block of
    a row-major buffer with one address per line, spread so that every thread of the CTA issues at most a few (a
    block smaller than the CTA gets one address per thread, the rest predicated off, instead of Triton's copies of
    each element in several threads: no duplicate requests).
    It pays where few programs stream long weight rows: the W8A8 GEMM with 64-row tiles (M 17-64) on layers of few
    output tiles, whose 64 programs each stream close to a megabyte of weight rows through a 4-stage pipeline. Where
    the grid covers the GPU several times it does not: every resident program's look-ahead adds up and evicts lines
    before their use, which is why the W4A16 gemv does not prefetch (``w8a8.configs.l2_ahead_for`` is the rule).
    Limits: CUDA only (inline PTX). Triton's interpreter cannot run inline assembly, so the launchers pass
    ``L2_AHEAD = 0`` there; prefetching changes no result, only timing. Addresses are clamped into the buffer (the
    last valid row and column), so a block at the edge never names memory outside it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

LINE_BYTES = tl.constexpr(128)
HOPPER_SHARED_MEMORY = 232448  # bytes of shared memory one block may opt into on sm_90 (H100, H200)


@dataclass(frozen=True)
class GPU:
    """A CUDA device as the dispatch rules see it: compute ``capability`` (major, minor), ``sms`` streaming
    multiprocessors, ``shared_memory`` bytes per block (opt-in), and a ``name`` for messages."""

    capability: tuple[int, int] = (9, 0)
    sms: int = 132
    shared_memory: int = HOPPER_SHARED_MEMORY
    name: str = ""

    def __post_init__(self) -> None:
        cap = self.capability
        if not (isinstance(cap, tuple) and len(cap) == 2 and all(isinstance(v, int) and v >= 0 for v in cap)):
            raise ValueError(f"capability must be a (major, minor) pair of ints, got {cap!r}")
        if not isinstance(self.sms, int) or self.sms < 1:
            raise ValueError(f"sms must be a positive int, got {self.sms!r}")
        if not isinstance(self.shared_memory, int) or self.shared_memory < 1:
            raise ValueError(f"shared_memory must be a positive int, got {self.shared_memory!r}")

    def __str__(self) -> str:
        return f"{self.name or 'GPU'} (sm_{self.capability[0]}{self.capability[1]}, {self.sms} SMs)"


@functools.lru_cache(maxsize=16)
def _cuda_gpu(index: int) -> GPU:
    props = torch.cuda.get_device_properties(index)
    return GPU((props.major, props.minor), props.multi_processor_count, props.shared_memory_per_block_optin, props.name)


def device_of(device: torch.device | str) -> GPU | None:
    """The ``GPU`` of a CUDA device (the current one for a bare "cuda"), None for any other device."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _cuda_gpu(device.index if device.index is not None else torch.cuda.current_device())


def interpreting() -> bool:
    """True under Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


PDL_REFUSED = "pdl needs a CUDA device of compute capability 9.0 or newer, outside Triton's interpreter"


def pdl_possible(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device can use programmatic dependent launch (griddepcontrol: sm_90+)."""
    return t.is_cuda and not interpreting() and device_of(t.device).capability >= (9, 0)


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 4 under the interpreter (so small test shapes still split K)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def sms_of(gpu: GPU | None) -> int:
    """``num_sms`` for a device description: the GPU's SMs, 4 off CUDA."""
    return gpu.sms if gpu is not None else 4


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 attention stays fp32 on tensor cores ("ieee"); 16-bit inputs ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def round_half_even(v):
    """Round fp32 to the nearest integer, ties to even (== torch.round); exact for |v| < 2**23."""
    f = tl.floor(v)
    d = v - f
    f_is_odd = (f - 2.0 * tl.floor(0.5 * f)) != 0.0
    return f + tl.where((d > 0.5) | ((d == 0.5) & f_is_odd), 1.0, 0.0)


@triton.jit
def prefetch_l2(ptrs, on):
    """Ask L2 for the line of each address in ``ptrs`` whose ``on`` (int32, same shape or scalar) is non-zero."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, on], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def prefetch_block_l2(base, row0, n_rows, stride_row, col0, n_cols, on, ROWS: tl.constexpr, COLS: tl.constexpr,
                      THREADS: tl.constexpr):  # fmt: skip
    """Prefetch rows row0 .. row0 + ROWS and columns col0 .. col0 + COLS of a buffer with unit column stride and
    ``n_rows`` x ``n_cols`` valid elements (indices are clamped to the last valid one); ``on``: a scalar condition.
    ``THREADS``: the CTA's threads (num_warps * 32), so that each address is issued by one thread only."""
    LINE: tl.constexpr = LINE_BYTES * 8 // base.dtype.element_ty.primitive_bitwidth  # elements per line
    PER_ROW: tl.constexpr = (COLS + LINE - 1) // LINE
    LINES: tl.constexpr = ROWS * PER_ROW
    SIZE: tl.constexpr = LINES if LINES > THREADS else THREADS
    i = tl.arange(0, SIZE)
    row = tl.minimum(row0 + i // PER_ROW, n_rows - 1)
    col = tl.minimum(col0 + (i % PER_ROW) * LINE, n_cols - 1)
    prefetch_l2(base + row * stride_row + col, ((i < LINES) & on).to(tl.int32))


def threads(num_warps: int) -> int:
    """THREADS for ``prefetch_block_l2``."""
    return num_warps * 32


# -- dispatch tables -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DispatchPath:
    """One way a family serves a product: ``plan(product)`` says whether it does (the family's plan) or not
    (None); ``launch(plan, *operands)`` runs it on operands its family checked."""

    name: str
    plan: Callable[[Any], Any]
    launch: Callable[..., torch.Tensor]


def first_plan(paths: tuple[DispatchPath, ...], product):
    """The plan of the first path that serves ``product``; the last path of every table serves them all."""
    for path in paths:
        plan = path.plan(product)
        if plan is not None:
            return plan
    raise AssertionError(f"unreachable: the {paths[-1].name} path plans every product")


# -- Gluon kernels ---------------------------------------------------------------------------------------------------

GLUON_TRITON = "3.6."  # the Gluon API the Hopper kernels are written for (3.7+ renamed TMA loads and shared views)


def gluon_unsupported(gpu: GPU | None, hopper_only: bool = True) -> str | None:
    """Why a Gluon kernel cannot run on ``gpu`` with this Triton (None: it can): it needs Triton GLUON_TRITON and a
    Hopper GPU (``hopper_only``: compute capability 9.0 exactly, for wgmma and TMA; else 9.0 or newer)."""
    if not triton.__version__.startswith(GLUON_TRITON):
        return f"written for Triton {GLUON_TRITON}x's Gluon, found Triton {triton.__version__}"
    if gpu is None or (gpu.capability != (9, 0) if hopper_only else gpu.capability < (9, 0)):
        return f"needs a CUDA device of compute capability 9.0{'' if hopper_only else ' or newer'}" + (
            " (Hopper)" if hopper_only else ""
        )
    return None
