"""Probe: does cuBLAS fp16 run slower on the W4A16 weights' values than on the baseline's random normal weights?

    python benchmarks/probes/probe_baseline_data.py [--out DIR] [--ms 256,1024,4096] [--group 128]

At M >= 1024 the committed W4A16 path (dequantize + cuBLAS) trails cuBLAS fp16 by more than its dequantization
costs: in results/w4a16-ws-stream-k-h200-2026-12-05.md, 28672 x 4096 at M = 16384 runs 0.86x (912 us behind
5,601) while the dequantization of those 117 M weights takes ~0.1 ms. The two products differ in the weight values
(bench_w4a16's baseline multiplies randn weights, the W4A16 path the dequantized codes: s (q - z) with s ~ 0.001-0.011)
and in the call (``F.linear`` against ``torch.mm(..., out=)``). A power-limited GEMM can depend on the operands'
bit patterns, so this probe times, per shape and M, in one run and bench_w4a16's way (CUDA graphs over rotated
operands larger than L2, medians):

  randn       F.linear(x, W)             W ~ N(0, 1): bench_w4a16's baseline
  randn/50    F.linear(x, W / 50)        N(0, 0.02), the spread of real checkpoints' (and the runtime's dummy) weights
  deq         F.linear(x, Wd)            Wd = the dequantized weights of bench_w4a16's Layer, dequantized beforehand
  deq-mm-out  torch.mm(x, Wd.t(), out=y) the call w4a16_linear makes when given an output buffer
  dequant     w4a16_dequantize(w, out=)  dequantization alone
  w4a16       w4a16_linear(x, w, out=y)  the committed path (the table's choice for this M)

each as ``<name>@32``: its rotated calls cycled to 32 per CUDA graph, so that every variant runs as many
back-to-back products per replay (between replays do_bench flushes L2 and the GPU idles briefly: a graph of one
long product gives a power-limited GPU more rest than a graph of 32); randn and w4a16 also as bench_w4a16 times
them, with their own rotation counts (R_fp16 for the float product, R_w4 >= R_fp16 for the 4-bit one),

and samples SM clock and board power with nvidia-smi while each variant runs (where nvidia-smi is present).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16, graph_timing
from bench_w4a16 import SHAPES, Layer, Timer, rotations
from quantkit.kernels import w4a16 as K

CYCLED = 32


class Smi:
    """nvidia-smi sampling SM clock (MHz) and power (W) every 20 ms between start() and stop()."""

    def __init__(self) -> None:
        self.proc = None

    def start(self) -> None:
        cmd = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "20"]
        try:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except FileNotFoundError:
            self.proc = None

    def stop(self) -> dict:
        if self.proc is None:
            return {}
        self.proc.terminate()
        out, _ = self.proc.communicate()
        rows = []
        for line in out.splitlines():
            try:
                clock, power = (float(v) for v in line.split(","))
            except ValueError:
                continue
            rows.append((clock, power))
        rows = rows[len(rows) // 4 :] or rows  # skip the warm-up samples
        if not rows:
            return {}
        return {"sm_mhz": sum(r[0] for r in rows) / len(rows), "watts": sum(r[1] for r in rows) / len(rows)}


def timed(timer: Timer, calls: list, smi: Smi) -> dict:
    smi.start()
    time.sleep(0.05)
    us = timer.per_call(calls)
    return {"us": us, **smi.stop()}


def variants(layer: Layer, m: int, gen: torch.Generator) -> dict[str, list]:
    n, k, dev = layer.n, layer.k, layer.device
    r = rotations(2 * n * k + 2 * m * (n + k))
    ws = [torch.randn(n, k, device=dev, generator=gen).half() for _ in range(r)]
    xs = [torch.randn(m, k, device=dev, generator=gen).half() for _ in range(max(r, len(layer.weights)))]
    ys = [torch.empty(m, n, device=dev, dtype=torch.float16) for _ in xs]
    small = [w / 50 for w in ws]
    deq = [K.w4a16_dequantize(w, torch.float16) for w in layer.weights[:r]]
    bufs = [torch.empty(n, k, device=dev, dtype=torch.float16) for _ in layer.weights]
    base = {
        "randn": [lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, ws, strict=False)],
        "randn/50": [lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, small, strict=False)],
        "deq": [lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, deq, strict=False)],
        "deq-mm-out": [lambda x=x, w=w, y=y: torch.mm(x, w.t(), out=y) for x, w, y in zip(xs, deq, ys, strict=False)],
        "dequant": [
            lambda w=w, b=b: K.w4a16_dequantize(w, torch.float16, out=b)
            for w, b in zip(layer.weights, bufs, strict=False)
        ],
        "w4a16": [
            lambda x=x, w=w, y=y: K.w4a16_linear(x, w, out=y) for x, w, y in zip(xs, layer.weights, ys, strict=False)
        ],
    }
    # The same calls cycled to CYCLED per graph: every variant then runs the same number of back-to-back products
    # per replay (bench_w4a16 gives the baseline R_fp16 calls and the 4-bit path R_w4 >= R_fp16).
    cycled = {f"{name}@{CYCLED}": [cs[i % len(cs)] for i in range(max(CYCLED, len(cs)))] for name, cs in base.items()}
    return {"randn": base["randn"], "w4a16": base["w4a16"], **cycled}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--ms", default="256,1024,4096")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ms = [int(v) for v in args.ms.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    timer, smi = Timer(smoke=False, warmup_ms=25, rep_ms=100), Smi()
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    path = args.out / "baseline-data-probe.json"
    print("N x K | M | variant: us (MHz, W) ...")
    for n, k in shapes:
        layer = Layer(n, k, args.group, "cuda", seed=n + k + args.group)
        for m in ms:
            if m * (n + k) * 2 * 4 > 8 * 2**30:  # keep x and y rotations within a few GB
                continue
            row = {"n": n, "k": k, "m": m}
            calls = variants(layer, m, gen)
            for _rep in range(2):  # twice, interleaved, so that a drifting clock shows
                for name, cs in calls.items():
                    row.setdefault(name, []).append(timed(timer, cs, smi))
            del calls
            torch.cuda.empty_cache()
            result["rows"].append(row)
            cells = []
            for name in row:
                if name in ("n", "k", "m"):
                    continue
                best = min(row[name], key=lambda t: t["us"])
                cells.append(f"{name}: {best['us']:.1f} ({best.get('sm_mhz', 0):.0f} {best.get('watts', 0):.0f})")
            print(f"{n}x{k} | {m} | " + " | ".join(cells), flush=True)
            path.write_text(json.dumps(result, indent=1))
        del layer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
