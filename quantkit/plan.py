"""The preflight plan of a quantize run, made from the model's config alone (no weight is read).

It says which linears of which decoder layers each stage of the recipe touches and with which scheme (overrides
applied), and estimates what the run needs: peak host and GPU memory, disk for the output and the resume state, and
(``probe_seconds``, for ``--dry-run``) the time, from a timing probe that runs the recipe on one decoder layer of the
same shape with random weights. Every real run checks the memory and disk estimates first (:func:`check_fits`).

The estimates count what dominates: the float weights a run holds (the whole model, or with offloading the modules
outside the decoder layers and one float layer), the quantized layers done so far, the calibration hidden states
(inputs and outputs of a layer: 2 x nsamples x seqlen x hidden size), the statistics of the largest group of linears
(GPTQ: two K x K fp32 matrices a linear), a batch's MLP activations, and a quality gate's reference distributions.
Allocator slack, CUDA context and library workspaces come on top: read them as lower bounds.
"""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from quantkit.errors import QuantkitError
from quantkit.quant.packing import packed_rows
from quantkit.quant.scheme import QuantScheme
from quantkit.recipe import Recipe
from quantkit.stages import stage_class


def size(n: float) -> str:
    """Bytes as people read them: 812 KiB, 3.4 MiB, 71.2 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit in ("B", "KiB") else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass
class Plan:
    model: str
    architecture: str
    layers: int
    rows: list[tuple[str, str, int, str, str]]  # (linear in a layer, N x K, how many a layer, what runs, which layers)
    float_bytes: int  # the float model's weights in the run's dtype
    output_bytes: int  # the checkpoint's tensors
    scratch_bytes: int  # the resume state at its largest
    host_bytes: int  # peak host memory
    device_bytes: int | None  # peak GPU memory (None: layers are processed on the CPU)
    device: str
    seconds: float | None = None  # estimated quantize time (probe_seconds)

    def lines(self) -> list[str]:
        out = [f"plan: {self.model} ({self.architecture}), {self.layers} decoder layers, processed on {self.device}"]
        for name, shape, count, what, where in self.rows:
            out.append(f"  {name} [{shape}]{f' x{count}' if count > 1 else ''}: {what} (layers {where})")
        gpu = "" if self.device_bytes is None else f", GPU ~{size(self.device_bytes)}"
        out.append(f"memory: host ~{size(self.host_bytes)}{gpu} (float weights {size(self.float_bytes)})")
        out.append(f"disk: output ~{size(self.output_bytes)}, resume state ~{size(self.scratch_bytes)}")
        if self.seconds is not None:
            out.append(f"time: ~{self.seconds / 60:.1f} min (a timing probe on one layer of this shape)")
        return out


def _spans(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    spans, start = [], indices[0]
    for a, b in zip(indices, [*indices[1:], None], strict=True):
        if b != a + 1:
            spans.append(f"{start}-{a}" if a != start else f"{a}")
            start = b
    return ", ".join(spans)


def quantized_bytes(scheme: QuantScheme, n: int, k: int) -> int:
    """Bytes of a quantized linear's buffers (docs/checkpoints.md): packed codes, zero points, scales, g_idx."""
    if scheme.progressive:  # codes, s1 fp32, s2 and z uint8 per group, perm int32
        return 16 * -(-k // 32) * n + 4 * n + 2 * scheme.n_groups(k) * n + 4 * k
    if not scheme.packed:
        return n * k + 4 * n + 4
    n_g = scheme.n_groups(k)
    return 4 * packed_rows(k, scheme.bits) * n + 4 * n_g * packed_rows(n, scheme.bits) + 2 * n_g * n + 4 * k


def stored_elements(module: torch.nn.Module) -> int:
    """Elements of what a checkpoint stores of ``module``: parameters and persistent buffers, a tied one once."""
    return sum(t.numel() for t in {id(t): t for t in module.state_dict(keep_vars=True).values()}.values())


def skeleton_of(folder: Path):
    """The meta-device model of ``folder``'s config, its fused experts split as a run splits them."""
    from quantkit.checkpoint.export import model_skeleton
    from quantkit.models.arch import arch_for
    from quantkit.models.experts import split_all_fused_experts
    from quantkit.models.loading import read_config

    skeleton = model_skeleton(read_config(folder))
    arch = arch_for(skeleton)
    if arch.fused_experts:
        split_all_fused_experts(skeleton, skeleton.get_submodule(arch.layers), arch.fused_experts, materialize=False)
    return skeleton, arch


def make_plan(folder: Path, recipe: Recipe, device: str, dtype: torch.dtype, offload: bool, resume_state: bool) -> Plan:
    """The plan of quantizing the model in ``folder`` with ``recipe`` (see the module doc)."""
    from quantkit.models.layers import linears

    skeleton, arch = skeleton_of(folder)
    size = torch.empty(0, dtype=dtype).element_size()
    layers = skeleton.get_submodule(arch.layers)
    rows: dict[tuple[str, str, str], dict[int, int]] = {}  # (name, shape, what) -> layer -> modules
    layer_float, layer_out, stats = [], [], []
    for i, layer in enumerate(layers):
        params = stored_elements(layer)
        out_bytes, group_stats = params * size, [0]
        for group in arch.sequential:
            group_stats.append(0)
            for name, lin in linears(layer, group, arch.never_quantize):
                full, n, k = f"{arch.layers}.{i}.{name}", lin.out_features, lin.in_features
                what, scheme = [], None
                for stage in recipe.stages:
                    if scheme is None and stage.selects(full, lin):
                        if stage_class(stage.method).kind == "weights":
                            scheme = stage.scheme_for(full, lin)
                            what.append(f"{stage.method} {scheme.name}")
                            group_stats[-1] += 8 * k * k if stage_class(stage.method).needs_hessian else 12 * k
                        else:
                            what.append(stage.method)
                if scheme is not None:
                    out_bytes += quantized_bytes(scheme, n, k) - n * k * size
                key = (re.sub(r"experts\.\d+\.", "experts.*.", name), f"{n} x {k}", " -> ".join(what) or "float")
                per_layer = rows.setdefault(key, {})
                per_layer[i] = per_layer.get(i, 0) + 1  # experts: how many a layer
        layer_float.append(params * size)
        layer_out.append(out_bytes)
        stats.append(max(group_stats))
    total = stored_elements(skeleton) * size
    outside = total - sum(layer_float)
    c, config = recipe.calibration, skeleton.config
    hidden = c.nsamples * c.seqlen * config.hidden_size * size if recipe.needs_calibration else 0
    wide = max(getattr(config, "intermediate_size", 0) or 0, config.hidden_size)
    work = 2 * hidden + max(stats) + 4 * min(c.batch_size, c.nsamples) * c.seqlen * wide * size * bool(hidden)
    gate = recipe.gate
    gate_bytes = 2 * gate.windows * (gate.seqlen - 1) * config.vocab_size * 4 if gate else 0
    host = (outside + max(layer_float) + sum(layer_out) if offload else total) + gate_bytes
    on_gpu = torch.device(device).type == "cuda"
    return Plan(
        model=str(folder), architecture=arch.name, layers=len(layers),
        rows=[(name, shape, max(n.values()), what, _spans(list(n))) for (name, shape, what), n in rows.items()],
        float_bytes=total, output_bytes=outside + sum(layer_out),
        scratch_bytes=(2 * hidden + sum(layer_out)) if resume_state else 0,
        host_bytes=host + (0 if on_gpu else work),
        device_bytes=max(layer_float) + work if on_gpu else None, device=device,
    )  # fmt: skip


def _free_host_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(plan: Plan, out: Path) -> None:
    """Stop at once, with one line, when the plan's memory or disk does not fit what is free now."""
    where = out.parent
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    need = plan.output_bytes + plan.scratch_bytes
    if need > free:
        saves = f"; --no-resume-state saves ~{size(plan.scratch_bytes)}" if plan.scratch_bytes else ""
        raise QuantkitError(f"needs ~{size(need)} of disk in {where} for the output and the resume state, "
                            f"{size(free)} free{saves}")  # fmt: skip
    host = _free_host_bytes()
    if host is not None and plan.host_bytes > host:
        raise QuantkitError(f"needs ~{size(plan.host_bytes)} of host memory, {size(host)} available "
                            "(--offload keeps the float layers on disk)")  # fmt: skip
    if plan.device_bytes is not None:
        gpu = torch.cuda.mem_get_info(torch.device(plan.device))[0]
        if plan.device_bytes > gpu:
            raise QuantkitError(f"needs ~{size(plan.device_bytes)} of GPU memory, {size(gpu)} free "
                                "(fewer or shorter calibration windows need less)")  # fmt: skip


def probe_seconds(folder: Path, recipe: Recipe, plan: Plan, dtype: torch.dtype) -> float:
    """Estimated quantize time: the recipe run on a one-layer model of this config with random weights, twice on 4
    and once on 8 random calibration windows, fitted as a + b x windows a layer, times the layers. Only as steady as
    the machine: other work on its cores slows multi-threaded torch far more than its share."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.pipeline import quantize

    config = AutoConfig.from_pretrained(folder)
    config.num_hidden_layers = 1
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:1]
    recipe = replace(recipe, gate=None)
    seqlen = recipe.calibration.seqlen
    times = []  # the first run also warms up (kernels, allocator)
    for windows in (4, 4, 8) if recipe.needs_calibration else (0, 0):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        calib = torch.randint(0, config.vocab_size, (windows, seqlen)) if windows else None
        t0 = time.perf_counter()
        quantize(model, recipe, calib, device=plan.device)
        times.append(time.perf_counter() - t0)
    if not recipe.needs_calibration:
        return plan.layers * min(times)
    four = min(times[:2])  # the quicker of two runs: a busy machine slows multi-threaded torch a lot
    per_window = max(times[2] - four, 0.0) / 4
    fixed = max(four - 4 * per_window, 0.0)
    return plan.layers * (fixed + per_window * recipe.calibration.nsamples)
