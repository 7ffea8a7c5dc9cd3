"""Probe: ``w4a16_linear`` under the register-A kernel's previous rule (commit 76e8ebb) and the current one, on every
cell where the two differ: fp16 and bf16 activations, groups of 128 (M 40 / 64 / 96 / 128) and 64 (M 40 / 64), the
eight layer shapes of probe_rega_wgmma.py, against cuBLAS of the same dtype in the same run.

    python benchmarks/probes/probe_rega_rule_ab.py [--out DIR]

Result (H200, results/w4a16-rega-ahead-h200-2026-12-04.md, JSON w4a16-rega-dispatch-ab5-h200-2026-12-04.json): the
current rule ahead or tied on every differing cell. GPU only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16
sys.path.insert(0, str(Path(__file__).resolve().parent))  # probe_rega_wgmma
from bench_w4a16 import Layer, Timer, rotations
from probe_rega_wgmma import SHAPES
from quantkit.kernels import w4a16 as K
from quantkit.kernels import w4a16_rega as R

PREVIOUS_SHORT_K = R.RegaConfig(64, 128, 3, 4, 1.0)


def previous_rule(m: int, n: int, k: int, group_size: int) -> R.RegaConfig | None:
    """``rega_config_for`` as of commit 76e8ebb: groups a multiple of 128 only, 128-row tiles by K at M 33-64."""
    if not 17 <= m <= 128 or (group_size or k) % 128:
        return None
    if m <= 32:
        return R.REGA_M32 if n >= 6144 else None
    if m > 64:
        return PREVIOUS_SHORT_K if n >= 6144 else None
    if n * k < 16 * 2**20:
        return None
    return R.REGA_M64 if k >= 8192 else PREVIOUS_SHORT_K


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    timer, dev, current = Timer(False), "cuda", R.rega_config_for
    rows = []
    for group, ms in ((128, (40, 64, 96, 128)), (64, (40, 64))):
        for n, k in SHAPES:
            layer = Layer(n, k, group, dev, seed=n + k)
            r = len(layer.weights)
            gen = torch.Generator(device=dev).manual_seed(0)
            for dtype in (torch.float16, torch.bfloat16):
                ws = [torch.randn(n, k, device=dev, generator=gen).to(dtype) for _ in range(rotations(2 * n * k))]
                for m in ms:
                    old, new = previous_rule(m, n, k, group), current(m, n, k, group)
                    if old == new:
                        continue
                    xs = [torch.randn(m, k, device=dev, generator=gen).to(dtype) for _ in range(max(r, len(ws)))]
                    base = timer.per_call([lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, ws, strict=False)])
                    outs = [torch.empty(m, n, device=dev, dtype=dtype) for _ in range(r)]
                    calls = [
                        lambda x=x, w=w, o=o: K.w4a16_linear(x, w, out=o)
                        for x, w, o in zip(xs, layer.weights, outs, strict=False)
                    ]
                    try:
                        R.rega_config_for = previous_rule  # rega_plan looks the rule up at call (capture) time
                        t_old = timer.per_call(calls)
                    finally:
                        R.rega_config_for = current
                    t_new = timer.per_call(calls)
                    row = dict(n=n, k=k, m=m, group=group, dtype=str(dtype)[6:], cublas_us=base, old_us=t_old,
                               new_us=t_new, old=old and old.name, new=new and new.name)  # fmt: skip
                    rows.append(row)
                    print(f"{n}x{k} g{group} {row['dtype']} M={m}: cuBLAS {base:.1f} us | old {base / t_old:.2f}x "
                          f"({row['old']}) | new {base / t_new:.2f}x ({row['new']})", flush=True)  # fmt: skip
            del layer
            torch.cuda.empty_cache()
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "probe_rega_rule_ab.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
