"""Probe: the mma.sync W4A16 gemv on words whose codes are stored in AutoAWQ's order within a word (K offsets 0, 2, 4,
6, 1, 3, 5, 7 in nibbles 0-7), against the same kernel on the GPTQ order.

    python benchmarks/probes/probe_mma_interleave.py [--out DIR] [--ms 1,8,16] [--groups 128] [--shapes all|big|NxK,..]
        [--variants mma-w2s4f8pv8d512,...]
    PYTHONPATH=<triton 3.6>:benchmarks python benchmarks/probes/probe_mma_interleave.py --compile   # no GPU

Why: the kernel turns nibbles (j, j + 4) of a word into one pair of 16-bit weights, so x has to be fed as the pair
(x[j], x[j + 4]): two PRMTs per pair of registers of x, 8 per K step with one row block of x (M <= 8) and 16 with two
(M = 9-16), next to 36 unpacking instructions and 4 or 8 mma. With the interleaved order those pairs are x's own
32-bit pairs. Both layouts run the same config and split (the automatic ones, or each ``--variants`` config);
every variant is checked against float64 (fp16 and bf16 activations) before it is timed; bench_w4a16.py's timing
(CUDA graphs over rotated weights larger than L2, medians), cuBLAS fp16 in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16
sys.path.insert(0, str(Path(__file__).resolve().parent))  # probe_mma_gemv
from bench_w4a16 import Layer, Timer, fp16_calls
from probe_mma_gemv import SHAPES, check_bf16, parse_variant
from quantkit.kernels.w4a16_mma_gemv import interleave_codes, mma_config_for, w4a16_mma_gemv
from quantkit.kernels.w4a16_weight import num_sms


def product(interleaved: bool, split: int | None = None):
    """The kernel in the signature Layer.calls expects; ``config`` None: the automatic config; ``split`` None: the
    config's own split."""
    return lambda x, w, config=None, out=None: w4a16_mma_gemv(x, w, out=out, config=config, split=split,
                                                              interleaved=interleaved)  # fmt: skip


def wave_split(cfg, n: int, k: int, sms: int) -> int:
    """The split that fills one wave of ``cfg.wave`` CTAs per SM (whole iterations per part, parts as even as they
    go), keeping at least ``cfg.min_depth`` K rows a part: more CTAs than the doubling rule's power of two."""
    ctas, iters = -(-n // cfg.block_n), k // (32 * cfg.steps)
    deepest = iters // max(1, -(-cfg.min_depth // (32 * cfg.steps))) if cfg.min_depth else iters
    return max(1, min(cfg.wave * sms // ctas, iters, deepest))


def report_compile() -> None:
    """Offline sm_90 compile (Triton 3.6 on PYTHONPATH): registers and K-loop SASS of both orders, the committed
    configs, one row block (M <= 8) and two (M = 9-16)."""
    import probe_mma_gemv
    from quantkit.kernels import w4a16_mma_gemv as MG

    for interleaved in (False, True):
        print(f"interleaved={interleaved}")
        probe_mma_gemv.report_compile([MG.MMA_PREFETCH, MG.MMA_TWO_BLOCKS, MG.MMA_STEPS2], interleaved)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--ms", default="1,8,16")
    ap.add_argument("--groups", default="128")
    ap.add_argument("--shapes", default="all", help="all, big (the four largest) or N x K pairs: 4096x11008,...")
    ap.add_argument(
        "--variants",
        default="mma-w2s4f8pv10d512u,mma-w2s4f8pv10d512ur96,mma-w2s4f8pv9d512ur104",
        help="configs timed besides the automatic one at M = 9-16, each at the split that fills its wave",
    )
    ap.add_argument("--compile", action="store_true", help="offline sm_90 compile report, no GPU")
    args = ap.parse_args()
    if args.compile:
        return report_compile()
    shapes = {"all": SHAPES, "big": SHAPES[:4]}.get(args.shapes)
    if shapes is None:
        shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    extra = [parse_variant(v) for v in args.variants.split(",") if v]
    timer, dev = Timer(False), "cuda"
    sms = num_sms(torch.device(dev))
    gen = torch.Generator(device=dev).manual_seed(1)
    rows = []
    for n, k in shapes:
        for group in map(int, args.groups.split(",")):
            layer = Layer(n, k, group, dev, seed=n + k)
            layer.w64()  # the float64 reference from the GPTQ order, before the words are swapped
            plain = layer.weights
            mixed = [dataclasses.replace(w, qweight=interleave_codes(w.qweight)) for w in plain]
            for m in map(int, args.ms.split(",")):
                fp16 = timer.per_call(fp16_calls(n, k, m, dev, gen))
                auto = mma_config_for(n, k, group, sms, m)
                row = {"n": n, "k": k, "m": m, "group": group, "fp16_us": fp16, "bytes": layer.bytes,
                       "auto": auto.name if auto else None}  # fmt: skip
                cells = []
                # M <= 8: the interleaved K step of the prefetch loop compiles to 74 registers (72 in GPTQ order), one
                # allocation unit more: also timed held to 72 (no spills offline), the wave its split assumes
                held = [dataclasses.replace(auto, maxnreg=72)] if m <= 8 and auto and auto.prefetch else []
                for cfg in [None, *held, *(extra if m > 8 else [])]:
                    split = None if cfg is None or cfg in held else wave_split(cfg, n, k, sms)
                    name = "auto" if cfg is None else f"{cfg.name}-sk{split or 'auto'}"
                    for interleaved, weights in ((False, plain), (True, mixed)):
                        layer.weights = weights
                        key = f"{name}{'-il' if interleaved else ''}"
                        linear = product(interleaved, split)
                        try:
                            ok = layer.check(m, cfg, linear=linear)["ok"] and check_bf16(layer, m, cfg, linear)
                            us = timer.per_call(layer.calls(m, cfg, linear=linear)) if ok else None
                        except Exception as exc:  # a config that cannot run the layer: the others still run
                            row[key + "_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                            cells.append(f"{key} FAILED")
                            continue
                        row[key + "_ok"], row[key + "_us"] = ok, us
                        cells.append(f"{key} {fp16 / us:.2f}x" if ok else f"{key} WRONG")
                    if row.get(f"{name}_us") and row.get(f"{name}-il_us"):
                        cells.append(f"il/plain {row[f'{name}_us'] / row[f'{name}-il_us']:.3f}")
                layer.weights = plain
                rows.append(row)
                print(f"{n}x{k} g{group} M={m} fp16 {fp16:.1f} us ({row['auto']}): " + " | ".join(cells), flush=True)
                if args.out:
                    args.out.mkdir(parents=True, exist_ok=True)
                    (args.out / "probe_mma_interleave.json").write_text(json.dumps(rows, indent=1))
            del layer, plain, mixed
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
