"""Where work runs: the one place that turns a user's device name into a ``torch.device`` or a clear error."""

from __future__ import annotations

import ctypes
import functools

import torch

from quantkit.errors import QuantkitError


def resolve_device(name: str | torch.device | None) -> torch.device:
    """``None``: CUDA when available, else the CPU. Otherwise ``cpu``, ``cuda`` or ``cuda:N`` of a GPU that exists."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise QuantkitError(f"unknown device {name!r} (cpu, cuda, cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise QuantkitError(f"unknown device {name!r} (cpu, cuda, cuda:N)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise QuantkitError(f"device {name} requested but CUDA is not available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise QuantkitError(f"device {name} requested but this machine has {torch.cuda.device_count()} GPU(s)")
    return device


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc; absent on macOS and Windows
    except (AttributeError, OSError):
        return None


def release_host_memory() -> None:
    """Give what Python and torch have freed back to the operating system (glibc's ``malloc_trim``; nothing happens
    where glibc is absent).

    glibc keeps what a multi-threaded process frees in its arenas, so the float weights, activations and statistics
    of layer after layer stayed resident until the runner called this after every layer (measured in
    docs/results/quantize-time.md). A few milliseconds a call."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
