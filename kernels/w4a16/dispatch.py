"""Which W4A16 / W8A16 kernel serves a product, in one place: an ordered table of paths, the first whose plan is
not None runs.

``PATHS`` in order (each path's rule lives beside its kernel; see there for the measurements behind it):

1. ``mma_gemv`` (``mma_gemv_configs.plan``): M <= 16 on CUDA sm_90+, 4-bit, K a multiple of the loop depth, groups
   the kernel takes (M 9-16 only for groups of 64, a multiple of 128 or one group): the mma.sync gemv (Gluon).
2. ``rega`` (``rega.plan``): M 17-128 on the layers where it measured faster, sm_90, 4-bit, groups a multiple of
   128 or of 64: the register-A wgmma GEMM (Gluon).
3. ``ws`` (``ws.plan``): M 65-512 where its split leaves long enough K slices, Hopper, 4-bit, groups of 64 or 128,
   TMA-aligned x: the warp-specialized GEMM (Gluon).
4. ``table`` (``table_plan``): everything else, and every product given an explicit ``KernelConfig``: the Triton
   regime table (``configs.config_for``: the CUDA-core gemv for M <= 2, swap-AB tensor-core tiles for M 3-128,
   dequantize + cuBLAS above; ``WIDE_M1`` / ``WIDE_M4`` on the widest layers). It always has a plan.

The three Gluon paths need Triton 3.6's Gluon API; with another Triton they decline and the table serves.
``choose(Product)`` is the whole decision; ``w4a16_linear`` launches it, and ``quantkit.kernels.explain`` reports it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from quantkit.kernels._device import DispatchPath, first_plan
from quantkit.kernels.w4a16 import mma_gemv, mma_gemv_configs, rega, ws
from quantkit.kernels.w4a16.configs import KernelConfig, config_for, plan_launch
from quantkit.kernels.w4a16.gemm import w4a16_dequantize, w4a16_gemm
from quantkit.kernels.w4a16.gemv import w4a16_gemv
from quantkit.kernels.w4a16.problem import Plan, Product
from quantkit.kernels.w4a16.weight import W4A16Weight, check_operands

TABLE_KERNELS = {
    "gemv": "CUDA-core gemv (Triton, w4a16/gemv.py)",
    "fused": "tensor-core GEMM (Triton, w4a16/gemm.py)",
    "dequant": "dequantize (Triton, w4a16/gemm.py) + cuBLAS",
}


def table_plan(p: Product, config: KernelConfig | None = None) -> Plan:
    """The Triton regime table's plan: ``config``, else ``config_for(M, N)``; the split-K factor of ``plan_launch``
    for the fused and gemv kernels."""
    cfg = config or config_for(p.m, p.n)
    split = 1 if cfg.method == "dequant" else plan_launch(cfg, p.m, p.n, p.k, p.group_size, p.sms).split_k
    return Plan("table", TABLE_KERNELS[cfg.method], cfg, split)


def _launch_table(plan: Plan, x, w, bias, out) -> torch.Tensor:
    cfg = plan.config
    if cfg.method == "dequant":
        check_operands(x, w, bias, out)
        wt = w4a16_dequantize(w, x.dtype)  # [N, K]
        b = bias.to(x.dtype) if bias is not None else None
        if out is None:
            return F.linear(x, wt, b)
        return torch.addmm(b, x, wt.t(), out=out) if b is not None else torch.mm(x, wt.t(), out=out)
    if cfg.method == "gemv":
        return w4a16_gemv(x, w, cfg, bias, out)[0]
    return w4a16_gemm(x, w, bias, out, cfg)[0]


def _checked(launch: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A Gluon path's launcher after ``check_operands`` (the Triton launchers check for themselves)."""

    def run(plan: Plan, x, w, bias, out) -> torch.Tensor:
        check_operands(x, w, bias, out)
        return launch(x, w, bias, out, plan.config, plan.split)

    return run


PATHS: tuple[DispatchPath, ...] = (
    DispatchPath("mma_gemv", mma_gemv_configs.plan, _checked(mma_gemv.launch)),
    DispatchPath("rega", rega.plan, _checked(rega.launch)),
    DispatchPath("ws", ws.plan, _checked(ws.launch)),
    DispatchPath("table", table_plan, _launch_table),
)
_BY_NAME = {path.name: path for path in PATHS}


def choose(p: Product) -> Plan:
    """The plan of the first path in ``PATHS`` that serves the product (the table always does)."""
    return first_plan(PATHS, p)


def w4a16_linear(
    x: torch.Tensor,
    w: W4A16Weight,
    bias: torch.Tensor | None = None,
    config: KernelConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W.T + bias: permutes x for act-order, then runs ``choose``'s plan for its M rows
    (or, with an explicit ``config``, the Triton table path with that config)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if w.perm is not None:
        x2 = x2.index_select(1, w.perm)
    p = Product.of(x2, w, out)
    plan = table_plan(p, config) if config is not None else choose(p)
    y = _BY_NAME[plan.path].launch(plan, x2, w, bias, out)
    return y.view(*lead, w.out_features)
