"""Layer-by-layer calibration: the heart of quantkit's memory use.

1. Capture the inputs of every decoder layer once: the model's own forward runs with each layer replaced by a
   pass-through that records its arguments (hidden states of layer 0; for every layer the keyword arguments it
   receives: position embeddings, masks, cache flags, which may differ per layer, e.g. sliding windows).
2. For each layer: move it alone to the compute device, let every stage of the recipe work on it (collect
   statistics with hooks, search scales, replace linears by quantized ones), then re-run it on the calibration
   hidden states so that the next layer sees the outputs of the quantized layer, and move it back.

Peak compute-device memory is one decoder layer + the calibration hidden states (inputs and outputs) + the
statistics of the linears being processed, never the whole model.

Mixture-of-experts layers (split into one linear per expert projection) first run once on their calibration inputs
to count the tokens routed to each expert; ``ExpertCalibration`` then says which tokens each expert's statistics
see while the stages work, and every expert's linears carry ``expert_tokens`` and ``expert_statistics`` in the
report (``routed``, ``all`` or ``none``: quantized without data).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from quantkit.calib.stats import LinearStats, StatsCollector
from quantkit.devices import release_host_memory
from quantkit.distributed import Shard, broadcast_object, reduce_, reduce_stats
from quantkit.errors import QuantkitError
from quantkit.models.arch import ArchSpec
from quantkit.models.experts import ExpertCalibration, LinearExperts
from quantkit.models.layers import linears

log = logging.getLogger(__name__)
REPORTED_MODE = {"routed": "routed", "all": "all", "unobserved": "none"}


def _hidden_of(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _copy(out):
    """A module's output with every tensor in it copied (callers may change what they receive in place)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_copy(o) for o in out)
    if isinstance(out, dict):
        return type(out)((k, _copy(v)) for k, v in out.items())
    return out


class _InputsSeen(Exception):
    """Raised by a pre-hook once every module being measured has received its input in this call."""


@dataclass
class LayerContext:
    """One decoder layer on the compute device, with its calibration inputs."""

    index: int
    prefix: str  # full module name of the layer, e.g. "model.layers.3"
    layer: nn.Module
    arch: ArchSpec
    hidden: list[torch.Tensor]  # per batch [b, L, H], on the compute device
    kwargs: list[dict]  # per batch keyword arguments of this layer
    device: torch.device
    report: dict[str, dict] = field(default_factory=dict)  # full linear name -> what the stages measured
    shard: Shard | None = None  # across processes: which of the calibration batches this rank holds
    kwargs_all: list[dict] | None = None  # across processes: the keyword arguments of every batch, of all ranks
    batch: int = -1  # the calibration batch running now (set by forward and collect)
    passes: int = 0  # passes over the batches so far
    _replayed: list = field(default_factory=list, init=False, repr=False)  # (module, own forward or None)
    _last_pass: bool = field(default=False, init=False, repr=False)  # forward(last=True) is running

    @property
    def has_data(self) -> bool:
        return bool(self.hidden)

    @property
    def first_window(self) -> int:
        """The index of ``hidden[0]``'s first window among all calibration windows (0 but across processes)."""
        return self.shard.first_window if self.shard is not None else 0

    def full_name(self, name: str) -> str:
        return f"{self.prefix}.{name}"

    def record(self, name: str, **values) -> None:
        self.report.setdefault(self.full_name(name), {}).update(values)

    def sequential_groups(self) -> list[list[tuple[str, nn.Linear]]]:
        """Float linears of this layer in execution order, grouped as the architecture table says."""
        skip = self.arch.never_quantize
        groups = [linears(self.layer, group, skip) for group in self.arch.sequential]
        return [g for g in groups if g]

    def _batches(self):
        """The calibration batches, one pass over them; ``self.batch`` says which one runs."""
        self.passes += 1
        try:
            for i, (h, kw) in enumerate(zip(self.hidden, self.kwargs, strict=True)):
                self.batch = i
                yield h, kw
        finally:
            self.batch = -1

    @torch.no_grad()
    def forward(self, last: bool = False) -> list[torch.Tensor]:
        """The layer's output hidden states, per batch.

        ``last``: nothing runs this layer on these inputs again (:func:`run_layerwise`'s pass that feeds the next
        layer), so each batch's output takes its input's place in ``hidden`` (the list returned) and replayed
        children hand over what they recorded instead of a copy: the inputs, the outputs and the recorded outputs
        are not all held at once.
        """
        if not last:
            return [_hidden_of(self.layer(h, **kw)) for h, kw in self._batches()]
        self._last_pass = True
        try:
            for h, kw in self._batches():
                self.hidden[self.batch] = _hidden_of(self.layer(h, **kw))
        finally:
            self._last_pass = False
        return self.hidden

    def stop_replaying(self) -> None:
        """Every child named to :meth:`replay` runs normally again (its own forward, if it had one, comes back:
        accelerate's offload hooks set one)."""
        while self._replayed:
            module, own = self._replayed.pop()
            if own is None:
                del module.forward
            else:
                module.forward = own

    def replay(self, name: str) -> None:
        """From now on, until :meth:`stop_replaying`, child ``name`` of the layer runs once per calibration batch;
        later passes get a copy of that output instead of running it again.

        True-sequential calibration runs the start of the layer again for every group of linears: once the
        attention block is quantized its output is fixed (same inputs, same weights), and replaying it skips q/k/v,
        attention and o for the MLP's groups and for the pass that feeds the next layer, with the same numbers.
        The caller vouches that the child's inputs and weights stay as they are until :meth:`stop_replaying`
        (:func:`run_layerwise` stops after the layer's last pass; the pipeline before each stage). A child called
        twice in one pass is not replayed (it runs every time). Costs one more copy of the hidden states: the weight
        stages ask for it on the CPU only (on an H200 it saved 1% of an 8B GPTQ for 2 GiB more memory).
        """
        module = self.layer.get_submodule(name)
        run = module.forward
        outputs: dict[int, tuple[int, object]] = {}  # batch -> (pass that recorded it, output)
        replayable = True

        def forward(*args, **kwargs):
            nonlocal replayable
            b = self.batch
            if replayable and b in outputs:
                recorded_in, out = outputs[b]
                if recorded_in != self.passes:
                    if self._last_pass:  # its last use: no copy, and it goes
                        del outputs[b]
                        return out
                    return _copy(out)
                replayable = False  # a second call in the pass that recorded it
                outputs.clear()
            if not replayable or b < 0 or self._last_pass:
                return run(*args, **kwargs)
            out = run(*args, **kwargs)
            outputs[b] = (self.passes, out)
            return _copy(out)

        self._replayed.append((module, vars(module).get("forward")))
        module.forward = forward

    @torch.no_grad()
    def collect(self, modules: dict[str, nn.Linear], hessian: bool = True) -> dict[str, LinearStats]:
        """Run the layer with hooks on ``modules``; every module gets stats (zero tokens if never called).

        Each calibration batch runs only until every module in ``modules`` has seen its input: the rest of the
        layer cannot change the statistics. Stopping there halves the cost of true-sequential calibration
        (q/k/v need only the input norm, o_proj only attention). PyTorch offers no way to leave a forward
        early other than raising from a hook, so this one place does that, with a private exception type; a
        module that is never called (an expert no token was routed to) simply lets the layer run to its end.
        """
        pending: set[str] = set()

        def stop_when_all_seen(name: str):
            def hook(module, args):
                pending.discard(name)
                if not pending:
                    raise _InputsSeen

            return hook

        with StatsCollector(modules, hessian, reduce_stats if self.shard is not None else None) as collector:
            handles = [m.register_forward_pre_hook(stop_when_all_seen(n)) for n, m in modules.items()]
            try:
                for h, kw in self._batches():
                    pending.update(modules)
                    with contextlib.suppress(_InputsSeen):
                        self.layer(h, **kw)
            finally:
                for handle in handles:
                    handle.remove()
            for name, m in modules.items():
                if name not in collector.stats:  # e.g. an expert no calibration token was routed to
                    k = m.in_features
                    collector.stats[name] = LinearStats(
                        xtx=torch.zeros(k, k, dtype=torch.float64, device=self.device) if hessian else None,
                        n_tokens=0,
                        absmax=torch.zeros(k, device=self.device),
                        abssum=torch.zeros(k, dtype=torch.float64, device=self.device),
                    )
        return collector.stats

    @torch.no_grad()
    def run_on_main(self, fn) -> None:
        """``fn(ctx)`` on rank 0 with every rank's calibration batches (a stage that does not split its work between
        processes), then the layer's tensors and report as rank 0 left them on every rank. ``fn`` may change the
        layer's weights in place, not its modules. Outside a process group: ``fn(self)``."""
        if self.shard is None:
            fn(self)
            return
        rank = self.shard.rank
        hidden = gather_batches(self.hidden, self.shard)
        report = None
        if rank == 0:
            whole = dataclasses.replace(self, hidden=hidden, kwargs=self.kwargs_all, shard=None, kwargs_all=None)
            fn(whole)
            report = {k: v for k, v in self.report.items()}
            del whole, hidden
        state = self.layer.state_dict()
        layout = [(k, tuple(t.shape), t.dtype) for k, t in state.items()]
        report, main_layout = broadcast_object((report, layout), 0, self.device)
        if layout != main_layout:
            raise QuantkitError(f"{self.prefix}: a stage that changes a layer's modules cannot run across processes")
        for t in state.values():
            torch.distributed.broadcast(t, src=0)
        self.report.update(report)

    @torch.no_grad()
    def capture_calls(self, module: nn.Module) -> list[tuple[tuple, dict]]:
        """The (args, kwargs) of every call of ``module`` while the layer runs on all batches."""
        calls: list[tuple[tuple, dict]] = []
        handle = module.register_forward_pre_hook(lambda m, a, k: calls.append((a, k)), with_kwargs=True)
        try:
            self.forward()
        finally:
            handle.remove()
        return calls


@torch.no_grad()
def expert_coverage(ctx: LayerContext, rule: ExpertCalibration) -> dict[str, dict]:
    """Count the calibration tokens routed to each expert of the layer (one pass over its calibration inputs), set
    each ``LinearExperts.calibration`` by ``rule`` and return {layer-relative linear name: what its report gets}."""
    blocks = [(name, m) for name, m in ctx.layer.named_modules() if isinstance(m, LinearExperts)]
    if not blocks or not ctx.has_data:
        return {}
    counts = {name: [0] * len(m) for name, m in blocks}

    def counter(name: str, e: int):
        def hook(module, args):
            counts[name][e] += args[0].shape[0]

        return hook

    handles = [expert.register_forward_pre_hook(counter(name, e)) for name, m in blocks for e, expert in enumerate(m)]
    try:
        ctx.forward()
    finally:
        for handle in handles:
            handle.remove()
    if ctx.shard is not None:  # the tokens of every rank's batches
        totals = torch.tensor([c for name, _ in blocks for c in counts[name]], dtype=torch.float64, device=ctx.device)
        reduce_([totals])
        flat = iter(int(c) for c in totals.tolist())
        counts = {name: [next(flat) for _ in m] for name, m in blocks}
    out = {}
    for name, m in blocks:
        m.calibration = [rule.mode(c) for c in counts[name]]
        for e, (c, mode) in enumerate(zip(counts[name], m.calibration, strict=True)):
            if mode != "routed" and rule.statistics != "all":
                what = "statistics from every token" if mode == "all" else "quantized by RTN"
                log.warning("%s.%s.%d: %d calibration tokens routed (min_tokens %d): %s", ctx.prefix, name, e, c,
                            rule.min_tokens, what)  # fmt: skip
            for short, _ in m[e].named_children():
                reported = "none" if mode == "routed" and c == 0 else REPORTED_MODE[mode]
                out[f"{name}.{e}.{short}"] = {"expert_tokens": c, "expert_statistics": reported}
    return out


def gather_batches(hidden: list[torch.Tensor], shard: Shard) -> list[torch.Tensor] | None:
    """Every rank's ``hidden`` (its share of the batches), in order, on rank 0; None on the other ranks."""
    out = []
    for i in range(len(shard.sizes)):
        owner = shard.owner(i)
        if owner == shard.rank and shard.rank != 0:
            torch.distributed.send(hidden[i - shard.start].contiguous(), dst=0)
        elif shard.rank == 0:
            h = hidden[i - shard.start] if owner == 0 else None
            if h is None:
                h = hidden[0].new_empty((shard.sizes[i], *hidden[0].shape[1:]))
                torch.distributed.recv(h, src=owner)
            out.append(h)
    return out if shard.rank == 0 else None


def decoder_layers(model: nn.Module, arch: ArchSpec) -> nn.ModuleList:
    return model.get_submodule(arch.layers)


@torch.no_grad()
def capture_layer_inputs(
    model: nn.Module, arch: ArchSpec, batches: list[torch.Tensor], device: torch.device
) -> tuple[list[torch.Tensor], list[list[dict]]]:
    """Hidden states entering layer 0 (per batch) and the keyword arguments of every layer (per layer, per batch)."""
    layers = decoder_layers(model, arch)
    base = model.get_submodule(arch.layers.rpartition(".")[0])
    others = [m for m in base.children() if m is not layers]
    homes = [next(m.parameters(), torch.empty(0)).device for m in others]
    records: list[list[tuple[tuple, dict]]] = [[] for _ in layers]

    def passthrough(i: int):
        def forward(*args, **kwargs):
            records[i].append((args, kwargs))
            return args[0] if args else kwargs["hidden_states"]

        return forward

    for m in others:
        m.to(device)
    for i, layer in enumerate(layers):
        layer.forward = passthrough(i)
    try:
        for ids in batches:
            base(input_ids=ids.to(device), use_cache=False)
    finally:
        for layer in layers:
            del layer.forward
        for m, home in zip(others, homes, strict=True):
            m.to(home)
    hidden = [args[0] if args else kw["hidden_states"] for args, kw in records[0]]
    kwargs = [[{k: v for k, v in kw.items() if k != "hidden_states"} for _, kw in rec] for rec in records]
    return hidden, kwargs


def run_layerwise(
    model: nn.Module,
    arch: ArchSpec,
    batches: list[torch.Tensor] | None,
    device: torch.device,
    on_layer,
    progress=None,
    prepare=None,
    state=None,
    experts: ExpertCalibration | None = None,
    shard: Shard | None = None,
) -> dict[str, dict]:
    """Call ``on_layer(ctx)`` for every decoder layer in order; return the merged per-linear report.

    ``batches`` are input-id tensors [b, L]; ``None`` runs without calibration data (e.g. RTN).
    ``progress`` is an optional callable ``(done, total, description)``, called once a layer is done (and saved).
    ``prepare(layer)`` runs on each layer where it lives, before it moves to ``device`` (the pipeline reads
    offloaded layers in there). ``state`` resumes and records the run (:class:`quantkit.resume.RunState`): its first
    ``state.done`` layers are already quantized, ``state.hidden(device)`` are the next one's inputs,
    ``state.report`` the report so far, and ``state.save(i, layer, hidden, report)`` runs after every layer.
    ``experts``: which tokens MoE experts calibrate on (default: the routed ones), see :func:`expert_coverage`.
    ``shard``: across processes, the batches this rank runs (every rank is given all ``batches``); a layer's
    outputs stay on the rank that computed them.
    """
    layers = decoder_layers(model, arch)
    if batches:
        hidden, layer_kwargs = capture_layer_inputs(model, arch, batches, device)
    else:
        hidden, layer_kwargs = [], [[] for _ in layers]
    all_kwargs = layer_kwargs
    if shard is not None and batches:
        hidden = hidden[shard.start : shard.stop]
        layer_kwargs = [kw[shard.start : shard.stop] for kw in layer_kwargs]
    report: dict[str, dict] = {}
    first = 0
    if state is not None and state.done:
        first, report = state.done, dict(state.report)
        hidden = state.hidden(device) if batches else []
        if shard is not None and batches:
            hidden = hidden[shard.start : shard.stop]
    try:
        for i, layer in enumerate(layers):
            if i < first:
                continue
            if prepare is not None:
                prepare(layer)
            home = next(layer.parameters(), torch.empty(0)).device
            layer.to(device)
            ctx = LayerContext(i, f"{arch.layers}.{i}", layer, arch, hidden, layer_kwargs[i], device)
            if shard is not None:
                ctx.shard, ctx.kwargs_all = shard, all_kwargs[i]
            t0 = time.perf_counter()
            try:
                coverage = expert_coverage(ctx, experts or ExpertCalibration())
                try:
                    on_layer(ctx)
                finally:
                    for m in layer.modules():
                        if isinstance(m, LinearExperts):
                            m.calibration = None
                for name, values in coverage.items():  # for the experts' linears that were quantized
                    if ctx.full_name(name) in ctx.report:
                        ctx.record(name, **values)
                if hidden and i + 1 < len(layers):
                    hidden = ctx.forward(last=True)  # the next layer sees this layer's quantized outputs
            finally:
                ctx.stop_replaying()
            layer.to(home)
            report.update(ctx.report)
            del ctx  # with it the layer's input hidden states
            if state is not None:
                carried = hidden if i + 1 < len(layers) else []
                if shard is not None and carried:  # the state holds every rank's batches; rank 0 writes it
                    carried = gather_batches(carried, shard) or []
                state.save(i, layer, carried, report)
            release_host_memory()  # the layer's float weights and statistics: freed, but kept by the allocator
            if progress is not None:
                progress(i + 1, len(layers), f"layer {i} ({time.perf_counter() - t0:.1f}s)")
    except BaseException:
        if state is not None:  # the layers saved before the failure stay resumable
            with contextlib.suppress(Exception):
                state.flush()
        raise
    if state is not None:
        state.flush()
    return report
