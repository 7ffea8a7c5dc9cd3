"""Launch configurations of the Triton W4A16 kernels (``gemm.py``, ``gemv.py``) and the regime table.

A regime is a range of M (rows of x); each has one ``KernelConfig``. The split-K factor is not stored: it follows
from the shape (``plan_launch``), so one table entry serves every layer shape. ``config_for`` reads the module's
``CONFIG_TABLE`` when it is called, so a benchmark may try another table in memory (``config_for(m, n, table)``, or
by assigning ``configs.CONFIG_TABLE``); the source is not rewritten by any tool.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

METHODS = ("gemv", "fused", "dequant")
LOCK_SLOTS = 4096  # split-K semaphores a prepared weight keeps: at most this many output tiles may be split


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_pow2(v: int) -> bool:
    """A positive power of two (tile sizes, warp counts)."""
    return isinstance(v, int) and v > 0 and v & (v - 1) == 0


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration.

    ``method``: "gemv" (CUDA-core kernel, ``gemv.py``: ``block_m`` rows of x per CTA, any power of two),
    "fused" (dequantize in registers, tl.dot on tensor cores, ``gemm.py``) or "dequant" (dequantize to [N, K],
    then cuBLAS through F.linear).
    ``split_waves``: split K until about ``split_waves * n_SMs`` CTAs exist (0: never split); scaled up in
    proportion where ``plan_launch`` caps BLOCK_K below ``block_k`` (groups smaller than the tile).
    ``fuse_scale`` (fused): W = (q - z) * s rounded in the tile, accumulated inside the dot, instead of scaling each
    tile's dot product. Either way BLOCK_K is capped so that a K tile never straddles groups (``plan_launch``).
    ``fold_zero`` (gemv, 4-bit): take the zero point and the unpacking offset out of the inner loop (no FADD per
    code; ``gemv._tile_mac_folded``).
    ``prefetch`` (gemv, num_stages 1): issue the loads of K tile t + 1 before the arithmetic of tile t (the next
    tile's words wait in registers), so every thread keeps a whole tile of loads in flight.
    ``vector_x`` (gemv, with ``fold_zero``): read x four activations per 8-byte load (needs whole K tiles, unit
    column stride and 8-byte aligned rows; otherwise the kernel reads one activation per load).
    ``swap_ab`` (fused): compute y.T = W.T @ x.T so the weight tile is the MMA's M side (wgmma for M < 64).
    ``fixup_unroll``: partial tiles the split-K fix-up loads per round (``epilogue.finish_tile``); 0 picks
    the module function ``fixup_unroll``'s default from the tile's size.
    """

    method: str = "fused"
    block_m: int = 16
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    split_waves: int = 0
    fuse_scale: bool = False
    group_m: int = 8
    swap_ab: bool = False
    fold_zero: bool = False
    prefetch: bool = False
    vector_x: bool = False
    fixup_unroll: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        for name in ("block_m", "block_n", "block_k", "num_warps", "group_m"):
            if not is_pow2(getattr(self, name)):
                raise ValueError(f"{name} must be a power of two, got {getattr(self, name)}")
        min_m = 1 if self.method == "gemv" else 16
        if self.block_m < min_m or self.block_n < 16 or self.block_k < 32:
            raise ValueError(
                f"tiles must be at least {min_m} (M), 16 (N) and 32 (K) wide: tl.dot's minimum, whole packed words"
            )
        if self.fixup_unroll and not (is_pow2(self.fixup_unroll) and self.fixup_unroll <= 32):
            raise ValueError(f"fixup_unroll must be 0 (default) or a power of two <= 32, got {self.fixup_unroll}")
        if not 0 <= self.split_waves <= 32 or self.num_stages < 1:
            raise ValueError("split_waves must be in [0, 32] and num_stages >= 1")
        if self.vector_x and not (self.method == "gemv" and self.fold_zero):
            raise ValueError("vector_x is an option of the gemv's folded path: it needs fold_zero")
        if self.prefetch and (self.method != "gemv" or self.num_stages != 1):
            raise ValueError("prefetch is a gemv option and replaces pipelining: it needs num_stages 1")

    @property
    def name(self) -> str:
        if self.method == "dequant":
            return "dequant+cublas"
        unroll = f"u{self.fixup_unroll}" if self.fixup_unroll else ""
        if self.method == "gemv":
            fold = ("f" if self.fold_zero else "") + ("p" if self.prefetch else "") + ("v" if self.vector_x else "")
            return (
                f"gemv-m{self.block_m}n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}"
                f"{fold}sw{self.split_waves}{unroll}"
            )
        scale = "fs" if self.fuse_scale else "ts"
        swap = "t" if self.swap_ab else ""
        return (
            f"m{self.block_m}n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}"
            f"sw{self.split_waves}{scale}{swap}{unroll}"
        )

    def to_dict(self) -> dict:
        return asdict(self)


# Largest M of each regime -> config, from a sweep of every candidate over the benchmark's layer shapes and groups
# (``benchmarks/bench_w4a16.py``; docs/results/w4a16.md). M = 1-2: the CUDA-core gemv with the zero folded out of the
# inner loop, whole-tile split-K fix-ups and, at M = 1, x read four activations per load; M 4-128: swap-AB tensor-core
# tiles whose BLOCK_M follows M (64-wide N tiles, 128 deep from M = 32); from M = 256 dequantize + cuBLAS.
CONFIG_TABLE: tuple[tuple[int, KernelConfig], ...] = (
    (1, KernelConfig("gemv", 1, 512, 128, 4, 1, split_waves=4, fold_zero=True, vector_x=True, fixup_unroll=32)),
    (2, KernelConfig("gemv", 2, 512, 64, 4, 1, split_waves=8, fold_zero=True, prefetch=True, fixup_unroll=8)),
    (4, KernelConfig("fused", 16, 128, 64, 4, 3, split_waves=4, fuse_scale=True, swap_ab=True)),
    (16, KernelConfig("fused", 16, 64, 64, 4, 3, split_waves=4, fuse_scale=True, swap_ab=True)),
    (32, KernelConfig("fused", 32, 64, 128, 4, 3, split_waves=2, fuse_scale=True, swap_ab=True)),
    (64, KernelConfig("fused", 64, 64, 128, 4, 3, split_waves=2, fuse_scale=True, swap_ab=True)),
    (128, KernelConfig("fused", 128, 64, 128, 4, 3, split_waves=2, fuse_scale=True, swap_ab=True)),
    (256, KernelConfig("dequant", 16, 128, 128, 4, 4)),
    (2**31, KernelConfig("dequant", 16, 128, 128, 4, 4)),
)


# M = 1 on wide layers (N >= WIDE_N): 64-deep K tiles (64 registers: 8 CTAs of 4 warps per SM instead of 5) and
# twice the splits; on N <= 8192 the table's config stayed ahead.
WIDE_N = 14336
WIDE_M1 = KernelConfig("gemv", 1, 512, 64, 4, 1, split_waves=8, fold_zero=True, vector_x=True, fixup_unroll=32)
# 3-4 rows of the widest layers (N >= WIDE_M4_N): the m4 regime's tiles split twice as far (the same compiled kernel:
# the split only changes the grid); on 14336-wide layers it lost, so they keep the table's config.
WIDE_M4_N = 28672
WIDE_M4 = KernelConfig("fused", 16, 128, 64, 4, 3, split_waves=8, fuse_scale=True, swap_ab=True)


def config_for(m: int, n: int | None = None, table: tuple[tuple[int, KernelConfig], ...] | None = None) -> KernelConfig:
    """The configuration of the regime that ``m`` rows fall in (``table``, default ``CONFIG_TABLE``); ``n`` (output
    features) picks ``WIDE_M1`` for one row of a wide layer and ``WIDE_M4`` for 3-4 rows of the widest."""
    if m == 1 and n is not None and n >= WIDE_N:
        return WIDE_M1
    if 2 < m <= 4 and n is not None and n >= WIDE_M4_N:
        return WIDE_M4
    table = CONFIG_TABLE if table is None else table
    for max_m, cfg in table:
        if m <= max_m:
            return cfg
    return table[-1][1]


def fixup_unroll(cfg: KernelConfig) -> int:
    """Partial tiles the split-K fix-up loads per round: the config's ``fixup_unroll``, else 4 for tiles of at
    most 2048 values (16 per thread at 4 warps: the extra registers cost no occupancy there), else 1."""
    if cfg.fixup_unroll:
        return cfg.fixup_unroll
    return 4 if cfg.block_m * cfg.block_n <= 2048 else 1


@dataclass(frozen=True)
class LaunchPlan:
    block_k: int
    split_k: int
    tiles_per_split: int
    grid: tuple[int, int]


def plan_launch(cfg: KernelConfig, m: int, n: int, k: int, group_size: int, num_sms: int) -> LaunchPlan:
    """Effective BLOCK_K (capped so that no K tile straddles groups) and the split-K factor.

    ``group_size`` is the contiguous group length along K, or 0 when there is a single group.
    """
    block_k = cfg.block_k
    if group_size:  # every K tile lies in one group: one row of scales and zeros per tile
        while group_size % block_k:
            block_k //= 2
    k_tiles = _cdiv(k, block_k)
    tiles = _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n)
    # a tile capped below the config's BLOCK_K holds proportionally fewer registers, so proportionally more CTAs
    # fit on an SM and are needed to fill it: the M = 1 gemv at group 64 runs 64 instead of 96 registers (8 CTAs
    # per SM instead of 5) and gained from twice the split on the larger layers
    waves = cfg.split_waves * (cfg.block_k // block_k)
    split = 1
    if waves and tiles <= LOCK_SLOTS:
        split = max(1, min(_cdiv(waves * num_sms, tiles), k_tiles))
    tiles_per_split = _cdiv(k_tiles, split)
    split = _cdiv(k_tiles, tiles_per_split)  # no empty splits
    return LaunchPlan(block_k, split, tiles_per_split, (tiles, split))
