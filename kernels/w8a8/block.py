"""Block-wise fp8 W8A8 GEMM (DeepSeek-V3, arXiv 2412.19437, section 3.3): e4m3 weights with one fp32 scale per
B x B block, e4m3 activations with one fp32 scale per 1 x B tile of each token, computed at run time.

Computes ``y[m, n] = sum_j (sum_{k in tile j} qa[m, k] * qw[n, k]) * a_scale[m, j] * w_scale[n // B, j] (+ bias[n])``
with ``j = k // B``: each B-long partial sum is formed from the codes alone, then scaled by its two scales and added
into a full fp32 accumulator. That is the report's fine-grained quantization and its promotion rule in one step:
Hopper's fp8 tensor cores accumulate with ~14 mantissa bits, so every B = 128 products the partial sum leaves the
tensor core, is multiplied by the scales on the CUDA cores and joins the fp32 sum (DeepGEMM's approach). The
promotion interval is B for every M, small M included.

How
    ``quantize_tiles``: one program per rows x B-wide tile of x: a_scale[m, j] = tile abs-max / 448, the codes
    rounded to the e4m3 grid (the scales optionally stored M-major, as the Hopper kernel reads them). The GEMM
    tiles the output in BLOCK_M x BLOCK_N and walks K in steps of BLOCK_K = B, one scale pair per step; ragged M,
    N, K are masked (a short last tile's padding is zero in both operands). Small M splits K across programs (the serial
    fix-up of ``w4a16.epilogue.finish_tile``); ``fp8_block_linear(fuse_quant=True)`` quantizes the activation
    tiles inside the GEMM instead. On Hopper with B = 128 and ``WS_FROM_M`` rows or more (from
    ``WS_ONE_WAVE_FROM_M`` where the output tiles make one wave) the warp-specialized Gluon kernel
    (``ws_kernel.py``) serves instead: in Triton's single loop each promotion waits
    for its wgmma, which left the block GEMM at 0.57x bf16 cuBLAS at M >= 1024 (H100, its best tile config).

Layouts: ``qw`` float8_e4m3fn [N, K] row-major, K contiguous; ``w_scale`` fp32 [ceil(N/B), ceil(K/B)] (DeepSeek-V3's
``weight_scale_inv``; ``Layout.FP8_BLOCK`` v1); ``qa`` [M, K] K contiguous; ``a_scale`` fp32 [M, ceil(K/B)],
row-major or M-major (``quantize_tiles(m_major=True)``).

Limits: B a power of two from 16 to 512 (32 or more on CUDA: 8-bit tensor-core products need K tiles of 32);
2-D operands under 2**31 elements. Hardware: written for sm_89/sm_90 (fp8 tensor cores). Off CUDA the reference
below is the module's CPU path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from quantkit.kernels._device import device_of, interpreting, num_sms
from quantkit.kernels.w4a16.configs import LOCK_SLOTS
from quantkit.kernels.w4a16.epilogue import finish_tile
from quantkit.kernels.w8a8.dispatch import PDL_PREFETCH_K, use_pdl
from quantkit.kernels.w8a8.gemm import await_activations, grouped_tile
from quantkit.kernels.w8a8.quant import (
    E4M3_MAX,
    FLOAT_DTYPES,
    MAX_NUMEL,
    MIN_AMAX,
    quantize_rows_reference,
    require,
    round_to_e4m3_grid,
)
from quantkit.kernels.w8a8.ws import block_unsupported, empty_m_major, launch_block

BLOCK_SIZES = (16, 32, 64, 128, 256, 512)
# From this many rows on Hopper (B = 128) the warp-specialized Gluon kernel serves: on the H100 at M = 256 it beat the
# Triton tiles on 11 of the 12 benchmark shapes (geomean over bf16 cuBLAS, end to end: 1.05x against 0.75x); at M = 64
# it won on 6 of 12, losing on the small ones (4096 x 4096: 0.77x against 0.85x; geomean 1.12x against 1.14x).
WS_FROM_M = 256
# From this many rows it also serves where its 128 x 128 output tiles number WS_MIN_TILES to one per SM (one wave).
# H100, M = 64, end to end over bf16 cuBLAS (two groups against the Triton tiles, same run): ahead on all five
# shapes with 56-112 tiles (e.g. 14336 x 4096: 1.38x against 1.19x; 7168 x 2048: 0.96x against 0.86x), behind on
# the three with 17-32 tiles and on three of four past one wave (18432 x 7168, 144 tiles: 1.17x against 1.46x).
WS_ONE_WAVE_FROM_M = 64
WS_MIN_TILES = 48
# Three consumer warp groups (192 x 128 tiles: fewer operand bytes per product, ``ws.launch_block(consumers=3)``)
# from this many rows. H100, end to end over bf16 cuBLAS against two groups in the same run: at M = 16384 ahead on
# 10 of 12 shapes (Llama geomean 1.34x against 1.27x, DeepSeek-V3 1.15x against 1.09x), even at 4096 (1.22x against
# 1.24x), behind below (1024: 0.95x against 1.19x; the larger tiles leave SMs idle in the last wave).
WS3_FROM_M = 16384
# Programmatic dependent launch between quantize_tiles and the small-M GEMM (``fp8_block_linear(pdl=True)``, as
# w8a8_linear does up to dispatch.PDL_MAX_M rows): correct (GPU test) but no faster on the H100 (Llama geomean
# 1.36x / 1.39x / 1.17x at M = 1 / 16 / 64 against 1.42x / 1.40x / 1.16x without), so off.
PDL_BY_DEFAULT = False
# Up to this many rows ``fp8_block_linear`` would quantize the activation tiles inside the GEMM (each program
# quantizes the tiles it reads; programs of one K range repeat that work) instead of launching ``quantize_tiles``
# first. Off: on the H100 the fused GEMM ran slower than the two launches it replaces (Llama geomean over bf16 cuBLAS
# 1.06x / 1.10x at M = 1 / 16 against 1.44x / 1.41x, same run); ``fuse_quant=True`` asks for it.
FUSED_QUANT_MAX_M = 0
# quantize_tiles' programs take one tile along K unless ``tiles_per_program`` asks for more: four tiles per program
# (8 warps) were slower on every large-M shape on the H100 (4096 x 14336, M = 16384: 548 us against 396 us).
QUANT_TILES = 1
_E4M3_MAX = tl.constexpr(E4M3_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)


# ----------------------------------------------------------------------------------------------------------------
# Reference (plain PyTorch): defines the numerics the kernel reproduces.
# ----------------------------------------------------------------------------------------------------------------


def _tiles(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [M, K] -> [M * ceil(K/B), B], the last tile of each row zero-padded (a zero never raises an abs-max)."""
    m, k = x.shape
    kb = -(-k // block)
    if k % block:
        x = F.pad(x, (0, kb * block - k))
    return x.reshape(m * kb, block)


def quantize_tiles_reference(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (qa float8_e4m3fn [M, K], a_scale fp32 [M, ceil(K/B)]): per 1 x B tile, scale = abs-max / 448."""
    m, k = x.shape
    q, s = quantize_rows_reference(_tiles(x, block), "fp8")
    kb = -(-k // block)
    return q.view(m, kb * block)[:, :k].contiguous(), s.view(m, kb)


def fp8_block_matmul_reference(
    qa: torch.Tensor,
    a_scale: torch.Tensor,
    qw: torch.Tensor,
    w_scale: torch.Tensor,
    block: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """y [M, N]: each B-long partial product of the codes in fp32, scaled by a_scale[m, j] * w_scale[n // B, j] and
    summed in fp32, tile by tile (the kernel's order), then the bias and ``out_dtype``."""
    m, k = qa.shape
    n = qw.shape[0]
    acc = torch.zeros(m, n, dtype=torch.float32, device=qa.device)
    w_cols = w_scale.float().repeat_interleave(block, 0)[:n]  # [N, ceil(K/B)]: each output row's block scales
    for j, k0 in enumerate(range(0, k, block)):
        part = qa[:, k0 : k0 + block].float() @ qw[:, k0 : k0 + block].float().t()  # [M, N]
        acc += part * a_scale[:, j : j + 1].float() * w_cols[:, j][None, :]
    if bias is not None:
        acc += bias.float()
    return acc.to(out_dtype)


# ----------------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _e4m3_tiles(x):
    """x fp32 [R, B] -> (codes fp32 on the e4m3 grid, scale [R]) of each row's tile: scale = abs-max / 448 (a NaN is
    skipped by the abs-max), codes = x * (448 / abs-max) clamped to +-448 and rounded."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), _MIN_AMAX)
    v = x * tl.math.div_rn(_E4M3_MAX, amax)[:, None]
    return round_to_e4m3_grid(tl.minimum(tl.maximum(v, -_E4M3_MAX), _E4M3_MAX)), tl.math.div_rn(amax, _E4M3_MAX)


@triton.jit
def _quantize_tiles_kernel(
    x_ptr, q_ptr, s_ptr,
    M, K,
    stride_xm, stride_qm, stride_sm, stride_sk,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, TILES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """ROWS rows x TILES B-wide tiles of x: each row's abs-max over a tile gives its scale (tile j of row m stored at
    s_ptr + m * stride_sm + j * stride_sk: either scale layout), then its e4m3 codes."""
    if PDL:  # the GEMM launched next may start now; it waits for this grid's writes before reading them
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * (TILES * BLOCK) + tl.arange(0, TILES * BLOCK)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if TILES == 1:
        codes, scale = _e4m3_tiles(x)
        tl.store(s_ptr + rows * stride_sm + tl.program_id(1) * stride_sk, scale, mask=rows < M)
    else:
        tiles = tl.program_id(1) * TILES + tl.arange(0, TILES)
        codes, scale = _e4m3_tiles(tl.reshape(x, (ROWS * TILES, BLOCK)))  # row r's tile t is row r * TILES + t
        s_mask = (rows < M)[:, None] & (tiles * BLOCK < K)[None, :]
        tl.store(s_ptr + rows[:, None] * stride_sm + tiles[None, :] * stride_sk, tl.reshape(scale, (ROWS, TILES)),
                 mask=s_mask)  # fmt: skip
        codes = tl.reshape(codes, (ROWS, TILES * BLOCK))
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], codes.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "steps_per_split"])
def _fp8_block_matmul_kernel(
    # pointers
    a_ptr, w_ptr, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, part_ptr, lock_ptr,
    # sizes
    M, N, K, steps_per_split,
    # strides
    stride_am, stride_wn, stride_cm, stride_cn, stride_asm, stride_ask, stride_wsn,
    # meta-parameters
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr, EMULATE_BF16: tl.constexpr,
    PDL: tl.constexpr, PREFETCH_K: tl.constexpr,  # programmatic dependent launch after quantize_tiles(pdl=True)
    QUANT_A: tl.constexpr,  # a_ptr is the float x: each 1 x B tile quantized here (``_e4m3_tiles``), no a_scale
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # = the quantization block B
    GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    await_activations(w_ptr, stride_wn, 1, pid_n, N, K, PDL, PREFETCH_K, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_m = offs_m % M  # rows past M / N wrap onto valid rows: loads need no M/N mask, the store drops them
    rows_n = offs_n % N
    j_begin = pid_k * steps_per_split
    j_end = tl.minimum(j_begin + steps_per_split, tl.cdiv(K, BLOCK_K))
    a_ptrs = a_ptr + rows_m[:, None] * stride_am + (j_begin * BLOCK_K + offs_k)[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + (j_begin * BLOCK_K + offs_k)[:, None] + rows_n[None, :] * stride_wn  # [BLOCK_K, BLOCK_N]
    a_scale_ptrs = a_scale_ptr + rows_m * stride_asm  # [BLOCK_M]: tile j of each row at + j * stride_ask
    w_scale_ptrs = w_scale_ptr + (rows_n // BLOCK_K) * stride_wsn  # [BLOCK_N]: block (n // B, j) at + j
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for j in range(j_begin, j_end):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(j * BLOCK_K + offs_k)[None, :] < K, other=0.0)
            w = tl.load(w_ptrs, mask=(j * BLOCK_K + offs_k)[:, None] < K, other=0.0)
        if QUANT_A:
            a, a_s = _e4m3_tiles(a.to(tl.float32))
            a = a.to(w.dtype)
        else:
            a_s = tl.load(a_scale_ptrs + j * stride_ask)
        part = tl.dot(a, w)  # one B-long partial sum in the tensor core, then promoted with its scales
        w_s = tl.load(w_scale_ptrs + j)
        acc += part * a_s[:, None] * w_s[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    finish_tile(acc, bias_ptr, c_ptr, part_ptr, lock_ptr, pid, offs_m, offs_n, M, N, stride_cm, stride_cn, SPLIT,
                HAS_BIAS, EMULATE_BF16)  # fmt: skip


@dataclass(frozen=True)
class BlockConfig:
    """One launch of the block GEMM: BLOCK_M x BLOCK_N output tiles (BLOCK_K is the quantization block), GROUP_M
    row tiles per L2 group, ``split_waves`` (split K until about that many waves of programs per SM exist; 0:
    never), warps and pipeline stages."""

    block_m: int
    block_n: int
    group_m: int = 8
    split_waves: int = 0
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "group_m", "num_warps"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value > 0 and value & (value - 1) == 0):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.block_m < 16 or self.block_n < 16 or not 0 <= self.split_waves <= 32 or self.num_stages < 1:
            raise ValueError("tiles must be at least 16 x 16, split_waves in [0, 32], num_stages >= 1")

    @property
    def name(self) -> str:
        return f"m{self.block_m}n{self.block_n}g{self.group_m}w{self.num_warps}s{self.num_stages}sw{self.split_waves}"


# Largest M of each regime -> config (small M: narrow tiles with K split over the SMs, as the W4A16 and W8A8 decode
# paths do), the winners of ``bench_w8a8.py --sweep-block`` on an H100 (end to end, geomean of the Llama shapes);
# on Hopper the warp-specialized kernel serves from WS_FROM_M rows (from WS_ONE_WAVE_FROM_M on one-wave shapes).
TILE_CONFIGS: tuple[tuple[int, BlockConfig], ...] = (
    (16, BlockConfig(16, 64, 1, split_waves=2, num_warps=4, num_stages=4)),
    (32, BlockConfig(32, 64, 1, split_waves=2, num_warps=4, num_stages=4)),
    (64, BlockConfig(64, 64, 1, split_waves=1, num_warps=4, num_stages=4)),
    (256, BlockConfig(64, 128, 8, split_waves=0, num_warps=4, num_stages=4)),
    (2**31, BlockConfig(128, 128, 8, split_waves=0, num_warps=8, num_stages=4)),
)


def tile_config(m: int) -> BlockConfig:
    """The config of the regime that ``m`` rows fall in (``TILE_CONFIGS``)."""
    return next(cfg for max_m, cfg in TILE_CONFIGS if m <= max_m)


def split_for(cfg: BlockConfig, m: int, n: int, k_steps: int, sms: int) -> tuple[int, int]:
    """(split, steps per split): enough K splits for ``split_waves * sms`` programs, none empty, never more than the
    K steps, and none where the output has more tiles than there are split-K semaphores."""
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    split = 1
    if cfg.split_waves and tiles <= LOCK_SLOTS:
        split = max(1, min(-(-cfg.split_waves * sms // tiles), k_steps))
    steps = -(-k_steps // split)
    return -(-k_steps // steps), steps


_LOCKS: dict[torch.device, torch.Tensor] = {}


def split_locks(device: torch.device) -> torch.Tensor:
    """The split-K semaphores of ``device`` (zeros; every launch resets the ones it used). Shared by all block
    GEMMs of the device: launches on one stream run one after another; two streams must not split at once."""
    if device not in _LOCKS:
        _LOCKS[device] = torch.zeros(LOCK_SLOTS, dtype=torch.int32, device=device)
    return _LOCKS[device]


def _require_pdl(pdl: bool, t: torch.Tensor) -> None:
    """Programmatic dependent launch needs sm_90+ and a real GPU (griddepcontrol; not Triton's interpreter)."""
    if pdl:
        gpu = device_of(t.device) if t.is_cuda else None
        require(
            gpu is not None and gpu.capability >= (9, 0) and not interpreting(),
            "pdl needs a CUDA device of compute capability 9.0 or newer (not Triton's interpreter)",
        )


def quantize_tiles(
    x: torch.Tensor, block: int, m_major: bool = False, pdl: bool = False, tiles_per_program: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_tiles_reference`` on x's device: (qa [M, K], a_scale [M, ceil(K/B)]), the same values for finite
    x (a NaN is skipped by the abs-max, as in the row quantizer).

    ``m_major``: a_scale is a view of fp32 [ceil(K/B), M'] storage (M' = M rounded up to ``ws.SCALE_ALIGN``), strides
    (1, M'), the layout in which the Hopper kernel copies each K step's scales by TMA (DeepGEMM takes the same);
    ``fp8_block_matmul`` takes either layout. One program per ROWS rows x ``tiles_per_program`` tiles (a power of
    two; None: ``QUANT_TILES``). ``pdl``: let the GEMM launched next with
    ``pdl=True`` start while this kernel runs (CUDA sm_90+)."""
    require(x.dim() == 2 and x.dtype in FLOAT_DTYPES, f"x must be 2-D fp16/bf16/fp32, got {x.dtype} {tuple(x.shape)}")
    require(block in BLOCK_SIZES, f"block must be one of {BLOCK_SIZES}, got {block}")
    require(x.numel() <= MAX_NUMEL, f"x has {x.numel()} elements; 32-bit offsets allow {MAX_NUMEL}")
    _require_pdl(pdl, x)
    m, k = x.shape
    kb = -(-k // block)
    require(kb <= 65535, f"K = {k} has {kb} tiles of {block}; the quantizer's grid allows 65535")
    if x.stride(1) != 1 or (m and (m - 1) * x.stride(0) + k > MAX_NUMEL):  # int32 offsets: read a compact copy
        x = x.contiguous()
    qa = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    a_scale = empty_m_major(m, kb, x.device) if m_major else torch.empty(m, kb, dtype=torch.float32, device=x.device)
    if m and k:
        tiles = QUANT_TILES if tiles_per_program is None else tiles_per_program
        require(tiles > 0 and tiles & (tiles - 1) == 0, f"tiles_per_program must be a power of two, got {tiles}")
        tiles = min(tiles, triton.next_power_of_2(kb))
        rows = min(triton.next_power_of_2(m), 64, max(8, 4096 // block))  # few rows: no programs of masked rows
        _quantize_tiles_kernel[(-(-m // rows), -(-kb // tiles))](
            x, qa, a_scale, m, k, x.stride(0), qa.stride(0), a_scale.stride(0), a_scale.stride(1),
            BLOCK=block, ROWS=rows, TILES=tiles, PDL=pdl, num_warps=4 if tiles == 1 else 8,
        )  # fmt: skip
    return qa, a_scale


def _check_weights(m, k, qw, w_scale, block, bias, out_dtype, on_cuda) -> int:
    """The checks shared by both entry points, for activations of [m, k]: the number of output columns N."""
    require(block in BLOCK_SIZES, f"block must be one of {BLOCK_SIZES}, got {block}")
    require(
        not on_cuda or block >= 32,
        "block size 16 is served on the CPU only: 8-bit tensor-core products need K tiles of 32",
    )
    require(
        qw.dim() == 2 and qw.dtype == torch.float8_e4m3fn,
        f"qw must be 2-D float8_e4m3fn, got {qw.dtype} {tuple(qw.shape)}",
    )
    n, kb = qw.shape[0], -(-k // block)
    require(qw.shape[1] == k, f"qw must be [N, K={k}], got {tuple(qw.shape)}")
    require(qw.stride(1) == 1, "qw must be contiguous along K")
    require(
        w_scale.dtype == torch.float32 and w_scale.shape == (-(-n // block), kb) and w_scale.stride(1) == 1,
        f"w_scale must be fp32 [{-(-n // block)}, {kb}], got {w_scale.dtype} {tuple(w_scale.shape)}",
    )
    require(bias is None or (bias.shape == (n,) and bias.is_contiguous()), f"bias must be contiguous [{n}]")
    require(out_dtype in FLOAT_DTYPES, f"out_dtype must be fp16, bf16 or fp32, got {out_dtype}")
    require(max(m * k, qw.numel(), m * n) <= MAX_NUMEL, f"operands exceed {MAX_NUMEL} elements")
    return n


def _launch_tiles(qa, a_scale, qw, w_scale, block, bias, out, cfg: BlockConfig, pdl: bool) -> torch.Tensor:
    """The Triton tile kernel on checked operands (a_scale None: qa is the float x, quantized in the kernel)."""
    m, k = qa.shape
    n = qw.shape[0]
    split, steps = split_for(cfg, m, n, -(-k // block), num_sms(qa.device))
    part = torch.empty(split, m, n, dtype=torch.float32, device=qa.device) if split > 1 else out
    fused = a_scale is None
    a_scale = w_scale if fused else a_scale
    grid = (-(-m // cfg.block_m) * -(-n // cfg.block_n), split)
    _fp8_block_matmul_kernel[grid](
        qa, qw, out, a_scale, w_scale, bias if bias is not None else w_scale, part, split_locks(qa.device),
        m, n, k, steps, qa.stride(0), qw.stride(0), out.stride(0), out.stride(1), a_scale.stride(0), a_scale.stride(1),
        w_scale.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % block == 0, SPLIT=split > 1,
        EMULATE_BF16=interpreting() and out.dtype == torch.bfloat16, PDL=pdl, PREFETCH_K=PDL_PREFETCH_K if pdl else 0,
        QUANT_A=fused,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return out


def _use_ws(m: int, n: int, device: torch.device) -> bool:
    """Whether ``m`` x ``n`` outputs go to the warp-specialized kernel (where it can serve them)."""
    if m >= WS_FROM_M:
        return True
    tiles = -(-m // 128) * -(-n // 128)
    return m >= WS_ONE_WAVE_FROM_M and device.type == "cuda" and WS_MIN_TILES <= tiles <= num_sms(device)


def fp8_block_matmul(
    qa: torch.Tensor,
    a_scale: torch.Tensor,
    qw: torch.Tensor,
    w_scale: torch.Tensor,
    block: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float16,
    config: BlockConfig | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """The block GEMM on quantized operands: y [M, N] in ``out_dtype`` (``config`` overrides ``tile_config``).
    ``pdl``: launch the Triton tiles with programmatic dependent launch after ``quantize_tiles(pdl=True)``."""
    require(qa.dim() == 2, f"qa must be 2-D, got {tuple(qa.shape)}")
    m, k = qa.shape
    n = _check_weights(m, k, qw, w_scale, block, bias, out_dtype, qa.is_cuda)
    kb = -(-k // block)
    require(qa.dtype == torch.float8_e4m3fn, f"qa must be float8_e4m3fn, got {qa.dtype}")
    require(qa.stride(1) == 1, "qa must be contiguous along K")
    require(
        a_scale.dtype == torch.float32
        and a_scale.shape == (m, kb)
        and 1 in a_scale.stride()
        and all(st > 0 or size == 1 for st, size in zip(a_scale.stride(), a_scale.shape, strict=True)),
        f"a_scale must be fp32 [{m}, {kb}] with unit stride along M or K, got {a_scale.dtype} "
        f"{tuple(a_scale.shape)} strides {a_scale.stride()}",
    )
    _require_pdl(pdl, qa)
    out = torch.empty(m, n, dtype=out_dtype, device=qa.device)
    if m == 0:
        return out
    if config is None and _use_ws(m, n, qa.device) and block_unsupported(qa, qw, out, block) is None:
        consumers = 3 if m >= WS3_FROM_M else 2
        return launch_block(qa, a_scale, qw, w_scale, bias, out, consumers)  # Hopper, large M: the Gluon kernel
    return _launch_tiles(qa, a_scale, qw, w_scale, block, bias, out, config or tile_config(m), pdl)


def fp8_block_linear(
    x: torch.Tensor,
    qw: torch.Tensor,
    w_scale: torch.Tensor,
    block: int,
    bias: torch.Tensor | None = None,
    config: BlockConfig | None = None,
    pdl: bool | None = None,
    fuse_quant: bool | None = None,
) -> torch.Tensor:
    """x [..., K] -> y [..., N] in x's dtype: quantize x per 1 x B tile, then the block GEMM (``config`` overrides
    ``tile_config``). ``fuse_quant`` (None: M <= ``FUSED_QUANT_MAX_M``, i.e. never): the GEMM quantizes the tiles
    itself, one launch, the same codes and scales (measured slower, see ``FUSED_QUANT_MAX_M``). ``pdl`` (None:
    ``PDL_BY_DEFAULT``; unfused only): up to ``dispatch.PDL_MAX_M`` rows on sm_90+ the GEMM starts while the
    quantizer runs (programmatic dependent launch, as ``w8a8_linear``); elsewhere it has no effect."""
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    if fuse_quant is None:
        fuse_quant = 0 < m <= FUSED_QUANT_MAX_M
    if fuse_quant:
        require(x2.dtype in FLOAT_DTYPES, f"x must be fp16/bf16/fp32, got {x2.dtype}")
        require(m < WS_ONE_WAVE_FROM_M, f"the fused quantizer serves fewer than {WS_ONE_WAVE_FROM_M} rows, got {m}")
        n = _check_weights(m, k, qw, w_scale, block, bias, x.dtype, x2.is_cuda)
        if x2.stride(1) != 1 or (m - 1) * x2.stride(0) + k > MAX_NUMEL:  # int32 offsets: a compact copy
            x2 = x2.contiguous()
        out = torch.empty(m, n, dtype=x.dtype, device=x2.device)
        if m:  # no rows: no launch (the split plan divides by the output tiles)
            _launch_tiles(x2, None, qw, w_scale, block, bias, out, config or tile_config(m), False)
        return out.reshape(*x.shape[:-1], n)
    pdl = (PDL_BY_DEFAULT if pdl is None else pdl) and use_pdl(x2)  # use_pdl: M <= PDL_MAX_M < WS_FROM_M
    qa, a_scale = quantize_tiles(x2, block, m_major=True, pdl=pdl)
    y = fp8_block_matmul(qa, a_scale, qw, w_scale, block, bias, out_dtype=x.dtype, config=config, pdl=pdl)
    return y.reshape(*x.shape[:-1], qw.shape[0])


__all__ = [
    "BLOCK_SIZES",
    "E4M3_MAX",
    "FUSED_QUANT_MAX_M",
    "PDL_BY_DEFAULT",
    "TILE_CONFIGS",
    "WS3_FROM_M",
    "WS_FROM_M",
    "BlockConfig",
    "fp8_block_linear",
    "fp8_block_matmul",
    "fp8_block_matmul_reference",
    "quantize_tiles",
    "quantize_tiles_reference",
    "tile_config",
]
