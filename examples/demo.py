"""The demo behind `make demo`: quantize the default model with the default recipe, save it, reload it
through Hugging Face `from_pretrained`, check the reloaded logits, and evaluate against the float model.

    python examples/demo.py [--model smollm2-135m] [--recipe default] [--windows 40] [--out out/demo]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

import quantkit
from quantkit.calib.data import evaluation_windows
from quantkit.cli.progress import progress_bar
from quantkit.eval import evaluate_windows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--recipe", default="default")
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--out", default="out/demo")
    args = ap.parse_args()
    console = Console(soft_wrap=True)
    hf_logging.disable_progress_bar()  # transformers' per-load "Loading weights" bars; the evaluation has its own
    t0 = time.perf_counter()

    model, tokenizer, folder = quantkit.load_model(args.model)
    console.print(f"[bold]1. quantize[/] {args.model} ({folder}) with recipe {args.recipe!r}")
    result = quantkit.quantize(model, args.recipe, tokenizer=tokenizer)
    console.print(f"   {len(result.layers)} linears quantized in {result.seconds:.1f}s")
    out = quantkit.save_quantized(model, args.out, tokenizer=tokenizer, overwrite=True)
    console.print(f"[bold]2. saved[/] {out}")

    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()  # works because quantkit is imported
    probe = tokenizer("Call me Ishmael.", return_tensors="pt").input_ids
    with torch.no_grad():
        same = torch.equal(model(probe).logits, reloaded(probe).logits)
    console.print(f"[bold]3. reloaded[/] through from_pretrained; logits identical to the in-memory model: {same}")
    if not same:
        raise SystemExit("reloaded logits differ from the in-memory quantized model")

    float_model, _, _ = quantkit.load_model(args.model)
    windows, protocol = evaluation_windows(tokenizer, "moby-dick", 512, args.windows)
    console.print(f"[bold]4. evaluate[/] on {protocol['source']}: {len(windows)} windows x 512 tokens")
    with progress_bar() as bar:  # two forward passes a window: a few minutes on two cores
        task = bar.add_task("evaluating", total=len(windows), note="")
        res = evaluate_windows(reloaded, windows, float_model, progress=lambda d, t: bar.update(task, completed=d))
    table = Table(title=f"{args.model}: float (dequantized GGUF) vs quantized ({args.recipe})")
    for col in ("model", "perplexity", "KL vs float", "top-1 agreement"):
        table.add_column(col)
    table.add_row("float", f"{res.baseline_perplexity:.3f}", "-", "-")
    schemes = ", ".join(sorted({s.scheme.name for s in quantkit.nn.factory.quantized_modules(reloaded).values()}))
    table.add_row(f"quantized ({schemes})", f"{res.perplexity:.3f}", f"{res.kl:.4f}", f"{res.top1_agreement:.3f}")
    console.print(table)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    console.print(f"wall time {time.perf_counter() - t0:.0f}s, peak memory (RSS) {peak_mb:.0f} MB")


if __name__ == "__main__":
    main()
