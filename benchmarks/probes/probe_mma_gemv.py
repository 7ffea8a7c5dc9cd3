"""Probe: the mma.sync W4A16 gemv (``kernels/w4a16_mma_gemv.py``) against the committed skinny-M path and cuBLAS fp16.

    python benchmarks/probes/probe_mma_gemv.py [--out DIR] [--ms 1,2,4,8,16] [--groups 128] [--shapes all|big]
        [--variants mma-w4s4f4,mma-w2s4f8pv14]
    PYTHONPATH=<triton 3.6>:benchmarks python benchmarks/probes/probe_mma_gemv.py --compile --variants ...  # no GPU

Timing as bench_w4a16.py (CUDA graphs over rotated weights larger than L2, medians), cuBLAS fp16 and the committed
path (``w4a16_linear``'s choice) in the same run; every variant checked against float64 first (within 2x cuBLAS
fp16's own error, fp16 and bf16 activations), and a wrong variant is reported, not timed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16
from bench_w4a16 import Layer, Timer, fp16_calls
from quantkit.kernels.w4a16_mma_gemv import MmaGemvConfig, w4a16_mma_gemv

# the six issue shapes, then the runtime's fused q/k/v and gate/up of Llama-3-8B
SHAPES = [(28672, 8192), (8192, 28672), (8192, 8192), (14336, 4096), (4096, 14336), (4096, 4096), (6144, 4096),
          (28672, 4096)]  # fmt: skip
VARIANTS = [
    MmaGemvConfig(4, 4, 4.0),
    MmaGemvConfig(4, 4, 4.0, prefetch=True),
    MmaGemvConfig(4, 4, 4.0, prefetch=True, wave=7),
    MmaGemvConfig(4, 4, 8.0, prefetch=True, wave=7),
    MmaGemvConfig(2, 4, 8.0, prefetch=True, wave=14),
    MmaGemvConfig(2, 4, 16.0, prefetch=True, wave=14),
]


def parse_variant(name: str) -> MmaGemvConfig:
    """``mma-w2s4f8pv14`` (the config's own name) -> MmaGemvConfig(2, 4, 8.0, prefetch=True, wave=14); a trailing
    ``d512`` sets min_depth, ``m32`` max_split, ``x8`` skip_split."""
    hit = re.fullmatch(r"(?:mma-)?w(\d+)s(\d+)f([\d.]+)(p?)(?:v(\d+))?(?:d(\d+))?(?:m(\d+))?(?:x(\d+))?", name)
    if not hit:
        raise SystemExit(f"--variants: cannot read {name!r} (expected e.g. mma-w4s4f4 or mma-w2s4f8pv14)")
    w, s, f, p, v, d, mx, x = hit.groups()
    return MmaGemvConfig(int(w), int(s), float(f), prefetch=bool(p), wave=int(v or 0), min_depth=int(d or 0),
                         max_split=int(mx or 16), skip_split=int(x or 0))  # fmt: skip


def check_bf16(layer: Layer, m: int, cfg, linear=w4a16_mma_gemv) -> bool:
    """``linear`` with bf16 activations within 2x cuBLAS bf16's own error of float64 (``Layer.check`` does fp16)."""
    x = torch.randn(m, layer.k, device=layer.device, generator=layer.gen).bfloat16()
    ref = x.double() @ layer.w64()
    err = (linear(x, layer.weights[0], config=cfg).double() - ref).abs().max().item()
    torch_err = ((x @ layer.w64().bfloat16()).double() - ref).abs().max().item()
    return err <= 2 * torch_err + 2**-20 * ref.abs().max().item()


def time_variants(layer: Layer, m: int, fp16: float, variants, timer: Timer, row: dict, line: list,
                  linear=w4a16_mma_gemv) -> None:  # fmt: skip
    """Each config of ``variants`` through ``linear``: checked (fp16 and bf16) then timed; its figures go into
    ``row`` and a line of text into ``line``. A variant that fails to compile or launch is reported, not fatal."""
    width = max(len(cfg.name) for cfg in variants) + 2
    for cfg in variants:
        try:
            ok = layer.check(m, cfg, linear=linear)["ok"] and check_bf16(layer, m, cfg, linear)
            us = timer.per_call(layer.calls(m, cfg, linear=linear)) if ok else None
        except Exception as exc:
            row[cfg.name + "_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            line.append(f"{cfg.name}: FAILED {row[cfg.name + '_error'][:200]}")
            continue
        row[cfg.name + "_ok"], row[cfg.name + "_us"] = ok, us
        tbs = layer.bytes / us / 1e6 if ok else 0.0
        line.append(f"{cfg.name:<{width}} {us:7.1f} us {fp16 / us:5.2f}x {tbs:5.2f} TB/s" if ok else
                    f"{cfg.name:<{width}} WRONG")  # fmt: skip


def report_compile(variants) -> None:
    """Offline sm_90 compile of each config (Triton 3.6 on PYTHONPATH, no GPU): registers, spills and the SASS
    instructions of the K loop (one iteration: ``steps`` K steps of 32), groups of 128, one and two row blocks
    (MB), split 4."""
    import triton
    from quantkit.kernels.w4a16_mma_gemv import _w4a16_mma_gemv_kernel as fn
    from sass_w4a16 import loop_body, machine_code
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    for cfg in variants:
        for mb, bf16 in [(mb, bf16) for mb in (1, 2) for bf16 in (False, True)]:  # one row block (M <= 8) or two
            act = "bf16" if bf16 else "fp16"
            sig = dict.fromkeys(fn.arg_names, "i32")
            sig.update(x_ptr="*i32", qw_ptr="*i32", qz_ptr="*i32", s_ptr="*fp16", bias_ptr=f"*{act}",
                       out_ptr=f"*{act}", ws_ptr="*fp32", cnt_ptr="*i32")  # fmt: skip
            const = dict(GROUP=128, STEPS=cfg.steps, MB=mb, BF16=bf16, HAS_BIAS=False, SPLIT_K=4, EVEN_N=True,
                         EVEN_SPLIT=True, PREFETCH=cfg.prefetch, num_warps=cfg.num_warps)  # fmt: skip
            sig.update(dict.fromkeys(const, "constexpr"))
            aligned = ["x_ptr", "qw_ptr", "qz_ptr", "s_ptr", "out_ptr", "ws_ptr", "N", "stride_qwk", "stride_qzg",
                       "stride_sg", "stride_om"]  # fmt: skip
            attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
            kernel = triton.compile(GluonASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": cfg.num_warps})  # fmt: skip
            regs, stack, sass = machine_code(kernel)
            print(f"{cfg.name:<20} MB={mb} {act}: regs {regs} stack {stack} loop {len(loop_body(sass))} instructions")


def walk(args, shapes, variants, linear, json_name: str) -> None:
    """The probes' loop: per (shape, M, group) cell, cuBLAS fp16 and the committed path (``w4a16_linear``'s own
    choice) timed, then ``time_variants`` of ``variants`` through ``linear``; a line per cell printed and, with
    ``args.out``, the JSON rewritten after every cell (a run cut short keeps what it measured)."""
    timer, dev = Timer(False), "cuda"
    gen = torch.Generator(device=dev).manual_seed(1)
    rows = []
    for n, k in shapes:
        for m in map(int, args.ms.split(",")):
            fp16 = timer.per_call(fp16_calls(n, k, m, dev, gen))
            for group in map(int, args.groups.split(",")):
                layer = Layer(n, k, group, dev, seed=n + k)
                cu = timer.per_call(layer.calls(m, None))
                row = {"n": n, "k": k, "m": m, "group": group, "fp16_us": fp16, "bytes": layer.bytes,
                       "committed_us": cu}  # fmt: skip
                line = [f"{n}x{k} g{group} M={m}: fp16 {fp16:.1f} us, committed {cu:.1f} us "
                        f"({fp16 / cu:.2f}x, {layer.bytes / cu / 1e6:.2f} TB/s)"]  # fmt: skip
                time_variants(layer, m, fp16, variants, timer, row, line, linear=linear)
                rows.append(row)
                print("\n    ".join(line), flush=True)
                if args.out:
                    args.out.mkdir(parents=True, exist_ok=True)
                    (args.out / json_name).write_text(json.dumps(rows, indent=1))
                del layer
                torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--groups", default="128")
    ap.add_argument("--shapes", default="all", help="all, big (the four largest) or N x K pairs: 4096x11008,...")
    ap.add_argument(
        "--variants", help="comma-separated config names instead of VARIANTS, e.g. mma-w4s2f4,mma-w2s4f8pv14"
    )
    ap.add_argument("--compile", action="store_true", help="offline sm_90 compile report of the variants, no GPU")
    args = ap.parse_args()
    variants = [parse_variant(v) for v in args.variants.split(",")] if args.variants else VARIANTS
    if args.compile:
        return report_compile(variants)
    shapes = {"all": SHAPES, "big": SHAPES[:4]}.get(args.shapes)
    if shapes is None:
        shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    walk(args, shapes, variants, w4a16_mma_gemv, "probe_mma_gemv.json")


if __name__ == "__main__":
    main()
