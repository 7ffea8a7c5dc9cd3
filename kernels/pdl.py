"""Programmatic dependent launch (PDL) for chains of small kernels: the runtime's decode steps.

What it does
    A kernel launched with PDL (``launch_pdl=True``, sm_90+) may start while the kernel before it on the stream
    still runs: as soon as every program of that one has executed ``griddepcontrol.launch_dependents``. Each
    kernel that takes part calls ``_enter`` (or ``_enter_after_prefetch``) first: it lets the next kernel start at
    once, then waits (``griddepcontrol.wait``) until the previous grid has finished and its writes are visible.
    So the next kernel's launch, its programs' placement on the SMs and, with ``_enter_after_prefetch``, its first
    weight lines (constant data, asked of L2 before the wait) overlap the tail of the current kernel.

Why
    A batch-1 decode step of Llama-3-8B is ~350 launches (11 per layer) of kernels that each run a few to a few tens
    of microseconds inside one CUDA graph; every boundary between two of them leaves the GPU draining and filling.

Rules a kernel follows when its ``PDL`` flag is set: no read of anything an earlier kernel writes and no write at
all before ``_enter`` returns; reads of constant data (weights) may come first. Then kernel n + 1 can only touch
activations once kernel n has finished, which itself waited for kernel n - 1, and so on: the chain keeps stream
order for every activation and output buffer, including buffers that the caching allocator reuses.

``chain()`` turns PDL on for launches made inside it (the runtime captures its decode CUDA graphs inside it);
``active(t)`` is what each launcher asks: on in the chain, on CUDA sm_90+, never in Triton's interpreter.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch
import triton
import triton.language as tl
from quantkit.kernels.w4a16_weight import interpreting

_chain = False


@contextmanager
def chain(enabled: bool = True) -> Iterator[None]:
    """Launch the kernels that support it with PDL inside this block (``enabled`` False: a no-op)."""
    global _chain
    previous, _chain = _chain, enabled
    try:
        yield
    finally:
        _chain = previous


@cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can be launched with PDL: CUDA sm_90+, not Triton's interpreter."""
    return device.type == "cuda" and not interpreting() and _supported(device.index or torch.cuda.current_device())


def active(t: torch.Tensor) -> bool:
    """Whether a kernel working on ``t`` is to be launched with PDL now: inside ``chain()`` and ``supported``."""
    return _chain and supported(t.device)


def launch_options(pdl: bool) -> dict:
    """Extra keyword arguments of a Triton launch: ``launch_pdl`` when ``pdl``."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 to fetch the lines of ``ptrs`` (no registers written, nothing waited for)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _enter(PDL: tl.constexpr):
    """With PDL: let the next kernel start, then wait for the previous one's writes. Without: nothing."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def _enter_after_prefetch(ptrs, PDL: tl.constexpr):
    """``_enter``, first asking L2 for the lines of ``ptrs`` (constant data this program reads first)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        _prefetch_l2(ptrs)
        tl.extra.cuda.gdc_wait()
