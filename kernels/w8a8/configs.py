"""Tile configs of the Triton W8A8 GEMM (``gemm.py``) per (format, M regime), and the rules that pick one.

A ``TileConfig`` is one launch of ``_w8a8_matmul_kernel`` / ``_w8a8_matmul_tma_kernel``: BLOCK_M x BLOCK_N output
tiles, BLOCK_K deep K steps, GROUP_M row tiles per L2 group, how operands are fetched (``use_tma``: 0 pointer loads,
1 TMA, 2 / 3 / 4 TMA with one / two / three persistent programs per SM; TMA modes fall back to pointer loads where
the operands are not TMA-compatible) and the launch's warps and pipeline stages. ``w8a8_matmul`` also takes one as
a dict with the keys ``CONFIG_KEYS`` (``TileConfig.from_dict``).

``CONFIGS`` holds one config per (format, regime) from a sweep of the candidates in ``benchmarks/bench_w8a8.py`` on
the issue's six layer shapes (docs/results/w8a8.md), with the changes by hand noted below; ``config_for`` reads it
when called, so a benchmark may try other configs in memory. Tuned on the H200 (sm_90, 132 SMs).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

M_REGIMES = (("m16", 16), ("m64", 64), ("m256", 256), ("large", None))  # regime = first whose bound >= M
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "USE_TMA", "num_warps", "num_stages")
TMA_MODES = (0, 1, 2, 3, 4)


def _pow2(v: int) -> bool:
    return isinstance(v, int) and v > 0 and v & (v - 1) == 0


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration of the Triton W8A8 GEMM (fields in ``CONFIG_KEYS`` order)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    use_tma: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        if self.use_tma not in TMA_MODES:
            raise ValueError(f"USE_TMA must be one of {sorted(TMA_MODES)}, got {self.use_tma}")
        for key, value in zip(CONFIG_KEYS, astuple(self), strict=True):
            if key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps") and not _pow2(value):
                raise ValueError(f"{key} must be a power of two, got {value}")
            if key in ("GROUP_M", "num_stages") and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{key} must be a positive int, got {value}")

    @classmethod
    def from_dict(cls, config: dict[str, int]) -> TileConfig:
        """From a dict with exactly the keys ``CONFIG_KEYS``."""
        if set(config) != set(CONFIG_KEYS):
            raise ValueError(f"config keys must be {CONFIG_KEYS}, got {sorted(config)}")
        return cls(*(config[key] for key in CONFIG_KEYS))

    def to_dict(self) -> dict[str, int]:
        return dict(zip(CONFIG_KEYS, astuple(self), strict=True))

    @property
    def name(self) -> str:
        fetch = ("ptr", "tma", "tma-p1", "tma-p2", "tma-p3")[self.use_tma]
        return (
            f"m{self.block_m}n{self.block_n}k{self.block_k}g{self.group_m}w{self.num_warps}s{self.num_stages}-{fetch}"
        )


CONFIGS: dict[tuple[str, str], TileConfig] = {
    ("int8", "m16"): TileConfig(16, 32, 256, 1, 1, 4, 6),
    ("int8", "m64"): TileConfig(64, 64, 256, 1, 0, 4, 4),  # by hand, M 17-32 (see UPPER_M64)
    ("int8", "m256"): TileConfig(64, 128, 128, 8, 0, 4, 4),
    # by hand: the persistent kernel with 256 x 128 tiles ran M >= 1024 faster than the sweep's 128 x 256 TMA tiles
    ("int8", "large"): TileConfig(256, 128, 128, 8, 2, 8, 3),
    ("fp8", "m16"): TileConfig(16, 64, 256, 1, 1, 4, 4),
    ("fp8", "m64"): TileConfig(64, 64, 256, 1, 0, 4, 4),  # by hand, M 17-32 (see UPPER_M64)
    ("fp8", "m256"): TileConfig(64, 128, 128, 8, 0, 4, 4),
    ("fp8", "large"): TileConfig(256, 128, 128, 8, 1, 8, 3),
}

# fp8 with fast accumulation and M > 256 (no promotion in the K loop, so the wide tile pays): the persistent kernel
# with 128 x 256 tiles, ahead of the promoted path's tiles
FP8_FAST_LARGE = TileConfig(128, 256, 128, 8, 2, 8, 3)

# int8 with M <= 16 on wide layers: the 16 x 32 tiles fit 3 CTAs per SM (72 KB of shared memory each), so more than
# 2 x SMs tiles leave a last wave on part of the SMs; two persistent programs per SM over 16 x 64 tiles spread them
# evenly (faster on 14336 x 4096 and 28672 x 8192; at or below 2 x SMs tiles the regime's config stayed ahead)
INT8_WIDE_SKINNY = TileConfig(16, 64, 256, 1, 3, 4, 4)
WIDE_TILES_PER_SM = 2  # of the regime's config's BLOCK_N

# The m64 regime in two halves. M 33-64: the persistent TMA kernel (one program per SM walking 64 x 64 x 256 tiles,
# so the next tile's loads overlap the current one's epilogue), 1-1.5% ahead of the swept TMA config in three runs.
# M 17-32: CONFIGS' m64 entry, pointer loads, which won at M = 32 by 6-7% against the swept TMA config.
UPPER_M64 = TileConfig(64, 64, 256, 1, 2, 4, 4)
UPPER_M64_FROM = 33

# M 17-64 (the m64 regime): each program asks L2 for its weight tile 4 K steps ahead (``_device.prefetch_block_l2``).
# It pays on layers of few output tiles (4096 x 14336: +13%, 4096 x 4096: +7%), is neutral on the others and lost
# 0-7% at M = 1 and 16, where the grid covers the GPU several times.
L2_AHEAD_M64 = 4


def m_regime(m: int) -> str:
    for name, bound in M_REGIMES:
        if bound is None or m <= bound:
            return name
    raise AssertionError("unreachable: the last regime has no bound")


def l2_ahead_for(m: int) -> int:
    """K tiles ahead that the GEMM prefetches into L2 for M rows (0: none)."""
    return L2_AHEAD_M64 if m_regime(m) == "m64" else 0


def config_for(m: int, fmt: str, fp8_fast_accum: bool = False, n: int | None = None, sms: int = 132) -> TileConfig:
    """The tile config for M rows (``CONFIGS`` by regime); ``n`` (output features) and ``sms`` pick the wide-layer
    int8 config for M <= 16 (``INT8_WIDE_SKINNY``); M 33-64 takes ``UPPER_M64``."""
    regime = m_regime(m)
    cfg = FP8_FAST_LARGE if fmt == "fp8" and fp8_fast_accum and regime == "large" else CONFIGS[(fmt, regime)]
    if fmt == "int8" and regime == "m16" and n is not None and -(-n // cfg.block_n) > WIDE_TILES_PER_SM * sms:
        cfg = INT8_WIDE_SKINNY
    if regime == "m64" and m >= UPPER_M64_FROM:
        cfg = UPPER_M64
    return cfg


def pick_config(m: int, fmt: str, fp8_fast_accum: bool = False, n: int | None = None, sms: int = 132) -> dict[str, int]:
    """``config_for`` as the dict ``w8a8_matmul``'s ``config`` takes."""
    return config_for(m, fmt, fp8_fast_accum, n, sms).to_dict()
