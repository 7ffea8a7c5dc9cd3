"""Probe: a W4A16 product for M = 16-64 where each thread unpacks its packed words straight into the register A
operand of an asynchronous wgmma (weights as A, "swap AB"), in Gluon, so that unpacking tile t + 1 runs while the
tensor cores multiply tile t.

    python benchmarks/probes/probe_rega_wgmma.py [--out DIR] [--ms 16,32,64] [--groups 128] [--shapes all|big]
        [--variants rw-n64k128s4,...]
    PYTHONPATH=<triton 3.6>:benchmarks python benchmarks/probes/probe_rega_wgmma.py --compile   # no GPU

Result (H200, results/w4a16-rega-wgmma-h200-2026-12-04.md): 1.46-1.52x cuBLAS fp16 at M = 64 on 28672 x 8192 /
8192 x 28672 (committed Triton tiles 0.91x / 1.18x), 1.74x / 1.81x at M = 32; behind the mma.sync gemv at M = 16 and
on 4096 x 4096. The kernel now lives in ``kernels/w4a16_rega_kernel.py`` (launch side ``w4a16_rega.py``, in the
dispatch for M 17-128 of the larger layers); this probe times its configs against the dispatch.

Why: at M = 16-64 the committed paths stream the 4-bit weight at 0.5-2.0 TB/s (results/w4a16-h200-2026-12-04e.md):
the mma.sync gemv (M <= 16) reloads x for every warp from L1 and issues the mma one warp at a time, and the Triton
tiles (M 17-64) either round-trip the dequantized tile through shared memory or, with A in registers
(``probe_rega.py``, 2026-12-03), wait for each wgmma before unpacking the next tile, so unpacking and MMA add up
(0.89x cuBLAS fp16 at M = 64). Gluon lets the kernel say the schedule: wgmma t is issued asynchronously with A from
registers and only wgmma t - 1 is waited for.

How
    - The packed words are read in place (GPTQ layout qweight int32 [K / 8, N]) with plain loads, a tile ahead
      (``PREFETCH``). Thread (warp w, lane 4 g + c) takes, for each 32-deep K block b of a BLOCK_K tile, word row
      4 b + c of weight rows 16 w + g and 16 w + g + 8: exactly the rows of its wgmma A fragment.
    - A word's eight codes are eight K positions of that row; the fragment wants k = 2c, 2c + 1, 2c + 8, 2c + 9 (and
      the same + 16) of each 32-block. The product over K does not care about order, so x is permuted once per call
      (a PyTorch copy, timed with the kernel) so that logical position 16 t + 8 h + 2 c + e of a block holds
      physical 8 c + 4 e + 2 t + h: then codes (j, j + 4) of word c, j = 2 t + h, are one 32-bit fragment register
      (the (q, q) pair one LOP3 with the fp16 magic produces, Marlin's trick), minus the zero pair, times the
      scale pair (fp16; bf16 in fp32 and one cvt per pair, like ``w4a16_ws_kernel``).
    - x tiles [BLOCK_M, BLOCK_K] (BLOCK_M = M rounded up to 16, 32 or 64: the wgmma's N) come by TMA into a ring of
      STAGES slots; after issuing wgmma t the kernel waits for t - 1 only and refills t - 1's slot.
    - The loop is unrolled by two (one fragment for even tiles, one for odd) and each fragment is kept alive up to the
      wait that retires its wgmma (``_keep``): without that, ptxas 12.8 writes the next fragment into registers an
      in-flight wgmma still reads, and results at M > 16 were wrong (results/w4a16-rega-wgmma-h200-2026-12-04.md).
    - split-K (grid axis 1) when the column tiles alone leave SMs idle: fp32 partials summed by PyTorch (probe only).

GPU only (Gluon has no interpreter mode). Timing as bench_w4a16.py (CUDA graphs over rotated weights larger than
L2, medians), cuBLAS fp16 and the committed path in the same run; every variant checked against float64 first
(within 2x cuBLAS's own error, fp16 and bf16 activations).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16, sass_w4a16
sys.path.insert(0, str(Path(__file__).resolve().parent))  # probe_mma_gemv
from probe_mma_gemv import walk
from quantkit.kernels.w4a16_rega import RegaConfig, block_m, w4a16_rega_gemm


def parse_variant(name: str) -> RegaConfig:
    hit = re.fullmatch(r"rw-n(\d+)k(\d+)s(\d+)w(\d+)v([\d.]+)(-w0)?(?:-a(\d))?", name)
    if not hit:
        raise SystemExit(f"--variants: cannot read {name!r} (expected e.g. rw-n64k128s4w4v1, ...-w0 or ...-a2)")
    n, k, s, w, v, w0, ahead = hit.groups()
    return RegaConfig(int(n), int(k), int(s), int(w), float(v), overlap=not w0, ahead=int(ahead or 0))


def linear(x, w, config, out=None):
    return w4a16_rega_gemm(x, w, out=out, config=config)


VARIANTS = [
    RegaConfig(64, 128, 4, 4, 1.0),
    RegaConfig(64, 128, 4, 4, 2.0),
    RegaConfig(128, 128, 4, 8, 1.0),
    RegaConfig(128, 128, 4, 4, 1.0),
    RegaConfig(64, 128, 3, 4, 1.0),
]

# the six issue shapes (the three largest first: --shapes big), then the runtime's fused q/k/v and gate/up
SHAPES = [(28672, 8192), (8192, 28672), (8192, 8192), (14336, 4096), (4096, 14336), (4096, 4096), (6144, 4096),
          (28672, 4096)]  # fmt: skip


def report_compile(variants, ms) -> None:
    """Offline sm_90 compile (Triton 3.6 on PYTHONPATH, no GPU) at each of ``ms`` rows: registers, spills, SASS of
    the K loop (two tiles when overlapped) and instructions per thread and weight."""
    import triton
    from quantkit.kernels.w4a16_rega_kernel import _w4a16_rega_kernel as fn
    from quantkit.kernels.w4a16_rega_kernel import layouts, x_descriptor
    from sass_w4a16 import loop_body, machine_code
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    for cfg in variants:
        for m in ms:
            for bf16 in (False, True):
                act = "bf16" if bf16 else "fp16"
                bm = block_m(m)
                x_desc = x_descriptor(torch.empty(m, 4096, dtype=torch.bfloat16 if bf16 else torch.float16), bm,
                                      cfg.block_k)  # fmt: skip
                sig = dict.fromkeys(fn.arg_names, "i32")
                sig.update(x_desc=mangle_type(x_desc), qw_ptr="*i32", qz_ptr="*i32", s_ptr="*bf16" if bf16 else "*i16",
                           bias_ptr=f"*{act}", out_ptr=f"*{act}", ws_ptr="*fp32", cnt_ptr="*i32")  # fmt: skip
                acc, a, words = layouts(bm, cfg.block_n, cfg.block_k, cfg.num_warps)
                const = dict(BM=bm, BN=cfg.block_n, BK=cfg.block_k, STAGES=cfg.stages, GROUP=128, BF16=bf16,
                             HAS_BIAS=False, SPLIT_K=1, OVERLAP=cfg.overlap, AHEAD=cfg.ahead, ACC_LAYOUT=acc,
                             A_LAYOUT=a, W_LAYOUT=words, num_warps=cfg.num_warps)  # fmt: skip
                sig.update(dict.fromkeys(const, "constexpr"))
                aligned = ["qw_ptr", "qz_ptr", "s_ptr", "out_ptr", "ws_ptr", "N", "K", "stride_qwk", "stride_qzg",
                           "stride_sg", "stride_om"]  # fmt: skip
                attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
                kernel = triton.compile(GluonASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                                        options={"num_warps": cfg.num_warps})  # fmt: skip
                regs, stack, sass = machine_code(kernel)
                body = loop_body(sass)
                ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0] for i in body)
                tiles = 2 if cfg.overlap else 1  # the overlapped loop is unrolled by two
                per_weight = len(body) * cfg.num_warps * 32 / (cfg.block_n * cfg.block_k * tiles)
                top = " ".join(f"{op}:{c}" for op, c in ops.most_common(14))
                print(f"{cfg.name} M={m} {act}: regs {regs} stack {stack} smem {kernel.metadata.shared} "
                      f"loop {len(body)} ({per_weight:.2f}/weight) {top}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--ms", default="16,32,64")
    ap.add_argument("--groups", default="128")
    ap.add_argument("--shapes", default="all", help="all (eight), big (the three largest) or issue (the six)")
    ap.add_argument("--variants", help="comma-separated config names, e.g. rw-n64k128s4w4v1")
    ap.add_argument("--compile", action="store_true", help="offline sm_90 compile report, no GPU")
    args = ap.parse_args()
    variants = [parse_variant(v) for v in args.variants.split(",")] if args.variants else VARIANTS
    if args.compile:
        return report_compile(variants, [int(m) for m in args.ms.split(",")])
    shapes = {"all": SHAPES, "big": SHAPES[:3], "issue": SHAPES[:6]}[args.shapes]
    walk(args, shapes, variants, linear, "probe_rega_wgmma.json")


if __name__ == "__main__":
    main()
