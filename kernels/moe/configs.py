"""Tile configs of the fused MoE GEMMs (``experts.py``): which BLOCK_M / BLOCK_N / BLOCK_K, warps, stages and
options serve a layer of a given format and shape at a given number of tokens.

``moe_config`` reads ``TUNED_CONFIGS`` (per format and layer shape, by tokens: entries printed by
``benchmarks/bench_moe.py --sweep`` on a GPU, pasted here) and falls back on ``DEFAULT_CONFIGS`` (per format, by
the mean rows per expert: first choices). ``block_k`` checks a config's K tile against the format's constraints.
``decode_config`` and ``decode_plan``: the decode path (``decode.py``) up to ``DECODE_MAX_TOKENS`` tokens;
``layer_config``: which of the two a layer of T tokens runs.
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
INF = float("inf")


def _tile(
    bm: int, bn: int, bk: int, warps: int, stages: int, swap: int = 0, scale_tile: int = 0, group: int = 0
) -> dict[str, int]:
    """A tuned entry: BLOCK_M x BLOCK_N x BLOCK_K (0: the format's), warps, stages, SWAP_AB, SCALE_TILE and (w4a16)
    the group it was timed with."""
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages, "SWAP_AB": swap}
    return {**cfg, "SCALE_TILE": scale_tile, "TUNED_GROUP": group} if group else cfg


# H100 (NVIDIA H100 80GB HBM3), bench_moe.py --sweep on the code of commit 4ef6b29, the fused layer in a CUDA graph:
# the best of 5-8 timed candidates per M (us in the comments); every candidate checked against the reference.
# w4a16 entries were measured with groups of 128 (TUNED_GROUP): other groups keep the format's K tile.
TUNED_CONFIGS: dict[tuple[str, int, int, int, int], list[tuple[float, dict[str, int]]]] = {
    ("float", 2048, 768, 128, 8): [  # qwen3-30b-a3b
        (1, _tile(16, 64, 128, 4, 4, swap=1)),  # 51.4 us
        (16, _tile(16, 128, 128, 4, 3, swap=1)),  # 277.3 us
        (64, _tile(16, 128, 128, 4, 3, swap=1)),  # 439.6 us
        (256, _tile(16, 64, 128, 4, 4, swap=1)),  # 530.0 us
        (1024, _tile(128, 128, 64, 8, 3)),  # 646.2 us
        (INF, _tile(128, 256, 64, 8, 3)),  # 1049.0 us
    ],
    ("w4a16", 2048, 768, 128, 8): [  # qwen3-30b-a3b
        (1, _tile(16, 64, 128, 4, 4, swap=1, group=128)),  # 46.7 us
        (16, _tile(16, 64, 128, 4, 4, swap=1, group=128)),  # 199.2 us
        (64, _tile(16, 64, 128, 4, 4, swap=1, group=128)),  # 326.0 us
        (256, _tile(16, 64, 128, 4, 4, swap=1, group=128)),  # 511.9 us
        (1024, _tile(128, 128, 64, 8, 3, group=128)),  # 765.4 us
        (INF, _tile(128, 128, 64, 8, 3, group=128)),  # 1692.5 us
    ],
    ("float", 4096, 14336, 8, 2): [  # mixtral-8x7b
        (1, _tile(16, 64, 128, 4, 4, swap=1)),  # 248.3 us
        (16, _tile(16, 64, 128, 4, 4, swap=1)),  # 799.7 us
        (64, _tile(16, 64, 128, 4, 4, swap=1)),  # 929.8 us
        (256, _tile(128, 128, 64, 8, 3)),  # 977.8 us
        (1024, _tile(128, 256, 64, 8, 3)),  # 1596.5 us
        (INF, _tile(128, 256, 64, 8, 3)),  # 5193.2 us
    ],
    ("w4a16", 4096, 14336, 8, 2): [  # mixtral-8x7b
        (1, _tile(16, 64, 128, 4, 4, swap=1, group=128)),  # 247.5 us
        (16, _tile(16, 64, 128, 4, 4, swap=1, group=128)),  # 577.1 us
        (64, _tile(16, 64, 128, 4, 4, swap=1, group=128)),  # 884.3 us
        (256, _tile(128, 128, 64, 8, 3, group=128)),  # 1300.0 us
        (1024, _tile(128, 128, 64, 8, 3, group=128)),  # 3175.3 us
        (INF, _tile(128, 128, 64, 8, 3, group=128)),  # 10658.4 us
    ],
}


def moe_config(
    tokens: int, top_k: int, num_experts: int, fmt: str = "float", hidden: int = 0, inter: int = 0, act_bytes: int = 2
) -> dict[str, int]:
    """The tile config of a layer of ``num_experts`` experts (H ``hidden``, I ``inter``, ``fmt`` one of FORMATS)
    over ``tokens`` tokens routed to ``top_k`` experts each: the tuned table's entry for this shape if there is one
    (timed with 16-bit activations: fp32 ones, ``act_bytes`` 4, take the defaults, whose tiles fit shared memory at
    twice the bytes), else the format's default by the mean rows per expert."""
    tuned = TUNED_CONFIGS.get((fmt, hidden, inter, num_experts, top_k)) if act_bytes <= 2 else None
    if tuned:
        return dict(next(cfg for most, cfg in tuned if tokens <= most))
    per_expert = tokens * top_k / num_experts
    return dict(next(cfg for most, cfg in DEFAULT_CONFIGS[fmt] if per_expert <= most))


def block_k(fmt: str, group_size: int, cfg: dict[str, int]) -> int:
    """The K tile of experts in ``fmt`` (``group_size``: w4a16's group, fp8_block's B): the config's BLOCK_K where
    the format allows it (ValueError where not), else the format's default. A tuned w4a16 entry's K tile applies to
    the group it was timed with (``TUNED_GROUP``); experts of another group size take the format's default."""
    bk = cfg.get("BLOCK_K", 0)
    if fmt == "w4a16" and cfg.get("TUNED_GROUP", group_size) != group_size:
        bk = 0
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


# The decode path (``decode.py``: CUDA-core GEMV over (expert block, N tile, K split)) serves a layer of at most
# this many tokens in these formats; larger ones run the tile path above (a config with ``DECODE`` picks either).
# Measured on the H100 (``bench_moe.py --ms 1,16,64``, 2026-12-07), decode path against the tile path:
# - w4a16: faster at M = 1 on both shapes (Mixtral-8x7B 116.9 us against 257.1, 52% of copy bandwidth against
#   24%; Qwen3-30B-A3B 42.0 against 47.4) and at M = 16 on Qwen3-30B-A3B (178.4 against 201.8); slower at M = 16
#   on Mixtral-8x7B (1031 against 649) and at M = 64 on both. So 1 token, 16 on Qwen3-30B-A3B's shape.
# - float: slower at every M measured (M = 1: 55.9 against 52.0 us on Qwen3-30B-A3B, 275.2 against 248.6 on
#   Mixtral-8x7B, whose tuned tiles reach 94% of copy bandwidth), so off.
DECODE_MAX_TOKENS = {"float": 0, "w4a16": 1}
# Per (format, H, I, E, top_k): the measured threshold of a layer shape where it differs from the format's.
TUNED_DECODE_MAX_TOKENS: dict[tuple[str, int, int, int, int], int] = {("w4a16", 2048, 768, 128, 8): 16}
DECODE_MAX_ROWS = 4  # BLOCK_M of the decode path at most: rows of one expert per program (one FMA per row and weight)
DECODE_LOCK_SLOTS = 4096  # split gate/up tiles (expert blocks x N tiles) one launch may fix up in place
DECODE_WARPS_PER_SM = 12  # K is split until about this many warps per SM run: one wave at ~168 registers a thread


def decode_config(tokens: int, top_k: int, num_experts: int) -> dict[str, int]:
    """The decode path's config: ``DECODE`` 1 and BLOCK_M, the rows of one expert a program takes (the next power
    of two of the mean rows per expert, at most ``DECODE_MAX_ROWS``). Optional keys a caller may add: BLOCK_N
    (w4a16: a multiple of 128, 4 columns per thread; float: rows of W per program), num_warps, SPLIT_K (at most
    that many K splits) and HOIST (w4a16, default 1 at BLOCK_M = 1 and 4 bits: a barrier after each K tile's loads,
    so that all of them issue before its arithmetic; 0: ptxas's own order, which may issue each load just before
    its use)."""
    per_expert = -(-tokens * top_k // num_experts)
    bm = 1
    while bm < min(per_expert, DECODE_MAX_ROWS):
        bm *= 2
    return {"DECODE": 1, "BLOCK_M": bm}


def layer_config(
    tokens: int,
    top_k: int,
    num_experts: int,
    fmt: str,
    hidden: int,
    inter: int,
    config: dict[str, int] | None,
    act_bytes: int = 2,
) -> dict[str, int]:
    """The config a layer runs: ``config`` with a ``DECODE`` key is a decode config (1, completed by
    ``decode_config``) or a tile config (0); without one it is a tile config over ``moe_config``'s; None picks the
    decode path up to the shape's ``TUNED_DECODE_MAX_TOKENS`` (else ``DECODE_MAX_TOKENS[fmt]``) tokens, else
    ``moe_config`` (``act_bytes``: the activations' element size)."""
    if config is None:
        most = TUNED_DECODE_MAX_TOKENS.get((fmt, hidden, inter, num_experts, top_k), DECODE_MAX_TOKENS.get(fmt, 0))
        decode = fmt in DECODE_MAX_TOKENS and tokens <= most
    else:
        decode = bool(config.get("DECODE", 0))
        if decode and fmt not in DECODE_MAX_TOKENS:
            raise ValueError(f"the decode path serves {tuple(DECODE_MAX_TOKENS)} experts, not {fmt}")
    base = decode_config(tokens, top_k, num_experts) if decode else moe_config(
        tokens, top_k, num_experts, fmt, hidden, inter, act_bytes
    )  # fmt: skip
    return {**base, **(config or {}), "DECODE": int(decode)}


def decode_plan(
    cfg: dict[str, int], fmt: str, n: int, k: int, group_size: int, blocks: int, itemsize: int, num_sms: int
) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, K tiles per split, splits) of one decode projection: ``n`` rows of W per
    expert (gate/up: 2I, a program's BLOCK_N rows are BLOCK_N / 2 gate rows and the matching up rows), ``k`` inputs,
    ``blocks`` the expert blocks expected to hold rows (the chosen experts at one row each), ``itemsize`` of a
    float weight. Warps: 1, 2 or 4 by the columns per expert; K split until ``DECODE_WARPS_PER_SM`` warps per SM
    (at most the config's SPLIT_K), whole K tiles per split and no empty split."""
    bm = cfg["BLOCK_M"]
    if bm > DECODE_MAX_ROWS or bm & (bm - 1):
        raise ValueError(f"decode BLOCK_M must be a power of two up to {DECODE_MAX_ROWS}, got {bm}")
    warps = cfg.get("num_warps") or (4 if n >= 4096 else 2 if n >= 1024 else 1)
    if fmt == "w4a16":  # the W4A16 gemv's tile: 4 columns (one 16-byte load of words) per thread, K tiles in a group
        bn = cfg.get("BLOCK_N") or 128 * warps
        bk = 128
        while group_size and group_size % bk:
            bk //= 2
    else:  # [BLOCK_N, BLOCK_K] rows of W, 16 bytes per thread along K; rows per warp x BLOCK_M = 8 (64 fp32 sums)
        bn = cfg.get("BLOCK_N") or warps * max(1, 8 // bm)
        bk = 32 * 16 // itemsize
    if warps < 1 or warps & (warps - 1):
        raise ValueError(f"decode num_warps must be a power of two, got {warps}")
    if bn < 2 or bn & (bn - 1) or bk & (bk - 1) or bk < 32:  # gate/up: BLOCK_N / 2 gate rows, as many up rows
        raise ValueError(f"decode BLOCK_N must be a power of two from 2 and BLOCK_K >= 32, got {bn} and {bk}")
    k_tiles = -(-k // bk)
    programs = max(1, blocks) * -(-n // bn)
    split = max(1, min(-(-DECODE_WARPS_PER_SM * num_sms // (programs * warps)), k_tiles, cfg.get("SPLIT_K") or k_tiles))
    per_split = -(-k_tiles // split)
    return bn, bk, warps, per_split, -(-k_tiles // per_split)
