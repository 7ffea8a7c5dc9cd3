"""The gptq recipe stage (registers method "gptq"): GPTQ on every selected linear of a decoder layer.

With ``true_sequential`` (default) the linears are quantized group by group in execution order (q/k/v, then o,
then gate/up, then down, from the architecture table), so that each group's Hessian is measured on the outputs
of the groups already quantized. Without it, all Hessians of the layer come from one float forward pass.

Defaults: act-order; at 4 and 8 bits static groups and a grid chosen per linear by held-out error; at other widths
(2, 3 bits) groups formed in activation order and MSE-clipped grids for every linear. The held-out choice: every 4th
calibration window (``HOLDOUT_EVERY``) is held out, GPTQ is fitted with min-max and with MSE-clipped grids on the
Hessian of the other windows, and the grid whose output error is lower on the held-out windows is kept (min-max on
ties); the linear is then quantized with that grid on the Hessian of all windows. The choice and both held-out
errors are recorded in the layer report (``grid``, ``heldout_loss``, and ``groups``). Static groups (``g_idx`` = k
// G) keep a 4- or 8-bit checkpoint exportable to compressed-tensors, which has no ``g_idx`` and is the format vLLM
serves at those widths; they cost some accuracy against groups formed in activation order (random-weight models of
five families: 0.7-3.8% more held-out output error). At other widths (2, 3 bits) no serving format needs them, and
groups formed in activation order are kept (SmolLM2-135M 3-bit g64: perplexity 72.26 against 74.75 with static
groups); the GPTQ format holds their ``g_idx``. Clipping always pays with so few levels: on SmolLM2-135M at 3-bit
g64 the held-out grid choice lost to MSE grids everywhere on all three calibration draws (perplexity +1.3-2.7% on
Moby Dick, +4.9-6.4% on the State of the Union addresses), so below 4 bits it is not run. The grid choice costs two
more GPTQ passes per linear and X^T X of the held-out windows; the grid search of static groups runs on the original
weights.

Why: the earlier defaults (act-order with groups formed in activation order, MSE-clipped grids everywhere) were
chosen on SmolLM2-135M, whose weights already sit on a Q4_1 grid, and overfit it: on another family's real model
(4-bit g64) they lost to plain static-group min-max GPTQ. ``static_groups: false, mse: true`` gives them back;
``mse: true`` / ``false`` fixes the grid for every linear (no held-out fit).

A linear that received no calibration token (an MoE expert no token was routed to) has an all-zero Hessian, so
GPTQ has nothing to minimise: it is quantized with RTN instead -- which is what GPTQ with H = I would compute --
and this is logged as a warning and recorded in the layer report (``fallback``), never silently.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from quantkit.algorithms.gptq import choose_grid, gptq
from quantkit.algorithms.rtn import rtn
from quantkit.distributed import reduce_
from quantkit.errors import QuantkitError
from quantkit.stages import register
from quantkit.stages.weights import WeightStage

log = logging.getLogger(__name__)

NO_TOKENS = "rtn: no calibration tokens reached this linear"
SERVED_BITS = (4, 8)  # the weight widths vLLM serves from compressed-tensors, which has no g_idx
HOLDOUT_EVERY = 4  # mse "auto": windows 3, 7, 11, ... of each calibration batch judge the grids


@dataclass
class HeldOut:
    """X^T X and token count of a linear's inputs on the held-out calibration windows."""

    xtx: torch.Tensor
    n_tokens: int = 0
    windows: int = 0  # calibration windows seen so far, whichever batch they came in


@register("gptq")
class GPTQStage(WeightStage):
    needs_hessian = True

    @dataclass(frozen=True)
    class Params:
        damp: float = 0.01
        block_size: int = 128
        act_order: bool = True
        static_groups: bool | str = "auto"  # "auto": static at the widths vLLM serves (SERVED_BITS), else act-order
        true_sequential: bool = True
        mse: bool | str = "auto"  # true / false: every linear's grid; "auto": chosen on held-out windows at
        # SERVED_BITS, MSE below them

        def __post_init__(self) -> None:
            if isinstance(self.damp, bool) or not isinstance(self.damp, (int, float)):
                raise QuantkitError(f"gptq damp must be a number, got {self.damp!r}")
            if not math.isfinite(self.damp) or not 0 <= self.damp < 1e3:
                raise QuantkitError(f"gptq damp must be >= 0 (a fraction of mean(diag(H)), e.g. 0.01), got {self.damp}")
            if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
                raise QuantkitError(f"gptq block_size must be a positive integer, got {self.block_size!r}")
            for name in ("act_order", "true_sequential"):
                if not isinstance(getattr(self, name), bool):
                    raise QuantkitError(f"gptq {name} must be true or false, got {getattr(self, name)!r}")
            if not isinstance(self.static_groups, bool) and self.static_groups != "auto":
                raise QuantkitError(f"gptq static_groups must be auto, true or false, got {self.static_groups!r}")
            if not isinstance(self.mse, bool) and self.mse != "auto":
                raise QuantkitError(f"gptq mse must be auto, true or false, got {self.mse!r}")

    @classmethod
    def check_stage(cls, stage, where: str) -> None:
        if stage.params is not None and stage.params.mse is True:
            for scheme in stage.schemes():
                if scheme.progressive:
                    raise QuantkitError(f"{where}: gptq mse: true clips grids, but {scheme.name} takes QServe's "
                                        "min-max grids; use mse: auto or false")  # fmt: skip

    def __init__(self, stage) -> None:
        super().__init__(stage)
        if self.params is None:
            self.params = self.Params()
        self._held: dict[int, HeldOut] = {}  # id(LinearStats) -> its held-out part (mse "auto")

    def apply(self, ctx) -> None:
        super().apply(ctx)
        for name, rec in ctx.report.items():  # name each linear that fell back, loudly
            if rec.get("method") == "gptq" and rec.get("fallback") == NO_TOKENS:
                log.warning("gptq: %s received no calibration tokens; quantized with RTN instead", name)

    def collect_together(self) -> bool:
        return not self.params.true_sequential

    def collect(self, ctx, modules):
        """The statistics of all calibration windows, and (mse "auto") X^T X of the held-out ones apart."""
        # the grid is chosen on held-out windows at SERVED_BITS only: below them every grid is clipped
        judged = {n: m for n, m in modules.items() if _judged(self.stage.scheme_for(ctx.full_name(n), m))}
        if self.params.mse != "auto" or not judged:
            return super().collect(ctx, modules)
        held: dict[str, HeldOut] = {}
        last: list = [None, None]  # the latest input tensor and its HeldOut: q/k/v (gate/up) share one input

        def hook(name):
            def pre(module, args):
                x = args[0]
                if x is last[0]:
                    held.setdefault(name, last[1])
                    return
                acc = held.get(name)
                if acc is None:
                    k = module.in_features
                    # summed in float64 as LinearStats are; windows numbered from this rank's first one
                    acc = held[name] = HeldOut(
                        torch.zeros(k, k, dtype=torch.float64, device=x.device), windows=ctx.first_window
                    )
                last[:] = [x, acc]
                # windows are dim 0 of a layer's input [b, L, K], numbered across batches so that any batch size
                # holds out every HOLDOUT_EVERY-th window; an expert sees routed tokens [t, K]
                if x.dim() == 3:
                    index = torch.arange(acc.windows, acc.windows + x.shape[0], device=x.device)
                    acc.windows += x.shape[0]
                    xh = x.detach()[index % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
                else:
                    xh = x.detach()[HOLDOUT_EVERY - 1 :: HOLDOUT_EVERY]
                xh = xh.reshape(-1, module.in_features).float()
                acc.xtx += xh.t() @ xh
                acc.n_tokens += xh.shape[0]

            return pre

        handles = [m.register_forward_pre_hook(hook(n)) for n, m in judged.items()]
        try:
            stats = super().collect(ctx, modules)
        finally:
            for handle in handles:
                handle.remove()
        self._held = {}
        for n in sorted(modules):  # one HeldOut per statistics object, in the same order on every rank
            if id(stats[n]) in self._held or n not in judged:
                continue
            k = modules[n].in_features
            self._held[id(stats[n])] = held.get(n) or HeldOut(torch.zeros(k, k, dtype=torch.float64, device=ctx.device))
        parts = list(self._held.values())
        if ctx.shard is not None:  # the held-out windows of every rank
            counts = torch.tensor([float(h.n_tokens) for h in parts], dtype=torch.float64, device=ctx.device)
            reduce_([*(h.xtx for h in parts), counts])
            for h, c in zip(parts, counts.tolist(), strict=True):
                h.n_tokens = int(c)
        for h in parts:
            h.xtx = h.xtx.float()
        return stats

    def quantize(self, w, stats, scheme):
        if stats is None:
            raise QuantkitError("gptq needs calibration data (no statistics were collected for this layer)")
        if stats.n_tokens == 0:
            return rtn(w, scheme), {"fallback": NO_TOKENS, "tokens": 0}
        p = self.params
        static = p.static_groups if isinstance(p.static_groups, bool) else scheme.bits in SERVED_BITS
        kwargs = dict(damp=p.damp, block_size=p.block_size, act_order=p.act_order, static_groups=static)
        extra = {"groups": "static" if static or not p.act_order else "act-order"} if scheme.group_size != -1 else {}
        mse = p.mse
        if mse == "auto" and scheme.progressive:
            mse = False
            extra.update(grid="minmax", grid_reason="progressive: QServe's min-max grid")
        elif mse == "auto" and scheme.bits not in SERVED_BITS:
            mse = True
            extra.update(grid="mse", grid_reason=f"{scheme.bits}-bit: clipped grids")
        elif mse == "auto":
            mse, chosen = self.choose_grid(w, stats, scheme, kwargs)
            extra.update(chosen)
        qw, info = gptq(w, stats.hessian(), scheme, mse=mse, **kwargs)
        return qw, {**info, "tokens": stats.n_tokens, **extra}

    def choose_grid(self, w, stats, scheme, kwargs) -> tuple[bool, dict]:
        """(mse, report entries) for one linear: the grid with the lower held-out error (min-max when no
        window could be held out: fewer than HOLDOUT_EVERY windows in all, or an expert's tokens all in one
        part)."""
        held = self._held.get(id(stats))
        n_fit = stats.n_tokens - (held.n_tokens if held else 0)
        if held is None or held.n_tokens == 0 or n_fit == 0:
            return False, {"grid": "minmax", "grid_reason": "no held-out calibration windows"}
        H_fit = (stats.xtx - held.xtx) * (2.0 / n_fit)
        H_held = held.xtx * (2.0 / held.n_tokens)
        mse, losses = choose_grid(w, H_fit, H_held, scheme, **kwargs)
        return mse, {
            "grid": "mse" if mse else "minmax",
            "heldout_loss": {k: float(f"{v:.6g}") for k, v in losses.items()},
            "heldout_tokens": held.n_tokens,
        }


def _judged(scheme) -> bool:
    """Whether mse "auto" chooses the grid of a linear of ``scheme`` on held-out windows: at SERVED_BITS, except
    progressive W4A8, whose two-level grid is min-max only."""
    return scheme.bits in SERVED_BITS and not scheme.progressive
