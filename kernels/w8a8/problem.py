"""What the W8A8 dispatch rules look at: one product (``Product``) and the choice made for it (``Plan``).

A ``Product`` holds the facts of qa [M, K] @ qw [N, K]^T that the paths' rules read: sizes, the 8-bit format, the
output dtype, the accumulation and launch options, the device (a ``GPU`` description, or None off CUDA) and whether
the operands suit TMA copies. ``Product.of`` builds it from checked tensors (``w8a8_matmul``), ``Product.dense`` from
shapes alone (contiguous, 16-byte aligned operands; ``quantkit.kernels.explain``), so both go through the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from quantkit.kernels._device import GPU, device_of, sms_of
from quantkit.kernels.w8a8.gemm import tma_compatible
from quantkit.kernels.w8a8.quant import FORMAT_OF_DTYPE


@dataclass(frozen=True)
class Product:
    """qa [m, k] @ qw [n, k]^T in ``fmt`` ("int8" or "fp8") into ``out_dtype`` on ``gpu`` (None: not CUDA), with
    ``fp8_fast_accum`` and programmatic dependent launch (``pdl``) as asked; ``tma_ok``: both operands have 16-byte
    aligned rows and base addresses; ``out_col_stride``: the output's column stride."""

    m: int
    n: int
    k: int
    fmt: str
    out_dtype: torch.dtype
    gpu: GPU | None
    fp8_fast_accum: bool = False
    pdl: bool = False
    tma_ok: bool = True
    out_col_stride: int = 1

    def __post_init__(self) -> None:
        if self.fmt not in ("int8", "fp8"):
            raise ValueError(f"fmt must be 'int8' or 'fp8', got {self.fmt!r}")
        if min(self.m, self.n, self.k) < 0:
            raise ValueError(f"sizes must not be negative, got M {self.m}, N {self.n}, K {self.k}")

    @classmethod
    def of(cls, qa: torch.Tensor, qw: torch.Tensor, out: torch.Tensor, fp8_fast_accum: bool, pdl: bool) -> Product:
        """The product as the (checked) tensors are."""
        return cls(
            qa.shape[0], qw.shape[0], qa.shape[1], FORMAT_OF_DTYPE[qa.dtype], out.dtype, device_of(qa.device),
            fp8_fast_accum, pdl, tma_compatible(qa, qw), out.stride(1),
        )  # fmt: skip

    @classmethod
    def dense(cls, m: int, n: int, k: int, fmt: str, out_dtype: torch.dtype, gpu: GPU | None,
              fp8_fast_accum: bool = False, pdl: bool = False) -> Product:  # fmt: skip
        """The product with contiguous operands, TMA-aligned where K allows it (K % 16 == 0)."""
        return cls(m, n, k, fmt, out_dtype, gpu, fp8_fast_accum, pdl, k % 16 == 0)

    @property
    def sms(self) -> int:
        """The SM count the launchers size their grids by (4 off CUDA, as ``num_sms``)."""
        return sms_of(self.gpu)


@dataclass(frozen=True)
class Plan:
    """The choice for one product: the dispatch ``path``, the ``kernel`` that runs (in words), its ``config`` and,
    for the Triton tiles, the operand ``fetch`` mode (0 pointer loads, 1 TMA, 2-4 TMA with 1-3 persistent programs
    per SM) after the fall-backs (operands unfit for TMA, a persistent epilogue that does not fit shared memory)."""

    path: str
    kernel: str
    config: object
    fetch: int = 0

    def __str__(self) -> str:
        name = getattr(self.config, "name", self.config)
        fetch = ("pointer loads", "TMA", "TMA, persistent x1", "TMA, persistent x2", "TMA, persistent x3")[self.fetch]
        return f"{self.kernel} [{self.path}: {name}" + (f", {fetch}]" if self.path == "tiles" else "]")
