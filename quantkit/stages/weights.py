"""Weight-quantization stages: replace the selected linears of a layer by quantized modules."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from quantkit.algorithms.rtn import rtn
from quantkit.calib.runner import LayerContext
from quantkit.calib.stats import LinearStats
from quantkit.distributed import broadcast_object, owners
from quantkit.nn.factory import make_quantized_linear
from quantkit.nn.w8a8 import W8A8Linear, static_input_scale
from quantkit.quant.scheme import QuantScheme
from quantkit.quant.tensor import QuantizedWeight
from quantkit.stages import register
from quantkit.stages.spec import Stage


class WeightStage:
    """Template for weight stages: selection, statistics, swap, report. Subclasses implement ``quantize``."""

    kind = "weights"
    needs_hessian = False
    splits_work = True  # across processes: statistics summed over the ranks, each linear quantized on one rank

    @dataclass(frozen=True)
    class Params:
        pass

    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self.params = stage.params

    @classmethod
    def check_stage(cls, stage: Stage, where: str) -> None:
        """Refuse, when the recipe is read, settings that no module of ``stage`` could run with (none here)."""

    @classmethod
    def needs_calibration(cls, stage: Stage) -> bool:
        """Calibration data is needed for Hessians, or for the input scale of static W8A8 activations."""
        return cls.needs_hessian or (stage.scheme is not None and not stage.scheme.act_dynamic)

    def quantize(self, w: torch.Tensor, stats: LinearStats | None, scheme: QuantScheme) -> tuple[QuantizedWeight, dict]:
        raise NotImplementedError

    def quantized_module(self, module, stats, scheme, input_scale):
        qw, info = self.quantize(module.weight.data, stats, scheme)
        return make_quantized_linear(qw, module.bias, module.weight.dtype, input_scale), info

    def cost(self, module) -> float:
        """What quantizing ``module`` costs, in relative units (GPTQ's solve: K^2 (K + N)), for sharing the linears
        of a layer between processes."""
        k, n = module.in_features, module.out_features
        return float(k * k * (k + n)) if self.needs_hessian else float(k * n)

    def collect_together(self) -> bool:
        """Collect the statistics of all groups in one pass (False: group by group, true-sequential)."""
        return False

    def collect(self, ctx: LayerContext, modules: dict) -> dict[str, LinearStats]:
        """The statistics of ``modules``' inputs over the calibration batches (a stage may gather more)."""
        return ctx.collect(modules, hessian=self.needs_hessian)

    def apply(self, ctx: LayerContext) -> None:
        chosen_groups = []
        for group in ctx.sequential_groups():
            chosen = [
                (n, m, self.stage.scheme_for(ctx.full_name(n), m))
                for n, m in group
                if self.stage.selects(ctx.full_name(n), m)
            ]
            if chosen:
                chosen_groups.append(chosen)
        wants_stats = ctx.has_data and (
            self.needs_hessian or any(not s.act_dynamic for g in chosen_groups for _, _, s in g)
        )
        if wants_stats and self.collect_together():
            everything = {n: m for g in chosen_groups for n, m, _ in g}
            stats_all = self.collect(ctx, everything)
        sequential = wants_stats and not self.collect_together()
        shard = ctx.shard
        loads = [0.0] * shard.size if shard is not None else None
        for i, chosen in enumerate(chosen_groups):
            stats = {}
            if sequential:
                stats = self.collect(ctx, {n: m for n, m, _ in chosen})
            elif wants_stats:
                stats = stats_all
            owner = owners({n: self.cost(m) for n, m, _ in chosen}, shard.size, loads) if shard is not None else {}
            done = {}  # name -> (quantized module, report entries, seconds)
            for name, module, scheme in chosen:
                if owner and owner[name] != shard.rank:
                    continue
                t0 = time.perf_counter()
                input_scale = None if scheme.act_dynamic else static_input_scale(stats[name].absmax.max(), scheme)
                new, info = self.quantized_module(module, stats.get(name), scheme, input_scale)
                done[name] = (new, info, round(time.perf_counter() - t0, 4))
            for rank in sorted(set(owner.values())):  # each rank's linears, to every rank
                done.update(broadcast_object(done if rank == shard.rank else None, rank, ctx.device))
            for name, _, scheme in chosen:
                new, info, seconds = done[name]
                ctx.layer.set_submodule(name, new)
                ctx.record(name, method=self.stage.method, scheme=scheme.name, seconds=seconds, **info)
            if sequential and ctx.device.type == "cpu":  # a GPU runs attention faster than it is worth a copy
                for child in settled_children(chosen_groups[: i + 1], chosen_groups[i + 1 :]):
                    ctx.replay(child)


def settled_children(done: list, to_do: list) -> set[str]:
    """Children of the layer (``self_attn``, ``mlp``) whose linears this stage has all quantized, among those it
    quantized in the last group of ``done``: their inputs come before every group still ``to_do`` in execution
    order and their weights are final, so their outputs can be replayed (:meth:`LayerContext.replay`)."""
    if not to_do:
        return set()
    pending = {n.split(".")[0] for group in to_do for n, _, _ in group}
    return {n.split(".")[0] for n, _, _ in done[-1]} - pending


@register("rtn")
class RTNStage(WeightStage):
    """Round-to-nearest: no calibration data needed for weight-only schemes.

    W4A8 layers take the same grid as W4A16 ones (progressive W4A8: QServe's two-level grid). W8A8 layers use the
    module's own per-channel RTN (int8 abs-max / 127, or fp8 e4m3), the grid its kernels' activation quantizer shares.
    """

    def quantize(self, w, stats, scheme):
        return rtn(w, scheme), {}

    def quantized_module(self, module, stats, scheme, input_scale):
        if scheme.packed or scheme.progressive:  # W*A16 and W4A8: the 4-bit grid of rtn()
            return super().quantized_module(module, stats, scheme, input_scale)
        return W8A8Linear.from_float(module, scheme, input_scale), {}
