"""Probe: W4A16 at large M by dequantizing in N-chunks into a scratch buffer small enough to stay in L2.

    python benchmarks/probes/probe_l2_dequant.py [--out DIR] [--ms 128,256,1024,4096] [--groups 128]

The committed large-M path (``dequant+cublas``) writes the whole fp16 weight [N, K] to device memory and cuBLAS
reads it back: 4 extra bytes per weight against the 0.5 it saves. Here the weight is dequantized a chunk of rows
at a time into one scratch buffer of a few MB, reused for every chunk, so its lines stay in the H200's 50 MB L2
(overwritten before they are evicted: little or no write-back), and cuBLAS multiplies each chunk straight into its
column slice of the output (``torch.mm(..., out=y[:, n0:n1])``, which cuBLAS writes with a leading dimension, no
copy). Variants:

  l2-<MB>     one scratch buffer of about <MB> MB, dequantize and GEMM in turn on one stream
  l2x2-<MB>   two such buffers; chunk i + 1 is dequantized on a second stream while chunk i is multiplied

Every variant is checked against float64 (within 2x cuBLAS fp16's own error) and timed in the same run as cuBLAS
fp16 and the committed path (bench_w4a16.py's method: CUDA graphs over rotated operands, L2 flushed, medians).
Rows are printed and the JSON rewritten as they come.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16
from bench_w4a16 import SHAPES, Layer, Timer, layer_walk
from quantkit.kernels import w4a16 as K
from quantkit.kernels import w4a16_configs as C

BUDGETS_MB = (8, 16, 32)


def chunk_rows(k: int, budget_mb: int) -> int:
    """Rows of an fp16 [rows, K] chunk of about ``budget_mb`` MB, a multiple of 128 (whole packed zero words)."""
    return max(128, (budget_mb * 2**20 // (2 * k)) // 128 * 128)


def slices(w: K.W4A16Weight, rows: int) -> list[tuple[K.W4A16Weight, int, int]]:
    """``w`` cut along N into views of ``rows`` output channels (the last one ragged): (weight, n0, n1)."""
    pf = 32 // w.bits
    out = []
    for n0 in range(0, w.out_features, rows):
        n1 = min(n0 + rows, w.out_features)
        part = K.W4A16Weight(w.qweight[:, n0:n1], w.qzeros[:, n0 // pf : -(-n1 // pf)], w.scales[:, n0:n1],
                             w.bits, w.group_size, w.in_features, n1 - n0)  # fmt: skip
        out.append((part, n0, n1))
    return out


class ChunkedLinear:
    """y = x @ W.T through chunked dequantization into ``buffers`` scratch buffers of ``rows`` x K."""

    def __init__(self, weights: list[K.W4A16Weight], rows: int, buffers: int, device: str) -> None:
        k = weights[0].in_features
        self.parts = [slices(w, rows) for w in weights]
        self.scratch = [torch.empty(rows, k, device=device, dtype=torch.float16) for _ in range(buffers)]
        self.side = torch.cuda.Stream() if buffers > 1 else None
        self.ready = [torch.cuda.Event() for _ in range(buffers)]
        self.free = [torch.cuda.Event() for _ in range(buffers)]

    def __call__(self, x: torch.Tensor, which: int, out: torch.Tensor) -> torch.Tensor:
        parts = self.parts[which]
        if self.side is None:
            buf = self.scratch[0]
            for part, n0, n1 in parts:
                w = K.w4a16_dequantize(part, x.dtype, out=buf[: n1 - n0])
                torch.mm(x, w.t(), out=out[:, n0:n1])
            return out
        main, side, nb = torch.cuda.current_stream(), self.side, len(self.scratch)
        side.wait_stream(main)
        for i, (part, n0, n1) in enumerate(parts):
            b = i % nb
            with torch.cuda.stream(side):
                if i >= nb:
                    side.wait_event(self.free[b])  # the GEMM of chunk i - nb is done with this buffer
                w = K.w4a16_dequantize(part, x.dtype, out=self.scratch[b][: n1 - n0])
                self.ready[b].record(side)
            main.wait_event(self.ready[b])
            torch.mm(x, w.t(), out=out[:, n0:n1])
            self.free[b].record(main)
        main.wait_stream(side)
        return out


def check(layer: Layer, fn: ChunkedLinear, m: int) -> dict:
    x = torch.randn(m, layer.k, device=layer.device, generator=layer.gen).half()
    ref = x.double() @ layer.w64()
    y = fn(x, 0, torch.empty(m, layer.n, device=layer.device, dtype=torch.float16))
    torch.cuda.synchronize()
    err = (y.double() - ref).abs().max().item()
    torch_err = ((x @ layer.w64().half()).double() - ref).abs().max().item()
    return {"err": err, "torch_err": torch_err, "ok": err <= 2 * torch_err + 2**-20 * ref.abs().max().item()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--ms", default="128,256,1024,4096")
    ap.add_argument("--groups", default="128")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ms = [int(v) for v in args.ms.split(",")]
    timer = Timer(smoke=False)
    gen = torch.Generator(device="cuda").manual_seed(3)
    rows = []
    groups = [int(g) for g in args.groups.split(",")]
    for n, k, group, layer, base in layer_walk(SHAPES, groups, ms, timer, "cuda", gen):
        r = len(layer.weights)
        variants = {f"l2-{mb}": ChunkedLinear(layer.weights, chunk_rows(k, mb), 1, "cuda") for mb in BUDGETS_MB}
        variants |= {f"l2x2-{mb}": ChunkedLinear(layer.weights, chunk_rows(k, mb), 2, "cuda") for mb in (8, 16)}
        for m in ms:
            row = {"n": n, "k": k, "group": group, "m": m, "fp16_us": base[m]}
            row["dequant_us"] = timer.per_call(layer.calls(m, C.KernelConfig("dequant")))
            xs = [torch.randn(m, k, device="cuda", generator=gen).half() for _ in range(r)]
            outs = [torch.empty(m, n, device="cuda", dtype=torch.float16) for _ in range(r)]
            line = f"{n}x{k} g{group} M={m}: fp16 {base[m]:.1f} us"
            line += f", dequant+cuBLAS {base[m] / row['dequant_us']:.2f}x"
            for name, fn in variants.items():
                c = check(layer, fn, m)
                calls = [
                    (lambda i=i, fn=fn, x=x, o=o: fn(x, i, o)) for i, (x, o) in enumerate(zip(xs, outs, strict=True))
                ]
                us = timer.per_call(calls) if c["ok"] else None
                row[name] = {"us": us, **c}
                line += f", {name} " + (f"{base[m] / us:.2f}x" if us else "WRONG")
            print(line, flush=True)
            rows.append(row)
            (args.out / "probe_l2_dequant.json").write_text(json.dumps(rows, indent=1))
        del variants


if __name__ == "__main__":
    main()
