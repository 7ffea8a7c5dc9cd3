"""Which W4A8 launch serves a product: the config table by M, the launch plan, and the entry points.

``w4a8_linear`` permutes x's columns for act-order (as ``w4a16_linear`` does), quantizes x per token
(``w8a8.quant.quantize_activations``: int8 or e4m3), then runs the GEMM of ``gemm.py`` with the plan ``choose``
makes. Two paths, one kernel:

- ``small_m`` (M <= ``SMALL_M``): swap-AB tiles (y.T = W @ qa.T: the unpacked weight tile is the MMA's 64-row M
  side, x's few rows its 16-wide N side) with K split across programs until about ``split_waves`` waves of SMs
  exist, as W4A16's few-row tiles do: a decode product has too few output tiles to fill the GPU otherwise.
- ``tiles`` (larger M): plain tiles whose BLOCK_M grows with M, split-K only where the tiles leave SMs idle.

``GROUP_LOOP_TABLE`` (the group-loop kernel's tiles; above M = 16 the default ``CONFIG_TABLE`` is ``FLAT_TABLE``, the
flat kernel's) is a first choice by reasoning, not tuned (H100 figures: docs/results/w4a8.md). The tile shapes follow
W4A16's and W8A8's measured tables (16-row swap-AB tiles, 64 deep, for decode; 64-row tiles up to 256 rows; wider
tiles above), cut down where an offline sm_90 compile (no GPU) spilled registers: the kernel keeps two accumulators
per output (the fp32 sum and the current group's int32 / fp32 partial) plus the unpacked weight tile, so 128 x 128
tiles spilled (Triton 3.9: 584 bytes of stack with 8 warps) while every entry below compiled to 8-bit wgmma without
spills, int8 and fp8 (Triton 3.6: 109-255 registers; 3.9: 122-255: the 64 x 128 tile is at the limit).
``benchmarks/bench_w4a8.py`` times them on a GPU; the table is to be tuned from it. A ``ProgressiveWeight`` runs
``progressive.py``'s kernel with ``PROGRESSIVE_TABLE`` (tiles swept on the H100), launched up to ``PDL_MAX_M`` rows
with programmatic dependent launch after its quantizer; ``gemv.py``'s GEMV serves one row where asked
(``PROGRESSIVE_GEMV``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from quantkit.kernels._device import PDL_REFUSED, device_of, num_sms, pdl_possible, sms_of
from quantkit.kernels.w4a8.flat import launch_flat
from quantkit.kernels.w4a8.gemm import check_w4a8_operands, launch
from quantkit.kernels.w4a8.gemv import (
    GEMV_BLOCK_K,
    GEMV_BLOCK_N,
    GEMV_SPLIT_WAVES,
    GEMV_STAGES,
    GEMV_WARPS,
    gemv_fits,
    launch_progressive_gemv,
)
from quantkit.kernels.w4a8.progressive import ProgressiveWeight, check_progressive_operands, launch_progressive
from quantkit.kernels.w4a16.configs import LOCK_SLOTS
from quantkit.kernels.w4a16.weight import W4A16Weight
from quantkit.kernels.w8a8.dispatch import use_pdl
from quantkit.kernels.w8a8.quant import DTYPE_OF_FORMAT, quantize_activations, require

SMALL_M = 16  # the small-M path serves up to this many rows
# Programmatic dependent launch of the progressive GEMM after its activation quantizer, up to W8A8's PDL_MAX_M rows
# (``w8a8.dispatch.pdl_rule``). H100, ``bench_w4a8.py --prog-small-sweep`` (2026-12-07, six Llama shapes, same run):
# 2.17x bf16 cuBLAS at M = 1 against 2.05x launched plainly, 2.05x at M = 16 both ways; the runtime's batch-1 decode
# (bench_serve.py, Llama-3-8B shape) 1.76x bf16 against 1.71x. ``w4a8_linear(pdl=False)`` turns it off.
PROGRESSIVE_PDL = True
# One row of x on a progressive weight: ``gemv.py``'s dp4a GEMV instead of the 16-row tiles. Off: on the H100
# (``bench_w4a8.py --prog-small-sweep``, 2026-12-07) it read 2.11x bf16 cuBLAS at M = 1, ahead of the tiles launched
# plainly (2.05x), behind them with programmatic dependent launch (2.17x), which the GEMV then did not take (it does
# now, untimed). ``w4a8_linear(gemv=True)`` asks for it.
PROGRESSIVE_GEMV = False


def _pow2(v: int) -> bool:
    return isinstance(v, int) and v > 0 and v & (v - 1) == 0


@dataclass(frozen=True)
class W4A8Config:
    """One launch of the W4A8 GEMM: BLOCK_M x BLOCK_N output tiles, BLOCK_K deep steps (capped to divide the group),
    GROUP_M row tiles per L2 group, ``split_waves`` (split K until about that many waves of programs per SM
    exist; 0: never), ``swap_ab`` (y.T = W @ qa.T), warps and pipeline stages; ``byte_unpack``: the weight tile is
    read as bytes and turned into int8 four codes per instruction (``gemm._bytes_to_signed``), else word by word;
    ``flat``: the flat-loop kernel of ``flat.py`` (one software-pipelined K loop), else ``gemm.py``'s group loop."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 128
    group_m: int = 8
    split_waves: int = 0
    swap_ab: bool = False
    num_warps: int = 4
    num_stages: int = 3
    byte_unpack: bool = True
    flat: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "group_m", "num_warps"):
            if not _pow2(getattr(self, name)):
                raise ValueError(f"{name} must be a power of two, got {getattr(self, name)}")
        if self.block_m < 16 or self.block_n < 16 or self.block_k < 32:
            raise ValueError("tiles must be at least 16 (M), 16 (N) and 32 (K) wide: tl.dot's minimum for 8 bits")
        if not 0 <= self.split_waves <= 32 or self.num_stages < 1:
            raise ValueError("split_waves must be in [0, 32] and num_stages >= 1")

    @property
    def name(self) -> str:
        swap = "t" if self.swap_ab else ""
        words = "" if self.byte_unpack else "-words"
        flat = "-flat" if self.flat else ""
        return (
            f"m{self.block_m}n{self.block_n}k{self.block_k}g{self.group_m}w{self.num_warps}s{self.num_stages}"
            f"sw{self.split_waves}{swap}{words}{flat}"
        )


# Largest M of each regime -> config of the group-loop kernel (gemm.py). First choices (see the module docstring);
# measured on an H100 (docs/results/w4a8.md): the byte unpacking ran M <= 16 at 1.33x bf16 against 1.07x word by
# word, and M >= 1024 at 0.19x against 0.31x, so the large-M entry unpacks word by word. Above M = 16 the flat kernel
# (FLAT_TABLE) replaced it as the default.
GROUP_LOOP_TABLE: tuple[tuple[int, W4A8Config], ...] = (
    (SMALL_M, W4A8Config(16, 64, 64, 1, split_waves=4, swap_ab=True, num_warps=4, num_stages=4)),
    (64, W4A8Config(64, 64, 128, 8, split_waves=2, num_warps=8, num_stages=4)),
    (256, W4A8Config(64, 128, 64, 8, split_waves=1, num_warps=8, num_stages=4)),
    (2**31, W4A8Config(128, 64, 64, 8, split_waves=0, num_warps=8, num_stages=4, byte_unpack=False)),
)


# The default (``CONFIG_TABLE``): the flat-loop kernel (``flat.py``) above M = 16, swap-AB tiles (x's rows on the
# MMA's N side, 128 weight rows on its M side, the unpacked weight tile the wgmma's register operand), 128 deep (one
# g128 group a step), 8 warps; split-K as the group-loop table.
# Compiled offline for sm_90 (Triton 3.6, int8): 149 (64-row) and 221 (128-row) registers, no spills, the weight tile
# from shared memory bytes straight into wgmma's register operand layout. Up to M = 16 it is the group-loop entry.
# H100, bench_w4a8.py, geomean over bf16 cuBLAS against the group-loop table in the same run: M = 64 0.70x against
# 0.56x, 256 0.31x against 0.21x, 1024 0.48x against 0.30x, 4096 0.50x against 0.31x. Above M = 64, the winner of
# ``bench_w4a8.py --flat-sweep`` (H100, two shapes, 4096 x 4096 and 28672 x 8192, nine tiles in one run): 128 x 64
# tiles with 4 warps, 0.53x / 0.52x / 0.56x at M = 256 / 1024 / 4096 against 0.44x / 0.44x / 0.47x for 128 x 128 with
# 8 warps and 0.32x-0.34x for 64 x 128 (the entry it replaces up to M = 256).
FLAT_TABLE: tuple[tuple[int, W4A8Config], ...] = (
    GROUP_LOOP_TABLE[0],
    (64, W4A8Config(64, 128, 128, 8, split_waves=2, swap_ab=True, num_warps=8, num_stages=4, flat=True)),
    (2**31, W4A8Config(128, 64, 128, 8, split_waves=0, swap_ab=True, num_warps=4, num_stages=4, flat=True)),
)


CONFIG_TABLE = FLAT_TABLE


# Progressive weights (``progressive.py``'s kernel, one int32 accumulator over K): from two sweeps on the H100
# (2026-12-07; geomean over bf16 cuBLAS, end to end, every candidate in the same run):
# - ``bench_w4a8.py --prog-small-sweep`` (six Llama shapes): at M = 1 FLAT_TABLE's small-M tile, 16 x 64, 64 deep,
#   K split over 4 waves, leads (2.05x; 128 deep 2.00x, 8 or 2 waves 1.98x / 1.94x, 128 wide 1.66x, 32 wide 1.10x);
#   at M = 16 the 128-deep one does (2.15x against 2.05x).
# - ``--prog-sweep`` (4096 x 4096 and 28672 x 8192): M 17-64, 64 x 64 tiles on 4 warps (1.63x against 1.36-1.38x for
#   64 x 128 on 8 warps and 1.28x for 128 x 64); M 65-256, FLAT_TABLE's 128 x 64 on 4 warps (1.07x, the best); above,
#   128 x 128 on 8 warps (1.15x / 1.23x at M = 1024 / 4096 against 1.02x / 1.04x). 256 rows of x (twice the MMAs per
#   unpacked code) lost at every M (at best 1.14x, M = 4096) and the unswapped 128 x 128 tile read 0.35-0.41x.
_PROG_SMALL = replace(GROUP_LOOP_TABLE[0][1], flat=True)
PROGRESSIVE_TABLE: tuple[tuple[int, W4A8Config], ...] = (
    (1, _PROG_SMALL),
    (SMALL_M, replace(_PROG_SMALL, block_k=128)),
    (64, W4A8Config(64, 64, 128, 8, split_waves=0, swap_ab=True, num_warps=4, num_stages=4, flat=True)),
    (256, FLAT_TABLE[-1][1]),
    (2**31, W4A8Config(128, 128, 128, 8, split_waves=0, swap_ab=True, num_warps=8, num_stages=4, flat=True)),
)


# The GEMV's launch as a config, so that ``plan_launch`` splits its K as the tiles': one row in a program's 16-row
# slot (the tiles' minimum; one row of x is all it reads), GEMV_BLOCK_N columns, GEMV_BLOCK_K deep.
GEMV_CONFIG = W4A8Config(16, GEMV_BLOCK_N, GEMV_BLOCK_K, 1, split_waves=GEMV_SPLIT_WAVES, num_warps=GEMV_WARPS,
                         num_stages=GEMV_STAGES)  # fmt: skip


def config_for(m: int, table: tuple[tuple[int, W4A8Config], ...] | None = None) -> W4A8Config:
    """The config of the regime that ``m`` rows fall in (``table``, default ``CONFIG_TABLE``)."""
    table = CONFIG_TABLE if table is None else table
    for max_m, cfg in table:
        if m <= max_m:
            return cfg
    return table[-1][1]


@dataclass(frozen=True)
class LaunchPlan:
    """``block_k`` after the cap, the K split, K tiles per split and per group, and the grid."""

    block_k: int
    split: int
    tiles_per_split: int
    group_tiles: int
    grid: tuple[int, int]


def plan_launch(cfg: W4A8Config, m: int, n: int, k: int, group_size: int, sms: int) -> LaunchPlan:
    """BLOCK_K capped to divide ``group_size`` (0: one group), and the split-K factor: enough splits for
    ``split_waves * sms`` programs, never more than the K tiles, none empty, and none where the output has more
    tiles than the weight has split-K semaphores (``LOCK_SLOTS``)."""
    block_k = cfg.block_k
    if group_size:
        while group_size % block_k:
            block_k //= 2
    k_tiles = -(-k // block_k)
    group_tiles = group_size // block_k if group_size else k_tiles
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    split = 1
    if cfg.split_waves and tiles <= LOCK_SLOTS:
        split = max(1, min(-(-cfg.split_waves * sms // tiles), k_tiles))
    tiles_per_split = -(-k_tiles // split)
    split = -(-k_tiles // tiles_per_split)
    return LaunchPlan(block_k, split, tiles_per_split, group_tiles, (tiles, split))


@dataclass(frozen=True)
class Plan:
    """The choice for one product: the ``path`` ("small_m" or "tiles"), its config and launch plan, and whether the
    weight is progressive (``progressive.py``'s kernel)."""

    path: str
    config: W4A8Config
    launch: LaunchPlan
    progressive: bool = False

    def __str__(self) -> str:
        split = f", split-K {self.launch.split}" if self.launch.split > 1 else ""
        module = "progressive.py" if self.progressive else "flat.py" if self.config.flat else "gemm.py"
        return f"W4A8 GEMM (Triton, w4a8/{module}) [{self.path}: {self.config.name}{split}]"


def choose(
    m: int,
    n: int,
    k: int,
    group_size: int,
    sms: int,
    config: W4A8Config | None = None,
    progressive: bool = False,
) -> Plan:
    """The plan for qa [m, k] @ W.T, W [n, k] in groups of ``group_size`` (0: one), on ``sms`` SMs; ``config``
    overrides the table's (``PROGRESSIVE_TABLE`` for a progressive weight, else ``CONFIG_TABLE``)."""
    cfg = config or config_for(m, PROGRESSIVE_TABLE if progressive else None)
    path = "small_m" if m <= SMALL_M and config is None else "tiles"
    return Plan(path, cfg, plan_launch(cfg, m, n, k, group_size, sms), progressive)


def explain(
    m: int, n: int, k: int, group_size: int, device: torch.device | str = "cuda", progressive: bool = False
) -> str:
    """One line: the path and config that serve x [m, k] @ W.T for W [n, k] on ``device`` (4 SMs off CUDA)."""
    return str(choose(m, n, k, group_size, sms_of(device_of(device)), progressive=progressive))


def w4a8_matmul(
    qa: torch.Tensor,
    a_scale: torch.Tensor,
    w: W4A16Weight | ProgressiveWeight,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float16,
    out: torch.Tensor | None = None,
    config: W4A8Config | None = None,
    pdl: bool = False,
    gemv: bool | None = None,
) -> torch.Tensor:
    """qa [M, K] int8 | float8_e4m3fn (kernel channel order) with per-token fp32 scales [M] x the 4-bit weight ->
    y [M, N] in ``out_dtype`` (``out`` if given); ``config`` overrides the table. A ``ProgressiveWeight`` (int8
    activations only) runs ``progressive.py``'s kernel; ``pdl`` (progressive only): launch it with programmatic
    dependent launch after a quantizer launched with ``pdl=True``. ``gemv`` (None: ``PROGRESSIVE_GEMV`` where no
    ``config`` is given): one row on a progressive weight runs ``gemv.py``'s GEMV (refused where it cannot)."""
    progressive = isinstance(w, ProgressiveWeight)
    if progressive:
        out = check_progressive_operands(qa, a_scale, w, bias, out_dtype, out)
    else:
        out = check_w4a8_operands(qa, a_scale, w, bias, out_dtype, out)
    m = qa.shape[0]
    if m == 0 or w.out_features == 0:
        return out
    require(not pdl or progressive, "pdl is only for progressive weights")
    require(not pdl or pdl_possible(qa), PDL_REFUSED)
    if gemv is None:
        gemv = progressive and PROGRESSIVE_GEMV and config is None and gemv_fits(qa, w)
    if gemv:
        require(progressive and gemv_fits(qa, w),
                "gemv needs a progressive weight, one contiguous row of x and K a multiple of 4")  # fmt: skip
        plan = plan_launch(GEMV_CONFIG, 1, w.out_features, w.in_features, w.group_size, num_sms(qa.device))
        launch_progressive_gemv(qa, a_scale, w, bias, out, plan, pdl)
        return out
    plan = choose(m, w.out_features, w.in_features, w.group_size, num_sms(qa.device), config, progressive)
    if progressive:
        launch_progressive(qa, a_scale, w, bias, out, plan.config, plan.launch, pdl)
    else:
        (launch_flat if plan.config.flat else launch)(qa, a_scale, w, bias, out, plan.config, plan.launch)
    return out


def progressive_pdl(x2: torch.Tensor) -> bool:
    """Whether a progressive weight's quantizer and GEMM run under programmatic dependent launch for x [M, K] by
    default: ``PROGRESSIVE_PDL`` and W8A8's ``use_pdl`` (sm_90+, few rows, outside the interpreter), read when
    called; shared by ``w4a8_linear`` and the kernels that make the codes in the quantizer's place."""
    return PROGRESSIVE_PDL and use_pdl(x2)


def w4a8_linear(
    x: torch.Tensor,
    w: W4A16Weight | ProgressiveWeight,
    bias: torch.Tensor | None = None,
    fmt: str = "int8",
    config: W4A8Config | None = None,
    pdl: bool | None = None,
    gemv: bool | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W.T + bias in x's dtype (fp16 / bf16): x permuted for act-order, quantized per token
    to ``fmt`` ("int8" or "fp8"), then the W4A8 GEMM with ``choose``'s plan (``config`` overrides the table).
    ``pdl`` (progressive weights; None: ``PROGRESSIVE_PDL`` and W8A8's ``pdl_rule``): the GEMM starts while the
    quantizer runs (programmatic dependent launch, sm_90+). ``gemv``: as ``w4a8_matmul``'s."""
    require(fmt in DTYPE_OF_FORMAT, f"fmt must be one of {sorted(DTYPE_OF_FORMAT)}, got {fmt!r}")
    require(x.dtype in (torch.float16, torch.bfloat16), f"x must be float16 or bfloat16, got {x.dtype}")
    require(x.shape[-1] == w.in_features, f"x must be [..., {w.in_features}], got {tuple(x.shape)}")
    x2 = x.reshape(-1, x.shape[-1])
    if w.perm is not None:
        x2 = x2.index_select(1, w.perm)
    progressive = isinstance(w, ProgressiveWeight)
    if pdl is None:
        pdl = progressive and progressive_pdl(x2)
    require(not pdl or progressive, "pdl is only for progressive weights")
    require(not pdl or pdl_possible(x2), PDL_REFUSED)
    qa, a_scale = quantize_activations(x2, fmt, pdl=pdl)
    y = w4a8_matmul(qa, a_scale, w, bias, out_dtype=x.dtype, config=config, pdl=pdl, gemv=gemv)
    return y.reshape(*x.shape[:-1], w.out_features)
