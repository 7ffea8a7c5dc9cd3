"""Static look at the prefill attention kernel for the H200 without a GPU: registers, spills and shared memory of
each launch configuration, with and without the cached-prefix loops (``flash_prefill(..., has_prefix=)``).

    PYTHONPATH=<dir with triton==3.6.0> python benchmarks/sass_prefill.py   (pip install --target; no GPU needed)

Compiles ``_prefill_kernel`` for sm_90 as the runtime launches it for Llama-3-8B attention (bf16, D = 128, GQA 4,
16-token pages, q and the chunk's K/V through TMA, 16-divisible strides) and reads the cubin with the cuobjdump
that ships in Triton's NVIDIA backend. Source of the register figures in results/attention-h200-2026-12-02-
prefixless.md and kernels/flash_prefill.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("unset TRITON_INTERPRET: this compiles for the GPU")

import triton
from quantkit.kernels import flash_prefill as P
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_w4a16 import TARGET, machine_code

CONFIGS = [  # (block_m, block_n, num_warps, num_stages): the committed ones first, then bench_attention's others
    (64, 64, 4, 3), (128, 128, 8, 3), (128, 32, 4, 4), (128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3),
    (128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 2),
]  # fmt: skip


def compile_prefill(block_m: int, block_n: int, num_warps: int, num_stages: int, has_prefix: bool):
    fn = P._prefill_kernel
    sig = dict.fromkeys(fn.arg_names, "i32")
    sig.update(dict.fromkeys(["q_ptr", "k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr"], "*bf16"))
    sig.update(dict.fromkeys(["block_tables_ptr", "cu_seqlens_ptr", "context_lens_ptr"], "*i32"))
    sig.update(q_desc=f"tensordesc<bf16[{block_m},128]>", qk_scale="fp32")
    sig.update(dict.fromkeys(["k_desc", "v_desc"], f"tensordesc<bf16[{block_n},128]>"))
    const = dict(
        HEAD_DIM=128, BLOCK_D=128, MASK_D=False, GROUP=4, PAGE=16, BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION="tf32", USE_TMA=True, HAS_WINDOW=False, LAZY=False, HAS_PREFIX=has_prefix,
    )  # fmt: skip
    sig.update(dict.fromkeys(const, "constexpr"))
    hints = [a for a in fn.arg_names if a.endswith("_ptr") or (a.startswith("stride") and a != "stride_bt")]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in hints}
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=TARGET, options=options)


def main() -> None:
    print(f"triton {triton.__version__}, target sm_90, bf16, D = 128, GQA 4, TMA")
    for cfg in CONFIGS:
        cells = []
        for has_prefix in (True, False):
            kernel = compile_prefill(*cfg, has_prefix=has_prefix)
            regs, stack, _ = machine_code(kernel)
            cells.append(f"{'with' if has_prefix else 'without'} prefix loops: regs {regs:>3} stack {stack:>4}")
        name = "m{} n{} w{} s{}".format(*cfg)
        print(f"{name:<16} smem {kernel.metadata.shared:>6} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
