"""The result of quantizing one weight matrix, before packing, and the per-group quantization grid.

Notation of the GPTQ format: W [N, K] (N outputs, K inputs), group g of input channel k is ``g_idx[k]``, and

    W[n, k] ~= scales[n, g_idx[k]] * (q[n, k] - zeros[n, g_idx[k]])

with unsigned integer codes q in [0, 2**bits - 1]. Progressive W4A8 (QServe's format,
``quantkit.kernels.w4a8.progressive``) is the same with ``scales[n, g] = s1[n] * s2[n, g]``: a per-channel fp32
scale s1 times an integer group scale s2 in [1, 15], zeros z in [0, 15]; it is stored as s1 * (s2 * (q - z)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quantkit.errors import QuantkitError
from quantkit.kernels.w4a8.progressive import W8_MAX, group_grid
from quantkit.quant.packing import pack_cols, pack_rows, unpack_cols, unpack_rows
from quantkit.quant.scheme import QuantScheme

# candidate weights per chunk of search_qparams: on CUDA few large launches (64 MB in fp32); on the CPU chunks that
# stay in cache (4 MB), since the ~10 passes over each chunk are bound by memory there
SEARCH_CHUNK_ELEMENTS = {"cuda": 1 << 24, "cpu": 1 << 20}


def compute_qparams(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max scale and integer zero point over the last dim of ``w`` [..., G] -> (scale [...], zero [...]).

    The range always includes 0. Symmetric: zero = 2**(bits-1), scale = 2*absmax / (2**bits - 1).
    Asymmetric: scale = (max - min) / (2**bits - 1), zero = round(-min / scale). An all-zero group gets scale 1.
    Scales are rounded to fp16, the precision they are stored in, so that codes computed here reproduce the
    saved checkpoint exactly (GPTQ's error feedback then sees the stored grid).
    """
    w = w.float()
    return qparams_from_range(w.amin(dim=-1), w.amax(dim=-1), bits, sym)


def qparams_from_range(
    xmin: torch.Tensor, xmax: torch.Tensor, bits: int, sym: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compute_qparams` from each group's min and max (fp32 [...])."""
    maxq = 2**bits - 1
    xmin = xmin.clamp(max=0)
    xmax = xmax.clamp(min=0)
    if sym:
        absmax = torch.maximum(-xmin, xmax)
        scale = 2 * absmax / maxq
        zero = torch.full_like(scale, 2 ** (bits - 1))
    else:
        scale = (xmax - xmin) / maxq
        zero = torch.zeros_like(scale)  # replaced below once the scale is safe to divide by
    scale = scale.to(torch.float16).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if not sym:
        zero = torch.round(-xmin / scale).clamp(0, maxq)
    return scale, zero


def search_qparams(
    w: torch.Tensor, bits: int, sym: bool, steps: int = 100, max_shrink: float = 0.8, norm: float = 2.4
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped grid of each group of ``w`` [..., G]: the min-max range shrunk by the factor among
    1, 1 - 1/steps, ..., 1 - max_shrink that minimises sum |w - dequant(quant(w))|^norm over the group.

    Per-channel 4-bit grids are set by a few outlying weights; clipping them trades their error for a finer
    grid for all the others. The exponent 2.4 (GPTQ's reference implementation uses the same) weighs large
    errors a little more than a plain squared error. Returns (scale [...], zero [...]) like
    :func:`compute_qparams`, which is the factor-1 candidate; on ties the larger factor wins. All factors are
    tried at once, in chunks of at most ``SEARCH_CHUNK_ELEMENTS`` candidate weights. A shrunk group's range is
    the factor times the group's min and max (rounding is monotonic, so this is exactly the min and max of the
    shrunk weights), and the error is computed in place in one buffer per chunk.
    """
    maxq = 2**bits - 1
    w = w.float()
    factors = torch.tensor([1 - i / steps for i in range(round(max_shrink * steps) + 1)], device=w.device)
    chunk = SEARCH_CHUNK_ELEMENTS["cuda" if w.is_cuda else "cpu"]
    per_chunk = max(1, chunk // max(1, w.numel()))
    shape = w.shape[:-1]
    wmin, wmax = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)  # [..., 1]
    w = w.unsqueeze(-2)  # [..., 1, G]
    best_err = torch.full(shape, float("inf"), device=w.device)
    best_scale, best_zero = torch.ones(shape, device=w.device), torch.zeros(shape, device=w.device)
    for f in factors.split(per_chunk):
        scale, zero = qparams_from_range(wmin * f, wmax * f, bits, sym)  # [..., F]: the group shrunk by each factor
        s, z = scale[..., None], zero[..., None]
        # |dequant(quant(w)) - w|^norm, summed over the group: [..., F]
        err = torch.div(w, s).round_().add_(z).clamp_(0, maxq).sub_(z).mul_(s).sub_(w).abs_().pow_(norm).sum(dim=-1)
        err, i = err.min(dim=-1)  # first minimum: the largest factor among equals
        scale, zero = scale.gather(-1, i[..., None])[..., 0], zero.gather(-1, i[..., None])[..., 0]
        better = err < best_err  # strict: an earlier chunk (larger factors) keeps ties
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


def progressive_channel_scale(w: torch.Tensor) -> torch.Tensor:
    """Level 1 of the progressive format: s1 [N] = max_k |w[n, k]| / 116 of w [N, K] (1 for an all-zero row), as
    ``quantize_progressive`` computes it."""
    s1 = w.float().abs().amax(dim=1) / W8_MAX if w.shape[1] else torch.ones(w.shape[0], device=w.device)
    return torch.where(s1 > 0, s1, torch.ones_like(s1))


def progressive_qparams(w: torch.Tensor, s1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Level 2 of the progressive format for groups w [N, ..., G] of rows with level-1 scales s1 [N]: the group's
    int8 values round(w / s1) (clamped to +-116) give s2 and z (``group_grid``); returns (scale = s1 * s2, zero = z),
    each [N, ...]. Every code 0..15 of such a grid decodes to an int8 d = s2 * (q - z)."""
    s1 = s1.view(-1, *([1] * (w.dim() - 1)))  # [N, 1, ..., 1]
    w8 = (w.float() / s1).round().clamp(-W8_MAX, W8_MAX)  # [N, ..., G] integers
    s2, z = group_grid(w8.amin(dim=-1), w8.amax(dim=-1))
    return s1[..., 0] * s2, z


@dataclass(frozen=True)
class GroupGrid:
    """The rule that gives each group of one weight its (scale, zero): ``grid(wg)`` for groups wg [N, ..., G] of
    the weight's rows -> (scale [N, ...], zero [N, ...]).

    One-level schemes: each group's own min-max grid (:func:`compute_qparams`), or its clipped one (``mse``,
    :func:`search_qparams`). Progressive schemes: the level-1 scales s1 (``channel_scale`` [N]) come from the whole
    rows of the weight :meth:`for_weight` was given (GPTQ: the original rows, before any error feedback), and each
    group's level 2 from its values as they are when its grid is fixed (:func:`progressive_qparams`).
    """

    scheme: QuantScheme
    mse: bool = False
    channel_scale: torch.Tensor | None = None

    @classmethod
    def for_weight(cls, w: torch.Tensor, scheme: QuantScheme, mse: bool = False) -> GroupGrid:
        """The grid rule of w [N, K] under ``scheme``."""
        if not scheme.progressive:
            return cls(scheme, mse)
        if mse:
            raise QuantkitError(f"{scheme.name} takes QServe's min-max grids: MSE-clipped grids (mse) do not apply")
        return cls(scheme, channel_scale=progressive_channel_scale(w))

    def __call__(self, wg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.channel_scale is not None:
            return progressive_qparams(wg, self.channel_scale)
        compute = search_qparams if self.mse else compute_qparams
        return compute(wg, self.scheme.bits, self.scheme.sym)


def quantize_with_qparams(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Codes q = clamp(round(w / scale) + zero, 0, maxq); scale and zero broadcast against w."""
    return torch.clamp(torch.round(w / scale) + zero, 0, maxq)


def grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [N, K] -> [N, n_g, G] in contiguous groups of ``group_size`` (-1: one group), the ragged last group
    zero-padded (a zero never changes a range that holds 0)."""
    n, k = w.shape
    g = k if group_size == -1 else min(group_size, k)
    n_g = -(-k // g)
    return F.pad(w, (0, n_g * g - k)).view(n, n_g, g)


def group_index(in_features: int, scheme: QuantScheme, device=None) -> torch.Tensor:
    """The contiguous group map ``g_idx[k] = k // G`` (int32 [K])."""
    return (torch.arange(in_features, device=device) // scheme.group_of(in_features)).to(torch.int32)


@dataclass
class QuantizedWeight:
    """Unpacked quantized weight.

    - ``q``: uint8 [N, K] codes
    - ``scales``: fp32 [N, n_groups]
    - ``zeros``: int32 [N, n_groups] (``2**(bits-1)`` everywhere when symmetric)
    - ``g_idx``: int32 [K], group of each input channel (non-monotonic after act-order)
    - ``channel_scale``: progressive schemes only: s1 fp32 [N]; then ``scales`` = s1 * s2 (s2: ``group_scale``)
    """

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    scheme: QuantScheme
    channel_scale: torch.Tensor | None = None

    @property
    def group_scale(self) -> torch.Tensor:
        """Progressive schemes: the integer level-2 scales s2 = scales / s1, int32 [N, n_groups]."""
        if self.channel_scale is None:
            raise QuantkitError(f"{self.scheme.name} has no level-2 group scales (not a progressive scheme)")
        return (self.scales.float() / self.channel_scale.float()[:, None]).round().to(torch.int32)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K] in ``dtype``, computed in fp32 (progressive: s1 * d, d = s2 * (q - z) an integer, as stored)."""
        g = self.g_idx.long()
        if self.channel_scale is not None:
            d = self.group_scale[:, g] * (self.q.int() - self.zeros[:, g].int())  # [N, K] int8 values
            return (self.channel_scale.float()[:, None] * d.float()).to(dtype)
        w = (self.q.float() - self.zeros.float()[:, g]) * self.scales.float()[:, g]
        return w.to(dtype)

    def pack(self) -> dict[str, torch.Tensor]:
        """GPTQ-v2 buffers: qweight int32 [ceil(K/32)*b, N], qzeros int32 [n_g, ceil(N/32)*b],
        scales fp16 [n_g, N], g_idx int32 [K]."""
        if not self.scheme.packed:
            raise QuantkitError(f"{self.scheme.name} is not stored in GPTQ-v2 buffers")
        b = self.scheme.bits
        return {
            "qweight": pack_rows(self.q.t(), b),
            "qzeros": pack_cols(self.zeros.t().to(torch.int64), b),
            "scales": self.scales.t().to(torch.float16).contiguous(),
            "g_idx": self.g_idx.to(torch.int32).contiguous(),
        }

    @classmethod
    def unpack(
        cls, buffers: dict[str, torch.Tensor], scheme: QuantScheme, in_features: int, out_features: int
    ) -> QuantizedWeight:
        b = scheme.bits
        q = unpack_rows(buffers["qweight"], b, in_features).t().contiguous()
        zeros = unpack_cols(buffers["qzeros"], b, out_features).t().to(torch.int32).contiguous()
        return cls(
            q=q,
            scales=buffers["scales"].t().float().contiguous(),
            zeros=zeros,
            g_idx=buffers["g_idx"].to(torch.int32),
            scheme=scheme,
        )
