"""Tile configs of the fused MoE GEMMs (``experts.py``): which BLOCK_M / BLOCK_N / BLOCK_K, warps, stages and
options serve a layer of a given format and shape at a given number of tokens.

``moe_config`` reads ``TUNED_CONFIGS`` (per format and layer shape, by tokens: entries printed by
``benchmarks/bench_moe.py --sweep`` on a GPU, pasted here) and falls back on ``DEFAULT_CONFIGS`` (per format, by
the mean rows per expert: first choices). ``block_k`` checks a config's K tile against the format's constraints.
"""

from __future__ import annotations

FORMATS = ("float", "w4a16", "fp8_block")

# Tile configs: BLOCK_M, BLOCK_N, num_warps, num_stages, and optionally BLOCK_K (w4a16: a multiple of 32 that divides
# the group; float: 16 or more; fp8_block: B only), SWAP_AB (the weight tile as the MMA's M side) and SCALE_TILE
# (w4a16: scale each K tile's product instead of rounding W; other numerics, see experts.py's docstring). One config
# serves both projections of a layer. ``DEFAULT_CONFIGS``: per format, by the mean rows per expert (first choices).
# ``TUNED_CONFIGS``: per (format, H, I, E, top_k), by tokens: ``bench_moe.py --sweep`` prints entries to paste here.
DEFAULT_CONFIGS: dict[str, list[tuple[float, dict[str, int]]]] = {
    fmt: [
        (16, {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4}),
        (64, {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4}),
        (float("inf"), {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}),
    ]
    for fmt in FORMATS
}
TUNED_CONFIGS: dict[tuple[str, int, int, int, int], list[tuple[float, dict[str, int]]]] = {}


def moe_config(
    tokens: int, top_k: int, num_experts: int, fmt: str = "float", hidden: int = 0, inter: int = 0
) -> dict[str, int]:
    """The tile config of a layer of ``num_experts`` experts (H ``hidden``, I ``inter``, ``fmt`` one of FORMATS)
    over ``tokens`` tokens routed to ``top_k`` experts each: the tuned table's entry for this shape if there is one,
    else the format's default by the mean rows per expert."""
    tuned = TUNED_CONFIGS.get((fmt, hidden, inter, num_experts, top_k))
    if tuned:
        return dict(next(cfg for most, cfg in tuned if tokens <= most))
    per_expert = tokens * top_k / num_experts
    return dict(next(cfg for most, cfg in DEFAULT_CONFIGS[fmt] if per_expert <= most))


def block_k(fmt: str, group_size: int, cfg: dict[str, int]) -> int:
    """The K tile of experts in ``fmt`` (``group_size``: w4a16's group, fp8_block's B): the config's BLOCK_K where
    the format allows it (ValueError where not), else the format's default."""
    bk = cfg.get("BLOCK_K", 0)
    if fmt == "fp8_block":
        if bk not in (0, group_size):
            raise ValueError(f"fp8_block experts take BLOCK_K = B = {group_size}, got {bk}")
        return group_size
    if fmt == "w4a16":
        bk = bk or (32 if group_size % 64 else 64)
        if bk % 32 or bk & (bk - 1) or (group_size and group_size % bk):
            raise ValueError(f"w4a16 BLOCK_K must be a power of two >= 32 dividing the group {group_size}, got {bk}")
        return bk
    bk = bk or 64
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"BLOCK_K must be a power of two from 16, got {bk}")
    return bk
