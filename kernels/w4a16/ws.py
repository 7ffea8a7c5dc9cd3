"""Launch side of the warp-specialized W4A16 GEMM (``ws_kernel.py``, Gluon, sm_90 only): configs, the rule
that picks one by M and layer shape, the split-K plan, what the kernel cannot take, and the launcher.

``dispatch.PATHS`` asks ``plan`` after the mma.sync and register-A paths; where it returns a plan, this kernel runs,
otherwise the Triton regime table (``configs.CONFIG_TABLE``) decides.
Everything here but the launch runs without a GPU (the CPU tests check the rules); the Gluon kernel module is
imported on the first launch only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from quantkit.kernels._device import GLUON_TRITON, gluon_unsupported, num_sms
from quantkit.kernels.w4a16.configs import LOCK_SLOTS, is_pow2
from quantkit.kernels.w4a16.problem import Plan, Product
from quantkit.kernels.w4a16.weight import W4A16Weight, check_operands


@dataclass(frozen=True)
class WSConfig:
    """Tile [block_m, block_n] x block_k of K per pipeline step; ``stages`` slots of x and packed words;
    ``dq_buffers`` dequantized tiles in shared memory; ``num_warps`` MMA warps (4 per 64 rows of wgmma);
    ``dq_warps`` dequantizing warps with ``dq_regs`` registers each (setmaxnreg); ``min_slice``: see
    ``ws_offered``."""

    block_m: int
    block_n: int
    block_k: int
    stages: int
    num_warps: int
    dq_buffers: int = 2
    dq_warps: int = 4
    dq_regs: int = 160
    min_slice: int = 0  # the dispatcher declines a product whose split leaves K slices shorter than this

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps", "dq_warps"):
            if not is_pow2(getattr(self, name)):
                raise ValueError(f"{name} must be a power of two, got {getattr(self, name)}")
        if min(self.stages, self.dq_buffers, self.dq_regs) < 1 or self.min_slice < 0:
            raise ValueError("stages, dq_buffers and dq_regs must be >= 1 and min_slice >= 0")

    @property
    def name(self) -> str:
        return (
            f"ws-m{self.block_m}n{self.block_n}k{self.block_k}w{self.num_warps}s{self.stages}"
            f"b{self.dq_buffers}d{self.dq_warps}r{self.dq_regs}"
        )


# M range -> config, from every candidate timed on the H200:
# 128-row tiles with 128-deep K steps and eight dequantizing warps up to M = 128, 256-row tiles above; above 512
# rows, dequantize + cuBLAS (the regime table), which led at M = 1024 (0.83x against 0.80x; no M between 256 and
# 1024 was timed, so the bound is a guess). With 256-row tiles, a layer split into K slices
# shorter than 2048 (4096 x 4096 at M = 256: 32 tiles x 4 slices of 1024) ran 0.65x cuBLAS fp16 against 0.72x for
# dequantize + cuBLAS in the same run, so those go to the table.
WS_TABLE: tuple[tuple[int, WSConfig], ...] = (
    (128, WSConfig(128, 128, 128, 3, 4, dq_warps=8, dq_regs=128)),
    (512, WSConfig(256, 128, 64, 4, 8, min_slice=2048)),
)
KERNEL = "warp-specialized GEMM (Gluon, w4a16/ws_kernel.py)"


WS_MIN_M = 65  # below: the swap-AB Triton tiles, whose 16-64 rows waste no MMA work
WS_GROUPS = (64, 128)
WS_TRITON = GLUON_TRITON  # the Gluon API the kernel is written for
WS_MAX_SPLIT = 8
WS_FILL = 0.75  # split K until tiles x split reaches this fraction of the SMs


def fit_group(cfg: WSConfig, group_size: int) -> WSConfig:
    """``cfg`` with 64-deep steps (one more stage) where its steps are deeper than a group: a step never straddles
    two groups."""
    if group_size % cfg.block_k == 0:
        return cfg
    return replace(cfg, block_k=64, stages=cfg.stages + 1)


def ws_config_for(m: int, group_size: int) -> WSConfig | None:
    """The committed config for ``m`` rows, or None where the Triton path is the measured choice."""
    if m < WS_MIN_M:
        return None
    for max_m, cfg in WS_TABLE:
        if m <= max_m:
            return fit_group(cfg, group_size)
    return None


def ws_split(cfg: WSConfig, m: int, n: int, k: int, group_size: int, sms: int) -> int:
    """Split-K factor: doubled while the grid has fewer than WS_FILL x SMs CTAs and every part keeps at least two
    steps. Parts are whole groups, as even as they go (the kernel's rule), so K need not split evenly: a 4096 x 11008
    layer (86 groups of 128) at M = 128 splits 4 ways (21-22 groups) where whole halves allowed only 2."""
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    groups = k // group_size
    split = 1
    while (
        tiles * split < WS_FILL * sms
        and split * 2 <= WS_MAX_SPLIT
        and groups // (split * 2) * group_size >= 2 * cfg.block_k
    ):
        split *= 2
    return split


def ws_offered(cfg: WSConfig | None, m: int, n: int, k: int, group_size: int, sms: int) -> bool:
    """Whether the dispatcher runs ``cfg`` (from ``ws_config_for``) for this product: its split-K leaves K slices
    of at least ``cfg.min_slice``."""
    return cfg is not None and k // ws_split(cfg, m, n, k, group_size, sms) >= cfg.min_slice


def unsupported(p: Product, cfg: WSConfig) -> str | None:
    """Why this kernel cannot run the product (None: it can). Checks the device, the weight's format and the
    alignment rules of the TMA copies; operand shapes and dtypes are ``check_operands``'s job."""
    if p.bits != 4:
        return f"4-bit weights only, got {p.bits}-bit"
    if p.group_size not in WS_GROUPS or p.group_size % cfg.block_k:
        return f"groups of {' or '.join(map(str, WS_GROUPS))} along K, got {p.group_size or 'one per column'}"
    if p.k % p.group_size:
        return f"K = {p.k} must be a whole number of groups"
    if p.n % 4:
        return f"N = {p.n} must be a multiple of 4 (16-byte rows of packed words for TMA)"
    if p.x_stride[1] != 1 or (p.x_stride[0] * p.element_size) % 16 or not p.x_aligned:
        return "x needs unit column stride and 16-byte aligned rows (TMA)"
    if p.out_col_stride != 1:
        return "out needs unit column stride"
    return gluon_unsupported(p.gpu)


def ws_unsupported_reason(x: torch.Tensor, w: W4A16Weight, out: torch.Tensor | None, cfg: WSConfig) -> str | None:
    """``unsupported`` for the product as the tensors are."""
    return unsupported(Product.of(x, w, out), cfg)


def plan(p: Product) -> Plan | None:
    """The plan when ``w4a16_linear`` runs this kernel for the product, else None: M in WS_TABLE's rows, the rule
    offers it (``ws_offered``) and the operands suit it (``unsupported``)."""
    if not p.is_cuda:
        return None
    cfg = ws_config_for(p.m, p.group_size)
    if cfg is None or unsupported(p, cfg) is not None:
        return None
    if not ws_offered(cfg, p.m, p.n, p.k, p.group_size, p.sms):
        return None
    return Plan("ws", KERNEL, cfg, ws_split(cfg, p.m, p.n, p.k, p.group_size, p.sms))


def w4a16_ws_gemm(
    x: torch.Tensor,
    w: W4A16Weight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: WSConfig | None = None,
    split: int | None = None,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T + bias with the warp-specialized kernel; x is already in kernel channel order.
    ``split``: the split-K factor instead of ``ws_split``'s (tests); at most one part per group."""
    check_operands(x, w, bias, out)
    m, k = x.shape
    cfg = config or ws_config_for(m, w.group_size)
    if cfg is None:
        raise ValueError(f"no warp-specialized config for M = {m} (WS_TABLE covers {WS_MIN_M}..{WS_TABLE[-1][0]})")
    reason = ws_unsupported_reason(x, w, out, cfg)
    if reason:
        raise ValueError(f"w4a16_ws_gemm: {reason}")
    tiles = -(-m // cfg.block_m) * -(-w.out_features // cfg.block_n)
    if split is None:
        split = ws_split(cfg, m, w.out_features, k, w.group_size, num_sms(x.device))
    elif not 1 <= split <= k // w.group_size or (split > 1 and tiles > LOCK_SLOTS):
        raise ValueError(f"split {split}: needs 1 to {k // w.group_size} parts (whole groups of {w.group_size}), "
                         f"tiles ({tiles}) at most {LOCK_SLOTS}")  # fmt: skip
    return launch(x, w, bias, out, cfg, split)


def launch(x: torch.Tensor, w: W4A16Weight, bias: torch.Tensor | None, out: torch.Tensor | None, cfg: WSConfig,
           split: int) -> torch.Tensor:  # fmt: skip
    """The launch for operands already checked (``w4a16_ws_gemm``, or the dispatch after ``check_operands``).
    ``ws_split`` leaves a split only below WS_FILL x SMs tiles, far under the LOCK_SLOTS tile counters."""
    from quantkit.kernels.w4a16.ws_kernel import descriptors, w4a16_ws_kernel  # Gluon: GPU machines only

    m, k = x.shape
    n = w.out_features
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    part = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else out
    x_desc, qw_desc = descriptors(x, w.qweight, cfg.block_m, cfg.block_n, cfg.block_k)
    bf16 = x.dtype == torch.bfloat16
    scales = w.scales if bf16 else w.scales.view(torch.int16)  # fp16 scales enter the PTX as raw 16-bit pairs
    w4a16_ws_kernel[(tiles, split)](
        x_desc, qw_desc, w.qzeros, scales, bias if bias is not None else out, out, part, w.locks,
        m, n, k, w.qzeros.stride(0), w.scales.stride(0), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STAGES=cfg.stages, DQ=cfg.dq_buffers,
        BF16=bf16, HAS_BIAS=bias is not None, DQ_REGS=cfg.dq_regs, DQ_WARPS=cfg.dq_warps, SPLIT_K=split,
        GROUP=w.group_size, num_warps=cfg.num_warps,
    )  # fmt: skip
    return out
