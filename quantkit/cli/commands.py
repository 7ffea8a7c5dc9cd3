"""The quantize, eval and inspect commands."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click
import torch
from rich.table import Table

from quantkit.checkpoint.load import load_any
from quantkit.checkpoint.verify import DEFAULT_MAX_KL, DEFAULT_MIN_TOP1
from quantkit.cli.base import DTYPES, QuantkitCommand, device_name, stderr, stdout, torch_dtype
from quantkit.cli.progress import progress_bar
from quantkit.cli.serve import check_draft, draft_eval_options, measure_draft, print_draft
from quantkit.errors import GateFailedError, QuantkitError

__all__ = [  # progress_bar lived here before cli/progress.py; examples import it from here
    "eval_command",
    "export_command",
    "import_command",
    "inspect_command",
    "progress_bar",
    "quantize_command",
    "resolve_recipe",
    "verify_command",
]


# CLI flag -> (recipe section, key). Section "scheme" changes every stage's scheme, "calibration" the
# calibration, "params" the parameters of every stage that has that parameter.
FLAG_MAP = {
    "bits": ("scheme", "bits"),
    "group_size": ("scheme", "group_size"),
    "sym": ("scheme", "sym"),
    "act_static": ("scheme", "act_dynamic"),
    "act_fmt": ("scheme", "act_fmt"),
    "calib": ("calibration", "source"),
    "nsamples": ("calibration", "nsamples"),
    "seqlen": ("calibration", "seqlen"),
    "seed": ("calibration", "seed"),
    "bos": ("calibration", "bos"),
    "calib_chat_template": ("calibration", "chat_template"),
    "damp": ("params", "damp"),
    "block_size": ("params", "block_size"),
    "act_order": ("params", "act_order"),
    "static_groups": ("params", "static_groups"),
    "mse": ("params", "mse"),
    "alpha": ("params", "alpha"),
    "alpha_search": ("params", "alpha_search"),
    "grid": ("params", "grid"),
    "refine_steps": ("params", "refine_steps"),
    "clip": ("params", "clip"),
    "clip_qk": ("params", "clip_skip"),
    "clip_separate_ends": ("params", "clip_separate_ends"),
    "scale_grouped_values": ("params", "scale_grouped_values"),
}
# flags whose value is not the parameter's: --act-static sets act_dynamic false, --clip-qk empties clip_skip
FLAG_VALUES = {"act_static": lambda v: not v, "clip_qk": lambda v: [] if v else None}


def resolve_recipe(method: str | None, recipe_spec: str | None, flags: dict):
    """Recipe from --recipe or --method (default: the shipped 'default' recipe), CLI flags on top."""
    from quantkit.presets import check_preset_bits, preset_recipe
    from quantkit.recipe import load_recipe
    from quantkit.stages import stage_class

    if method and recipe_spec:
        raise QuantkitError("give either --method or --recipe, not both")
    changes: dict[str, dict] = {"scheme": {}, "calibration": {}, "params": {}}
    for flag, value in flags.items():
        if value is None:
            continue
        section, key = FLAG_MAP[flag]
        value = FLAG_VALUES.get(flag, lambda v: v)(value)
        if value is not None:
            changes[section][key] = value
    recipe = preset_recipe(method) if method else load_recipe(recipe_spec or "default")
    check_preset_bits(method, changes["scheme"].get("bits"))  # None: no preset, nothing to check
    known = {f for s in recipe.stages for f in stage_class(s.method).Params.__dataclass_fields__}
    stray = sorted(set(changes["params"]) - known)
    if stray:
        flag = "--" + stray[0].replace("_", "-")
        methods = ", ".join(s.method for s in recipe.stages)
        raise QuantkitError(f"{flag} does not apply to this recipe's methods ({methods})")
    return recipe.with_overrides(changes["scheme"], changes["calibration"], changes["params"])


def summary_table(recipe, model_spec: str, device: str, dtype: torch.dtype, out: Path, offload: bool) -> Table:
    table = Table(title="quantkit quantize: resolved configuration", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("model", model_spec)
    table.add_row("output", str(out))
    table.add_row("device / dtype", f"{device} / {str(dtype).removeprefix('torch.')}")
    table.add_row("float layers", "read from disk one at a time (--offload)" if offload else "all in memory")
    table.add_row("recipe", recipe.name or "(unnamed)")
    for i, s in enumerate(recipe.stages):
        params = {k: v for k, v in (s.params.__dict__ if s.params else {}).items()}
        scheme = s.scheme.name if s.scheme else "-"
        table.add_row(f"stage {i + 1}", f"{s.method}  scheme={scheme}  {params if params else ''}")
    if recipe.needs_calibration:
        c = recipe.calibration
        bos = {"auto": "BOS where the tokenizer adds it", True: "BOS", False: "no BOS"}[c.bos]
        chat = ", chat template" if c.chat_template else ""
        table.add_row("calibration", f"{c.source}: {c.nsamples} x {c.seqlen} tokens, seed {c.seed}, {bos}{chat}")
    else:
        table.add_row("calibration", "not needed")
    return table


@click.command("quantize", cls=QuantkitCommand)
@click.option("--model", default="smollm2-135m", show_default=True, help="HF folder, .gguf file or built-in name.")
@click.option("--method", default=None, help="Preset: rtn, gptq, awq, awq+gptq, w8a8, w4a8, w4a8-progressive, ...")
@click.option("--recipe", "recipe_spec", default=None, help="A YAML recipe file or shipped recipe name.")
@click.option(
    "--out", type=click.Path(path_type=Path), required=True, help="Output checkpoint folder (made with its parents)."
)
@click.option("--bits", type=int, default=None)
@click.option("--group-size", type=int, default=None, help="Input channels per scale; -1 = per-channel.")
@click.option("--sym/--asym", default=None, help="Symmetric or asymmetric (integer zero point).")
@click.option("--calib", default=None, help="Calibration text: shipped name, files, or hf:NAME[:CONFIG][:SPLIT].")
@click.option("--nsamples", type=int, default=None)
@click.option("--seqlen", type=int, default=None)
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=None)
@click.option(
    "--bos/--no-bos",
    default=None,
    help="Start every calibration window with BOS (default: where the tokenizer adds it, e.g. Llama 3, Gemma).",
)
@click.option(
    "--calib-chat-template",
    is_flag=True,
    default=None,
    help="Render calibration text through the tokenizer's chat template (user / assistant turns; instruct models).",
)
@click.option("--damp", type=float, default=None, help="GPTQ dampening (fraction of mean diag H).")
@click.option("--block-size", type=int, default=None, help="GPTQ lazy-update block size.")
@click.option("--act-order/--no-act-order", default=None, help="GPTQ: columns by decreasing diag(H).")
@click.option(
    "--static-groups/--no-static-groups",
    default=None,
    help="GPTQ: groups of consecutive inputs with grids fixed up front (exports to every format), or groups formed "
    "in act-order (g_idx; exports to gptq only). Default: static at 4 and 8 bits.",
)
@click.option(
    "--mse/--no-mse",
    default=None,
    help="GPTQ: clip every group's grid where that lowers its error, or never (default: at 4 and 8 bits chosen "
    "per linear by the output error on held-out calibration windows; below 4 bits clipped).",
)
@click.option("--alpha", type=float, default=None, help="SmoothQuant migration strength.")
@click.option("--alpha-search/--no-alpha-search", default=None, help="SmoothQuant: search alpha per layer.")
@click.option("--act-static", is_flag=True, default=None, help="W8A8: static per-tensor activation scales.")
@click.option("--act-fmt", type=click.Choice(["int", "fp8"]), default=None, help="W4A8: int8 or e4m3 activations.")
@click.option("--grid", type=int, default=None, help="AWQ: scale-search grid size.")
@click.option("--refine-steps", type=int, default=None,
              help="AWQ: Adam steps refining each channel's scale after the grid (default 50; 0: none).")  # fmt: skip
@click.option("--clip/--no-clip", default=None, help="AWQ: clipping search.")
@click.option("--clip-qk", is_flag=True, default=None, help="AWQ: clip q_proj and k_proj too (skipped by default).")
@click.option(
    "--clip-separate-ends/--no-clip-separate-ends",
    default=None,
    help="AWQ: after the common shrink, shrink each end of an asymmetric range alone.",
)
@click.option(
    "--scale-grouped-values/--no-scale-grouped-values",
    default=None,
    help="AWQ: scale v_proj -> o_proj under grouped-query heads too (one scale per value channel).",
)
@click.option("--device", default=None, help="Where layers are processed (default: cuda if available).")
@click.option("--dtype", type=click.Choice(["auto", *DTYPES]), default="auto", show_default=True)
@click.option(
    "--offload/--no-offload",
    default=None,
    help="Read each decoder layer from the model's files only when its turn comes (default: on for safetensors).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run from its last complete layer.")
@click.option("--no-resume-state", is_flag=True, help="Do not save resume state (beside --out) after each layer.")
@click.option("--dry-run", is_flag=True, help="Print the plan and its estimates, read no weights, write nothing.")
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True, help="Processes that share the "
              "calibration (one GPU each with NCCL, or gloo on the CPU); under torchrun, its processes.")  # fmt: skip
@click.option("--dist-timeout", type=click.IntRange(min=1), default=1800, show_default=True,
              help="Seconds a process waits for the others at a collective before the run stops.")  # fmt: skip
def quantize_command(
    model, method, recipe_spec, out, device, dtype, offload, overwrite, resume, no_resume_state, dry_run, nproc,
    dist_timeout, **flags,
) -> None:  # fmt: skip
    """Quantize a model and save a self-describing checkpoint."""
    arguments = {k: v for k, v in locals().items() if k != "flags"} | flags
    import quantkit
    from quantkit import distributed
    from quantkit.checkpoint.save import check_apart, check_output
    from quantkit.pipeline import recipe_windows

    out = check_output(out, overwrite)  # before any work: a bad output path fails first
    if resume and no_resume_state:
        raise QuantkitError("--resume continues from the resume state that --no-resume-state turns off")
    ranks = distributed.check_processes(nproc, device_name(device))  # processes in all (torchrun's too)
    state_dir = None if no_resume_state else out.with_name(f".{out.name}.resume")
    device = device_name(device)
    dtype = torch_dtype(dtype, device)
    recipe = resolve_recipe(method, recipe_spec, flags)
    folder = quantkit.models.loading.resolve_model(model)  # bad input fails here, before any heavy work
    check_apart(out, folder)
    quantkit.models.loading.check_supported(folder)
    if offload is None:
        offload = any(folder.glob("*.safetensors"))
    from quantkit.plan import check_fits, make_plan, probe_seconds

    plan = make_plan(folder, recipe, device, dtype, offload, resume_state=state_dir is not None)
    if dry_run:
        plan.seconds = probe_seconds(folder, recipe, plan, dtype)
        click.echo("\n".join(plan.lines()))
        return
    check_fits(plan, out)  # stop now, not hours later, when the memory or the disk cannot hold the run
    if nproc > 1:  # each new process runs this command as one rank (below)
        return distributed.launch(nproc, quantize_rank, {**arguments, "nproc": 1})
    if ranks > 1:
        device = distributed.init_from_env(device, dist_timeout)
    t0 = time.perf_counter()
    float_model, tokenizer, folder = quantkit.load_model(
        folder, dtype=dtype, offload=offload, scratch_dir=next(p for p in out.parents if p.is_dir())
    )  # converted weights (fused experts) wait beside the output, on the disk the user chose
    calib = fingerprint = None
    if recipe.needs_calibration:  # cut the windows now so that too little text fails before any output
        calib, fingerprint = recipe_windows(recipe, float_model, tokenizer)
    stdout.print(summary_table(recipe, model, device, dtype, out, offload))
    n_layers = len(float_model.get_submodule(quantkit.models.arch_for(float_model).layers))
    with progress_bar(distributed.is_main()) as bar, distributed.named_failures():
        task = bar.add_task("quantizing", total=n_layers, note="")
        result = quantkit.quantize(
            float_model,
            recipe,
            calib,
            fingerprint=fingerprint,
            tokenizer=tokenizer,
            device=device,
            state_dir=state_dir,
            resume=resume,
            progress=lambda done, total, note: bar.update(task, completed=done, note=note),
        )
    float_model.quantkit.source_model = str(folder)
    if not distributed.is_main():  # rank 0 alone writes and reports
        return
    state = result.state
    if state is not None and state.resumed:
        stdout.print(f"resumed: {state.resumed} of {n_layers} layers restored from {state.folder}")
    if state is not None and state.saves:
        stdout.print(f"resume state: {state.bytes_written / state.saves / 2**20:.1f} MiB and "
                     f"{state.seconds / state.saves:.2f}s a layer")  # fmt: skip
    if result.gate is not None:
        g = result.gate
        verdict = "passed" if g["passed"] else "FAILED"
        stdout.print(f"gate: {verdict} (KL {g['kl']:.4f}, top-1 {g['top1_agreement']:.3f}, perplexity "
                     f"{g['ppl_increase']:+.2%} on {g['tokens']} tokens)")  # fmt: skip
    try:
        path = quantkit.save_quantized(float_model, out, tokenizer=tokenizer, overwrite=overwrite)
    except QuantkitError as exc:
        if state is None or isinstance(exc, GateFailedError):
            raise
        raise QuantkitError(f"{exc} (the quantized layers stay in {state.folder}: rerun with --resume)") from None
    stdout.print(
        f"[green]saved[/] {path}  ({len(result.layers)} linears quantized in {result.seconds:.1f}s, "
        f"total {time.perf_counter() - t0:.1f}s)"
    )
    from quantkit.checkpoint.export import export_formats

    stored = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    if stored > EXPORT_CHECK_BYTES:  # the check converts every tensor in memory: too much after a large model
        stdout.print("exports to: run `quantkit export` to check each format (the check reads the whole checkpoint)")
    else:
        formats = export_formats(path)
        can = [f for f, reason in formats.items() if reason is None]
        cannot = "; ".join(f"not {f}: {reason}" for f, reason in formats.items() if reason is not None)
        stdout.print(f"exports to: {', '.join(can) or 'no other format'}" + (f" ({cannot})" if cannot else ""))
    from quantkit.checkpoint.smoothing import outlier_rows

    ratios = [
        (r["outlier_before"], r["outlier_after"])
        for r in outlier_rows(result.layers)
        if None not in (r["outlier_before"], r["outlier_after"])
    ]
    if ratios:  # the checkpoint's smoothing.md holds the whole table
        before, after = (statistics.median(x) for x in zip(*ratios, strict=True))
        stdout.print(
            f"smoothing: median activation outlier ratio {before:.1f} -> {after:.1f} over {len(ratios)} groups "
            f"(table: {path / 'smoothing.md'})"
        )


def quantize_rank(**arguments) -> None:
    """One rank of ``quantize --nproc N``, in a process that :func:`quantkit.distributed.launch` started."""
    quantize_command.callback(**arguments)


@click.command("eval", cls=QuantkitCommand)
@click.option(
    "--model", required=True, help="quantkit or compressed-tensors checkpoint, HF folder, .gguf or built-in name."
)
@click.option("--baseline", default=None, help="Float model to compare against (KL, top-1 agreement).")
@click.option("--data", "source", default="moby-dick", show_default=True, help="Evaluation text.")
@click.option("--seqlen", type=click.IntRange(min=2), default=512, show_default=True)
@click.option(
    "--windows", type=click.IntRange(min=0), default=40, show_default=True, help="Number of windows (0 = all)."
)
@click.option("--device", default=None)
@click.option("--dtype", type=click.Choice(["auto", *DTYPES]), default="auto", show_default=True)
@click.option(
    "--bos/--no-bos", default=None, help="Start every window with BOS (default: where the tokenizer adds it)."
)
@click.option(
    "--chat-template",
    is_flag=True,
    help="Render each window through the tokenizer's chat template as a user turn and the assistant's answer "
    "(as --calib-chat-template does; instruct models).",
)
@draft_eval_options
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of a table.")
def eval_command(model, baseline, source, seqlen, windows, device, dtype, bos, chat_template, as_json, **draft) -> None:
    """Perplexity (and KL / top-1 agreement against a float baseline); with --draft, the heads' acceptance length."""
    from quantkit.calib.data import evaluation_windows
    from quantkit.eval import evaluate_windows

    device = device_name(device)
    dtype = torch_dtype(dtype, device)
    m, tokenizer = load_any(model, dtype, device)
    check_draft(m, **draft)  # bad heads, or heads of another model, fail before the evaluation
    base = load_any(baseline, dtype, device)[0] if baseline else None
    if base is not None and base.config.vocab_size != m.config.vocab_size:
        raise QuantkitError(
            f"--baseline {baseline} has a vocabulary of {base.config.vocab_size} tokens, the model "
            f"{m.config.vocab_size}: KL and top-1 agreement need the same tokenizer"
        )
    limit = getattr(m.config, "max_position_embeddings", None)
    if limit is not None and seqlen > limit:
        raise QuantkitError(f"--seqlen {seqlen} is longer than the model's {limit} positions")
    bos = "auto" if bos is None else bos
    ids, protocol = evaluation_windows(tokenizer, source, seqlen, windows or None, bos, chat_template=chat_template)
    t0 = time.perf_counter()
    with progress_bar() as bar:
        task = bar.add_task("evaluating", total=len(ids), note="")
        result = evaluate_windows(m, ids, base, progress=lambda d, t: bar.update(task, completed=d))
    report = {
        "model": model,
        "baseline": baseline,
        **result.to_dict(),
        "protocol": protocol,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    measure_draft(m, tokenizer, ids, device, report, **draft)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    table = Table(title=f"quantkit eval on {protocol['source']} ({result.tokens} predictions, seqlen {seqlen})")
    for col in ("model", "perplexity", "KL vs baseline", "top-1 agreement"):
        table.add_column(col)
    if base is not None:
        table.add_row(f"{baseline} (baseline)", f"{result.baseline_perplexity:.3f}", "-", "-")
    table.add_row(
        model,
        f"{result.perplexity:.3f}",
        f"{result.kl:.4f}" if result.kl is not None else "-",
        f"{result.top1_agreement:.3f}" if result.top1_agreement is not None else "-",
    )
    stdout.print(table)
    print_draft(report)


EXPORT_CHECK_BYTES = 2 << 30  # quantize reports the formats a checkpoint exports to up to this size of tensors


@click.command("inspect", cls=QuantkitCommand)
@click.argument("folder", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True)
@click.option("--kernels", is_flag=True, help="Which kernel and config serve each layer shape at a few M.")
@click.option("--ms", default="1,16,64,256,1024", show_default=True, help="With --kernels: rows per product.")
@click.option(
    "--gpu", default="auto", show_default=True, type=click.Choice(["auto", "cuda", "cpu", "h100", "h200"]),
    help="With --kernels: the device asked about (auto: this GPU, else an H100's rules).",
)  # fmt: skip
def inspect_command(folder: Path, as_json: bool, kernels: bool, ms: str, gpu: str) -> None:
    """Per-layer scheme, bytes and compression ratio of a quantkit checkpoint (reads only metadata); with
    --kernels, the kernel that serves each layer shape (quantkit.kernels.explain)."""
    from quantkit.checkpoint.inspect import inspect_checkpoint, kernel_choices

    info = inspect_checkpoint(folder)
    given = click.get_current_context().get_parameter_source
    if not kernels and any(given(name).name == "COMMANDLINE" for name in ("ms", "gpu")):
        raise QuantkitError("--ms and --gpu go with --kernels")
    if kernels:
        try:
            m_values = [int(m) for m in ms.split(",")]
        except ValueError:
            raise QuantkitError(f"--ms must be comma-separated integers, got {ms!r}") from None
        if any(m < 1 for m in m_values):
            raise QuantkitError(f"--ms values must be >= 1, got {ms!r}")
        rows = kernel_choices(info, m_values, gpu)
        if as_json:
            click.echo(json.dumps(rows, indent=2))
        for row in [] if as_json else rows:
            click.echo(f"[{row['modules']} modules] {row['kernel']}")
        return
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    table = Table(title=f"{folder}  ({info['architecture']}, format v{info['format_version']})")
    for col in ("module", "scheme", "layout", "shape [N, K]", "bytes", "fp16 bytes", "ratio"):
        table.add_column(col, justify="right" if col in ("bytes", "fp16 bytes", "ratio") else "left")
    for row in info["modules"]:
        table.add_row(
            row["name"],
            row["scheme"],
            row["layout"],
            f"{row['shape'][0]} x {row['shape'][1]}",
            f"{row['bytes']:,}",
            f"{row['fp16_bytes']:,}",
            f"{row['ratio']:.2f}x",
        )
    t = info["totals"]
    table.add_row(
        "[bold]quantized linears", "", "", "", f"{t['quantized_bytes']:,}", f"{t['fp16_bytes']:,}", f"{t['ratio']:.2f}x"
    )
    stdout.print(table)
    stdout.print(
        f"whole checkpoint: {t['file_bytes']:,} bytes of tensors; recipe: {info['recipe']}; "
        f"calibration: {info['calibration']}; versions: {info['versions']}"
    )
    if info["mtp"]:  # multi-token-prediction layers carried over from the source (checkpoint/mtp.py)
        m = info["mtp"]
        stdout.print(f"MTP layers {', '.join(m['layers'])}: {m['tensors']} tensors, {m['mode']}"
                     + (f" ({len(m['modules'])} quantized linears)" if m.get("modules") else ""))  # fmt: skip
    for row in info["experts"]:  # calibration coverage of MoE experts (quant_report.json)
        stdout.print(f"{row['experts']}.{row['expert']}: {row['tokens']} calibration tokens routed, "
                     f"statistics: {row['statistics']}")  # fmt: skip


@click.command("export", cls=QuantkitCommand)
@click.argument("folder", type=click.Path(path_type=Path))
@click.option(
    "--format", "fmt", type=click.Choice(["compressed-tensors", "gptq", "awq", "fp8"]), required=True,
    help="compressed-tensors (vLLM, transformers + compressed-tensors; every scheme but act-order), gptq"
    " (checkpoint format v1: one weight-only integer scheme, act-order included), awq (GEMM: 4-bit groups) or fp8"
    " (DeepSeek-V3's block-wise layout, for w8a8-fp8-block).",
)  # fmt: skip
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Folder to write (made with its parents).")
@click.option("--overwrite", is_flag=True, help="Replace --out if it holds a checkpoint (or is empty).")
def export_command(folder: Path, fmt: str, out: Path, overwrite: bool) -> None:
    """Re-encode a quantkit checkpoint in a format other tools serve; the integers are copied, not re-quantized."""
    from quantkit.checkpoint.export import export_checkpoint

    with stderr.status(f"exporting {folder} as {fmt}"):
        done = export_checkpoint(folder, out, fmt, overwrite=overwrite)
    stdout.print(f"wrote {done.path} ({fmt}, {done.modules} quantized linears)")


@click.command("import", cls=QuantkitCommand)
@click.argument("folder", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Folder to write (made with its parents).")
@click.option("--overwrite", is_flag=True, help="Replace --out if it holds a checkpoint (or is empty).")
def import_command(folder: Path, out: Path, overwrite: bool) -> None:
    """Make a quantkit checkpoint of a GPTQ (v1 / v2), AWQ (GEMM) or compressed-tensors one, without
    re-quantizing, so that quantkit's eval, inspect, generate and bench-serve can run it."""
    from quantkit.checkpoint.foreign import import_checkpoint

    with stderr.status(f"importing {folder}"):
        done = import_checkpoint(folder, out, overwrite=overwrite)
    note = ""
    if done.scale_change:
        note = f"; scales stored as fp16 moved by up to {done.scale_change:.2e} (relative)"
    stdout.print(f"wrote {done.path} (from {done.method}, {done.modules} quantized linears{note})")


@click.command("verify", cls=QuantkitCommand)
@click.argument("folder", type=click.Path(path_type=Path))
@click.option("--baseline", default=None, help="Float model to compare with on a few windows (KL, top-1 agreement).")
@click.option("--max-kl", type=float, default=DEFAULT_MAX_KL, show_default=True, help="With --baseline: largest KL.")
@click.option("--min-top1", type=float, default=DEFAULT_MIN_TOP1, show_default=True, help="With --baseline.")
@click.option("--windows", type=click.IntRange(min=1), default=4, show_default=True, help="With --baseline.")
@click.option("--seqlen", type=click.IntRange(min=2), default=256, show_default=True, help="With --baseline.")
@click.option("--device", default=None, help="With --baseline: where both models run (default: cuda if available).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of the one-line verdict.")
def verify_command(folder, baseline, max_kl, min_top1, windows, seqlen, device, as_json) -> None:
    """Check that a quantkit, GPTQ, AWQ, compressed-tensors or fp8 checkpoint holds what its config says (exit 0: it
    passes, 1: a check fails, 2: it cannot be verified)."""
    from quantkit.checkpoint.verify import verify_checkpoint

    device = device_name(device) if baseline else "cpu"
    verdict = verify_checkpoint(folder, baseline, windows=windows, seqlen=seqlen, max_kl=max_kl, min_top1=min_top1,
                                device=device)  # fmt: skip
    click.echo(json.dumps(verdict.to_dict(), indent=2) if as_json else verdict.line())
    if not verdict.ok:
        raise SystemExit(1)
