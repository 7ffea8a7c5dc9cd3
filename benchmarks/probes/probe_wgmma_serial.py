"""Probe: the fused W4A16 kernel with and without ptxas's wgmma serialization (same configs, same run).

    git show <commit before the change>:kernels/w4a16.py > kernels/w4a16_old.py
    python benchmarks/probes/probe_wgmma_serial.py [--out DIR] [--ms 4,16,64,128] [--groups 128]

Why: ptxas -v on the committed M = 64 / 128 configs (and the split m16n128 one) says "(C7515) Potential
Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma instructions defining accumulator
registers of a wgmma between start and end of the pipeline stage": the K loop ``range(t_begin, t_end)`` may run
zero times as far as the compiler knows, and the zero-trip path's zero accumulator meets the last wgmma's wait.
ptxas then waits on every wgmma right after issuing it. ``tl.assume(t_end > t_begin)`` (true: plan_launch makes no
empty split) removes the path and the warning. This times ``kernels/w4a16_old.py`` (the kernel before) against the
current one with the same committed config per M, cuBLAS fp16 in the same run (bench_w4a16.py's method), both
checked against float64 first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16
from bench_w4a16 import SHAPES, Timer, layer_walk
from quantkit.kernels import w4a16 as K
from quantkit.kernels import w4a16_configs as C


def main() -> None:
    from quantkit.kernels import w4a16_old as OLD

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--ms", default="4,16,64,128")
    ap.add_argument("--groups", default="128")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ms = [int(v) for v in args.ms.split(",")]
    groups = [int(g) for g in args.groups.split(",")]
    timer = Timer(smoke=False)
    gen = torch.Generator(device="cuda").manual_seed(11)
    rows = []
    for n, k, group, layer, base in layer_walk(SHAPES, groups, ms, timer, "cuda", gen):
        for m in ms:
            cfg = C.config_for(m, n)
            row = {"n": n, "k": k, "group": group, "m": m, "config": cfg.name, "fp16_us": base[m]}
            for tag, linear in (("old", OLD.w4a16_linear), ("new", K.w4a16_linear)):
                good = layer.check(m, cfg, linear)["ok"]
                row[tag] = timer.per_call(layer.calls(m, cfg, linear)) if good else None
                row[tag + "_ok"] = good
            speed = {t: f"{base[m] / row[t]:.2f}x" if row[t] else "FAILED" for t in ("old", "new")}
            print(f"{n}x{k} g{group} M={m} {cfg.name}: fp16 {base[m]:.1f} us | old {speed['old']} | new {speed['new']}",
                  flush=True)  # fmt: skip
            rows.append(row)
            (args.out / "probe_wgmma_serial.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
