"""Configs and dispatch rule of the mma.sync W4A16 gemv (``mma_gemv.py``, Gluon): which config serves M = 1-16
rows of an N x K layer, how far K is split, and what the kernel cannot take. Plain Python: the rule runs without a
GPU (the dispatch asks ``plan``; ``quantkit.kernels.explain`` asks it about any ``GPU``).

The configs below were each timed against the choices before them on the decoder layers of Llama-2/3 and Qwen2.5
(docs/results/w4a16.md); each comment says where a config wins and why the rule stops there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from quantkit.kernels._device import GLUON_TRITON, gluon_unsupported
from quantkit.kernels.w4a16.configs import is_pow2
from quantkit.kernels.w4a16.problem import Plan, Product
from quantkit.kernels.w4a16.weight import W4A16Weight

KERNEL = "mma.sync gemv (Gluon, w4a16/mma_gemv.py)"


@dataclass(frozen=True)
class MmaGemvConfig:
    """``num_warps`` warps of 32 columns per CTA; ``steps`` K steps of 32 per loop iteration (all their loads
    issued together); K is split until the grid has ``fill`` x SMs CTAs (at most ``max_split`` slices)."""

    num_warps: int = 4
    steps: int = 4
    fill: float = 4.0
    max_split: int = 16
    prefetch: bool = False  # steps == 4 only: the next iteration's words are loaded before this one's math
    wave: int = 0  # > 0: the split never makes the grid exceed this many CTAs per SM (one wave of resident CTAs)
    min_depth: int = 0  # > 0: the split never leaves a CTA fewer than this many K rows
    skip_split: int = 0  # > 0: a split measured slow for this config; the rule goes one doubling on (or back)
    wave_divisor: bool = False  # the split: the largest divisor of the loop count whose grid fits one wave (``wave``)
    uneven: bool = False  # the doubling split need not divide the loop count (parts differ by at most one iteration)

    def __post_init__(self) -> None:
        if not is_pow2(self.num_warps) or not (isinstance(self.steps, int) and self.steps >= 1):
            raise ValueError(f"num_warps must be a power of two and steps >= 1, got {self.num_warps}, {self.steps}")
        if not self.fill > 0 or not (isinstance(self.max_split, int) and self.max_split >= 1):
            raise ValueError(f"fill must be positive and max_split >= 1, got {self.fill}, {self.max_split}")
        if min(self.wave, self.min_depth, self.skip_split) < 0:
            raise ValueError("wave, min_depth and skip_split must be >= 0 (0: not used)")

    @property
    def block_n(self) -> int:
        return 32 * self.num_warps

    @property
    def name(self) -> str:
        extra = ("p" if self.prefetch else "") + (f"v{self.wave}" if self.wave else "")
        extra += f"d{self.min_depth}" if self.min_depth else ""
        extra += f"m{self.max_split}" if self.max_split != 16 else ""
        extra += f"x{self.skip_split}" if self.skip_split else ""
        extra += "e" if self.wave_divisor else ""
        extra += "u" if self.uneven else ""
        return f"mma-w{self.num_warps}s{self.steps}f{self.fill:g}{extra}"


MMA_MAX_M = 16
MMA_TRITON = GLUON_TRITON  # the Gluon API the kernel is written for
# ``w4a16_linear`` runs this kernel up to MMA_DISPATCH_M rows (H200, eight layer shapes): against the previous choice
# 0.95-1.12x at M = 1 (the CUDA-core gemv; 7 of 8 shapes faster), 1.12-1.95x at M = 2-8; M = 9-16 see MMA_TWO_BLOCKS.
MMA_DISPATCH_M = 16
MMA_DEFAULT = MmaGemvConfig()
# Loading the next iteration's words first holds 66 registers instead of 58 (groups of 128, one row block; offline
# sm_90 compile with Triton 3.6), allocated in units of 8 as 72 against 64: 28 resident warps per SM instead of 32.
# It won where its one-wave split gives the grid as many warps as the default's (28672 x 8192 at M = 1: 2.93x cuBLAS
# fp16 against 2.61x; 4096 x 14336 2.23x against 1.96x) and lost where the wave cap halves them (8192 x 8192 2.65x
# against 3.00x), hence ``mma_config_for``. With groups of 64 the loop holds 72 registers (76 were read on the GPU
# for the revision timed then), a wave holds fewer CTAs than the cap assumes, and the full table lost up to a third at
# M = 2-8: groups of 64 never take it.
MMA_PREFETCH = MmaGemvConfig(2, 4, 8.0, prefetch=True, wave=14)
# Groups of 64, M <= 8: two K steps per iteration (one group each), no prefetch. At M = 1 it beat MMA_DEFAULT on 7
# of 8 shapes (1.06-1.19x; 14336 x 4096 0.88x); at M = 4 on the five whose split reaches max_split (1.03-1.50x) and
# lost on the three of N >= 14336 split 4-8 ways (0.87-0.89x): ``mma_config_for`` keeps it to M = 1 and to the
# layers it splits max_split ways.
MMA_STEPS2 = MmaGemvConfig(4, 2, 4.0)
# The same loop at M = 1 (groups of 64), with the split rule fitted to every split of it timed on eight shapes in two
# runs: 8-way splits ran 1.25-1.91x cuBLAS fp16 where 4 or 16 ran
# 2.2-3.0x on every shape, so the rule steps over 8 (14336 x 4096: 1.81x -> 2.17x), and the layers of N = 4096 fill
# the GPU only at 32 slices (4096 x 14336: 2.00x -> 2.22x; 4096 x 4096 tied); the other shapes keep their split.
MMA_STEPS2_M1 = MmaGemvConfig(4, 2, 4.0, max_split=32, skip_split=8)
# It also serves groups of 128 (and, as for MMA_PREFETCH, other multiples or one group) at M = 1 on layers of at most
# MMA_STEPS2_M1_MAX_N columns (64 column tiles, K split 16-32 ways): against the prefetch / default choice, two runs:
# 4096 x 14336 +7% / +7%, 4096 x 4096 +5% / +5%, 6144 x 4096 +3% / +4%, 8192 x 8192 and 8192 x 28672 +1% / +1%;
# on the wider layers it lost 3-7% (14336 x 4096, 28672 x 4096, 28672 x 8192), which keep the prefetch loop.
MMA_STEPS2_M1_MAX_N = 8192
# Groups of a multiple of 128 (or one group) at M = 2-8: MMA_STEPS2 on layers of 33-64 column tiles (4096 < N <= 8192),
# where two runs of every shape at M = 2 / 4 / 8 had it
# 3-5% ahead of the default loop (8192 x 8192, 8192 x 28672) and 5-13% ahead of the prefetch loop (6144 x 4096); at 32
# tiles it was within 2% or lost (4096 x 14336 at M = 2: 0.93x), on the wider layers it lost 7-24%.
MMA_STEPS2_TILES = (33, 64)
# M = 9-16 (two mma row blocks per warp): the prefetch loop with a split that keeps the grid within 8 CTAs per SM
# and each CTA at 512 K rows or more. With two row blocks the prefetch loop holds 128 registers (sm_90, compiled
# offline with Triton 3.6): 16 resident warps, i.e. 8 two-warp CTAs per SM, not MMA_PREFETCH's wave of 14; and short
# K slices pay the fp32 partial sums of 16 rows. Every split timed at M = 16: this
# rule picks the fastest on all 16 (shape, group 128 / 64) cells; against the Triton m16 tiles that served these rows
# before, 1.01-1.64x (geomean over cuBLAS fp16 1.29x -> 1.78x at group 128, 1.27x -> 1.62x at group 64, 1.29x ->
# 1.79x with one group per column).
# Its parts need not divide K evenly (``uneven``): on the layers the split is the one timed above, and on
# layers whose K has few factors of two the doubling no longer stops at 1-4 slices (4096 x 11008: 2 -> 16, 8192 x
# 29568: 1 -> 8).
MMA_TWO_BLOCKS = MmaGemvConfig(2, 4, 8.0, prefetch=True, wave=8, min_depth=512, uneven=True)
# M = 1, groups of a multiple of 128 (or one group): the prefetch loop split into the largest whole number of slices
# whose grid fits one wave of 14 CTAs per SM, any divisor of the loop count, where that split is not a power of two and
# fills at least MMA_WAVE_FILL of the wave (K = 7 x 2^j layers). Same run, every split of four configs: 8192 x 28672
# split 14 3.00x cuBLAS fp16 against 2.86x for the two-step loop's 16 (and 2.52x for the prefetch loop's power-of-two
# 8); 4096 x 14336 split 28 2.47x against 2.38x. With groups of 64 the same splits lost (2.31x against 2.62x, 2.01x
# against 2.22x): not taken there.
MMA_PREFETCH_WAVE = MmaGemvConfig(2, 4, 8.0, max_split=32, prefetch=True, wave=14, wave_divisor=True)
MMA_WAVE_FILL = 0.9
# M <= 8, groups of a multiple of 128 (or one group), when the rules above leave the grid under MMA_REFILL of one
# wave (MMA_REFILL_ROWS at M = 2-8) on a layer whose K is no power of two (``under_filled``: the down projections
# of Llama-2 and Qwen2.5, whose K has few factors of two, so the doubling stops early): MMA_PREFETCH_WAVE if its split
# fills at least MMA_PREFETCH_REFILL of its wave, else the default loop with the divisor rule (MMA_DEFAULT_WAVE, 8 CTAs
# per SM; when it fills more), which goes one divisor past the wave when no divisor fills half of it. Fitted on every
# divisor split of three configs on four such layers at M = 1 and 4, then checked old rule against new through the same
# kernel on seven layers, e.g. at M = 1 4096 x 11008 0.91x -> 1.99x cuBLAS fp16 (split 4 -> 43), 8192 x 29568 0.71x ->
# 2.52x (2 -> 11, prefetch), 3584 x 3584 1.03x -> 1.94x; at M = 4 0.41-1.02x -> 1.16-2.31x.
MMA_RESIDENT_4W = 8  # CTAs per SM of the four-warp loops (58-64 registers a thread)
MMA_REFILL = 0.625  # M = 1: the four layers switched filled 6-61%; 6144 x 4096 (73%) keeps its measured best
# M = 2-8: the one-wave prefetch split lost where the doubling rule already filled 55% (4096 x 14336, split 16 -> 28:
# 2.03x -> 1.65x at M = 2, 1.84x -> 1.33x at M = 8), so below half a wave only
MMA_REFILL_ROWS = 0.5
MMA_PREFETCH_REFILL = 0.75
MMA_DEFAULT_WAVE = MmaGemvConfig(4, 4, 4.0, max_split=64, wave=MMA_RESIDENT_4W, wave_divisor=True)


def mma_gemv_split(cfg: MmaGemvConfig, n: int, k: int, sms: int) -> int:
    """Split-K factor: doubled while the grid has fewer than cfg.fill x SMs CTAs, K still splits into whole loop
    iterations, (cfg.wave) the grid stays within one wave of resident CTAs and (cfg.min_depth) each CTA keeps at
    least that many K rows; a result of cfg.skip_split moves one doubling on where allowed, else one back.
    cfg.wave_divisor: instead, the largest divisor of the loop count (at most cfg.max_split) within one wave, or,
    when that fills less than half of the wave, the smallest divisor past it (a wave and part of another beat a mostly
    idle GPU)."""
    ctas = -(-n // cfg.block_n)
    iters = k // (32 * cfg.steps)
    if cfg.wave_divisor:
        divisors = [s for s in range(1, min(iters, cfg.max_split) + 1) if iters % s == 0]
        cap = cfg.wave * sms
        inside = max((s for s in divisors if ctas * s <= cap), default=1)
        past = [s for s in divisors if ctas * s > cap]
        return min(past) if 2 * ctas * inside < cap and past else inside

    def allowed(split: int) -> bool:
        return (
            split <= cfg.max_split
            and (cfg.uneven or iters % split == 0)
            and iters >= split
            and not (cfg.wave and ctas * split > cfg.wave * sms)
            and not (cfg.min_depth and iters // split * 32 * cfg.steps < cfg.min_depth)
        )

    split = 1
    while ctas * split < cfg.fill * sms and allowed(split * 2):
        split *= 2
    if cfg.skip_split and split == cfg.skip_split:
        split = split * 2 if allowed(split * 2) else split // 2
    return split


def unsupported(p: Product, cfg: MmaGemvConfig) -> str | None:
    """Why this kernel cannot run the product (None: it can); operand shapes and dtypes are ``check_operands``'s."""
    depth = 32 * cfg.steps
    group = p.group_size
    if p.bits != 4:
        return f"4-bit weights only, got {p.bits}-bit"
    if p.m > MMA_MAX_M:
        return f"M = {p.m} rows; this kernel takes at most {MMA_MAX_M}"
    if cfg.prefetch and cfg.steps != 4:
        return f"prefetch is written for 4 steps per iteration, got {cfg.steps}"
    if p.k % depth:
        return f"K = {p.k} must be a multiple of {depth}"
    if group and (group % 32 or (group % depth if group >= depth else cfg.steps % (group // 32))):
        return f"group size {group} must be a multiple of {depth} or divide it in multiples of 32"
    if p.n % 4:
        return f"N = {p.n} must be a multiple of 4"
    if p.x_stride[1] != 1 or p.x_stride[0] % 2:
        return "x needs unit column stride and an even row stride (read as 32-bit pairs)"
    if p.out_col_stride != 1:
        return "out needs unit column stride"
    return gluon_unsupported(p.gpu, hopper_only=False)


def mma_gemv_unsupported_reason(x: torch.Tensor, w: W4A16Weight, out: torch.Tensor | None,
                                cfg: MmaGemvConfig) -> str | None:  # fmt: skip
    """``unsupported`` for the product as the tensors are."""
    return unsupported(Product.of(x, w, out), cfg)


def grid_warps(cfg: MmaGemvConfig, n: int, k: int, sms: int) -> int:
    """Warps the launch of ``cfg`` puts on the GPU for an N x K layer (CTAs x split x warps per CTA)."""
    return -(-n // cfg.block_n) * mma_gemv_split(cfg, n, k, sms) * cfg.num_warps


def wave_split_fits(n: int, k: int, sms: int) -> bool:
    """Whether MMA_PREFETCH_WAVE's split of an N x K layer is one the doubling rules cannot reach (not a power of
    two) and fills at least MMA_WAVE_FILL of its wave."""
    split = mma_gemv_split(MMA_PREFETCH_WAVE, n, k, sms)
    return split & (split - 1) != 0 and wave_fill(MMA_PREFETCH_WAVE, n, k, sms) >= MMA_WAVE_FILL


@functools.lru_cache(maxsize=1024)
def mma_config_for(n: int, k: int, group: int, sms: int, m: int = 1) -> MmaGemvConfig | None:
    """The measured config for an N x K layer at M rows (see the configs above), None where this kernel is not the
    choice: M = 9-16 with groups other than 64, a multiple of 128 or one group (groups of 32 ran at about cuBLAS
    fp16's speed on every path; the Triton m16 tiles keep them).
    M <= 8: for groups of 64 MMA_STEPS2_M1 at M = 1 and MMA_STEPS2 where it splits K max_split ways; for groups of
    a multiple of 128 (or one group) MMA_PREFETCH_WAVE at M = 1 where ``wave_split_fits``, else MMA_STEPS2_M1 at
    M = 1 on layers of at most MMA_STEPS2_M1_MAX_N columns and
    MMA_STEPS2 at M = 2-8 on layers of MMA_STEPS2_TILES column tiles, then MMA_PREFETCH where its grid has at least
    as many warps as MMA_DEFAULT's; else MMA_DEFAULT. For groups of a multiple of 128 (or one group) a choice that is
    ``under_filled`` gives way to MMA_PREFETCH_WAVE or MMA_DEFAULT_WAVE (see there)."""
    if m > 8:
        return MMA_TWO_BLOCKS if group % 64 == 0 else None
    cfg = doubling_config(n, k, group, sms, m)
    if group % 128 == 0 and cfg is not MMA_PREFETCH_WAVE and under_filled(cfg, n, k, sms, m):
        if wave_fill(MMA_PREFETCH_WAVE, n, k, sms) >= MMA_PREFETCH_REFILL:
            return MMA_PREFETCH_WAVE
        if wave_fill(MMA_DEFAULT_WAVE, n, k, sms) > wave_fill(cfg, n, k, sms):
            return MMA_DEFAULT_WAVE
    return cfg


def under_filled(cfg: MmaGemvConfig, n: int, k: int, sms: int, m: int = 1) -> bool:
    """Whether cfg's doubling split leaves the grid under MMA_REFILL (M = 1) or MMA_REFILL_ROWS (M = 2-8) of a wave
    on a layer whose K is not a power of two (K = odd x 2^j, odd > 1: the doubling runs out of factors of two)."""
    return k & (k - 1) != 0 and wave_fill(cfg, n, k, sms) < (MMA_REFILL if m == 1 else MMA_REFILL_ROWS)


def wave_fill(cfg: MmaGemvConfig, n: int, k: int, sms: int) -> float:
    """The share of one wave of resident CTAs (cfg.wave per SM, else MMA_RESIDENT_4W) that cfg's grid fills."""
    if k % (32 * cfg.steps):
        return 0.0
    ctas = -(-n // cfg.block_n) * mma_gemv_split(cfg, n, k, sms)
    return ctas / ((cfg.wave or MMA_RESIDENT_4W) * sms)


def doubling_config(n: int, k: int, group: int, sms: int, m: int) -> MmaGemvConfig:
    """``mma_config_for`` at M <= 8 before its under-filled-grid fallback."""
    if m == 1 and group % 128 == 0 and wave_split_fits(n, k, sms):
        return MMA_PREFETCH_WAVE
    if m == 1 and (group == 64 or (group % 128 == 0 and n <= MMA_STEPS2_M1_MAX_N)):
        return MMA_STEPS2_M1
    if group % 128 == 0 and MMA_STEPS2_TILES[0] <= -(-n // MMA_STEPS2.block_n) <= MMA_STEPS2_TILES[1]:
        return MMA_STEPS2
    if group == 64 and mma_gemv_split(MMA_STEPS2, n, k, sms) == MMA_STEPS2.max_split:
        return MMA_STEPS2
    if group % 128 == 0 and grid_warps(MMA_PREFETCH, n, k, sms) >= grid_warps(MMA_DEFAULT, n, k, sms):
        return MMA_PREFETCH
    return MMA_DEFAULT


def plan(p: Product) -> Plan | None:
    """The plan when ``w4a16_linear`` runs this kernel for the product, else None: CUDA, M up to MMA_DISPATCH_M, a
    measured config (``mma_config_for``) and operands it takes (``unsupported``)."""
    if not p.is_cuda or p.m > MMA_DISPATCH_M:
        return None
    cfg = mma_config_for(p.n, p.k, p.group_size, p.sms, p.m)
    if cfg is None or unsupported(p, cfg) is not None:
        return None
    return Plan("mma_gemv", KERNEL, cfg, mma_gemv_split(cfg, p.n, p.k, p.sms))
