"""What the W4A16 dispatch rules look at: one product (``Product``) and the choice made for it (``Plan``).

A ``Product`` holds the facts of x [M, K] @ W.T for a kernel-ready weight W [N, K] that any path's rule reads:
sizes, bits, the contiguous group length, x's dtype, the device (a ``GPU`` description, or None off CUDA) and the
strides and alignment of x and out. It is built from tensors (``Product.of``) by ``w4a16_linear``, or from shapes
alone (``Product.dense``: contiguous, 16-byte aligned operands) when a rule is asked about a product that is not
at hand (``quantkit.kernels.explain``), so both go through the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from quantkit.kernels._device import GPU, device_of, sms_of
from quantkit.kernels.w4a16.weight import W4A16Weight


@dataclass(frozen=True)
class Product:
    """x [m, k] @ W.T + bias for W [n, k] of ``bits``-bit codes in contiguous groups of ``group_size`` along K (0:
    one group); x in ``dtype`` on ``gpu`` (None: not a CUDA device). ``x_stride`` (row, column) in elements,
    ``x_aligned``: x's first element on a 16-byte boundary; ``out_col_stride``: 1 without a given ``out``."""

    m: int
    n: int
    k: int
    bits: int
    group_size: int
    dtype: torch.dtype
    gpu: GPU | None
    x_stride: tuple[int, int]
    x_aligned: bool = True
    out_col_stride: int = 1

    def __post_init__(self) -> None:
        if min(self.m, self.n, self.k) < 0 or self.group_size < 0:
            raise ValueError(f"sizes must not be negative, got M {self.m}, N {self.n}, K {self.k}")
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")

    @classmethod
    def of(cls, x: torch.Tensor, w: W4A16Weight, out: torch.Tensor | None = None) -> Product:
        """The product x [M, K] @ W.T into ``out`` as the tensors are (x already in kernel channel order)."""
        return cls(
            m=x.shape[0], n=w.out_features, k=w.in_features, bits=w.bits, group_size=w.group_size, dtype=x.dtype,
            gpu=device_of(x.device), x_stride=(x.stride(0), x.stride(1)), x_aligned=x.data_ptr() % 16 == 0,
            out_col_stride=1 if out is None else out.stride(1),
        )  # fmt: skip

    @classmethod
    def dense(cls, m: int, n: int, k: int, bits: int, group_size: int, dtype: torch.dtype, gpu: GPU | None) -> Product:
        """The product with contiguous, 16-byte aligned operands (what the runtime's layers pass)."""
        return cls(m, n, k, bits, group_size, dtype, gpu, (k, 1))

    @property
    def is_cuda(self) -> bool:
        return self.gpu is not None

    @property
    def sms(self) -> int:
        """The SM count the launchers size their grids by (4 off CUDA, as ``num_sms``)."""
        return sms_of(self.gpu)

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize


@dataclass(frozen=True)
class Plan:
    """The choice for one product: the dispatch ``path`` that serves it, the ``kernel`` that runs (in words), its
    ``config`` (the path's config dataclass) and the split-K factor (1: none)."""

    path: str
    kernel: str
    config: object
    split: int = 1

    def __str__(self) -> str:
        split = f", split-K {self.split}" if self.split > 1 else ""
        return f"{self.kernel} [{self.path}: {getattr(self.config, 'name', self.config)}{split}]"
