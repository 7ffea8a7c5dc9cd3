"""Launch side of the register-A wgmma W4A16 product (``rega_kernel.py``, Gluon, sm_90 only) for M = 17-128:
configs, the rule that picks one by M and layer shape, the split-K plan, the x permutation, what the kernel cannot
take, and the launcher.

``dispatch.PATHS`` asks ``plan`` after the mma.sync path and before the warp-specialized one; where it
returns a plan, this kernel runs, otherwise the paths after it decide. Everything here but the launch runs
without a GPU (the CPU tests check the rules and ``permute_x``); the Gluon kernel module is imported on the first
launch only.

The rule (``rega_config_for``) follows A/Bs of ``w4a16_linear`` with and without this kernel on the H200, fp16 and
bf16, eight layer shapes including the runtime's fused 6144 x 4096 and 28672 x 4096 (speedups over cuBLAS of the same
dtype, ...-ab2-..., ...-ab5-...):
- M 17-32 on layers at least 6144 wide (e.g. fp16 28672 x 8192 1.27x -> 1.74x, 14336 x 4096 1.25x -> 1.43x,
  6144 x 4096 1.12x -> 1.26x; bf16 8192 x 28672 1.09x -> 1.50x; the one loss 28672 x 4096 bf16 1.08x -> 1.03x).
- M 33-64 on layers of at least 16 M weights: 128-row tiles where the layer is at least 8192 wide, 64-row tiles with
  the operands loaded two tiles ahead (``ahead=2``) on the narrower ones, where 128-row tiles leave SMs idle
  (4096 x 14336 at M = 64: fp16 0.99x -> 1.40x, bf16 0.86x -> 1.27x against the 128-row tiles; 28672 x 4096 fp16
  1.23x -> 1.51x with 128-row tiles instead of the 64-row ones the first rule, by K, gave it).
- M 65-128 on layers at least 6144 wide, ahead of the warp-specialized kernel, with the 64-row tiles loading two
  tiles ahead (bf16 0.67-0.95x -> 0.75-1.09x on the six layers, +10-15% each; fp16 -2% to +4%).
- Groups of 64, layers of at least 24 M weights, 64-deep tiles loaded two tiles ahead: M 33-64 128-row tiles (fp16
  0.79-1.02x -> 0.84-1.39x, bf16 0.74-0.89x -> 0.76-1.29x against the Triton tiles; 6144 x 4096 at M = 40 tied);
  M 17-32 64-row tiles (fp16 at M = 32: 0.99-1.28x -> 1.12-1.55x); M 65-128 64-row tiles, 128-row ones on layers at
  least 16384 wide (fp16 at M = 128: 0.53-0.85x on the warp-specialized kernel -> 0.74-1.16x). The M 17-32 and
  65-128 cells were timed at M = 32 and 128 in fp16 only.
Not taken: M <= 16 (the mma.sync gemv is faster), M 17-32 and 65-128 on 4096-wide layers (4096 x 4096 1.29x ->
0.91x at M = 17), M > 128 (a 256-row tile, timed: 0.54-0.78x cuBLAS fp16 at M = 256 where the warp-specialized
kernel runs 0.74-0.92x).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from quantkit.kernels._device import GLUON_TRITON, gluon_unsupported, num_sms
from quantkit.kernels.w4a16.configs import LOCK_SLOTS, is_pow2
from quantkit.kernels.w4a16.gemv import w4a16_gemv_reference
from quantkit.kernels.w4a16.problem import Plan, Product
from quantkit.kernels.w4a16.weight import W4A16Weight, check_operands

w4a16_rega_reference = w4a16_gemv_reference  # the same product

KERNEL = "register-A wgmma GEMM (Gluon, w4a16/rega_kernel.py)"
REGA_TRITON = GLUON_TRITON  # the Gluon API the kernel is written for
REGA_MIN_M, REGA_MAX_M = 17, 128  # the rule's rows
REGA_KERNEL_MAX_M = 128  # the kernel's: one tile of x rows, the wgmma's N up to 128
REGA_MAX_SPLIT = 8


@dataclass(frozen=True)
class RegaConfig:
    """``block_n`` weight rows x ``block_k`` of K per tile (the wgmma's M x K; its N is M rounded up to 16, 32, 64 or
    128); ``stages`` TMA slots of x; ``num_warps`` (4 per warp group of 64 rows); ``split_waves``: split K while the
    grid holds fewer than this many CTAs per SM; ``overlap`` False: each wgmma retired before the next tile is
    unpacked (an ablation for the probe); ``ahead``: 0 loads a tile's packed words one tile ahead and its zeros and
    scales where they are used, 1 or 2 load all three that many tiles ahead."""

    block_n: int = 64
    block_k: int = 128
    stages: int = 4
    num_warps: int = 4
    split_waves: float = 1.0
    overlap: bool = True
    ahead: int = 0  # outside 0-2 the rule reports it (``unsupported``)

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            if not is_pow2(getattr(self, name)):
                raise ValueError(f"{name} must be a power of two, got {getattr(self, name)}")
        if not (isinstance(self.stages, int) and self.stages >= 1) or not self.split_waves > 0:
            raise ValueError(f"stages must be >= 1 and split_waves positive, got {self.stages}, {self.split_waves}")

    @property
    def name(self) -> str:
        base = f"rw-n{self.block_n}k{self.block_k}s{self.stages}w{self.num_warps}v{self.split_waves:g}"
        return base + ("" if self.overlap else "-w0") + (f"-a{self.ahead}" if self.ahead else "")


REGA_M32 = RegaConfig(64, 128, 4, 4, 2.0)  # M 17-32
REGA_M64 = RegaConfig(128, 128, 4, 4, 1.0)  # M 33-64, N >= REGA_M64_WIDE_N (two m64 blocks per warp, 255 registers)
REGA_M64_NARROW = RegaConfig(64, 128, 3, 4, 1.0, ahead=2)  # M 33-64, N < REGA_M64_WIDE_N
REGA_M32_G64 = RegaConfig(64, 64, 6, 4, 2.0, ahead=2)  # M 17-32, groups of 64
REGA_M64_G64 = RegaConfig(128, 64, 6, 4, 1.0, ahead=2)  # M 33-64, groups of 64; M 65-128 on layers >= 16384 wide
REGA_M128_G64 = RegaConfig(64, 64, 4, 4, 1.0, ahead=2)  # M 65-128, groups of 64, narrower layers
REGA_M128 = REGA_M64_NARROW  # M 65-128 (the wgmma's N = 128): the same tiles measured best
REGA_MIN_N = 6144  # M 17-32 and 65-128 only on layers at least this wide
REGA_M64_MIN_WEIGHTS = 16 * 2**20  # M 33-64, groups of a multiple of 128: layers of at least this many weights
REGA_M64_WIDE_N = 8192  # ... of which those at least this wide take the 128-row tiles
REGA_G64_MIN_WEIGHTS = 24 * 2**20  # groups of 64: layers of at least this many weights
REGA_G64_WIDE_N = 16384  # groups of 64, M 65-128: layers at least this wide take the 128-row tiles
# K of an odd number of tiles (the kernel adds a zero tile past K): timed on 8192 x 29568 (Qwen2.5-72B's down
# projection, 242 M weights) at M 17-128, 1.08-1.33x faster than the Triton tiles / warp-specialized kernel that
# served it, and on 9728 x 896 (Qwen2.5-0.5B's gate/up, 8.7 M) at M = 32, where it lost to the Triton tile (0.81x
# against 0.95x cuBLAS fp16): only layers of this many weights
REGA_ODD_MIN_WEIGHTS = 16 * 2**20


def rega_config_for(m: int, n: int, k: int, group_size: int) -> RegaConfig | None:
    """The measured choice for M rows of an N x K layer, or None where another path is (see the module header)."""
    cfg = _rega_config(m, n, k, group_size)
    if cfg is not None and (k // cfg.block_k) % 2 and n * k < REGA_ODD_MIN_WEIGHTS:
        return None
    return cfg


def _rega_config(m: int, n: int, k: int, group_size: int) -> RegaConfig | None:
    """``rega_config_for`` before the odd-tile-count rule."""
    if not REGA_MIN_M <= m <= REGA_MAX_M:
        return None
    if group_size == 64:
        if n * k < REGA_G64_MIN_WEIGHTS:
            return None
        if m <= 32:
            return REGA_M32_G64
        return REGA_M64_G64 if m <= 64 or n >= REGA_G64_WIDE_N else REGA_M128_G64
    if (group_size or k) % 128:
        return None
    if m <= 32:
        return REGA_M32 if n >= REGA_MIN_N else None
    if m > 64:
        return REGA_M128 if n >= REGA_MIN_N else None
    if n * k < REGA_M64_MIN_WEIGHTS:
        return None
    return REGA_M64 if n >= REGA_M64_WIDE_N else REGA_M64_NARROW


def block_m(m: int) -> int:
    """The wgmma's N (rows of x per tile) for M rows: 16, 32, 64 or 128."""
    return 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128


def rega_split(cfg: RegaConfig, n: int, k: int, sms: int) -> int:
    """Split-K factor: doubled while the grid holds fewer than ``split_waves`` CTAs per SM and every part keeps at
    least 512 of K. Parts are whole pairs of tiles (the loop takes them in pairs), as even as they go (the kernel's
    rule), so K need not split evenly: a 4096 x 11008 layer (43 pairs of 128-deep tiles) at M = 64 splits 4 ways
    (10-11 pairs) where whole halves were not possible."""
    tiles = -(-n // cfg.block_n)
    pairs = -(-k // (2 * cfg.block_k))
    split = 1
    while (
        tiles * split < cfg.split_waves * sms
        and split * 2 <= REGA_MAX_SPLIT
        and pairs // (split * 2) * 2 * cfg.block_k >= 512
    ):
        split *= 2
    return split


def permute_x(x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """x [M, K] (K a multiple of 32) -> a contiguous copy [rows, K] (zero rows after M) whose 32-blocks hold physical
    positions 8c + 4e + 2t + h at 16t + 8h + 2c + e: the order in which the kernel's fragment registers take a word's
    codes. Padding to the tile's rows keeps the TMA copies of x inside the tensor (with rows past M left to the
    copy engine's out-of-bounds fill, M = 17 / 96 ran 15-30% slower than M = 32 / 128 on the same tiles)."""
    m, k = x.shape
    v = x.reshape(m, k // 32, 4, 2, 2, 2).permute(0, 1, 4, 5, 2, 3)
    if rows is not None and rows > m:
        v = F.pad(v, (0, 0) * 5 + (0, rows - m))
    return v.reshape(-1, k)


def unsupported(p: Product, cfg: RegaConfig) -> str | None:
    """Why this kernel cannot run the product (None: it can). Operand shapes and dtypes are ``check_operands``'s
    job."""
    m, k, n = p.m, p.k, p.n
    if p.bits != 4:
        return f"4-bit weights only, got {p.bits}-bit"
    if cfg.ahead not in (0, 1, 2):
        return f"operands are loaded 0, 1 or 2 tiles ahead, got ahead={cfg.ahead}"
    if not 1 <= m <= REGA_KERNEL_MAX_M:
        return f"M = {m} rows: this kernel takes 1..{REGA_KERNEL_MAX_M}"
    if (p.group_size or k) % cfg.block_k:
        return f"groups must be a multiple of {cfg.block_k} along K, got {p.group_size or 'one per column'}"
    if k % cfg.block_k:
        return f"K = {k} must be a multiple of {cfg.block_k}"
    if n % cfg.block_n:
        return f"N = {n} must be a multiple of {cfg.block_n}"
    if p.out_col_stride != 1:
        return "out needs unit column stride"
    return gluon_unsupported(p.gpu)


def rega_unsupported_reason(x: torch.Tensor, w: W4A16Weight, out: torch.Tensor | None, cfg: RegaConfig) -> str | None:
    """``unsupported`` for the product as the tensors are."""
    return unsupported(Product.of(x, w, out), cfg)


def plan(p: Product) -> Plan | None:
    """The plan when ``w4a16_linear`` runs this kernel for the product, else None."""
    if not p.is_cuda:
        return None
    cfg = rega_config_for(p.m, p.n, p.k, p.group_size)
    if cfg is None or unsupported(p, cfg) is not None:
        return None
    return Plan("rega", KERNEL, cfg, rega_split(cfg, p.n, p.k, p.sms))


def w4a16_rega_gemm(
    x: torch.Tensor,
    w: W4A16Weight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: RegaConfig | None = None,
    split: int | None = None,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T + bias with the register-A wgmma kernel; x is already in kernel channel order.
    ``config``: instead of ``rega_config_for``'s (tests, probes: any M up to 128); ``split``: the split-K factor
    instead of ``rega_split``'s; at most one part per pair of tiles."""
    check_operands(x, w, bias, out)
    m, k = x.shape
    n = w.out_features
    cfg = config or rega_config_for(m, n, k, w.group_size)
    if cfg is None:
        raise ValueError(f"w4a16_rega_gemm: no measured config for M = {m} on a {n} x {k} layer (pass config=)")
    reason = rega_unsupported_reason(x, w, out, cfg)
    if reason:
        raise ValueError(f"w4a16_rega_gemm: {reason}")
    if split is None:
        split = rega_split(cfg, n, k, num_sms(x.device))
    elif not 1 <= split <= -(-k // (2 * cfg.block_k)) or (split > 1 and n // cfg.block_n > LOCK_SLOTS):
        raise ValueError(f"split {split}: K = {k} has {-(-k // (2 * cfg.block_k))} pairs of {cfg.block_k}-deep "
                         "tiles, at least one per part")  # fmt: skip
    return launch(x, w, bias, out, cfg, split)


def launch(x: torch.Tensor, w: W4A16Weight, bias: torch.Tensor | None, out: torch.Tensor | None, cfg: RegaConfig,
           split: int) -> torch.Tensor:  # fmt: skip
    """The launch for operands already checked (``w4a16_rega_gemm``, or the dispatch after ``check_operands``).
    ``rega_split`` splits only layers of fewer than 2 x SMs column tiles, far under the LOCK_SLOTS counters."""
    from quantkit.kernels.w4a16.rega_kernel import layouts, w4a16_rega_kernel, x_descriptor  # Gluon: GPU only

    m, k = x.shape
    n = w.out_features
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    bm = block_m(m)
    xp = permute_x(x, bm)
    part = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else out
    bf16 = x.dtype == torch.bfloat16
    acc_layout, a_layout, w_layout = layouts(bm, cfg.block_n, cfg.block_k, cfg.num_warps)
    w4a16_rega_kernel[(n // cfg.block_n, split)](
        x_descriptor(xp, bm, cfg.block_k), w.qweight, w.qzeros, w.scales if bf16 else w.scales.view(torch.int16),
        bias if bias is not None else out, out, part, w.locks,
        m, n, k, w.qweight.stride(0), w.qzeros.stride(0), w.scales.stride(0), out.stride(0),
        BM=bm, BN=cfg.block_n, BK=cfg.block_k, STAGES=cfg.stages, GROUP=w.group_size or k, BF16=bf16,
        HAS_BIAS=bias is not None, SPLIT_K=split, OVERLAP=cfg.overlap, AHEAD=cfg.ahead,
        ODD_K=(k // cfg.block_k) % 2 == 1, ACC_LAYOUT=acc_layout,
        A_LAYOUT=a_layout, W_LAYOUT=w_layout, num_warps=cfg.num_warps,
    )  # fmt: skip
    return out
