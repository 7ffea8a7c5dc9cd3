"""The quantize pipeline in one function: calibration windows -> layer-by-layer stages -> quantized model."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from quantkit import checks
from quantkit.calib.data import calibration_windows
from quantkit.calib.runner import run_layerwise
from quantkit.devices import resolve_device
from quantkit.distributed import Shard, check_same, in_turn, world
from quantkit.errors import QuantkitError
from quantkit.models import offload
from quantkit.models.arch import arch_for, position_limit
from quantkit.models.experts import split_all_fused_experts
from quantkit.recipe import Gate, Recipe, load_recipe
from quantkit.stages import build_stage


@dataclass
class QuantizeResult:
    """What ``quantize`` did: kept on the model as ``model.quantkit`` and written into the checkpoint."""

    recipe: Recipe
    calibration: dict | None  # fingerprint: source, sha256, nsamples, seqlen, seed
    layers: dict[str, dict] = field(default_factory=dict)  # per linear: method, scheme, seconds, loss, ...
    seconds: float = 0.0
    peak_device_bytes: int | None = None
    device: str = "cpu"
    source_model: str | None = None  # where the float model came from (set by the caller, recorded on save)
    gate: dict | None = None  # the recipe's quality gate: passed, failures, and the figures measured
    state: object | None = field(default=None, repr=False)  # the run's resume state (quantkit.resume.RunState)


def recipe_windows(recipe: Recipe, model: nn.Module, tokenizer) -> tuple[torch.Tensor, dict]:
    """(windows, fingerprint): the calibration windows ``recipe.calibration`` asks for, cut from its text with
    ``tokenizer``; windows longer than the model's positions are refused first."""
    checks.tokenizer(tokenizer)
    c = recipe.calibration
    check_window_length(c.seqlen, model)
    return calibration_windows(
        tokenizer, c.source, c.nsamples, c.seqlen, c.seed, bos=c.bos, chat_template=c.chat_template
    )


def gate_reference(gate: Gate, model: nn.Module, tokenizer) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(windows, the float model's next-token log-probs on each): what :func:`check_gate` compares with, taken
    before the model is quantized in place."""
    from quantkit.calib.data import evaluation_windows
    from quantkit.eval.perplexity import window_log_probs

    if tokenizer is None:
        raise QuantkitError("the recipe's gate needs a tokenizer (pass tokenizer=...)")
    checks.tokenizer(tokenizer)
    check_window_length(gate.seqlen, model)
    windows, _ = evaluation_windows(tokenizer, gate.source, gate.seqlen, gate.windows)
    with torch.no_grad():
        return windows, [window_log_probs(model, ids) for ids in windows]


def check_gate(gate: Gate, model: nn.Module, windows: torch.Tensor, reference: list[torch.Tensor]) -> dict:
    """The gate's verdict on the quantized ``model``: passed, the bounds it broke, and the figures measured."""
    from quantkit.eval.perplexity import evaluate_windows

    r = evaluate_windows(model, windows, reference)
    figures = {"kl": r.kl, "top1_agreement": r.top1_agreement, "perplexity": r.perplexity,
               "baseline_perplexity": r.baseline_perplexity, "ppl_increase": r.perplexity / r.baseline_perplexity - 1,
               "tokens": r.tokens}  # fmt: skip
    failures = gate.failures(figures)
    return {"passed": not failures, "failures": failures, **figures, "gate": gate.to_dict()}


def prepare_model(model: nn.Module) -> None:
    """Make every expert an ordinary linear (transformers 5 fuses them into 3-D parameters)."""
    arch = arch_for(model)
    for layer in model.get_submodule(arch.layers):
        prepare_layer(model, arch, layer)


def prepare_layer(model: nn.Module, arch, layer: nn.Module) -> None:
    """What a decoder layer needs before its stages run: its weights read in if they were offloaded to disk, its
    fused experts split into ordinary linears."""
    offload.onload(layer)
    if arch.fused_experts:
        split_all_fused_experts(model, [layer], arch.fused_experts)


def check_calibration_windows(calib, model: nn.Module) -> torch.Tensor:
    """``calib`` as the layer-wise runner needs it (int64 [nsamples >= 1, seqlen >= 1], every id a row of the
    model's embedding), or a QuantkitError that says what is wrong with it."""
    if not isinstance(calib, torch.Tensor):
        raise QuantkitError(f"calib must be a torch.Tensor of token ids [nsamples, seqlen], got {type(calib).__name__}")
    if calib.dim() != 2 or calib.numel() == 0:
        raise QuantkitError(f"calib must be token ids [nsamples, seqlen] with both > 0, got shape {list(calib.shape)}")
    if calib.dtype.is_floating_point or calib.dtype.is_complex or calib.dtype == torch.bool:
        raise QuantkitError(f"calib must hold integer token ids, got {calib.dtype}")
    if calib.device.type == "meta":
        raise QuantkitError("calib is on the meta device: it holds no token ids")
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(embedding, "num_embeddings", None)
    low, high = int(calib.min()), int(calib.max())
    if low < 0 or (vocab is not None and high >= vocab):
        raise QuantkitError(f"calib token ids must lie in [0, {vocab}) for this model, found {low}..{high}")
    check_window_length(calib.shape[1], model)
    return calib.long()


def check_window_length(seqlen: int, model: nn.Module) -> None:
    """Refuse calibration windows longer than the model's positions: past them its rotary or learned position
    tables no longer describe what it was trained on, and the statistics would be of a model that never runs."""
    limit = position_limit(getattr(model, "config", None))
    if limit is not None and seqlen > limit:
        raise QuantkitError(f"calibration windows of {seqlen} tokens are longer than the model's {limit} positions")


def quantize(
    model: nn.Module,
    recipe: Recipe | dict | str | Path,
    calib: torch.Tensor | None = None,
    *,
    tokenizer=None,
    device: str | torch.device | None = None,
    progress=None,
    fingerprint: dict | None = None,
    state_dir: str | Path | None = None,
    resume: bool = False,
) -> QuantizeResult:
    """Quantize ``model`` in place following ``recipe`` (a Recipe, a mapping shaped like a recipe's YAML, a YAML
    file or a shipped recipe's name); returns what was done.

    ``calib`` is an int64 tensor [nsamples, seqlen] of token windows (``fingerprint`` says where they came
    from); when None and the recipe needs data, windows are cut from ``recipe.calibration`` with
    ``tokenizer``. ``device`` is where each layer is processed (default: CUDA when available, else CPU); the
    model itself stays where it is. A model dispatched by accelerate with offloaded layers (``load_model(...,
    offload=True)``, or a ``device_map`` with "disk") loses its hooks: each layer is read in when its turn comes
    and stays in host memory, quantized.

    A recipe with a ``gate`` needs ``tokenizer``: the float model's next-token distributions on the gate's windows
    are taken first, and the quantized model's figures against them end up in ``result.gate``; ``save_quantized``
    writes a checkpoint that missed its gate to ``OUT.rejected`` and raises :class:`GateFailedError`.

    ``state_dir``: persist after every decoder layer what the run needs to go on (:mod:`quantkit.resume`); with
    ``resume``, continue from the state there when its fingerprint matches this run (refused when it does not).
    ``save_quantized`` deletes the state once the checkpoint is written.

    Inside an initialised torch.distributed process group of several ranks (:mod:`quantkit.distributed`), every
    rank calls this with the same model, recipe and windows: each runs a contiguous share of the calibration
    batches, the statistics are summed over the ranks and each linear is quantized on one of them; every rank ends
    with the same quantized model, and ``progress`` and the gate run on rank 0 only (``save_quantized`` writes
    there). Rank 0 alone writes the resume state, which holds every rank's batches: a run resumes with any number
    of processes.
    """
    if not isinstance(model, nn.Module):
        raise QuantkitError(f"quantize needs a torch.nn.Module (quantkit.load_model), got {type(model).__name__}")
    if isinstance(recipe, dict):
        recipe = Recipe.from_dict(recipe)
    elif not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe)
    arch = arch_for(model)
    device = resolve_device(device)
    batches = None
    if recipe.needs_calibration:
        if calib is None:
            if tokenizer is None:
                raise QuantkitError("this recipe needs calibration data: pass calib windows or a tokenizer")
            calib, fingerprint = recipe_windows(recipe, model, tokenizer)
        else:
            calib = check_calibration_windows(calib, model)
        if fingerprint is None:
            fingerprint = {"source": "tensor", "nsamples": calib.shape[0], "seqlen": calib.shape[1]}
        batches = list(calib.split(recipe.calibration.batch_size))
    rank, size = world()
    shard = None
    if size > 1:
        if batches:
            check_same((list(calib.shape), int(calib.sum()), int((calib * calib).sum())), "calibration windows")
        shard = Shard.of([len(b) for b in batches] if batches else [])
        progress = progress if rank == 0 else None
    gate = recipe.gate if rank == 0 else None
    if gate is not None:  # the float model's figures, before it changes
        gate_windows, reference = gate_reference(gate, model, tokenizer)
    offload.take_over(model, model.get_submodule(arch.layers))  # accelerate's offload, if any: layers load one by one
    state = None
    if state_dir is not None:
        from quantkit.resume import RunState, run_fingerprint

        where = device.type if size > 1 else device  # each rank has its own GPU; their checkpoint is the same
        key = run_fingerprint(model, recipe, calib if batches else None, fingerprint if batches else None, where)
        state = in_turn(lambda: RunState.open(state_dir, key, resume, writes=rank == 0))  # rank 0 tidies first
        state.restore(model.get_submodule(arch.layers), lambda layer: prepare_layer(model, arch, layer))
    stages = [build_stage(s) for s in recipe.stages]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()

    def on_layer(ctx):
        for stage in stages:
            ctx.stop_replaying()  # what a stage replays holds only until another stage may change the layer
            if getattr(stage, "splits_work", False):
                stage.apply(ctx)
            else:  # across processes: on rank 0, with every rank's batches
                ctx.run_on_main(stage.apply)

    def prepare(layer):
        prepare_layer(model, arch, layer)

    try:
        with torch.no_grad():
            layers = run_layerwise(
                model,
                arch,
                batches,
                device,
                on_layer,
                progress,
                prepare=prepare,
                state=state,
                experts=recipe.experts,
                shard=shard,
            )
    finally:
        offload.finish(model)
    result = QuantizeResult(
        recipe, fingerprint if batches else None, layers, time.perf_counter() - t0, device=str(device)
    )
    if device.type == "cuda":
        result.peak_device_bytes = torch.cuda.max_memory_allocated(device)
    result.state = state
    if not layers:
        raise QuantkitError("the recipe selected no linear layer to quantize (check targets / ignore)")
    if gate is not None:
        result.gate = check_gate(gate, model, gate_windows, reference)
    model.quantkit = result
    return result
