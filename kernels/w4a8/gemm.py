"""W4A8 GEMM (Triton): 8-bit activations x 4-bit weights turned into 8-bit operands in registers, int8 or fp8 e4m3.

What it computes
    y[m, n] = a_scale[m] * sum_g s[g, n] * sum_{k in g} qa[m, k] * (q[k, n] - z[g, n])  (+ bias[n])
    with qa, a_scale the per-token codes and fp32 scales of ``w8a8.quant.quantize_activations`` (int8 symmetric,
    QMAX 127, or e4m3, QMAX 448), q, z the 4-bit codes and zero points of a GPTQ-v2 weight (``W4A16Weight``: z = 8
    for symmetric layers, so q - z lies in [-8, 7]; asymmetric: in [-15, 15]) and s its fp16 group scales.
    int8: q - z is an int8 operand, each group's partial sum is an int32 MMA accumulation (exact: |sum| <=
    127 * 15 * K), converted to fp32, multiplied by s[g, n] and added into the fp32 accumulator; per-channel weights
    (one group) are scaled once at the end. fp8: the same with q - z as e4m3 (integers up to 16 are exact there),
    an fp32 partial sum per group (on sm_90 each BLOCK_K of products is promoted into it, as in ``w8a8/gemm.py``).
    Epilogue: times a_scale[m], plus bias, one rounding to the output dtype (fp16 / bf16 / fp32).

Layouts consumed
    qa [M, K] int8 | float8_e4m3fn (any strides; in the weight's kernel channel order: act-order callers permute
    x's columns first), a_scale fp32 [M]; the weight in ``KERNEL_LAYOUT`` (``w4a16/weight.py``): qweight int32
    [ceil(K/32)*4, N] (8 codes per word along K, lowest bits first), qzeros int32 [n_g, ceil(N/32)*4], scales fp16
    [n_g, N], groups contiguous along K (``group_size`` 0: one group). bias [N] any float dtype.

How
    Tiles of BLOCK_M x BLOCK_N outputs (GROUP_M row tiles at a time for L2 reuse), an outer loop over the weight
    groups a program's K range meets and an inner loop of BLOCK_K steps inside one group (``plan_launch`` caps
    BLOCK_K so that it divides the group). The weight tile is loaded as words [BLOCK_N, BLOCK_K / 8] and unpacked
    in registers to [BLOCK_N, BLOCK_K] (K contiguous: the K-major B operand that 8-bit wgmma reads); tl.join keeps
    a word's eight codes in its thread. SWAP_AB computes y.T = W @ qa.T, so that the weight tile is the MMA's M
    side and a few rows of x still fill a 64-row wgmma (the small-M path). Split-K (grid axis 1 > 1): W4A16's
    one-launch serial fix-up (``w4a16.epilogue.finish_tile``): each split writes a_scale * partial to an fp32
    buffer [split, M, N] and counts itself in on the output tile's semaphore in ``W4A16Weight.locks``; the last
    arrival adds the splits in order (deterministic), adds the bias, casts and resets the semaphore. No second
    launch: at decode sizes a launch gap costs as much as the product.

Limits: 4-bit weights only; groups a multiple of 32 (``w4a16.unsupported_reason``); int32 offsets (tensors under
2**31 elements); the split-K semaphores live in the weight, so one weight must not run on two streams at once.
In Triton's interpreter the bf16 cast truncates, so the store rounds to nearest even by hand.
Hardware: written for sm_90 (8-bit wgmma); compiled offline for sm_90 with Triton 3.6 and 3.9 (wgmma s8.s8 and
e4m3.e4m3, ``dispatch.CONFIG_TABLE``'s tiles without register spills); correct on an H100 (its tests), not tuned: it
runs decode products at 1.33x bf16 cuBLAS but M >= 64 at 0.2-0.6x (docs/results/w4a8.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quantkit.kernels._device import interpreting
from quantkit.kernels.w4a16.epilogue import finish_tile
from quantkit.kernels.w4a16.weight import W4A16Weight, unpack_gptq_codes
from quantkit.kernels.w8a8.gemm import grouped_tile
from quantkit.kernels.w8a8.quant import FLOAT_DTYPES, FORMAT_OF_DTYPE, quantize_activations_reference, require

CODES_PER_WORD = 8


# ---------------------------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------------------------
def signed_codes(w: W4A16Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(q - z as int32 [K, N], fp32 scale of each weight [K, N]), both in kernel channel order."""
    k, n = w.in_features, w.out_features
    q = unpack_gptq_codes(w.qweight, 4, k)  # [K, N]
    zeros = unpack_gptq_codes(w.qzeros.t().contiguous(), 4, n).t()  # [n_g, N]
    g = torch.arange(k, device=q.device) // (w.group_size or k)  # [K] group of each kernel channel
    return q - zeros[g], w.scales.float()[g]


def w4a8_reference(
    x: torch.Tensor, w: W4A16Weight, bias: torch.Tensor | None = None, fmt: str = "int8"
) -> torch.Tensor:
    """float64 y [..., N] of the quantized operands: x [..., K] (checkpoint channel order) permuted for act-order,
    quantized per token (``quantize_activations_reference``), times the exact 4-bit weight s * (q - z)."""
    require(w.bits == 4, f"W4A8 needs 4-bit weights, got {w.bits}-bit")
    x2 = x.reshape(-1, x.shape[-1])
    if w.perm is not None:
        x2 = x2.index_select(1, w.perm)
    qa, a_scale = quantize_activations_reference(x2, fmt)
    codes, scales = signed_codes(w)
    y = (qa.double() @ (codes.double() * scales.double())) * a_scale.double()[:, None]
    if bias is not None:
        y = y + bias.double()
    return y.reshape(*x.shape[:-1], w.out_features)


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def codes_along_k(words):
    """int32 words [R, C] -> 4-bit codes [R, C * 8], code j of word c at column c * 8 + j.

    The joins nest so that the last one's selector becomes the least significant bit of j: the leaf pairs are
    (j, j + 4), then (j, j + 2) pairs of those, then (j, j + 1)."""
    c0 = words & 15
    c1 = (words >> 4) & 15
    c2 = (words >> 8) & 15
    c3 = (words >> 12) & 15
    c4 = (words >> 16) & 15
    c5 = (words >> 20) & 15
    c6 = (words >> 24) & 15
    c7 = (words >> 28) & 15
    even = tl.join(tl.join(c0, c4), tl.join(c2, c6))
    odd = tl.join(tl.join(c1, c5), tl.join(c3, c7))
    return tl.reshape(tl.join(even, odd), (words.shape[0], words.shape[1] * 8))


@triton.jit
def _bytes_to_signed(b, zb, USE_ASM: tl.constexpr):
    """uint8 [R, C] bytes of a GPTQ word (two 4-bit codes each, the low nibble first along K) and uint8 [R, C]
    128 - z -> (lo, hi) int8 [R, C]: q - z of the low and of the high nibble.

    Per byte, q + (128 - z) lies in [113, 143] (no carry into the next byte) and XOR 0x80 turns it into the int8
    q - z; so on the GPU one 32-bit instruction serves the four bytes of a word (inline PTX, four bytes a
    register): 7 instructions per 8 codes instead of a shift, mask, subtraction and narrowing per code."""
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t;
            and.b32 t, $2, 0x0F0F0F0F;
            add.u32 t, t, $3;
            xor.b32 $0, t, 0x80808080;
            shr.u32 t, $2, 4;
            and.b32 t, t, 0x0F0F0F0F;
            add.u32 t, t, $3;
            xor.b32 $1, t, 0x80808080;
            }""",
            constraints="=r,=r,r,r",
            args=[b, zb],
            dtype=(tl.int8, tl.int8),
            is_pure=True,
            pack=4,
        )
    else:  # Triton's interpreter runs no PTX: the same arithmetic per byte
        lo = ((b & 15).to(tl.int32) + zb.to(tl.int32) - 128).to(tl.int8)
        hi = ((b >> 4).to(tl.int32) + zb.to(tl.int32) - 128).to(tl.int8)
    return lo, hi


@triton.jit
def byte_tile(qb_ptrs, zb, t, K, stride_qbk, offs_kw, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """K tile ``t`` of the weight as int8 q - z [BLOCK_N, BLOCK_K], from its bytes [BLOCK_K / 8, BLOCK_N * 4] (word
    row r, byte 4n + j holds codes 8r + 2j (low nibble) and 8r + 2j + 1 (high) of column n)."""
    BLOCK_KW: tl.constexpr = BLOCK_K // 8
    if EVEN_K:
        b = tl.load(qb_ptrs + t * BLOCK_KW * stride_qbk)
    else:  # codes past K (padding of the last word) meet zero activations
        b = tl.load(qb_ptrs + t * BLOCK_KW * stride_qbk, mask=((t * BLOCK_KW + offs_kw) * 8 < K)[:, None], other=0)
    lo, hi = _bytes_to_signed(b, zb, USE_ASM)  # [BKW, BN * 4] each
    codes = tl.join(tl.reshape(lo, (BLOCK_KW, BLOCK_N, 4)), tl.reshape(hi, (BLOCK_KW, BLOCK_N, 4)))  # [BKW, BN, 4, 2]
    return tl.reshape(tl.permute(codes, (1, 0, 2, 3)), (BLOCK_N, BLOCK_K))  # k = 8r + 2j + nibble


@triton.jit
def tile_operands(pid, a_ptr, qw_ptr, M, N, stride_am, stride_ak, stride_qwk, stride_qwn, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    """Program ``pid``'s output tile and its operands at the first K tile: (offs_m, offs_n, offs_k, offs_kw, rows,
    cols, cols_b, a_ptrs [BM, BK], qw_ptrs [BN, BK / 8] words, qb_ptrs [BK / 8, BN * 4] the same tile's bytes, byte
    4n + j of each word row, word rows contiguous: stride_qwn == 1; cols_b the column of each byte). Rows and columns
    past M / N wrap onto valid ones: loads need no mask, the store drops them."""
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kw = tl.arange(0, BLOCK_K // 8)
    rows = offs_m % M
    cols = offs_n % N
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    qw_ptrs = qw_ptr + offs_kw[None, :] * stride_qwk + cols[:, None] * stride_qwn
    offs_nb = pid_n * BLOCK_N * 4 + tl.arange(0, BLOCK_N * 4)
    cols_b = (offs_nb // 4) % N
    byte_cols = tl.max_contiguous(tl.multiple_of(cols_b * 4 + offs_nb % 4, 4), 4)
    qb_ptrs = qw_ptr.to(tl.pointer_type(tl.uint8)) + offs_kw[:, None] * (stride_qwk * 4) + byte_cols[None, :]
    return offs_m, offs_n, offs_k, offs_kw, rows, cols, cols_b, a_ptrs, qw_ptrs, qb_ptrs


@triton.jit
def _group_dot(a_ptrs, qw_ptrs, qb_ptrs, z, zb, lo, hi, K, stride_ak, stride_qwk, offs_k, offs_kw,
               IS_FP8: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, BYTES: tl.constexpr,
               USE_ASM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):  # fmt: skip
    """The partial sum of K tiles lo .. hi - 1 (one group): int32 (int8) or fp32 (fp8), [BN, BM] when SWAP_AB.
    BYTES: the weight tile comes from its bytes (``byte_tile``), else from int32 words code by code."""
    BLOCK_KW: tl.constexpr = BLOCK_K // 8
    if SWAP_AB:
        part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32 if IS_FP8 else tl.int32)
    else:
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32 if IS_FP8 else tl.int32)
    for t in range(lo, hi):
        k0 = t * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs + k0 * stride_ak)
        else:
            a = tl.load(a_ptrs + k0 * stride_ak, mask=(k0 + offs_k < K)[None, :], other=0.0)
        if BYTES:
            wq = byte_tile(qb_ptrs, zb, t, K, stride_qwk * 4, offs_kw, EVEN_K, USE_ASM, BLOCK_N, BLOCK_K)
        else:
            if EVEN_K:
                words = tl.load(qw_ptrs + t * BLOCK_KW * stride_qwk)
            else:  # codes past K (padding of the last word) meet zero activations
                words = tl.load(qw_ptrs + t * BLOCK_KW * stride_qwk,
                                mask=((t * BLOCK_KW + offs_kw) * 8 < K)[None, :], other=0)  # fmt: skip
            wq = codes_along_k(words) - z[:, None]  # [BN, BK] in [-15, 15]
        if IS_FP8:
            wq = wq.to(tl.float16).to(a.dtype)  # exact: small integers
            if SWAP_AB:
                part = tl.dot(wq, tl.trans(a), part, max_num_imprecise_acc=BLOCK_K)
            else:
                part = tl.dot(a, tl.trans(wq), part, max_num_imprecise_acc=BLOCK_K)
        else:
            wq = wq.to(tl.int8)
            if SWAP_AB:
                part = tl.dot(wq, tl.trans(a), part, out_dtype=tl.int32)
            else:
                part = tl.dot(a, tl.trans(wq), part, out_dtype=tl.int32)
    return part


@triton.jit(do_not_specialize=["M", "group_tiles", "tiles_per_split"])
def _w4a8_gemm_kernel(
    # pointers
    a_ptr, a_scale_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
    # sizes
    M, N, K, group_tiles, tiles_per_split,
    # strides
    stride_am, stride_ak, stride_qwk, stride_qwn, stride_qzg, stride_qzn, stride_sg, stride_sn, stride_om, stride_on,
    # meta-parameters
    IS_FP8: tl.constexpr, SWAP_AB: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BYTES: tl.constexpr, USE_ASM: tl.constexpr, EMULATE_BF16: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FIXUP: tl.constexpr,
):  # fmt: skip
    BLOCK_KW: tl.constexpr = BLOCK_K // 8
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m, offs_n, offs_k, offs_kw, rows, cols, cols_b, a_ptrs, qw_ptrs, qb_ptrs = tile_operands(
        pid, a_ptr, qw_ptr, M, N, stride_am, stride_ak, stride_qwk, stride_qwn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M
    )

    k_tiles = tl.cdiv(K, BLOCK_K)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, k_tiles)
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(t_begin // group_tiles, (t_end - 1) // group_tiles + 1):
        lo = tl.maximum(g * group_tiles, t_begin)
        hi = tl.minimum(g * group_tiles + group_tiles, t_end)
        if BYTES:  # 128 - z per byte column, broadcast down the word rows
            zw = tl.load(qz_ptr + g * stride_qzg + (cols_b // 8) * stride_qzn)
            zb = (128 - ((zw >> ((cols_b % 8) * 4)) & 15)).to(tl.uint8)
            zb = tl.broadcast_to(zb[None, :], (BLOCK_KW, BLOCK_N * 4))
            z = cols
        else:
            zw = tl.load(qz_ptr + g * stride_qzg + (cols // 8) * stride_qzn)
            z = (zw >> ((cols % 8) * 4)) & 15  # [BN]
            zb = z
        s = tl.load(s_ptr + g * stride_sg + cols * stride_sn).to(tl.float32)  # [BN]
        part = _group_dot(a_ptrs, qw_ptrs, qb_ptrs, z, zb, lo, hi, K, stride_ak, stride_qwk, offs_k, offs_kw, IS_FP8,
                          SWAP_AB, EVEN_K, BYTES, USE_ASM, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        if SWAP_AB:
            acc += part.to(tl.float32) * s[:, None]
        else:
            acc += part.to(tl.float32) * s[None, :]
    if SWAP_AB:
        acc = tl.trans(acc)  # [BM, BN]

    y = acc * tl.load(a_scale_ptr + rows)[:, None]
    finish_tile(y, bias_ptr, out_ptr, part_ptr, lock_ptr, pid, offs_m, offs_n, M, N, stride_om, stride_on, SPLIT,
                HAS_BIAS, EMULATE_BF16, FIXUP)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------------------------
def check_w4a8_operands(qa, a_scale, w: W4A16Weight, bias, out_dtype, out) -> torch.Tensor:
    """Shapes, dtypes and devices of qa [M, K] @ W.T into out [M, N]; raises ValueError naming the operand; returns
    ``out``, allocated when None."""
    k, n = w.in_features, w.out_features
    require(w.bits == 4, f"W4A8 needs 4-bit weights, got {w.bits}-bit")
    require(qa.dtype in FORMAT_OF_DTYPE, f"qa must be int8 or float8_e4m3fn, got {qa.dtype}")
    rows, n_g = -(-k // 32) * 4, w.scales.shape[0]
    require(
        w.qweight.dtype == torch.int32 and tuple(w.qweight.shape) == (rows, n),
        f"qweight must be int32 [{rows}, {n}], got {w.qweight.dtype} {tuple(w.qweight.shape)}",
    )
    require(
        w.qzeros.dtype == torch.int32 and tuple(w.qzeros.shape) == (n_g, -(-n // 32) * 4),
        f"qzeros must be int32 [{n_g}, {-(-n // 32) * 4}], got {w.qzeros.dtype} {tuple(w.qzeros.shape)}",
    )
    require(
        w.scales.dtype == torch.float16 and w.scales.shape[1] == n,
        f"scales must be float16 [n_groups, {n}], got {w.scales.dtype} {tuple(w.scales.shape)}",
    )
    return check_product(qa, a_scale, (w.qweight, w.qzeros, w.scales), k, n, bias, out_dtype, out)


def check_product(qa, a_scale, weights: tuple, k: int, n: int, bias, out_dtype, out) -> torch.Tensor:
    """The checks every W4A8 weight format shares, after its own: qa [M, K] on a CUDA device (or the interpreter),
    a_scale fp32 [M], bias [N], the output (allocated when None), one device for all and 32-bit sizes."""
    require(qa.dim() == 2 and qa.shape[1] == k, f"qa must be [M, {k}], got {tuple(qa.shape)}")
    require(qa.is_cuda or interpreting(), "qa must be a CUDA tensor (or set TRITON_INTERPRET=1 to run on CPU)")
    m = qa.shape[0]
    require(
        a_scale.dtype == torch.float32 and a_scale.shape == (m,) and a_scale.is_contiguous(),
        f"a_scale must be contiguous fp32 [{m}], got {a_scale.dtype} {tuple(a_scale.shape)}",
    )
    require(bias is None or (bias.shape == (n,) and bias.is_floating_point()), f"bias must be a float tensor [{n}]")
    require(out_dtype in FLOAT_DTYPES, f"out_dtype must be fp16, bf16 or fp32, got {out_dtype}")
    devices = {t.device for t in (qa, a_scale, *weights, bias, out) if t is not None}
    require(len(devices) == 1, f"all tensors must be on one device, got {sorted(map(str, devices))}")
    require(max(qa.numel(), weights[0].numel(), m * n) < 2**31, "tensors of 2**31 elements or more are not served")
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=qa.device)
    require(
        tuple(out.shape) == (m, n) and out.dtype == out_dtype,
        f"out must be {out_dtype} [{m}, {n}], got {out.dtype} {tuple(out.shape)}",
    )
    return out


def fixup_unroll(block_m: int, block_n: int) -> int:
    """Partial tiles the split-K fix-up loads per round: W4A16's rule, 4 for tiles of at most 2048 values, else 1
    (4 made the 64 x 128 tile spill 24 bytes of registers in an offline sm_90 compile)."""
    return 4 if block_m * block_n <= 2048 else 1


def launch(qa, a_scale, w: W4A16Weight, bias, out, cfg, plan) -> torch.Tensor:
    """Run the GEMM with tile config ``cfg`` (``dispatch.W4A8Config``) and launch plan ``plan`` (``plan_launch``)
    on checked operands."""
    m, k = qa.shape
    n = w.out_features
    emulate_bf16 = interpreting() and out.dtype == torch.bfloat16
    part = out
    if plan.split > 1:
        part = torch.empty(plan.split, m, n, dtype=torch.float32, device=qa.device)
    _w4a8_gemm_kernel[plan.grid](
        qa, a_scale, w.qweight, w.qzeros, w.scales, bias if bias is not None else a_scale, out, part, w.locks,
        m, n, k, plan.group_tiles, plan.tiles_per_split,
        qa.stride(0), qa.stride(1), w.qweight.stride(0), w.qweight.stride(1), w.qzeros.stride(0), w.qzeros.stride(1),
        w.scales.stride(0), w.scales.stride(1), out.stride(0), out.stride(1),
        IS_FP8=qa.dtype == torch.float8_e4m3fn, SWAP_AB=cfg.swap_ab, SPLIT=plan.split > 1, HAS_BIAS=bias is not None,
        EVEN_K=k % plan.block_k == 0, BYTES=cfg.byte_unpack and w.qweight.stride(1) == 1,
        USE_ASM=not interpreting(), EMULATE_BF16=emulate_bf16, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=plan.block_k, GROUP_M=cfg.group_m, FIXUP=fixup_unroll(cfg.block_m, cfg.block_n),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
