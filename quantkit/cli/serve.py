"""The ``generate`` and ``bench-serve`` commands: thin wrappers over ``quantkit.runtime``."""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path

import click

from quantkit.cli.base import QuantkitCommand, device_name
from quantkit.errors import QuantkitError
from quantkit.runtime.config import DTYPES, EngineConfig
from quantkit.runtime.sampling_params import SamplingParams
from quantkit.train_draft import PRECISIONS, TrainDraftConfig

DUMMY_PREFIX = "dummy:"


def _defaults(cls) -> dict:
    return {f.name: f.default for f in fields(cls)}


ENGINE = _defaults(EngineConfig)
SAMPLING = _defaults(SamplingParams)


def _speculative(settings: dict):
    """The ``SpeculativeConfig`` the --speculative options ask for (None without --speculative); takes them out of
    ``settings``."""
    from quantkit.runtime.speculative.config import SpeculativeConfig

    spec = {name: settings.pop(option) for option, name in SPEC_OPTIONS.items()}
    method = spec.pop("method")
    given = sorted(option for option, name in SPEC_OPTIONS.items() if name != "method" and spec[name] is not None)
    if method is None:
        if given:
            raise QuantkitError(f"--{given[0].replace('_', '-')} needs --speculative")
        return None
    return SpeculativeConfig(method=method, **{k: v for k, v in spec.items() if v is not None})


def _engine(model: str, **settings):
    """An LLM for a model folder, quantkit checkpoint, .gguf, built-in name, or ``dummy:<shape>``."""
    from quantkit.runtime import LLM
    from quantkit.runtime.bench import DUMMY_MODELS

    speculative = _speculative(settings)
    settings = {k: v for k, v in settings.items() if v is not None}
    if speculative is not None:
        settings["speculative"] = speculative
    if "device" in settings:
        settings["device"] = device_name(settings["device"])
    if model.startswith(DUMMY_PREFIX):
        shape = model.removeprefix(DUMMY_PREFIX)
        if shape not in DUMMY_MODELS:
            raise QuantkitError(f"unknown dummy model {shape!r}; available: {', '.join(sorted(DUMMY_MODELS))}")
        return LLM(DUMMY_MODELS[shape], **settings)
    from quantkit.models.loading import resolve_model

    return LLM(str(resolve_model(model)), **settings)


def engine_options(f):
    d = ENGINE
    options = [
        click.option(
            "--model",
            default="smollm2-135m",
            show_default=True,
            help="HF folder, quantkit checkpoint, .gguf, built-in name, or dummy:<shape> (random weights).",
        ),
        click.option("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when available)."),
        click.option("--dtype", type=click.Choice(DTYPES), default=d["dtype"], show_default=True),
        click.option("--max-num-seqs", type=int, default=d["max_num_seqs"], show_default=True),
        click.option("--max-num-batched-tokens", type=int, default=d["max_num_batched_tokens"], show_default=True),
        click.option("--max-model-len", type=int, default=None, help="Default: the model's, capped at 32768."),
        click.option("--num-kv-blocks", type=int, default=None, help="Default: from free GPU memory; CPU: 1024."),
        click.option("--gpu-memory-utilization", type=float, default=d["gpu_memory_utilization"], show_default=True),
        click.option("--enforce-eager", is_flag=True, help="No CUDA graphs."),
        click.option(
            "--fp8-fast-accum",
            is_flag=True,
            help="fp8 W8A8 layers (CUDA) accumulate in the tensor cores' reduced precision instead of promoting every "
            "128 products: ~1.1x faster at M >= 1024 on the H200 (1.61x against 1.46x bf16), +0.06-0.65% error against "
            "the unquantized product.",
        ),
        click.option(
            "--async-scheduling/--no-async-scheduling",
            default=d["async_scheduling"],
            show_default=True,
            help="Launch each step before the previous step's tokens reach the host (same outputs).",
        ),
    ]
    options += [
        click.option("--speculative", "spec_method", default=None,
                     type=click.Choice(["draft", "self", "ngram", "eagle", "medusa", "mtp"]),
                     help="Speculative decoding: draft tokens with a draft model (--draft-model), the "
                     "target's own weights quantized (self), prompt lookup (ngram), draft heads made by train-draft "
                     "(eagle, medusa: --draft-model is their folder), or the checkpoint's own multi-token-prediction "
                     "layers (mtp: DeepSeek-V3's), and verify them losslessly."),
        click.option("--num-spec-tokens", type=int, default=None, help="Most tokens drafted per step (default 4)."),
        click.option("--draft-model", default=None,
                     help="draft: the draft model's folder; self: a quantkit checkpoint of the same model "
                     "(default: quantize the target in memory to --draft-scheme); eagle, medusa: the heads' folder."),
        click.option("--draft-scheme", default=None, help="self: RTN scheme of the draft (default w4a16-g128)."),
        click.option("--draft-layers", type=int, default=None, help="self: keep only the first L layers."),
        click.option("--num-tree-tokens", type=int, default=None,
                     help="eagle, medusa: draft a tree of up to this many tokens (at most 63; --num-spec-tokens deep) "
                     "instead of a chain, verified in one step."),
        click.option("--tree-topk", type=int, default=None,
                     help="eagle, medusa with --num-tree-tokens: candidates per expanded node or head (default 8)."),
        click.option("--draft-vocab-size", type=int, default=None,
                     help="eagle: greedy chains and trees draft only the N most frequent tokens of the heads' "
                     "training text (a draft vocabulary: N lm_head rows read per drafted token)."),
        click.option("--spec-decoding-acceptance-method",
                     type=click.Choice(["rejection_sampler", "typical_acceptance_sampler"]), default=None,
                     help="Draft trees, sampled requests: the lossless rule (rejection_sampler, default) or Medusa's "
                     "typical acceptance (LOSSY: output no longer follows the target's distribution)."),
        click.option("--typical-acceptance-sampler-posterior-threshold", type=float,
                     default=None, help="typical_acceptance_sampler: epsilon, the probability cap (default 0.09)."),
        click.option("--typical-acceptance-sampler-posterior-alpha", type=float, default=None,
                     help="typical_acceptance_sampler: delta, the entropy factor (default 0.3)."),
        click.option("--spec-adaptive/--spec-fixed", "spec_adaptive", default=None,
                     help="Adapt k to the acceptance and pause speculation where it costs more than it gains "
                     "(default), or draft k tokens every step."),
    ]  # fmt: skip
    for option in reversed(options):
        f = option(f)
    return f


SPEC_OPTIONS = {  # option name -> SpeculativeConfig field
    "spec_method": "method",
    "num_spec_tokens": "num_speculative_tokens",
    "draft_model": "draft",
    "draft_scheme": "draft_scheme",
    "draft_layers": "draft_layers",
    "spec_adaptive": "adaptive",
    "num_tree_tokens": "num_tree_tokens",
    "tree_topk": "tree_topk",
    "draft_vocab_size": "draft_vocab_size",
    "spec_decoding_acceptance_method": "acceptance_method",
    "typical_acceptance_sampler_posterior_threshold": "posterior_threshold",
    "typical_acceptance_sampler_posterior_alpha": "posterior_alpha",
}


def draft_eval_options(f):
    """``eval``'s options for the acceptance length of draft heads (``quantkit.eval.acceptance``)."""
    options = [
        click.option("--draft", default=None, type=click.Path(path_type=Path),
                     help="Draft heads (train-draft's folder): also report their mean acceptance length tau, tokens "
                     "per verify step of greedy speculative decoding on the evaluation windows."),
        click.option("--num-spec-tokens", type=click.IntRange(1, 64), default=4, show_default=True,
                     help="With --draft: tokens drafted per verify step (a chain)."),
        click.option("--num-tree-tokens", type=click.IntRange(1, 63), default=None,
                     help="With --draft: draft a tree of up to this many tokens (--num-spec-tokens deep) instead."),
        click.option("--draft-new-tokens", type=click.IntRange(min=2), default=64, show_default=True,
                     help="With --draft: greedy tokens generated after each window's first half."),
    ]  # fmt: skip
    for option in reversed(options):
        f = option(f)
    return f


def check_draft(model, draft, num_spec_tokens, num_tree_tokens, draft_new_tokens) -> None:
    """One-line errors for ``eval``'s draft options, and for heads made for another model than ``model``."""
    from quantkit.eval.acceptance import check_heads

    if draft is None:
        if num_tree_tokens is not None:
            raise QuantkitError("--num-tree-tokens needs --draft")
        return
    check_heads(model, draft)


def measure_draft(model, tokenizer, windows, device, report: dict, draft, num_spec_tokens, num_tree_tokens,
                  draft_new_tokens) -> None:  # fmt: skip
    """``eval --draft``: the heads' acceptance on ``model`` over the evaluation ``windows`` -> ``report["draft"]``."""
    if draft is None:
        return
    from quantkit.cli.progress import progress_bar
    from quantkit.eval.acceptance import acceptance_length

    with progress_bar() as bar:
        bar.add_task("drafting and verifying", total=None, note=str(draft))
        result = acceptance_length(model, tokenizer, windows, draft, num_spec_tokens, draft_new_tokens,
                                   num_tree_tokens, device)  # fmt: skip
    report["draft"] = {"heads": str(draft), **result.to_dict()}


def print_draft(report: dict) -> None:
    d = report.get("draft")
    if d is None:
        return
    k = d["num_speculative_tokens"]
    shape = f"tree of {d['num_tree_tokens']}, depth {k}" if d["num_tree_tokens"] else f"chain of {k}"
    click.echo(
        f"draft {d['heads']} ({d['method']}, {shape}): tau {d['tau']:.3f} tokens per verify step, acceptance "
        f"{100 * d['acceptance_rate']:.1f}% over {d['verify_steps']} steps ({d['prompts']} prompts of "
        f"{d['prompt_tokens']} tokens, {d['new_tokens']} greedy tokens each, {d['seconds']:.0f} s)"
    )


@click.command("generate", cls=QuantkitCommand)
@click.argument("prompts", nargs=-1, required=True)
@engine_options
@click.option("--max-tokens", type=int, default=SAMPLING["max_tokens"], show_default=True)
@click.option("--temperature", type=float, default=SAMPLING["temperature"], show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=SAMPLING["top_k"], show_default=True, help="0 = off.")
@click.option("--top-p", type=float, default=SAMPLING["top_p"], show_default=True)
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=SAMPLING["seed"])
@click.option("-n", "n", type=int, default=SAMPLING["n"], show_default=True, help="Completions per prompt.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per prompt instead of text.")
@click.option("--token-ids", is_flag=True, help="PROMPTS are space-separated token ids (models with no tokenizer).")
def generate_command(prompts, model, max_tokens, temperature, top_k, top_p, seed, n, as_json, token_ids, **settings):
    """Complete PROMPTS with the paged runtime; streams the text of a single prompt as it is generated."""
    if token_ids:
        try:
            prompts = [[int(t) for t in p.split()] for p in prompts]
        except ValueError:
            raise QuantkitError("--token-ids prompts must be space-separated integers") from None
    llm = _engine(model, **settings)
    params = SamplingParams(n=n, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_tokens=max_tokens)
    if len(prompts) == 1 and n == 1 and not as_json and llm.tokenizer is not None:
        tokens, shown = [], ""
        for event in llm.stream(list(prompts), params):
            tokens.append(event.token_id)
            text = llm.tokenizer.decode(tokens, skip_special_tokens=True)
            click.echo(text[len(shown) :], nl=False)
            shown = text
        click.echo()
        return
    for prompt, out in zip(prompts, llm.generate(list(prompts), params), strict=True):
        if as_json:
            click.echo(json.dumps({"prompt": prompt, "completions": [asdict(c) for c in out.outputs]}))
        else:
            for c in out.outputs:
                click.echo(f"[{c.index}] {c.text if c.text is not None else c.token_ids}")


@click.command("bench-serve", cls=QuantkitCommand)
@engine_options
@click.option("--num-requests", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--min-input-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--max-input-len", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--output-len", type=int, default=256, show_default=True)
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True)
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), default=None, help="JSON results.")
def bench_serve_command(num_requests, min_input_len, max_input_len, output_len, seed, out_path, model, **settings):
    """Offline throughput of the paged runtime: random prompts, all submitted at once, EOS ignored."""
    from quantkit.runtime.bench import kernel_names, offline_throughput, random_workload

    if min_input_len > max_input_len:
        raise QuantkitError(f"--min-input-len {min_input_len} is above --max-input-len {max_input_len}")
    if out_path is not None and not out_path.expanduser().resolve().parent.is_dir():
        raise QuantkitError(f"cannot write {out_path}: its folder does not exist")
    llm = _engine(model, **settings)
    prompts = random_workload(num_requests, min_input_len, max_input_len, llm.model.config.vocab_size, seed)
    result, _ = offline_throughput(llm, prompts, output_len)
    row = {"model": model, **result.to_dict()}
    click.echo(
        f"{result.requests} requests, {result.prompt_tokens} prompt + {result.output_tokens} output tokens in "
        f"{result.seconds:.2f} s: {result.output_tok_s:.1f} output tok/s, {result.total_tok_s:.1f} total tok/s, "
        f"KV waste {100 * result.kv_waste:.2f}%, {result.preemptions} preemptions"
    )
    if llm.spec is not None:
        t = llm.spec.totals
        row["speculative"] = {"acceptance_rate": t.acceptance_rate, "tokens_per_verify": t.emitted / max(t.steps, 1),
                              "verify_steps": t.steps, "paused_steps": t.paused_steps, "draft_seconds": t.draft_time,
                              "speculative_step_seconds": t.step_time}  # fmt: skip
        click.echo(
            f"speculative: acceptance {100 * t.acceptance_rate:.1f}%, {t.emitted / max(t.steps, 1):.2f} tokens per "
            f"verify step over {t.steps} steps ({t.paused_steps} paused), drafting {t.draft_time:.2f} s of "
            f"{t.step_time:.2f} s in speculative steps"
        )
    if result.compiles:
        names = kernel_names(result.compiled)
        click.echo(
            f"warning: {result.compiles} Triton kernels compiled inside the timed run ({names}); the figure is too low"
        )
    if out_path is not None:
        out_path.write_text(json.dumps(row, indent=2))


TRAIN = _defaults(TrainDraftConfig)


@click.command("train-draft", cls=QuantkitCommand)
@click.option("--model", required=True, help="The target: HF folder, quantkit checkpoint, .gguf or built-in name.")
@click.option("--method", type=click.Choice(["eagle", "medusa"]), required=True, help="Which draft heads.")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="The heads' folder.")
@click.option(
    "--data",
    multiple=True,
    default=TRAIN["data"],
    show_default=True,
    help="Training text (repeatable): a shipped name, local files, or hf:NAME[:CONFIG][:SPLIT].",
)
@click.option(
    "--tokens",
    type=click.IntRange(min=0),
    default=TRAIN["tokens"],
    show_default=True,
    help="Training tokens (a held-out share comes on top); 0: all of the text.",
)
@click.option(
    "--num-heads",
    type=click.IntRange(min=1),
    default=TRAIN["num_heads"],
    show_default=True,
    help="medusa: heads K (tokens t+2 .. t+K+1).",
)
@click.option("--seqlen", type=click.IntRange(min=2), default=TRAIN["seqlen"], show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=TRAIN["batch_size"], show_default=True)
@click.option("--epochs", type=click.IntRange(min=1), default=TRAIN["epochs"], show_default=True)
@click.option("--lr", type=float, default=TRAIN["lr"], show_default=True)
@click.option(
    "--val-fraction",
    type=float,
    default=TRAIN["val_fraction"],
    show_default=True,
    help="Held-out windows, as a share of the training ones.",
)
@click.option(
    "--save-every",
    type=click.IntRange(min=1),
    default=TRAIN["save_every"],
    show_default=True,
    help="Steps between resume states.",
)
@click.option(
    "--loss-positions",
    type=click.IntRange(min=0),
    default=TRAIN["loss_positions"],
    show_default=True,
    help="Positions per window where the training loss is taken; 0: all.",
)
@click.option("--unroll", type=click.IntRange(min=1), default=TRAIN["unroll"], show_default=True,
              help="eagle: drafting steps trained in a row, each on its predecessors' features.")  # fmt: skip
@click.option(
    "--self-distill",
    type=click.IntRange(min=1),
    default=TRAIN["self_distill"],
    help="Train on about this many tokens the target writes itself from passages of --data, not on --data.",
)
@click.option(
    "--precision",
    type=click.Choice(PRECISIONS),
    default=TRAIN["precision"],
    show_default=True,
    help="bf16: autocast; auto: bf16 on a GPU, fp32 on the CPU.",
)
@click.option("--resume", is_flag=True, help="Continue the run whose state is in --out.")
@click.option("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when available).")
@click.option("--seed", type=click.IntRange(min=0), default=TRAIN["seed"], show_default=True)
def train_draft_command(model, method, out, resume, device, tokens, loss_positions, **settings):
    """Train Medusa or EAGLE draft heads on the target's own hidden states (self-distilled), for --speculative."""
    from quantkit.cli.progress import progress_bar
    from quantkit.train_draft import train_draft

    config = TrainDraftConfig(method=method, tokens=tokens or None, loss_positions=loss_positions or None, **settings)
    with progress_bar() as bar:
        tasks = {}

        def progress(stage, done, total, note):
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total, note="")
            bar.update(tasks[stage], completed=done, note=note)

        record = train_draft(model, config, out, resume=resume, device=device_name(device), progress=progress)
    before, after = record["before"], record["after"]
    click.echo(
        f"{method} heads in {out}: {record['train_tokens']} training tokens x {config.epochs} epochs, "
        f"{record['steps']} steps, "
        f"{record['seconds']:.0f} s; held-out loss {before['loss']:.3f} -> {after['loss']:.3f}, top-1 agreement "
        f"{' '.join(f'{a:.3f}' for a in before['top1'])} -> {' '.join(f'{a:.3f}' for a in after['top1'])}"
    )
