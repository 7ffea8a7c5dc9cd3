"""Quantize the default model, export it in the formats other servers read (compressed-tensors for vLLM, GPTQ v1,
AWQ GEMM), and check each export: through transformers and the compressed-tensors package where that reader is
installed, and by importing it back into quantkit otherwise. Every check compares logits with the quantkit
checkpoint's, bit for bit.

    python examples/export_formats.py [--model smollm2-135m] [--group-size 64] [--out out/export-example]

(Group 64 divides SmolLM2-135M's widths, 576 and 1536; the exporters refuse a group that does not, as the
formats' readers would.)
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM

import quantkit


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--out", default="out/export-example")
    args = ap.parse_args()
    console = Console(soft_wrap=True)
    out = Path(args.out)

    model, tokenizer, _ = quantkit.load_model(args.model)
    recipe = {"scheme": {"bits": 4, "group_size": args.group_size, "sym": True}, "stages": [{"method": "rtn"}]}
    quantkit.quantize(model, recipe)
    source = quantkit.save_quantized(model, out / "quantkit", tokenizer=tokenizer, overwrite=True)
    probe = tokenizer("Call me Ishmael. Some years ago, never mind how long precisely", return_tensors="pt")
    with torch.no_grad():
        want = quantkit.load_quantized(source)(probe.input_ids).logits

    table = Table(title=f"{args.model}, 4-bit group {args.group_size}, exported into {out}/<format>")
    for col in ("format", "MB", "checked through", "logits identical"):
        table.add_column(col)
    table.add_row("quantkit", f"{folder_bytes(source) / 1e6:.1f}", "-", "-")
    failures = 0
    for fmt in ("compressed-tensors", "gptq", "awq"):
        done = quantkit.export_checkpoint(source, out / fmt, fmt, overwrite=True)
        if fmt == "compressed-tensors" and importlib.util.find_spec("compressed_tensors") is not None:
            reader, reloaded = "transformers + compressed-tensors", AutoModelForCausalLM.from_pretrained(done.path)
        else:
            back = quantkit.import_checkpoint(done.path, out / f"{fmt}-imported", overwrite=True)
            reader, reloaded = "quantkit import", quantkit.load_quantized(back.path)
        with torch.no_grad():
            same = torch.equal(reloaded.eval()(probe.input_ids).logits, want)
        failures += not same
        table.add_row(fmt, f"{folder_bytes(done.path) / 1e6:.1f}", reader, str(same))
    console.print(table)
    if failures:
        raise SystemExit(f"{failures} export(s) computed other logits than the quantkit checkpoint")


if __name__ == "__main__":
    main()
