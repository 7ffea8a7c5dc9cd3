"""The per-token activation quantizer at few rows: alone, fused into the runtime's norm and SiLU gate, and before the
progressive W4A8 GEMM, each against what it replaces in the same run.

Rows of x [M, K] at M in {1, 16}, timed in CUDA graphs of R rotated calls (``common.Timer``):

  quant one / split    ``quantize_activations(x, "int8")`` with one program per row / the row split over programs
                       (``quant.split_rows``'s count, forced)
  norm two / fused     ``add_rms_norm`` then the quantizer / ``add_rms_norm_quant`` (hidden widths 4096, 8192)
  silu two / fused / fused split
                       ``silu_mul`` then the quantizer (its default rule) / ``silu_mul_quant`` one program per row /
                       split (gate widths 14336, 28672)
  prog one / split     the progressive W4A8 path end to end (quantizer, then the GEMM, both under the programmatic
                       dependent launch the dispatcher would use) with the quantizer unsplit / split; W4A16 and bf16
                       cuBLAS beside them, on the six Llama shapes

    python benchmarks/bench_quantizer.py                       # H100 / H200
    TRITON_INTERPRET=1 python benchmarks/bench_quantizer.py --smoke   # CPU plumbing check: tiny sizes, wall clock
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

import torch
from bench_w4a8 import Problem
from common import LLAMA_SHAPES, Timer, add_out_argument, environment, kernel_device, out_folder
from quantkit.kernels import w4a8 as K
from quantkit.kernels.dense.norm_quant import add_rms_norm_quant, silu_mul_quant
from quantkit.kernels.dense.norm_rope import add_rms_norm, silu_mul
from quantkit.kernels.w4a8.dispatch import progressive_pdl
from quantkit.kernels.w8a8 import quant as Q

ROTATIONS = 20  # copies of the (small) activations per graph
WIDTHS = (4096, 8192, 14336, 28672)
NORM_WIDTHS = (4096, 8192)
GATE_WIDTHS = (14336, 28672)


def forced_split(m: int, k: int, sms: int) -> int:
    """``split_rows``'s count for a row of k at m rows, whatever its width and pdl (at least 2)."""
    return max(2, min(-(-k // Q.SPLIT_BLOCK_K), sms // m))


def timed(timer: Timer, fn, items) -> float:
    """Microseconds per call of ``fn(item)`` over the rotated ``items``."""
    return timer.per_call([partial(fn, item) for item in items])


def quant(x, split):
    return Q.quantize_activations(x, "int8", split=split)


def norm_two(w, x):
    return Q.quantize_activations(add_rms_norm(x, w, 1e-5, x)[0], "int8")


def norm_fused(w, x):
    return add_rms_norm_quant(x, w, 1e-5, x)


def silu_two(gu):
    return Q.quantize_activations(silu_mul(*gu), "int8")


def silu_fused(split, gu):
    return silu_mul_quant(*gu, split=split)


def prog(p: Problem, pdl: bool, split: int, i: int):
    """The progressive path as ``w4a8_linear`` runs it, with the quantizer's programs per row forced."""
    qa, a_scale = Q.quantize_activations(p.x[i], "int8", pdl=pdl, split=split)
    return K.w4a8_matmul(qa, a_scale, p.wp[i], out_dtype=torch.bfloat16, pdl=pdl)


def report(rows: list[dict], row: dict) -> None:
    rows.append(row)
    print("  ".join(f"{a} {b:.1f}" if isinstance(b, float) else f"{a}={b}" for a, b in row.items()), flush=True)


def time_rows(timer: Timer, device: str, ms, widths, norm_widths, gate_widths, sms: int) -> list[dict]:
    rows = []
    for m in ms:
        for k in widths:
            xs = [torch.randn(m, k, device=device).to(torch.bfloat16) for _ in range(ROTATIONS)]
            s = forced_split(m, k, sms)
            row = {"M": m, "K": k, "split": s, "quant one": timed(timer, partial(quant, split=1), xs),
                   "quant split": timed(timer, partial(quant, split=s), xs)}  # fmt: skip
            if k in norm_widths:
                w = torch.rand(k, device=device).to(torch.bfloat16) + 0.5
                row["norm two"] = timed(timer, partial(norm_two, w), xs)
                row["norm fused"] = timed(timer, partial(norm_fused, w), xs)
            if k in gate_widths:
                gus = [torch.randn(m, 2 * k, device=device).to(torch.bfloat16).split(k, -1) for _ in range(ROTATIONS)]
                row["silu two"] = timed(timer, silu_two, gus)
                row["silu fused"] = timed(timer, partial(silu_fused, 1), gus)
                row["silu fused split"] = timed(timer, partial(silu_fused, s), gus)
            report(rows, row)
    return rows


def time_progressive(timer: Timer, device: str, ms, shapes, sms: int) -> list[dict]:
    rows = []
    for m in ms:
        for n, k in shapes:
            p = Problem(n, k, m, 128, device, 0, timer.smoke)
            pdl = progressive_pdl(p.x[0])
            s = forced_split(m, k, sms)
            report(rows, {"M": m, "N": n, "K": k, "pdl": pdl, "bf16": timer.per_call(p.calls("bf16")),
                          "w4a16": timer.per_call(p.calls("w4a16")),
                          "prog one": timed(timer, partial(prog, p, pdl, 1), range(p.r)),
                          "prog split": timed(timer, partial(prog, p, pdl, s), range(p.r))})  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    """One markdown table of ``rows`` (their keys as columns; cells a row lacks left empty), microseconds."""
    cols = list(dict.fromkeys(c for r in rows for c in r))
    cell = lambda v: f"{v:.1f}" if isinstance(v, float) else "" if v is None else str(v)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check (needs TRITON_INTERPRET=1)")
    add_out_argument(ap, "quantizer")
    args = ap.parse_args(argv)
    device = kernel_device(args.smoke)
    timer = Timer(smoke=True, warmup_ms=0, rep_ms=0) if args.smoke else Timer(smoke=False, warmup_ms=10, rep_ms=50)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 4
    if args.smoke:  # tiny sizes; every path still runs (two programs per split row)
        rows = time_rows(timer, device, (1, 2), (256,), (256,), (256,), sms)
        prog = time_progressive(timer, device, (1,), [(96, 128)], sms)
    else:
        rows = time_rows(timer, device, (1, 16), WIDTHS, NORM_WIDTHS, GATE_WIDTHS, sms)
        prog = time_progressive(timer, device, (1, 16), LLAMA_SHAPES, sms)
    out_dir = out_folder(args.out)
    env = environment(device)
    (out_dir / "quantizer.json").write_text(json.dumps({"env": env, "rows": rows, "progressive": prog}, indent=1))
    head = f"# The activation quantizer at few rows\n\n{env['device']}, {env['date']}, commit {env['commit']}, us\n\n"
    (out_dir / "quantizer.md").write_text(head + markdown(rows) + "\n\n" + markdown(prog) + "\n")
    print(f"{env['device']}, {env['date']}; microseconds per call; results in {out_dir}/quantizer.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
