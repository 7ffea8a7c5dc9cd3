"""Which W8A8 kernel serves a product, in one place: an ordered table of paths, the first whose plan is not None
runs; and the two entry points, ``w8a8_matmul`` (codes in, y out) and ``w8a8_linear`` (quantize x, then the GEMM).

``PATHS`` in order:

1. ``ws`` (``ws.plan``): fp8 with the default promoted accumulation, M > 256, no programmatic dependent launch, on
   Hopper with Triton 3.6 and TMA-aligned operands: the warp-specialized Gluon kernel, whose two consumer warp
   groups overlap each other's promotions with their wgmma (same promotion interval and error as the tiles).
2. ``tiles`` (``tiles_plan``): everything else, and every product given an explicit tile config: the Triton GEMM
   with ``configs.config_for``'s tile config (by format and M regime; the wide-layer int8 config at M <= 16; the
   persistent ``UPPER_M64`` at M 33-64; the fast-accumulation fp8 config at M > 256), fetching operands by TMA
   where the config asks for it and the operands allow it, persistently where the epilogue fits shared memory.

Two launch options ride along: programmatic dependent launch for M <= ``PDL_MAX_M`` on sm_90+ (``use_pdl``; the
quantizer lets the GEMM start at once, 3-4% end to end at M <= 64, slower at M = 256) and the L2 prefetch ahead at
M 17-64 (``configs.l2_ahead_for``).
"""

from __future__ import annotations

import torch
import triton
from quantkit.kernels._device import GPU, DispatchPath, device_of, first_plan, interpreting
from quantkit.kernels.w8a8 import ws
from quantkit.kernels.w8a8.configs import TileConfig, config_for, l2_ahead_for
from quantkit.kernels.w8a8.gemm import check_matmul_operands, launch_tiles, persistent_fits
from quantkit.kernels.w8a8.problem import Plan, Product
from quantkit.kernels.w8a8.quant import FORMAT_OF_DTYPE, quantize_activations, require

PDL_MAX_M = 64  # w8a8_linear launches the GEMM with programmatic dependent launch up to this many rows (use_pdl)
PDL_PREFETCH_K = 1024  # bytes of each weight row asked from L2 before the GEMM waits for the quantizer
TILES_KERNEL = "tiled GEMM (Triton, w8a8/gemm.py)"


def tiles_plan(p: Product, config: TileConfig | None = None) -> Plan:
    """The Triton tiles' plan: ``config``, else ``config_for``'s, with the fetch mode the operands and the device's
    shared memory allow."""
    cfg = config or config_for(p.m, p.fmt, p.fp8_fast_accum, p.n, p.sms)
    mode = cfg.use_tma
    if mode >= 2 and not persistent_fits(cfg, p.out_dtype.itemsize, p.gpu):
        mode = 1  # one tile per program: its epilogue reuses the pipeline's shared memory
    return Plan("tiles", TILES_KERNEL, cfg, mode if cfg.use_tma > 0 and p.tma_ok else 0)


def _launch_ws(plan: Plan, qa, a_scale, qw, w_scale, bias, out, *options) -> torch.Tensor:
    return ws.launch(qa, a_scale, qw, w_scale, bias, out)


def _launch_tiles(plan: Plan, qa, a_scale, qw, w_scale, bias, out, *options) -> torch.Tensor:
    return launch_tiles(qa, a_scale, qw, w_scale, bias, out, plan.config, plan.fetch, *options)


PATHS: tuple[DispatchPath, ...] = (
    DispatchPath("ws", ws.plan, _launch_ws),
    DispatchPath("tiles", tiles_plan, _launch_tiles),
)
_BY_NAME = {path.name: path for path in PATHS}


def choose(p: Product) -> Plan:
    """The plan of the first path in ``PATHS`` that serves the product (the tiles always do)."""
    return first_plan(PATHS, p)


def w8a8_matmul(
    qa: torch.Tensor,
    a_scale: torch.Tensor,
    qw: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float16,
    out: torch.Tensor | None = None,
    config: TileConfig | dict[str, int] | None = None,
    fp8_fast_accum: bool = False,
    pdl: bool = False,
    prefetch_k: int = 0,
    l2_ahead: int | None = None,
) -> torch.Tensor:
    """qa [M, K] x qw [N, K] (both int8 or both float8_e4m3fn, K contiguous) -> y [M, N] in ``out_dtype``.

    ``a_scale`` fp32 [M] (per token) or [1] (per tensor); ``w_scale`` fp32 [N]; ``bias`` [N] any float dtype.
    ``config`` (a ``TileConfig``, or a dict with the keys ``CONFIG_KEYS``) runs the Triton tiles with it; without
    it ``choose`` decides. ``fp8_fast_accum``: the whole K loop accumulates in the tensor core (see ``gemm.py``;
    ignored for int8). ``pdl``: launch with programmatic dependent launch, so that the kernel may start while the one
    before it (the activation quantizer, ``quantize_activations(pdl=True)``) runs, and waits for it before reading
    ``qa``; meanwhile each program asks L2 for the first ``prefetch_k`` bytes (128 x a power of two) of its weight
    rows. CUDA sm_90+ only. ``l2_ahead``: while on K tile t, each program asks L2 for its weight's tile t +
    ``l2_ahead`` (0: none; None: ``l2_ahead_for(m)``; never in the interpreter).
    """
    out = check_matmul_operands(qa, a_scale, qw, w_scale, bias, out_dtype, out)
    m, n = qa.shape[0], qw.shape[0]
    require(
        prefetch_k == 0 or (prefetch_k >= 128 and triton.next_power_of_2(prefetch_k) == prefetch_k and pdl),
        f"prefetch_k must be 0 or 128 x a power of two, with pdl; got {prefetch_k}",
    )
    require(not pdl or (qa.is_cuda and not interpreting()), "pdl needs a CUDA device (not Triton's interpreter)")
    l2_ahead = l2_ahead_for(m) if l2_ahead is None else l2_ahead
    require(0 <= l2_ahead <= 8, f"l2_ahead must be in [0, 8], got {l2_ahead}")
    if m == 0 or n == 0:
        return out
    p = Product.of(qa, qw, out, fp8_fast_accum, pdl)
    if config is None:
        plan = choose(p)
    else:
        plan = tiles_plan(p, config if isinstance(config, TileConfig) else TileConfig.from_dict(config))
    return _BY_NAME[plan.path].launch(plan, qa, a_scale, qw, w_scale, bias, out, fp8_fast_accum, pdl, prefetch_k,
                                      l2_ahead)  # fmt: skip


def w8a8_linear(
    x: torch.Tensor,
    qw: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
    config: TileConfig | dict[str, int] | None = None,
    fp8_fast_accum: bool = False,
    pdl: bool | None = None,
) -> torch.Tensor:
    """x [..., K] fp16/bf16/fp32 -> y [..., N] in x's dtype: quantize the activations (format of ``qw``), then GEMM.

    ``pdl`` (None: ``use_pdl``'s rule): launch the GEMM with programmatic dependent launch after the quantizer, with
    an L2 prefetch of ``PDL_PREFETCH_K`` bytes of each program's weight rows before it waits for the codes.
    """
    require(qw.dtype in FORMAT_OF_DTYPE, f"qw must be int8 or float8_e4m3fn, got {qw.dtype}")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    pdl = use_pdl(x2) if pdl is None else pdl
    qa, a_scale = quantize_activations(x2, FORMAT_OF_DTYPE[qw.dtype], input_scale, pdl=pdl)
    y = w8a8_matmul(
        qa, a_scale, qw, w_scale, bias, out_dtype=x.dtype, config=config, fp8_fast_accum=fp8_fast_accum, pdl=pdl,
        prefetch_k=PDL_PREFETCH_K if pdl else 0,
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], qw.shape[0])


def pdl_rule(m: int, gpu: GPU | None) -> bool:
    """Programmatic dependent launch for M rows on a device (``GPU``, None off CUDA): sm_90+ and M <= PDL_MAX_M. The
    quantizer's launch and run overlap the GEMM's start and its first weight lines (+3-4% geomean end to end at
    M <= 64 in every run, -11% to +12% per cell). At M = 256 it was 8-15% slower: the GEMM's programs then hold the
    SMs while they wait."""
    return gpu is not None and m <= PDL_MAX_M and gpu.capability >= (9, 0)


def use_pdl(x: torch.Tensor) -> bool:
    """``pdl_rule`` for x [M, K] on its device, never in Triton's interpreter."""
    return x.is_cuda and not interpreting() and pdl_rule(x.shape[0], device_of(x.device))
