"""The awq recipe stage (registers method "awq"): AWQ scale and clip search on one decoder layer at a time.

A "transform" stage: it rewrites the float weights of the layer (scales folded into producers and consumers,
weights clamped to the searched clip ranges) and leaves quantization to the weight stage after it (RTN, GPTQ),
which then sees the scaled, clipped weights. The fake-quant objective uses the stage's scheme (the recipe's
default scheme, with the stage's overrides per linear).

Per layer, for each smoothing group of the architecture table in order: capture the calls of the group's block
and mean |x| of its input in one forward pass, search the scales, fold them at once (so later groups see the
folded layer). Then capture a token sample of every linear to clip in one more pass, search and clamp.

With ``quantizer: gptq`` (the awq+gptq preset) each group's scales, found for round-to-nearest, are re-judged with
GPTQ in the objective: s^p for p in ``temper_powers``, p = 0 being plain GPTQ, each GPTQ candidate fitted on other
calibration batches than those it is judged on (``temper_holdout``). On two SmolLM2-135M layers (3- and
4-bit, groups of 128: 12 groups) full AWQ scales raised GPTQ's block-output error in 11 groups; s^0.5 lowered it
in 6, by up to 6%: GPTQ already spends the Hessian on the channels that AWQ protects. Powers {0, 0.25, 0.5, 0.75}
beat {0, 0.5} in the four grouped SmolLM2 cells (4-bit g64 51.73 -> 50.37; docs/results/accuracy.md).

Token-wise blocks (MLPs, MoE blocks) are judged on ``search_tokens`` rows evenly strided over every calibration
window rather than on whole windows: the same cost buys more varied tokens, and attention keeps its windows.

``save_search`` writes each layer's results to ``<dir>/<layer prefix>.safetensors``; ``load_search`` replays
such a directory without calibration data.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from quantkit.algorithms.awq import (
    BlockObjective,
    ClippedRTNCandidate,
    GPTQCandidate,
    GroupScales,
    LayerSearch,
    LinearObjective,
    clip_ratios,
    clip_weight,
    group_range,
    refine_scales,
    rtn_candidate,
    search_clip,
    search_scales,
    temper_scales,
)
from quantkit.calib.runner import LayerContext
from quantkit.errors import QuantkitError
from quantkit.models.fold import BoundGroup, bind_smooth_groups, fold_group
from quantkit.models.layers import match
from quantkit.quant.scheme import QuantScheme
from quantkit.stages import register
from quantkit.stages.awq_inputs import input_stats, sample_inputs, token_count, token_sample, tokenwise
from quantkit.stages.spec import Stage


def _pattern_matches(pattern: str, name: str) -> bool:
    """``re:<regex>`` full-matches the name inside the layer; otherwise the name or its last dotted parts."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


@register("awq")
class AWQStage:
    kind = "transform"

    @dataclass(frozen=True)
    class Params:
        grid: int = 20  # scale-search points a = 0, 1/grid, ... (grid - 1)/grid
        duo_scaling: bool = True  # s = mean|x|^a / mean|w|^(1-a); False: s = mean|x|^a
        clip: bool = True
        clip_grid: int = 20  # shrink steps of 1/clip_grid
        clip_min: float = 0.5  # smallest fraction of the range tried
        clip_tokens: int = 512  # calibration tokens per linear for the clip objective
        # asymmetric schemes: after the common shrink of both ends, shrink each end alone (3x the clip search);
        # with clip_skip [] the best AWQ measured on SmolLM2 (recipe awq-w4g128-clipqk), mixed at 4 bits without
        # (with refinement, 4-bit g128: better in 2 of 3 calibration draws, mean 54.82 against 54.98)
        clip_separate_ends: bool = False
        # calibration windows the scale objective runs on (None: all). 16 windows and 4096 tokens below are the
        # protocol of every AWQ figure in the README; twice both changed nothing (4-bit g128, two calibration
        # draws: 55.67 / 56.70 against 55.46 / 56.88, docs/results/accuracy.md), all 128 default windows and 8192
        # tokens took twice as long on the CPU (SmolLM2-135M: 88 s a layer against 44 s, bench_awq.py --cpu-smollm2)
        search_samples: int | None = 16
        # token-wise blocks (MLPs, MoE blocks: called with nothing but their input) are judged on this many tokens
        # evenly strided over every calibration window instead (None: on the search_samples windows)
        search_tokens: int | None = 4096
        # the quantizer that follows: "gptq" re-judges each group's scales s as s^p, p in temper_powers, with GPTQ
        # (act-order, MSE grids: GPTQ's defaults) in the objective (p = 0 is plain GPTQ, so scaling is kept only where
        # it lowers GPTQ's block error on the judged tokens)
        quantizer: str = "rtn"
        temper_powers: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75])
        # keep the smallest power unless another lowers the block error by more than this fraction of its error
        temper_margin: float = 0.0
        # GPTQ candidates fitted on other calibration batches than those they are judged on (the windows past
        # search_samples, else the second half of the batches), not fitted and judged on the same tokens: on
        # SmolLM2-135M 3-bit g128 this turned AWQ+GPTQ from worse than GPTQ alone in three calibration draws of
        # three (mean 76.09 vs 75.04) to better (73.74), and 3-bit g64 from 71.26 to 70.03 (GPTQ 72.09)
        temper_holdout: bool = True
        # not clipped: q and k (their error is amplified through the attention scores, which the clip objective
        # does not see), and Phi-3's fused qkv_proj, which holds q and k rows; names or "re:<regex>" in the layer.
        # AutoAWQ's default; on SmolLM2-135M clipping them too (clip_skip: []) was better in every cell measured:
        # with separate ends and refinement 0.58x RTN's perplexity increase at 4-bit g128 over three calibration
        # draws, against 0.63x with these defaults (docs/results/accuracy.md)
        clip_skip: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "qkv_proj"])
        # v_proj -> o_proj under grouped-query heads (fewer value channels than o_proj columns): search one scale
        # per value channel, shared by the o_proj columns that read it (the fold stays exact). Off by default, as
        # in AutoAWQ: on SmolLM2-135M (3 value heads for 9 query heads) it was mixed -- AWQ + RTN worse in 4 of 6
        # cells (3-bit g128 108.6 -> 117.2), AWQ + GPTQ better in 4 of 6 (docs/results/accuracy.md)
        scale_grouped_values: bool = False
        # judge the scale candidates of clipped consumers with each group's range shrunk as the diagonal output
        # error prefers (the clip search's grid), not with the full range the clip search will not keep
        clip_aware_search: bool = False
        # after the grid: Adam steps on each channel's log scale against the same block error, rounding passed
        # straight through; kept only when the exact error is lower (0: the paper's grid search alone). On
        # SmolLM2-135M, 4-bit, mean of three calibration draws: perplexity increase over RTN's 0.72x -> 0.63x at
        # g128, 0.61x -> 0.59x at g64 (docs/results/accuracy.md); ~3x the search time on a CPU
        refine_steps: int = 50
        refine_lr: float = 0.01
        save_search: str | None = None  # directory for the search results, one file per layer
        load_search: str | None = None  # directory written by save_search: replay it instead of searching

        def __post_init__(self) -> None:
            for name in ("grid", "clip_grid", "clip_tokens"):
                v = getattr(self, name)
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise QuantkitError(f"awq {name} must be a positive integer, got {v!r}")
            v = self.refine_steps
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise QuantkitError(f"awq refine_steps must be a non-negative integer, got {v!r}")
            v = self.refine_lr
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise QuantkitError(f"awq refine_lr must be a positive number, got {v!r}")
            for name in ("search_samples", "search_tokens"):
                v = getattr(self, name)
                if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                    raise QuantkitError(f"awq {name} must be a positive integer or null, got {v!r}")
            for name in (
                "duo_scaling",
                "clip",
                "clip_separate_ends",
                "scale_grouped_values",
                "temper_holdout",
                "clip_aware_search",
            ):
                if not isinstance(getattr(self, name), bool):
                    raise QuantkitError(f"awq {name} must be true or false, got {getattr(self, name)!r}")
            v = self.temper_margin
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
                raise QuantkitError(f"awq temper_margin must be a fraction in [0, 1), got {v!r}")
            v = self.clip_min
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= 1:
                raise QuantkitError(f"awq clip_min must be a fraction in (0, 1], got {v!r}")
            skip = self.clip_skip
            if isinstance(skip, str):
                skip = [skip]
            if not isinstance(skip, (list, tuple)) or not all(isinstance(p, str) for p in skip):
                raise QuantkitError(f"awq clip_skip must be a list of name patterns, got {skip!r}")
            object.__setattr__(self, "clip_skip", list(skip))
            for name in ("save_search", "load_search"):
                v = getattr(self, name)
                if v is not None and not (isinstance(v, str) and v):
                    raise QuantkitError(f"awq {name} must be a directory path or null, got {v!r}")
            if self.quantizer not in ("rtn", "gptq"):
                raise QuantkitError(f"awq quantizer must be 'rtn' or 'gptq', got {self.quantizer!r}")
            powers = self.temper_powers
            if (
                not isinstance(powers, (list, tuple))
                or not powers
                or not all(isinstance(p, (int, float)) and not isinstance(p, bool) and 0 <= p <= 1 for p in powers)
            ):
                raise QuantkitError(f"awq temper_powers must be a non-empty list of numbers in [0, 1], got {powers!r}")
            object.__setattr__(self, "temper_powers", [float(p) for p in powers])
            if self.save_search is not None and self.load_search is not None:
                raise QuantkitError("awq: give save_search or load_search, not both")

    @classmethod
    def check_stage(cls, stage: Stage, where: str = "awq") -> None:
        scheme = stage.scheme
        if scheme is None:
            raise QuantkitError(f"{where}: awq needs a scheme (the recipe's default scheme) for its fake-quantization "
                                "objective")  # fmt: skip
        if not scheme.weight_only or scheme.fmt != "int":
            raise QuantkitError(f"{where}: awq searches for weight-only integer schemes, got {scheme.name}")

    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self.params = stage.params if stage.params is not None else self.Params()
        self.check_stage(stage)

    @classmethod
    def needs_calibration(cls, stage: Stage) -> bool:
        return stage.params is None or stage.params.load_search is None

    def apply(self, ctx: LayerContext) -> None:
        if self.params.load_search is not None:
            search = self._load(ctx)
            self._replay(ctx, search)
        else:
            if not ctx.has_data:
                raise QuantkitError("awq needs calibration data (or load_search with saved search results)")
            search = self._search(ctx)
            if self.params.save_search is not None:
                self._save(ctx, search)

    # search ---------------------------------------------------------------------------------------------

    def _selected(self, ctx: LayerContext, name: str, module: nn.Module) -> bool:
        return isinstance(module, nn.Linear) and self.stage.selects(ctx.full_name(name), module)

    def _search(self, ctx: LayerContext) -> LayerSearch:
        search = LayerSearch()
        for group in bind_smooth_groups(ctx.layer, ctx.arch):
            found = self._search_group(ctx, group)
            if found is not None:
                search.groups.append(found)
        if self.params.clip:
            self._search_clips(ctx, search)
        return search

    def _search_group(self, ctx: LayerContext, group: BoundGroup) -> GroupScales | None:
        _, consumers, _ = group.modules(ctx.layer)
        for n, m in zip(group.consumers, consumers, strict=True):
            if not isinstance(m, nn.Linear):
                raise QuantkitError(
                    f"awq: {ctx.full_name(n)} is already quantized ({type(m).__name__}); "
                    "put the awq stage before the weight stage"
                )
        if group.channel_map is not None and not self.params.scale_grouped_values:
            for n in group.consumers:
                ctx.record(n, awq_skipped=f"{group.producer} feeds grouped-query heads (scale_grouped_values is off)")
            return None
        schemes = [
            self.stage.scheme_for(ctx.full_name(n), m) if self._selected(ctx, n, m) else None
            for n, m in zip(group.consumers, consumers, strict=True)
        ]
        if all(sc is None for sc in schemes):
            return None
        t0 = time.perf_counter()
        block = ctx.layer.get_submodule(group.block)
        search_ctx = self._search_context(ctx)
        calls = search_ctx.capture_calls(block)
        sampled = self.params.search_tokens is not None and tokenwise(calls)
        if sampled:
            calls = token_sample(calls if search_ctx is ctx else ctx.capture_calls(block), self.params.search_tokens)
        # the consumers' input width: under grouped-query heads (v_proj -> o_proj) wider than the producer's output,
        # each value channel read by several o_proj columns (group.channel_map)
        width = consumers[0].in_features
        gram = consumers == [block] and width < token_count(calls)  # a lone linear: the Gram matrix is cheaper
        tempered = self.params.quantizer == "gptq"
        # the in-sample Gram matrix: the lone linear's objective, and GPTQ's Hessian unless held-out batches fit it
        x_mean, x_sq, xtx, n_tokens = input_stats(
            calls, width, ctx.device, gram or (tempered and not self.params.temper_holdout)
        )
        if n_tokens == 0:  # no calibration token reached the block (an expert nobody was routed to)
            for n in group.consumers:
                ctx.record(n, awq_skipped="no calibration tokens")
            return None
        objective = LinearObjective(block.weight, xtx, n_tokens) if gram else BlockObjective(block, calls, consumers)
        quantize = rtn_candidate
        if self.params.clip_aware_search and self.params.clip and not tempered:
            clipped = ClippedRTNCandidate(x_sq, clip_ratios(self.params.clip_grid, self.params.clip_min))
            quantize = [
                rtn_candidate if any(_pattern_matches(p, n) for p in self.params.clip_skip) else clipped
                for n in group.consumers
            ]
        found = search_scales(
            [m.weight for m in consumers],
            schemes,
            x_mean,
            objective,
            grid=self.params.grid,
            duo_scaling=self.params.duo_scaling,
            group_size=self.stage.scheme.group_size,
            channel_map=group.channel_map,
            quantize=quantize,
        )
        if self.params.refine_steps:
            found = refine_scales(
                [m.weight for m in consumers],
                schemes,
                objective,
                found,
                self.params.refine_steps,
                self.params.refine_lr,
                group.channel_map,
                quantize,
            )
        power = None
        if tempered:
            judge, hessian = objective, xtx
            if self.params.temper_holdout:
                held = self._holdout(ctx, search_ctx, block, consumers, width, objective, sampled)
                if held is None:
                    why = "one calibration batch" if len(ctx.hidden) < 2 else "no token in one part"
                    for n in group.consumers:
                        ctx.record(n, awq_temper_in_sample=why)
                    if hessian is None:
                        hessian = input_stats(calls, width, ctx.device, True)[2]
                else:
                    judge, hessian = held
            scales, power, losses = temper_scales(
                [m.weight for m in consumers],
                schemes,
                judge,
                found.scales,
                GPTQCandidate(hessian, act_order=True, mse=True),
                tuple(self.params.temper_powers),
                group.channel_map,
                self.params.temper_margin,
            )
            found = replace(found, scales=scales, loss=losses[power])  # loss_rtn stays the identity under RTN
            del judge, hessian
        del calls, objective
        fold_group(ctx.layer, group, found.scales, ctx.arch.norm)
        for n in group.consumers:
            ctx.record(
                n,
                awq_ratio=found.ratio,
                **({"awq_refined": found.refined} if self.params.refine_steps else {}),
                awq_loss=found.loss,
                awq_loss_rtn=found.loss_rtn,
                awq_seconds=round(time.perf_counter() - t0, 3),
                **({"awq_power": power, "awq_losses_gptq": losses} if tempered else {}),
            )
        return GroupScales(
            group.producer,
            list(group.consumers),
            list(group.readers),
            group.producer_rows,
            found.scales.cpu(),
            found.ratio,
            found.loss,
            found.loss_rtn,
        )

    def _holdout(self, ctx, search_ctx, block, consumers, width: int, objective, sampled: bool):
        """(objective, Hessian) for temper_holdout: GPTQ's Hessian from the batches past ``search_ctx`` and the
        objective on ``search_ctx``'s (token-sampled as the search samples them; the search's own ``objective``
        when it judged exactly those calls); when the search uses every batch, the Hessian from the second half
        of the batches and the objective on the first. None (judged in sample) with a single batch, or when no
        token reached the block in one of the two parts."""
        used = len(search_ctx.hidden)
        reuse = used < len(ctx.hidden) and not sampled  # the search judged exactly search_ctx's calls
        if used >= len(ctx.hidden):
            used = len(ctx.hidden) // 2
            search_ctx = replace(ctx, hidden=ctx.hidden[:used], kwargs=ctx.kwargs[:used])
        if used == 0:
            return None
        rest = replace(ctx, hidden=ctx.hidden[used:], kwargs=ctx.kwargs[used:])
        _, _, hessian, n_fit = input_stats(rest.capture_calls(block), width, ctx.device, True)
        if n_fit == 0:  # an expert that tokens reached in one part only
            return None
        if reuse:
            return objective, hessian
        calls = search_ctx.capture_calls(block)
        if sampled:
            calls = token_sample(calls, self.params.search_tokens)
        if token_count(calls) == 0:
            return None
        if consumers == [block] and width < token_count(calls):
            _, _, gram, n = input_stats(calls, width, ctx.device, True)
            return LinearObjective(block.weight, gram, n), hessian
        return BlockObjective(block, calls, consumers), hessian

    def _search_context(self, ctx: LayerContext) -> LayerContext:
        """``ctx`` limited to the first calibration batches holding ``search_samples`` windows (all when None)."""
        limit = self.params.search_samples
        if limit is None:
            return ctx
        kept, windows = 0, 0
        while kept < len(ctx.hidden) and windows < limit:
            windows += ctx.hidden[kept].shape[0]
            kept += 1
        return replace(ctx, hidden=ctx.hidden[:kept], kwargs=ctx.kwargs[:kept])

    def _search_clips(self, ctx: LayerContext, search: LayerSearch) -> None:
        skip = self.params.clip_skip
        targets = {
            n: m
            for group in ctx.sequential_groups()
            for n, m in group
            if self._selected(ctx, n, m) and not any(_pattern_matches(p, n) for p in skip)
        }
        if not targets:
            return
        samples = sample_inputs(ctx, targets, self.params.clip_tokens)
        for name, module in targets.items():
            x = samples.get(name)
            if x is None:
                ctx.record(name, awq_clip_skipped="no calibration tokens")
                continue
            t0 = time.perf_counter()
            scheme = self.stage.scheme_for(ctx.full_name(name), module)
            lo, hi = search_clip(
                module.weight, x, scheme, self.params.clip_grid, self.params.clip_min, self.params.clip_separate_ends
            )
            ratio = _mean_ratio(module.weight, lo, hi, scheme)
            clip_weight(module.weight.data, lo, hi, scheme.group_size)
            search.clips[name] = (lo.cpu(), hi.cpu())
            ctx.record(name, awq_clip_mean_ratio=ratio, awq_clip_seconds=round(time.perf_counter() - t0, 3))

    # replay ----------------------------------------------------------------------------------------------

    def _replay(self, ctx: LayerContext, search: LayerSearch) -> None:
        bound = {g.producer: g for g in bind_smooth_groups(ctx.layer, ctx.arch)}
        for saved in search.groups:
            group = bound.get(saved.producer)
            if group is None or (group.consumers, group.readers) != (saved.consumers, saved.readers):
                raise QuantkitError(
                    f"awq load_search: the saved group of {ctx.full_name(saved.producer)} does not match this model"
                )
            fold_group(ctx.layer, group, saved.scales, ctx.arch.norm)
            for n in saved.consumers:
                ctx.record(
                    n, awq_ratio=saved.ratio, awq_loss=saved.loss, awq_loss_rtn=saved.loss_rtn, awq_replayed=True
                )
        for name, (lo, hi) in search.clips.items():
            if not match(ctx.layer, name):
                raise QuantkitError(f"awq load_search: {ctx.full_name(name)} is not in this model")
            module = ctx.layer.get_submodule(name)
            scheme = self.stage.scheme_for(ctx.full_name(name), module)
            ratio = _mean_ratio(module.weight, lo, hi, scheme)
            clip_weight(module.weight.data, lo, hi, scheme.group_size)
            ctx.record(name, awq_clip_mean_ratio=ratio, awq_replayed=True)

    # files ----------------------------------------------------------------------------------------------

    def _save(self, ctx: LayerContext, search: LayerSearch) -> None:
        from safetensors.torch import save_file

        folder = Path(self.params.save_search)
        folder.mkdir(parents=True, exist_ok=True)
        tensors, meta = search.to_tensors(self.stage.scheme)
        save_file(tensors, str(folder / f"{ctx.prefix}.safetensors"), metadata=meta)

    def _load(self, ctx: LayerContext) -> LayerSearch:
        from safetensors import safe_open

        path = Path(self.params.load_search) / f"{ctx.prefix}.safetensors"
        if not path.is_file():
            raise QuantkitError(f"awq load_search: {path} not found (was the search saved for this model?)")
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
        search = LayerSearch.from_tensors(tensors, meta, str(path))
        saved = LayerSearch.scheme_of(meta)
        if saved != self.stage.scheme:
            raise QuantkitError(
                f"awq load_search: {path} was searched for {saved.name}, this recipe quantizes to "
                f"{self.stage.scheme.name}"
            )
        return search


def _mean_ratio(w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scheme: QuantScheme) -> float:
    """Mean clipped range over the unclipped range (1.0: nothing clipped), for the report; call before clipping."""
    lo0, hi0 = group_range(w.detach(), scheme.group_size, scheme.sym)
    if lo0.shape != lo.shape:
        raise QuantkitError(
            f"clip ranges of shape {tuple(lo.shape)} do not fit {scheme.name} on a weight {tuple(w.shape)}"
        )
    full = (hi0 - lo0).cpu()
    clipped = (hi - lo).float().cpu()
    ok = full > 0
    return round(float((clipped[ok] / full[ok]).mean()), 4) if ok.any() else 1.0
