"""W4A8 with progressive group quantization (QServe, Lin et al. 2024, arXiv 2405.04532): one int32 accumulator over K.

The format (``ProgressiveWeight``)
    Level 1, per output channel n: symmetric int8 with an fp32 scale s1[n] = max_k |w[n, k]| / 116 and codes
    w8 = round(w / s1) in the protective range [-116, 116]. Level 2, per group of ``group_size`` along K: the int8
    values quantized again, asymmetric 4-bit codes q in [0, 15] with an integer scale s2[g, n] in [1, 15] and an
    integer zero point z[g, n] in [0, 15] (``group_grid``). Stored: the codes, s1, s2 and the scaled zeros
    sz = z * s2 (uint8). The weight is w = s1 * d, d = q * s2 - sz = s2 * (q - z): no float scale inside K.

Why every d is an exact int8 value
    ``group_grid``: s2 = round((max - min) / 15), clamped to [1, 15], over the group's w8 with 0 included (so
    min <= 0 <= max, integers in [-116, 116]), and z = round(-min / s2), clamped to [0, 15]. Over every such
    (min, max) pair (enumerated in the tests) sz <= 121 and 15 * s2 - sz <= 126: every code 0..15 of every group,
    not only the codes RTN picks, decodes to d in [-121, 126]. So an algorithm that picks any code on this grid
    (GPTQ's error feedback included) stays exact. 116 is the largest range with that property: QServe's 119 keeps
    the codes RTN picks within 119 + 16 / 2 = 127, but the code 15 of some groups decodes to 128-132 there.
    Producers of the format must keep every stored d in [-128, 127]: the kernel's packed arithmetic relies on it.

What the kernel computes
    y[m, n] = a_scale[m] * s1[n] * sum_k qa[m, k] * d[k, n]  (+ bias[n]), qa, a_scale the per-token int8 codes and
    fp32 scales of ``w8a8.quant.quantize_activations``. The sum is one int32 MMA accumulation over all of K, exact:
    |sum| <= 127 * 127 * K < 2**31 for K <= 2**17 (``MAX_K``; longer K is refused). The epilogue converts it once,
    scales by s1 and a_scale, adds the bias and rounds once to the output dtype. No per-group conversion: the loop
    is W8A8's (``w8a8/gemm.py``) plus the 4-bit -> int8 step in registers.

The 4-bit -> int8 step (subtraction after multiplication, packed)
    One 32-bit word holds eight codes of one output channel: byte j (j = 0..3) has the code of k = 4c + j in its low
    nibble and of k = 16 + 4c + j in its high nibble, word c = 0..3 of each 32-deep K chunk. Per word, on the GPU
    (inline PTX, seven instructions for eight codes): x = word & 0x0F0F0F0F holds four codes, one a byte; x * s2 +
    (0x80808080 - sz * 0x01010101), one IMAD, has per byte q * s2 + 128 - sz = d + 128 in [1, 255], so no byte
    carries into or borrows from the next and the 32-bit sum is exact; XOR 0x80808080 makes each byte the int8 d.
    The same for the high nibbles (a shift first). The two words are k = 4c .. 4c + 3 and 16 + 4c .. 16 + 4c + 3:
    the two K quads that thread 4r + c holds of an int8 wgmma / mma register operand, so with SWAP_AB (the weight
    tile the MMA's left operand, in registers) a thread unpacks exactly the words it multiplies.

Layouts
    qweight int32 [ceil(K/32) * 4, N] (word row 4T + c of chunk T as above; codes past K are 0), s1 fp32 [N], s2 and
    sz uint8 [n_groups, N] (contiguous groups along K; ``group_size`` 0: one group), ``perm`` int64 [K] or None (the
    kernel reads x[:, perm]); qa [M, K] int8, a_scale fp32 [M], bias [N] any float dtype.

Kernel: the flat kernel's structure (``flat.py``: one software-pipelined loop over K tiles, each inside one group,
SWAP_AB for small M, ``gemm.tile_operands`` for the prologue, ``w4a16.epilogue.finish_tile`` for the store and the
split-K fix-up). Limits: int8 activations only; int32 offsets; the split-K semaphores live in the weight (one stream
per weight). Hardware: written for sm_90 (8-bit wgmma); compiled offline for sm_90 with Triton 3.6 (IGMMA s8.s8, the
left operand in registers with SWAP_AB; the swept tiles without spills, 43-125 registers; 157 loop instructions per
thread per 128-deep step of the 128 x 128 tile); tested and timed on an H100 (docs/results/w4a8.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from quantkit.kernels._device import interpreting, prefetch_block_l2, threads
from quantkit.kernels.w4a8.gemm import check_product, fixup_unroll, tile_operands
from quantkit.kernels.w4a16.configs import LOCK_SLOTS
from quantkit.kernels.w4a16.epilogue import finish_tile
from quantkit.kernels.w8a8.gemm import grouped_tile
from quantkit.kernels.w8a8.quant import quantize_activations_reference, require

W8_MAX = 116  # level 1's protective range: with it every code of every group decodes into int8 (module docstring)
S2_MAX = 15  # level 2's largest scale (reached at a range of 232): q * s2 <= 225 fits a byte
MAX_K = 2**17  # 127 * 127 * K < 2**31: the int32 accumulator over all of K is exact
PDL_PREFETCH_TILES = 2  # under programmatic dependent launch, weight K tiles asked from L2 before the wait
LAYOUT = "progressive_w4_chunk32"  # the packing above
LAYOUT_VERSION = 1


@dataclass
class ProgressiveWeight:
    """A progressive W4A8 weight in the kernel layout (see the module docstring for every buffer's shape and dtype).
    ``locks`` int32 [LOCK_SLOTS] zeros: split-K semaphores, reset by the kernel after every use."""

    qweight: torch.Tensor
    s1: torch.Tensor
    s2: torch.Tensor
    sz: torch.Tensor
    group_size: int
    in_features: int
    perm: torch.Tensor | None = None
    layout: str = LAYOUT
    layout_version: int = LAYOUT_VERSION
    locks: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.locks = torch.zeros(LOCK_SLOTS, dtype=torch.int32, device=self.qweight.device)

    @property
    def out_features(self) -> int:
        return self.s1.shape[0]


# ---------------------------------------------------------------------------------------------------------------
# Format: packing, RTN quantization, dequantization, reference
# ---------------------------------------------------------------------------------------------------------------
def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (any integer dtype, 0..15) -> qweight int32 [ceil(K/32) * 4, N] (module docstring)."""
    n, k = q.shape
    q = F.pad(q.to(torch.uint8), (0, -k % 32))  # codes past K are 0
    q = q.reshape(n, -1, 2, 4, 4)  # [N, T, h, c, j]: k = 32T + 16h + 4c + j
    byte = q[:, :, 0] | (q[:, :, 1] << 4)  # [N, T, c, j]
    return byte.permute(1, 2, 0, 3).contiguous().reshape(-1, n * 4).view(torch.int32)  # [4T, N], byte j of word


def unpack_codes(qweight: torch.Tensor, k: int) -> torch.Tensor:
    """qweight int32 [ceil(K/32) * 4, N] -> codes uint8 [N, K] (the inverse of ``pack_codes``)."""
    rows, n = qweight.shape
    byte = qweight.contiguous().view(torch.uint8).reshape(rows // 4, 4, n, 4).permute(2, 0, 1, 3)  # [N, T, c, j]
    q = torch.stack((byte & 15, byte >> 4), dim=2)  # [N, T, h, c, j]
    return q.reshape(n, -1)[:, :k]


def _group_of(k: int, group_size: int, device) -> torch.Tensor:
    """int64 [K]: the group of each input channel (``group_size`` 0: one group)."""
    return torch.arange(k, device=device) // (group_size or max(k, 1))


def group_grid(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Level 2's grid of groups whose int8 values span [lo, hi] (integers in [-116, 116]; 0 is added to the range):
    (s2 in [1, 15], z in [0, 15]) as float tensors, asymmetric min-max as QServe's; every code of the grid decodes
    into int8 (module docstring)."""
    lo, hi = lo.float().clamp(max=0), hi.float().clamp(min=0)
    s2 = ((hi - lo) / 15).round().clamp(1, S2_MAX)
    return s2, (-lo / s2).round().clamp(0, 15)


def quantize_progressive(w: torch.Tensor, group_size: int = 128) -> ProgressiveWeight:
    """RTN of a float weight w [N, K] (nn.Linear's layout) into the progressive format (module docstring);
    ``group_size`` a positive multiple of 32, or 0 for one group."""
    require(w.dim() == 2 and w.is_floating_point(), f"w must be a float [N, K] tensor, got {w.dtype} {tuple(w.shape)}")
    require(group_size == 0 or (group_size > 0 and group_size % 32 == 0),
            f"group_size must be 0 or a positive multiple of 32, got {group_size}")  # fmt: skip
    n, k = w.shape
    w = w.float()
    s1 = w.abs().amax(1) / W8_MAX if k else torch.ones(n, device=w.device)
    s1 = torch.where(s1 > 0, s1, torch.ones_like(s1))  # an all-zero row: any scale
    w8 = (w / s1[:, None]).round().clamp(-W8_MAX, W8_MAX)  # [N, K] integers
    g = group_size or max(k, 1)
    w8g = F.pad(w8, (0, -k % g)).reshape(n, -1, g)  # [N, n_g, g]; padding 0 lies in every group's range anyway
    s2, z = group_grid(w8g.amin(-1), w8g.amax(-1))  # [N, n_g]
    q = ((w8g / s2[..., None]).round() + z[..., None]).clamp(0, 15).reshape(n, -1)[:, :k]
    return ProgressiveWeight(
        qweight=pack_codes(q.to(torch.uint8)),
        s1=s1.contiguous(),
        s2=s2.t().to(torch.uint8).contiguous(),
        sz=(z * s2).t().to(torch.uint8).contiguous(),
        group_size=group_size,
        in_features=k,
    )


def int8_weight(w: ProgressiveWeight) -> torch.Tensor:
    """d = q * s2 - sz, int32 [N, K] in kernel channel order: every value in [-127, 127]."""
    k = w.in_features
    g = _group_of(k, w.group_size, w.qweight.device)
    q = unpack_codes(w.qweight, k).int()
    return q * w.s2.t().int()[:, g] - w.sz.t().int()[:, g]


def dequantize(w: ProgressiveWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight s1 * d [N, K] in ``dtype``, in checkpoint channel order (act-order undone)."""
    wk = w.s1.to(torch.float64)[:, None] * int8_weight(w).to(torch.float64)
    if w.perm is not None:
        wk = torch.empty_like(wk).index_copy_(1, w.perm, wk)
    return wk.to(dtype)


def progressive_reference(x: torch.Tensor, w: ProgressiveWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float64 y [..., N] of the quantized operands: x [..., K] (checkpoint order) permuted for act-order, quantized
    per token to int8, times the exact int8 weight d, scaled by a_scale[m] * s1[n]."""
    x2 = x.reshape(-1, x.shape[-1])
    if w.perm is not None:
        x2 = x2.index_select(1, w.perm)
    qa, a_scale = quantize_activations_reference(x2, "int8")
    y = (qa.double() @ int8_weight(w).double().t()) * a_scale.double()[:, None] * w.s1.double()[None, :]
    if bias is not None:
        y = y + bias.double()
    return y.reshape(*x.shape[:-1], w.out_features)


# ---------------------------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _int8_quads(b, s2, sz, USE_ASM: tl.constexpr):
    """uint8 [R, C] bytes of the packed words, with each byte column's s2 and sz (int32 [R, C]) -> (lo, hi) int8
    [R, C]: d = q * s2 - sz of the low and of the high nibbles. On the GPU one word (four bytes) a register: the
    IMAD's addend 0x80808080 - sz * 0x01010101 (module docstring) is computed per column, outside the asm, and the
    asm reads the first of the four equal int32 registers of s2 and of that addend."""
    if USE_ASM:
        addend = -2139062144 - sz * 16843009  # 0x80808080 - sz * 0x01010101 mod 2**32 (int32 arithmetic wraps)
        lo, hi = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, u;
            and.b32 t, $2, 0x0F0F0F0F;
            mad.lo.u32 t, t, $3, $7;
            xor.b32 $0, t, 0x80808080;
            shr.u32 u, $2, 4;
            and.b32 u, u, 0x0F0F0F0F;
            mad.lo.u32 u, u, $3, $7;
            xor.b32 $1, u, 0x80808080;
            }""",
            constraints="=r,=r,r,r,r,r,r,r,r,r,r",
            args=[b, s2, addend],
            dtype=(tl.int8, tl.int8),
            is_pure=True,
            pack=4,
        )
    else:  # Triton's interpreter runs no PTX: the same values per byte
        lo = ((b & 15).to(tl.int32) * s2 - sz).to(tl.int8)
        hi = ((b >> 4).to(tl.int32) * s2 - sz).to(tl.int8)
    return lo, hi


@triton.jit
def _weight_tile(qb_ptrs, s2, sz, t, KW, stride_qbk, offs_kw, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """K tile ``t`` of the weight as int8 d [BLOCK_N, BLOCK_K] from its bytes [BLOCK_K / 8, BLOCK_N * 4] (word row
    r, byte 4n + j) and the tile's group's s2, sz (int32 [BLOCK_N]); KW: word rows in all."""
    BLOCK_KW: tl.constexpr = BLOCK_K // 8
    if EVEN_K:
        b = tl.load(qb_ptrs + t * BLOCK_KW * stride_qbk)
    else:  # word rows past the last chunk: zeros (their activations are zero too)
        b = tl.load(qb_ptrs + t * BLOCK_KW * stride_qbk, mask=(t * BLOCK_KW + offs_kw < KW)[:, None], other=0)
    # per column, broadcast to its four bytes of every word row: each thread reads the values of its own rows
    s2 = tl.reshape(tl.broadcast_to(s2[None, :, None], (BLOCK_KW, BLOCK_N, 4)), (BLOCK_KW, BLOCK_N * 4))
    sz = tl.reshape(tl.broadcast_to(sz[None, :, None], (BLOCK_KW, BLOCK_N, 4)), (BLOCK_KW, BLOCK_N * 4))
    lo, hi = _int8_quads(b, s2, sz, USE_ASM)  # [BKW, BN * 4]: k = 32T + 4c + j and 16 + 32T + 4c + j
    d = tl.reshape(tl.join(lo, hi), (BLOCK_KW // 4, 4, BLOCK_N, 4, 2))  # [T, c, n, j, h]
    return tl.reshape(tl.permute(d, (2, 0, 4, 1, 3)), (BLOCK_N, BLOCK_K))  # [n, T, h, c, j]: k = 32T + 16h + 4c + j


@triton.jit(do_not_specialize=["M", "tiles_per_split"])
def _w4a8_progressive_kernel(
    # pointers
    a_ptr, a_scale_ptr, qw_ptr, s1_ptr, s2_ptr, sz_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
    # sizes
    M, N, K, tiles_per_split,
    # strides
    stride_am, stride_ak, stride_qwk, stride_qwn, stride_sg, stride_om, stride_on,
    # meta-parameters
    SWAP_AB: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    USE_ASM: tl.constexpr, EMULATE_BF16: tl.constexpr, GROUP_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FIXUP: tl.constexpr, PDL: tl.constexpr,
    PREFETCH_TILES: tl.constexpr, THREADS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m, offs_n, offs_k, offs_kw, rows, cols, _, a_ptrs, _, qb_ptrs = tile_operands(
        pid, a_ptr, qw_ptr, M, N, stride_am, stride_ak, stride_qwk, stride_qwn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M
    )
    if EVEN_N:  # no column wraps: each word row of the tile is BLOCK_N * 4 contiguous bytes (16-byte cp.async)
        _, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_nb = pid_n * BLOCK_N * 4 + tl.arange(0, BLOCK_N * 4)
        qb_ptrs = qw_ptr.to(tl.pointer_type(tl.uint8)) + offs_kw[:, None] * (stride_qwk * 4) + offs_nb[None, :]
    KW = tl.cdiv(K, 32) * 4
    k_tiles = tl.cdiv(K, BLOCK_K)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, k_tiles)
    if PDL:  # launched while the activation quantizer may still run: the first weight tiles to L2, then wait for it
        if PREFETCH_TILES > 0:
            _, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            prefetch_block_l2(qw_ptr, t_begin * (BLOCK_K // 8), KW, stride_qwk, pid_n * BLOCK_N, N, t_begin < t_end,
                              PREFETCH_TILES * (BLOCK_K // 8), BLOCK_N, THREADS)  # fmt: skip
        tl.extra.cuda.gdc_wait()
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for t in range(t_begin, t_end):
        k0 = t * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs + k0 * stride_ak)
        else:
            a = tl.load(a_ptrs + k0 * stride_ak, mask=(k0 + offs_k < K)[None, :], other=0)
        g = t // GROUP_TILES if GROUP_TILES else 0  # each K tile lies in one group (GROUP_TILES 0: one group)
        s2 = tl.load(s2_ptr + g * stride_sg + cols).to(tl.int32)  # [BN]
        sz = tl.load(sz_ptr + g * stride_sg + cols).to(tl.int32)
        d = _weight_tile(qb_ptrs, s2, sz, t, KW, stride_qwk * 4, offs_kw, EVEN_K, USE_ASM, BLOCK_N, BLOCK_K)
        if SWAP_AB:
            acc = tl.dot(d, tl.trans(a), acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(a, tl.trans(d), acc, out_dtype=tl.int32)
    s1 = tl.load(s1_ptr + cols)
    if SWAP_AB:
        y = tl.trans(acc.to(tl.float32) * s1[:, None])  # [BM, BN]
    else:
        y = acc.to(tl.float32) * s1[None, :]
    y = y * tl.load(a_scale_ptr + rows)[:, None]
    finish_tile(y, bias_ptr, out_ptr, part_ptr, lock_ptr, pid, offs_m, offs_n, M, N, stride_om, stride_on, SPLIT,
                HAS_BIAS, EMULATE_BF16, FIXUP)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------------------------
def check_progressive_operands(qa, a_scale, w: ProgressiveWeight, bias, out_dtype, out) -> torch.Tensor:
    """Shapes, dtypes and devices of qa [M, K] @ W.T into out [M, N]; raises ValueError naming the operand; returns
    ``out``, allocated when None."""
    k, n = w.in_features, w.out_features
    require(qa.dtype == torch.int8, f"qa must be int8 for a progressive weight, got {qa.dtype}")
    require(k <= MAX_K, f"K = {k} is over {MAX_K}: the int32 accumulator over K could overflow")
    rows, n_g = -(-k // 32) * 4, -(-k // (w.group_size or max(k, 1)))
    require(
        w.qweight.dtype == torch.int32 and tuple(w.qweight.shape) == (rows, n) and w.qweight.is_contiguous(),
        f"qweight must be contiguous int32 [{rows}, {n}], got {w.qweight.dtype} {tuple(w.qweight.shape)}",
    )
    require(w.s1.dtype == torch.float32 and w.s1.is_contiguous(), f"s1 must be contiguous fp32 [{n}]")
    for name in ("s2", "sz"):
        t = getattr(w, name)
        require(
            t.dtype == torch.uint8 and tuple(t.shape) == (n_g, n) and t.is_contiguous(),
            f"{name} must be contiguous uint8 [{n_g}, {n}], got {t.dtype} {tuple(t.shape)}",
        )
    return check_product(qa, a_scale, (w.qweight, w.s1, w.s2, w.sz), k, n, bias, out_dtype, out)


def launch_progressive(qa, a_scale, w: ProgressiveWeight, bias, out, cfg, plan, pdl: bool = False) -> None:
    """Run the progressive GEMM with tile config ``cfg`` (``dispatch.W4A8Config``; its BLOCK_K a multiple of 32)
    and launch plan ``plan`` (``dispatch.plan_launch``) on checked operands. ``pdl``: programmatic dependent launch
    after a quantizer launched with ``pdl=True`` (the grid prefetches its first ``PDL_PREFETCH_TILES`` weight tiles
    to L2, then waits for the codes)."""
    m, k = qa.shape
    n = w.out_features
    part = out
    if plan.split > 1:
        part = torch.empty(plan.split, m, n, dtype=torch.float32, device=qa.device)
    _w4a8_progressive_kernel[plan.grid](
        qa, a_scale, w.qweight, w.s1, w.s2, w.sz, bias if bias is not None else a_scale, out, part, w.locks,
        m, n, k, plan.tiles_per_split,
        qa.stride(0), qa.stride(1), w.qweight.stride(0), w.qweight.stride(1), w.s2.stride(0), out.stride(0),
        out.stride(1),
        SWAP_AB=cfg.swap_ab, SPLIT=plan.split > 1, HAS_BIAS=bias is not None, EVEN_K=k % plan.block_k == 0,
        EVEN_N=n % cfg.block_n == 0, USE_ASM=not interpreting(),
        EMULATE_BF16=interpreting() and out.dtype == torch.bfloat16,
        GROUP_TILES=plan.group_tiles if w.group_size else 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=plan.block_k, GROUP_M=cfg.group_m,
        FIXUP=fixup_unroll(cfg.block_m, cfg.block_n), PDL=pdl, PREFETCH_TILES=PDL_PREFETCH_TILES,
        THREADS=threads(cfg.num_warps), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
