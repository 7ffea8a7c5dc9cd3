"""Fused MoE experts: every routed expert's SiLU-gated MLP over its tokens, one grouped GEMM launch per projection.

What it computes
    For routing (weights fp32 [T, k], ids [T, k]) from ``routing.route`` and pairs p = t * k + j:
      gu[p]  = x[t] @ W13[ids[t, j]].T                         [T*k, 2I]  gate and up in one launch (W13 = [gate; up])
      a[p]   = silu(gu[p, :I]) * gu[p, I:]                      [T*k, I]   fp32, rounded once (``silu_mul``'s numerics)
      o[p]   = (a[p] @ W2[ids[t, j]].T) * weights[t, j]        [T*k, H]   the fp32 product weighted, rounded once
      y[t]   = sum_j o[t * k + j]                               [T, H]     summed over k in fp32 (no atomics: the
                                                                           same bits on every run), then rounded
    Every product accumulates in fp32 and is rounded to x's dtype (fp16, bf16 or fp32) when stored.
    ``fused_moe_reference`` defines these numerics with a plain loop over experts.

Expert weight layouts (``ExpertWeights``: one projection of every expert stacked on a leading axis E)
    float      ``weight`` [E, N, K] in x's dtype (nn.Linear's [N, K] per expert; transformers 5's fused
               ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] are this layout)
    w4a16      the W4A16 kernel layout (``kernels.w4a16.weight``) per expert: ``weight`` (qweight) int32
               [E, ceil(K/32)*b, N], ``qzeros`` int32 [E, n_g, ceil(N/32)*b], ``scales`` fp16 [E, n_g, N], groups
               contiguous along K, b = 4 or 8; W = s * (q - z) rounded once to x's dtype, as PyTorch's
               dequantize-then-matmul. Act-order experts carry ``perm`` int64 [E, K] (kernel channel i is input
               channel perm[e, i]): the kernel gathers A's columns through it, so each expert keeps its own order
    fp8_block  the block fp8 layout (``kernels.w8a8.block``) per expert: ``weight`` e4m3 [E, N, K], ``scales`` fp32
               [E, ceil(N/B), ceil(K/B)]; activations quantized per 1 x B tile of each row (``quantize_tiles``) and
               each B-long partial sum promoted to fp32 with its two scales (DeepSeek-V3's rule)

Two paths (``configs.layer_config``): up to ``DECODE_MAX_TOKENS`` tokens (measured: W4A16 1, float 0) experts take
``decode.py``'s GEMV programs over (expert block of 1-4 rows, N tile, K split) on the W4A16 gemv's unpacking: the
tiles pad an expert's rows to BLOCK_M (H100, Mixtral-8x7B W4A16, batch 1: 24% of copy bandwidth; the GEMV 52%).
Larger layers, fp8_block experts and tile configs take the tile path; ``_sum_k_kernel`` serves both (on the decode
path it also adds the down projection's K splits and applies the routing weight).

How (tile path)
    ``routing.align`` sorts the pairs by expert and pads each expert's run to BLOCK_M rows; the GEMM grid is
    [NB blocks, N / BLOCK_N] with NB an upper bound that depends on T only (no host sync, capturable). A program
    reads its block's expert; blocks past the last run exit before loading anything, so at batch 1 only the
    chosen experts' weights are read. Rows are gathered through the sorted pair ids (x's row t = p // k for the
    first GEMM, row p for the second) and stored at row p, so no permuted copy of x exists. The gate/up launch
    ends in SiLU-and-multiply: a BLOCK_N tile holds BLOCK_N / 2 gate rows of W13 and the matching up rows, so its
    epilogue rounds both to x's dtype (gu's rounding), forms silu(g) * u in fp32 and stores a [T*k, I] once per
    element (no gu buffer, no silu recomputed per down-projection tile; fp8_block quantizes a per tile between
    the launches). The down launch multiplies its fp32 result by the routing weight before the store. w4a16 tiles
    are dequantized in registers by the W4A16 GEMM's own helpers (``kernels.w4a16.gemm.dequant_tile``): each
    packed word loaded once, two codes per 32-bit operation through the "magic number" bit pattern (fp16; bf16
    converts in fp32), a word's codes kept in its thread, W rounded once to x's dtype. ``SWAP_AB`` computes
    out.T = W.T @ A.T, so the weight tile is the MMA's M side: Hopper's wgmma for a few rows per expert.
    ``SCALE_TILE`` (w4a16, off by default): the W4A16 GEMM's tile mode, the dot of the exact integers q - z (two
    codes per operation in bf16 too) and its fp32 result times s per column and K tile: fewer ALU operations per
    code, and W is never rounded, so the result is not bit-equal to ``fused_moe_reference`` (as exact or more). One more
    launch (``_sum_k_kernel``) sums each token's k rows in order in fp32 and casts them once; ``routed_moe`` routes
    and aligns a decode step in one launch (``routing.route_and_align``), so a layer is four launches.

Limits: int32 offsets within an expert and within x, a and o (the expert offset is 64-bit); the interpreter
computes bf16 in fp32 and rounds by hand (``EMULATE_BF16``). Hardware: compiled offline for sm_90 with Triton 3.6
(loads pipelined through cp.async, wgmma for the 64-row tiles). Tile configs (``configs.moe_config``): a table per
format and layer shape by tokens (``TUNED_CONFIGS``, from ``benchmarks/bench_moe.py --sweep``), else per-format
first choices by the mean rows per expert.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from quantkit.kernels._device import dot_precision, interpreting
from quantkit.kernels.dense.norm_rope import silu_mul_reference
from quantkit.kernels.moe.configs import DECODE_LOCK_SLOTS, FORMATS, block_k, layer_config
from quantkit.kernels.moe.decode import decode_experts
from quantkit.kernels.moe.routing import align, max_blocks, route_and_align
from quantkit.kernels.w4a16.epilogue import to_act
from quantkit.kernels.w4a16.gemm import dequant_tile, load_group, magic_pattern, pattern_pair
from quantkit.kernels.w4a16.weight import W4A16Weight, unpack_gptq_codes
from quantkit.kernels.w8a8.block import (
    BLOCK_SIZES,
    fp8_block_matmul_reference,
    quantize_tiles,
    quantize_tiles_reference,
)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class ExpertWeights:
    """One projection of all E experts, stacked (layouts in the module docstring): ``fmt`` one of FORMATS,
    ``in_features`` K and ``out_features`` N per expert; ``bits`` (w4a16) 4 or 8; ``group_size`` w4a16's
    contiguous group length (0: one group) or fp8_block's B; ``perm`` (w4a16 act-order) int64 [E, K]; ``locks``
    int32 [DECODE_LOCK_SLOTS] zeros: the decode path's split-K semaphores, reset by its kernel after every use."""

    fmt: str
    weight: torch.Tensor
    in_features: int
    out_features: int
    scales: torch.Tensor | None = None
    qzeros: torch.Tensor | None = None
    bits: int = 0
    group_size: int = 0
    perm: torch.Tensor | None = None
    locks: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # the decode path's split-K semaphores (``decode.py``), zero between launches: one stream at a time
        self.locks = torch.zeros(DECODE_LOCK_SLOTS, dtype=torch.int32, device=self.weight.device)

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    @classmethod
    def from_float(cls, weights: Sequence[torch.Tensor]) -> ExpertWeights:
        """From each expert's [N, K] float weight."""
        w = torch.stack(list(weights))
        return cls("float", w, w.shape[2], w.shape[1])

    @classmethod
    def from_w4a16(cls, weights: Sequence[W4A16Weight]) -> ExpertWeights:
        """From each expert's kernel-ready W4A16 weight (``prepare_gptq_weight``); all of one shape and scheme."""
        first = weights[0]
        for w in weights:
            if (w.bits, w.group_size, w.in_features, w.out_features) != (
                first.bits, first.group_size, first.in_features, first.out_features
            ):  # fmt: skip
                raise ValueError("experts must share bits, group size and shape")
        qweight, scales, qzeros = (
            torch.stack([getattr(w, n) for w in weights]) for n in ("qweight", "scales", "qzeros")
        )
        perm = None
        if any(w.perm is not None for w in weights):  # act-order: each expert's own order (identity where none)
            ident = torch.arange(first.in_features, device=qweight.device)
            perm = torch.stack([w.perm if w.perm is not None else ident for w in weights]).long()
        return cls("w4a16", qweight, first.in_features, first.out_features, scales, qzeros, first.bits,
                   first.group_size, perm)  # fmt: skip

    @classmethod
    def from_fp8_block(cls, weights: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], block: int):
        """From each expert's e4m3 [N, K] weight and fp32 [ceil(N/B), ceil(K/B)] block scales."""
        w = torch.stack(list(weights))
        return cls("fp8_block", w, w.shape[2], w.shape[1], torch.stack(list(scales)), group_size=block)

    def dequantize(self, e: int) -> torch.Tensor:
        """Expert e's weight [N, K] in fp32 (the reference's operand; w4a16: s * (q - z) in fp32)."""
        if self.fmt == "float":
            return self.weight[e].float()
        if self.fmt == "fp8_block":
            b = self.group_size
            s = self.scales[e].repeat_interleave(b, 0).repeat_interleave(b, 1)
            return self.weight[e].float() * s[: self.out_features, : self.in_features]
        k, n = self.in_features, self.out_features
        q = unpack_gptq_codes(self.weight[e], self.bits, k).float()  # [K, N]
        z = unpack_gptq_codes(self.qzeros[e].t().contiguous(), self.bits, n).t().float()  # [n_g, N]
        g = torch.arange(k, device=q.device) // (self.group_size or k)
        w = ((q - z[g]) * self.scales[e].float()[g]).t()  # [N, K] in kernel channel order
        if self.perm is None:
            return w
        return torch.empty_like(w).index_copy_(1, self.perm[e], w)  # input channel perm[e, i] <- kernel channel i


def check_weights(w: ExpertWeights, x_dtype: torch.dtype) -> None:
    """Shapes and dtypes of one stacked projection for activations of ``x_dtype``; raises ValueError."""
    e, n, k = w.num_experts, w.out_features, w.in_features
    if w.fmt not in FORMATS:
        raise ValueError(f"expert weight format must be one of {FORMATS}, got {w.fmt!r}")
    if w.fmt == "float" and (w.weight.dtype != x_dtype or tuple(w.weight.shape) != (e, n, k)):
        raise ValueError(
            f"float experts must be {x_dtype} [{e}, {n}, {k}], got {w.weight.dtype} {tuple(w.weight.shape)}"
        )
    if w.fmt == "w4a16":
        rows, n_g = -(-k // 32) * w.bits, w.scales.shape[1]
        if w.bits not in (4, 8) or x_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"w4a16 experts need 4 or 8 bits and fp16/bf16 x, got {w.bits} bits, {x_dtype}")
        if w.weight.dtype != torch.int32 or tuple(w.weight.shape) != (e, rows, n):
            raise ValueError(f"qweight must be int32 [{e}, {rows}, {n}], got {w.weight.dtype} {tuple(w.weight.shape)}")
        if tuple(w.qzeros.shape) != (e, n_g, -(-n // 32) * w.bits) or w.scales.dtype != torch.float16:
            raise ValueError(f"qzeros/scales must be [{e}, {n_g}, ...] int32 / float16, got {w.qzeros.shape}")
        if w.group_size % 32 or (w.group_size and n_g != -(-k // w.group_size)):
            raise ValueError(f"group size {w.group_size} must be 0 or a multiple of 32 matching {n_g} groups")
    if w.fmt == "fp8_block":
        b = w.group_size
        if b not in BLOCK_SIZES or w.weight.dtype != torch.float8_e4m3fn or tuple(w.weight.shape) != (e, n, k):
            raise ValueError(f"fp8_block experts must be e4m3 [{e}, {n}, {k}] with B in {BLOCK_SIZES}, got "
                             f"{w.weight.dtype} {tuple(w.weight.shape)}, B = {b}")  # fmt: skip
        if w.scales.dtype != torch.float32 or tuple(w.scales.shape) != (e, -(-n // b), -(-k // b)):
            raise ValueError(f"fp8_block scales must be fp32 [{e}, {-(-n // b)}, {-(-k // b)}]")
    if w.weight.stride(-1) != 1 and w.fmt != "w4a16":
        raise ValueError("expert weights must be contiguous along K")


# ----------------------------------------------------------------------------------------------------------------
# Reference (plain PyTorch): a loop over experts, the numerics of the module docstring.
# ----------------------------------------------------------------------------------------------------------------


def _project_reference(a: torch.Tensor, w: ExpertWeights, e: int) -> torch.Tensor:
    """fp32 a [R, K] (x's dtype; fp8_block: quantized per tile here) @ W_e.T -> fp32 [R, N]."""
    if w.fmt == "fp8_block":
        qa, a_scale = quantize_tiles_reference(a, w.group_size)
        return fp8_block_matmul_reference(qa, a_scale, w.weight[e], w.scales[e], w.group_size, None, torch.float32)
    return a.float() @ w.dequantize(e).to(a.dtype).float().t()  # w4a16: W rounded once to x's dtype


def fused_moe_reference(
    x: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """y [T, H] in x's dtype: the module docstring's formulas, expert by expert."""
    t, k = ids.shape
    inter = w2.in_features
    out = torch.zeros(t * k, x.shape[1], dtype=x.dtype, device=x.device)
    flat = ids.reshape(-1).long()
    for e in range(w13.num_experts):
        pairs = (flat == e).nonzero().flatten()
        if pairs.numel() == 0:
            continue
        gu = _project_reference(x[pairs // k], w13, e).to(x.dtype)
        a = silu_mul_reference(gu[:, :inter], gu[:, inter:])
        out[pairs] = (_project_reference(a, w2, e) * weights.reshape(-1)[pairs, None].float()).to(x.dtype)
    return out.view(t, k, x.shape[1]).float().sum(dim=1).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------------

FLOAT, W4A16, FP8_BLOCK = 0, 1, 2
_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_FORMAT_CODE = {"float": FLOAT, "w4a16": W4A16, "fp8_block": FP8_BLOCK}


@triton.jit(do_not_specialize=["P", "magic_pair"])
def _moe_gemm_kernel(
    # pointers
    a_ptr, a_scale_ptr, w_ptr, z_ptr, s_ptr, perm_ptr, out_ptr, pairs_ptr, block_expert_ptr, route_w_ptr,
    # sizes
    N, K, P, group_size, glu_offset, a_div,
    # w4a16: MAGIC:MAGIC as a run-time value (kept in a register, as the W4A16 GEMM does)
    magic_pair,
    # strides
    stride_am, stride_ak, stride_asm, stride_we, stride_wk, stride_wn, stride_ze, stride_zg, stride_zn,
    stride_se, stride_sg, stride_sn, stride_pe, stride_om, stride_on,
    # meta-parameters
    FORMAT: tl.constexpr, PERM: tl.constexpr, BITS: tl.constexpr, GLU: tl.constexpr,
    WEIGHTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr,
    SCALE_TILE: tl.constexpr,
    COMPUTE: tl.constexpr, PRECISION: tl.constexpr, MAGIC: tl.constexpr, HALF_SCALE: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # past the last run: nothing to compute, no weight read
        return
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < P
    a_rows = tl.where(valid, pairs // a_div, 0)  # a run-time value: both layer shapes share one compiled kernel
    if GLU:  # gate/up: the tile's first half holds gate rows n0 + j of W13, its second half up rows I + n0 + j
        HALF: tl.constexpr = BLOCK_N // 2
        col = tl.arange(0, BLOCK_N)
        offs_out = pid_n * HALF + col % HALF  # the column of a = silu(g) * u that both halves feed
        offs_n = offs_out + (col // HALF) * glu_offset
        n_mask = offs_out < glu_offset
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    e64 = expert.to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_base = w_ptr + e64 * stride_we
    if SWAP_AB:  # out.T = W.T @ A.T: the weight tile is the MMA's M side (wgmma even for a few rows of A)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        a_mask = valid[:, None] & k_mask[None, :]
        if PERM:  # act-order: kernel channel kk is A's column perm[e, kk]
            cols = tl.load(perm_ptr + e64 * stride_pe + kk, mask=k_mask, other=0).to(tl.int32)
            a_tile = a_ptr + a_rows[:, None] * stride_am + cols[None, :] * stride_ak
        else:
            a_tile = a_ptrs + k0 * stride_ak
        a = tl.load(a_tile, mask=a_mask, other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        if FORMAT == 2:  # fp8_block: a B-long partial sum of codes, promoted with its two scales (BLOCK_K = B)
            w = tl.load(w_base + kk[:, None] * stride_wk + offs_n[None, :] * stride_wn, mask=w_mask, other=0.0)
            j = k0 // BLOCK_K
            a_s = tl.load(a_scale_ptr + a_rows * stride_asm + j)
            w_s = tl.load(s_ptr + e64 * stride_se + (offs_n // BLOCK_K) * stride_sg + j * stride_sn, mask=n_mask,
                          other=0.0)  # fmt: skip
            if SWAP_AB:
                acc += tl.dot(tl.trans(w), tl.trans(a)) * w_s[:, None] * a_s[None, :]
            else:
                acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        else:
            if FORMAT == 0:  # float [E, N, K], read as a [BLOCK_K, BLOCK_N] tile
                w = tl.load(w_base + kk[:, None] * stride_wk + offs_n[None, :] * stride_wn, mask=w_mask, other=0.0)
            else:  # w4a16: the W4A16 GEMM's unpacking, W = s * (q - z) rounded once to x's dtype (a tile: one group)
                PF: tl.constexpr = 32 // BITS
                FUSE_SCALE: tl.constexpr = not SCALE_TILE
                rows = k0 // PF + tl.arange(0, BLOCK_K // PF)  # packed-word rows of this tile (BLOCK_K % 32 == 0)
                words = tl.load(w_base + rows[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                                mask=(rows * PF < K)[:, None] & n_mask[None, :], other=0)  # fmt: skip
                zeros, scales = load_group(z_ptr + e64 * stride_ze, s_ptr + e64 * stride_se, k0 // group_size,
                                           offs_n[None, :], n_mask[None, :], stride_zg, stride_zn, stride_sg,
                                           stride_sn, BITS)  # fmt: skip
                w = dequant_tile(words, zeros, scales, magic_pair, a_ptr.dtype.element_ty, COMPUTE, BITS, MAGIC,
                                 FUSE_SCALE, HALF_SCALE, EMULATE_BF16)  # fmt: skip
            if FORMAT == 1 and SCALE_TILE:  # w holds the exact q - z: the dot's fp32 result is scaled per column
                if SWAP_AB:
                    acc += tl.dot(tl.trans(w), tl.trans(a.to(COMPUTE))) * tl.trans(scales.to(tl.float32))
                else:
                    acc += tl.dot(a.to(COMPUTE), w) * scales.to(tl.float32)
            elif SWAP_AB:
                acc = tl.dot(tl.trans(w.to(COMPUTE)), tl.trans(a.to(COMPUTE)), acc, input_precision=PRECISION)
            else:
                acc = tl.dot(a.to(COMPUTE), w.to(COMPUTE), acc, input_precision=PRECISION)
    if SWAP_AB:
        acc = tl.trans(acc)
    ACT: tl.constexpr = out_ptr.dtype.element_ty
    if GLU:  # g and u rounded to x's dtype (the layer's gu), then silu(g) * u in fp32, rounded once when stored
        gu = to_act(acc, ACT, EMULATE_BF16).to(tl.float32)
        g, u = tl.split(tl.permute(tl.reshape(gu, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        acc = g / (1.0 + tl.exp(-g)) * u
        offs_c = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        c_mask = offs_c < glu_offset
    else:
        offs_c = offs_n
        c_mask = n_mask
    if WEIGHTED:
        acc = acc * tl.load(route_w_ptr + pairs, mask=valid, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs[:, None] * stride_om + offs_c[None, :] * stride_on
    tl.store(out_ptrs, to_act(acc, ACT, EMULATE_BF16), mask=valid[:, None] & c_mask[None, :])


@triton.jit
def _sum_k_kernel(o_ptr, w_ptr, y_ptr, H, splits, stride_os, stride_om, stride_ym, TOP_K: tl.constexpr,
                  SPLITS_PAD: tl.constexpr, BLOCK_H: tl.constexpr, WEIGHTED: tl.constexpr, ACT: tl.constexpr,
                  EMULATE_ACT: tl.constexpr, EMULATE_BF16: tl.constexpr):  # fmt: skip
    """y[t] = sum_j o[t * TOP_K + j] in fp32, j in order (the same bits on every run), cast once to y's dtype.
    o [splits, T * TOP_K, H]: each row the sum of its splits (all loaded at once, one fixed reduction tree; splits
    <= SPLITS_PAD); WEIGHTED (o holds the down projection's fp32 partials): times the pair's routing weight and
    rounded to ACT first (o's rounding in the reference). EMULATE_ACT / EMULATE_BF16: the interpreter's rounding to
    bf16 of o / y."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    offs_s = tl.arange(0, SPLITS_PAD)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = o_ptr + (t * TOP_K + j) * stride_om + offs
        if SPLITS_PAD == 1:
            o = tl.load(row, mask=mask, other=0.0).to(tl.float32)
        else:
            parts = tl.load(row[None, :] + offs_s[:, None] * stride_os, mask=(offs_s < splits)[:, None] & mask[None, :],
                            other=0.0)  # fmt: skip
            o = tl.sum(parts.to(tl.float32), axis=0)
        if WEIGHTED:
            o = to_act(o * tl.load(w_ptr + t * TOP_K + j), ACT, EMULATE_ACT).to(tl.float32)
        acc += o
    tl.store(y_ptr + t * stride_ym + offs, to_act(acc, y_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------


def _grouped_gemm(a, a_scale, w: ExpertWeights, out, pairs, block_expert, route_w, p, a_div, glu, cfg) -> None:
    """One launch: out[p] = A[p // a_div] @ W_e.T (glu: silu(gate) * up of W = [gate; up], out [P, N / 2];
    route_w: times the pair's weight)."""
    n, k = w.out_features, w.in_features
    emulate = interpreting() and out.dtype == torch.bfloat16
    act = a.dtype
    compute = tl.float32 if emulate or act == torch.float32 else (tl.float16 if act == torch.float16 else tl.bfloat16)
    z = w.qzeros if w.qzeros is not None else w.weight
    s = w.scales if w.scales is not None else w.weight
    a_s = a_scale if a_scale is not None else a
    if w.fmt == "w4a16":  # qweight [E, K/pf, N]: strides as (e, k, n)
        wst = (w.weight.stride(0), w.weight.stride(1), w.weight.stride(2))
    else:  # [E, N, K]
        wst = (w.weight.stride(0), w.weight.stride(2), w.weight.stride(1))
    zst = (z.stride(0), z.stride(1), z.stride(2)) if w.qzeros is not None else (0, 0, 0)
    sst = (s.stride(0), s.stride(1), s.stride(2)) if w.scales is not None else (0, 0, 0)
    grid = (block_expert.numel(), triton.cdiv(n // 2, cfg["BLOCK_N"] // 2) if glu else triton.cdiv(n, cfg["BLOCK_N"]))
    perm = w.perm if w.perm is not None else w.weight
    magic = magic_pattern(w.bits, act) if w.fmt == "w4a16" else 0
    _moe_gemm_kernel[grid](
        a, a_s, w.weight, z, s, perm, out, pairs, block_expert, route_w if route_w is not None else out,
        n, k, p, (w.group_size or 2**30) if w.fmt == "w4a16" else 0, n // 2 if glu else 0, a_div, pattern_pair(magic),
        a.stride(0), a.stride(1), a_s.stride(0), *wst, *zst, *sst, perm.stride(0), out.stride(0),
        out.stride(1), FORMAT=_FORMAT_CODE[w.fmt], PERM=w.perm is not None, BITS=w.bits, GLU=glu,
        WEIGHTED=route_w is not None, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=block_k(w.fmt, w.group_size, cfg),
        SWAP_AB=bool(cfg.get("SWAP_AB", 0)), SCALE_TILE=w.fmt == "w4a16" and bool(cfg.get("SCALE_TILE", 0)),
        COMPUTE=compute, PRECISION=dot_precision(act), MAGIC=magic,
        HALF_SCALE=act == torch.float16, EMULATE_BF16=emulate, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )  # fmt: skip


def check_operands(x, w13: ExpertWeights, w2: ExpertWeights, weights, ids) -> None:
    """One line per mismatch of ``fused_moe``'s operands; raises ValueError."""
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be fp16/bf16/fp32 [T, H], got {x.dtype} {tuple(x.shape)}")
    if not (x.is_cuda or interpreting()):
        raise ValueError("x must be a CUDA tensor (or set TRITON_INTERPRET=1 to run the kernels on CPU)")
    t, h = x.shape
    check_weights(w13, x.dtype)
    check_weights(w2, x.dtype)
    if w13.fmt != w2.fmt or w13.num_experts != w2.num_experts:
        raise ValueError("gate/up and down weights must share format and expert count")
    if w13.in_features != h or w2.out_features != h or w13.out_features != 2 * w2.in_features:
        raise ValueError(f"need W13 [E, 2I, {h}] and W2 [E, {h}, I], got {w13.out_features} x {w13.in_features} "
                         f"and {w2.out_features} x {w2.in_features}")  # fmt: skip
    if ids.dim() != 2 or ids.shape[0] != t or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be int32/int64 [{t}, k], got {ids.dtype} {tuple(ids.shape)}")
    if weights.shape != ids.shape or weights.dtype != torch.float32:
        raise ValueError(f"weights must be fp32 {tuple(ids.shape)}, got {weights.dtype} {tuple(weights.shape)}")
    if x.stride(1) != 1:
        raise ValueError("x must be contiguous along H")
    if len({v.device for v in (x, w13.weight, w2.weight, weights, ids)}) != 1:
        raise ValueError("x, the expert weights and the routing must be on one device")
    if t * ids.shape[1] * max(h, w13.out_features) >= 2**31:
        raise ValueError("T * k rows of 2I or H values must stay under 2**31 elements (32-bit offsets)")


def fused_moe(
    x: torch.Tensor,
    w13: ExpertWeights,
    w2: ExpertWeights,
    weights: torch.Tensor,
    ids: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    config: dict[str, int] | None = None,
    aligned: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """y [T, H] (``out_dtype``, default x's: fp32 keeps the sum over k unrounded) of the routed experts.
    ``config``: a tile config (keys of ``moe_config``) or, with ``DECODE`` 1, a decode config (``decode_config``);
    None: ``configs.layer_config`` picks by T (the decode path up to ``DECODE_MAX_TOKENS``).
    ``aligned``: ``align(ids, E, BLOCK_M)`` already computed (``route_and_align``) for the config's BLOCK_M."""
    check_operands(x, w13, w2, weights, ids)
    t, h = x.shape
    k = ids.shape[1]
    p, inter = t * k, w2.in_features
    if p == 0:
        return torch.zeros(t, h, dtype=out_dtype or x.dtype, device=x.device)
    cfg = layer_config(t, k, w13.num_experts, w13.fmt, h, inter, config, x.element_size())
    if aligned is None:
        aligned = align(ids, w13.num_experts, cfg["BLOCK_M"])
    pairs, block_expert = aligned
    nb = max_blocks(p, w13.num_experts, cfg["BLOCK_M"])
    if block_expert.shape != (nb,) or pairs.shape != (nb * cfg["BLOCK_M"],):
        raise ValueError(f"aligned must be align(ids, {w13.num_experts}, {cfg['BLOCK_M']}) ([{nb * cfg['BLOCK_M']}] "
                         f"and [{nb}]), got {tuple(pairs.shape)} and {tuple(block_expert.shape)}")  # fmt: skip
    route_w = weights.reshape(-1).contiguous()
    if cfg["DECODE"]:  # fp32 partials of the down projection: weighted and rounded by the sum below
        o, splits = decode_experts(x, w13, w2, ids, pairs, block_expert, cfg)
    else:
        splits = 1
        act = torch.empty(p, inter, dtype=x.dtype, device=x.device)  # silu(g) * u of every pair
        o = torch.empty(p, h, dtype=x.dtype, device=x.device)
        if w13.fmt == "fp8_block":
            qx, x_scale = quantize_tiles(x, w13.group_size)
            _grouped_gemm(qx, x_scale, w13, act, pairs, block_expert, None, p, k, True, cfg)
            qa, a_scale = quantize_tiles(act, w2.group_size)
            _grouped_gemm(qa, a_scale, w2, o, pairs, block_expert, route_w, p, 1, False, cfg)
        else:
            _grouped_gemm(x, None, w13, act, pairs, block_expert, None, p, k, True, cfg)
            _grouped_gemm(act, None, w2, o, pairs, block_expert, route_w, p, 1, False, cfg)
    y = torch.empty(t, h, dtype=out_dtype or x.dtype, device=x.device)
    pad = triton.next_power_of_2(splits)
    block_h = min(max(32, 2048 // pad), 1024, triton.next_power_of_2(h))  # 16 partials per thread and pair
    _sum_k_kernel[(t, triton.cdiv(h, block_h))](
        o, route_w, y, h, splits, o.stride(0) if splits > 1 else 0, o.stride(-2), y.stride(0), TOP_K=k,
        SPLITS_PAD=pad, BLOCK_H=block_h, WEIGHTED=bool(cfg["DECODE"]), ACT=_TL_DTYPE[x.dtype],
        EMULATE_ACT=interpreting() and x.dtype == torch.bfloat16,
        EMULATE_BF16=interpreting() and y.dtype == torch.bfloat16, num_warps=4,
    )  # fmt: skip
    return y


def routed_moe(
    x: torch.Tensor,
    logits: torch.Tensor,
    w13: ExpertWeights,
    w2: ExpertWeights,
    top_k: int,
    out_dtype: torch.dtype | None = None,
    config: dict[str, int] | None = None,
    **routing,
) -> torch.Tensor:
    """``fused_moe`` of ``route(logits, top_k, **routing)``, with routing and alignment in one launch where
    ``route_and_align`` allows it (a decode step: route, one grouped GEMM per projection, the sum). ``config`` as
    ``fused_moe``'s: None takes the decode path (``decode.py``) up to ``configs.layer_config``'s threshold
    (``DECODE_MAX_TOKENS``)."""
    t, h = x.shape
    if logits.shape != (t, w13.num_experts):
        raise ValueError(f"logits must be [{t}, {w13.num_experts}], got {tuple(logits.shape)}")
    cfg = layer_config(t, top_k, w13.num_experts, w13.fmt, h, w2.in_features, config, x.element_size())
    weights, ids, pairs, block_expert = route_and_align(logits, top_k, cfg["BLOCK_M"], **routing)
    return fused_moe(x, w13, w2, weights, ids, out_dtype, cfg, (pairs, block_expert))
