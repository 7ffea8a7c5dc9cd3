"""Bit packing of integer codes into int32 words, in the GPTQ ``qweight`` / ``qzeros`` order.

Codes are unsigned integers in ``[0, 2**bits - 1]``. Along the packed dimension every run of 32 codes becomes
``bits`` int32 words forming one little-endian bit stream: code ``j`` of the run occupies bits
``j*bits .. j*bits + bits - 1`` of the stream, so for 2/4/8 bits word ``r`` holds codes ``r*pf .. r*pf + pf - 1``
(``pf = 32 / bits``, lowest bits first) and 3-bit codes straddle word boundaries. This is exactly the layout the
GPTQ format uses (AutoGPTQ's packing). A packed dimension that is not a multiple of 32 is padded with zero codes, so
``packed_rows(K, bits) = ceil(K / 32) * bits``; when ``K % 32 == 0`` this equals GPTQ's ``K * bits / 32``.
"""

from __future__ import annotations

from enum import Enum

import torch

WORD_BITS = 32
CODES_PER_RUN = 32  # one run of 32 codes fills exactly `bits` words for any bits


class Layout(str, Enum):
    """On-disk layouts of packed weights. The version of each is in ``LAYOUT_VERSIONS``.

    ``gptq_v2``: ``qweight`` int32 [ceil(K/32)*b, N] packed along the input dimension; ``qzeros`` int32
    [n_groups, ceil(N/32)*b] packed along the output dimension, zero points stored as they are (no v1 "-1");
    ``scales`` fp16 [n_groups, N]; ``g_idx`` int32 [K]; optional ``bias`` [N].

    ``int8_rowmajor``: W8A8 integer: ``weight`` int8 [N, K], ``weight_scale`` fp32 [N], optional
    ``input_scale`` fp32 [1] (static activations), optional ``bias`` [N].

    ``fp8_rowmajor``: W8A8 fp8 e4m3: ``weight`` float8_e4m3fn [N, K], ``weight_scale`` fp32 [N],
    optional ``input_scale`` fp32 [1], optional ``bias`` [N].

    ``fp8_block``: block-wise W8A8 fp8 (block B): ``weight`` float8_e4m3fn [N, K], ``weight_scale`` fp32
    [ceil(N/B), ceil(K/B)] with ``W[n, k] ~= weight[n, k] * weight_scale[n // B, k // B]``, optional ``bias`` [N].

    ``progressive_w4a8``: QServe's two-level W4A8 (``quantkit.nn.progressive``): ``qweight`` int32 [ceil(K/32)*4, N]
    in the progressive kernel's packing, ``weight_scale`` fp32 [N], ``group_scale`` and ``group_zero`` uint8
    [n_groups, N], ``perm`` int32 [K], optional ``bias`` [N]; ``W[:, perm[j]] = weight_scale * group_scale[g] *
    (code[:, j] - group_zero[g])`` with g = j // group_size.
    """

    GPTQ_V2 = "gptq_v2"
    INT8_ROWMAJOR = "int8_rowmajor"
    FP8_ROWMAJOR = "fp8_rowmajor"
    FP8_BLOCK = "fp8_block"
    PROGRESSIVE_W4A8 = "progressive_w4a8"


LAYOUT_VERSIONS = {
    Layout.GPTQ_V2: 1,
    Layout.INT8_ROWMAJOR: 1,
    Layout.FP8_ROWMAJOR: 1,
    Layout.FP8_BLOCK: 1,
    Layout.PROGRESSIVE_W4A8: 1,
}


def packed_rows(n: int, bits: int) -> int:
    """Number of int32 words that hold ``n`` codes of ``bits`` bits (padded to whole runs of 32)."""
    return -(-n // CODES_PER_RUN) * bits


def _bit_positions(bits: int):
    """For each code j of a run: (word index, shift, number of bits spilling into the next word)."""
    for j in range(CODES_PER_RUN):
        offset = j * bits
        word, shift = divmod(offset, WORD_BITS)
        spill = max(0, shift + bits - WORD_BITS)
        yield j, word, shift, spill


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes along dim 0: [K, N] integer -> int32 [ceil(K/32)*bits, N]."""
    if codes.dim() != 2:
        raise ValueError(f"pack_rows expects a 2-D tensor, got shape {tuple(codes.shape)}")
    k, n = codes.shape
    runs = -(-k // CODES_PER_RUN)
    c = torch.zeros(runs * CODES_PER_RUN, n, dtype=torch.int64, device=codes.device)
    c[:k] = codes.to(torch.int64)
    if int(c.min()) < 0 or int(c.max()) >= 2**bits:
        raise ValueError(f"codes out of range for {bits}-bit packing")
    c = c.view(runs, CODES_PER_RUN, n)  # [runs, 32, N]
    words = torch.zeros(runs, bits, n, dtype=torch.int64, device=codes.device)
    for j, word, shift, spill in _bit_positions(bits):
        words[:, word] |= (c[:, j] << shift) & 0xFFFFFFFF
        if spill:
            words[:, word + 1] |= c[:, j] >> (bits - spill)
    words = words.view(runs * bits, n)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # reinterpret the low 32 bits as signed


def unpack_rows(words: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_rows`: int32 [ceil(K/32)*bits, N] -> uint8 codes [K, N]."""
    rows, n = words.shape
    if rows % bits:
        raise ValueError(f"{rows} packed rows is not a whole number of {bits}-bit runs")
    runs = rows // bits
    if runs * CODES_PER_RUN < k:
        raise ValueError(f"{rows} packed rows hold at most {runs * CODES_PER_RUN} codes, need {k}")
    w = words.to(torch.int64).view(runs, bits, n) & 0xFFFFFFFF
    mask = 2**bits - 1
    codes = torch.empty(runs, CODES_PER_RUN, n, dtype=torch.int64, device=words.device)
    for j, word, shift, spill in _bit_positions(bits):
        v = w[:, word] >> shift
        if spill:
            v = v | (w[:, word + 1] << (bits - spill))
        codes[:, j] = v & mask
    return codes.view(runs * CODES_PER_RUN, n)[:k].to(torch.uint8)


def pack_cols(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack along dim 1 (the ``qzeros`` direction): [G, N] -> int32 [G, ceil(N/32)*bits]."""
    return pack_rows(codes.t(), bits).t().contiguous()


def unpack_cols(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_cols`: int32 [G, ceil(N/32)*bits] -> uint8 [G, N]."""
    return unpack_rows(words.t(), bits, n).t().contiguous()
