"""Static look at the W4A16 kernel for the H200 without a GPU: compile for sm_90 and read the machine code.

    python benchmarks/sass_w4a16.py                 the committed table and every sweep candidate, groups 128 and 64
    python benchmarks/sass_w4a16.py --table-only    the committed table only
    PYTHONPATH=<dir with triton==3.6.0> python ...  the GPU machine's Triton (pip install --target; no GPU needed)

For each configuration: registers, stack (non-zero means spills), shared memory, MMA kind (mma.sync or wgmma) and
the SASS instruction histogram of the main loop, with "per weight" = loop instructions x threads / weights per
iteration. A memory-bound decode kernel on the H200 has ~4.3 issue slots per 4-bit weight (HBM at ~4 TB/s over
0.52 bytes per weight, 132 SMs x 128 thread-instructions per clock at 1.98 GHz); above that it cannot reach the
roofline however well its loads overlap. This is a static count: no latency, no occupancy effects, no timing.

Uses the Triton installed here (the GPU machine has 3.6; code generation may differ a little) and the cuobjdump
that ships in Triton's NVIDIA backend. Benchmark shapes are multiples of 16, so N, K and row strides are compiled
with 16-divisibility like there.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("unset TRITON_INTERPRET: this compiles for the GPU")

import torch
import triton
import triton.language as tl
from quantkit.kernels import w4a16 as K
from quantkit.kernels import w4a16_configs as C
from quantkit.kernels import w4a16_gemv as G
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_w4a16 import SWEEP

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
DIVISIBLE = ["N", "K", "stride_xm", "stride_qwk", "stride_qzg", "stride_sg", "stride_om"]
UNIT_STRIDES = ["stride_xk", "stride_qwn", "stride_qzn", "stride_sn", "stride_on"]


def compile_kernel(cfg: C.KernelConfig, group: int, dtype: torch.dtype, split: bool, n: int = 4096, k: int = 4096):
    """Compile the kernel ``cfg`` runs (gemv or fused) for sm_90 as the benchmark shapes specialize it."""
    gemv = cfg.method == "gemv"
    fn = G._w4a16_gemv_kernel if gemv else K._w4a16_gemm_kernel
    act = "fp16" if dtype == torch.float16 else "bf16"
    sig = dict.fromkeys(fn.arg_names, "i32")
    sig.update(x_ptr=f"*{act}", out_ptr=f"*{act}", bias_ptr=f"*{act}", s_ptr="*fp16", part_ptr="*fp32")
    sig.update(qw_ptr="*i32", qz_ptr="*i32", lock_ptr="*i32")
    plan = C.plan_launch(cfg, 1, n, k, group, 132)
    const = dict(
        BITS=4, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=plan.block_k, SPLIT=split, HAS_BIAS=False,
        EVEN_K=True, EMULATE_BF16=False, FIXUP=C.fixup_unroll(cfg), **dict.fromkeys(UNIT_STRIDES, 1),
    )  # fmt: skip
    if gemv:
        const.update(STAGES=cfg.num_stages, FOLD=cfg.fold_zero, PREFETCH=cfg.prefetch, X_VEC=cfg.vector_x)
    else:
        const.update(
            GROUP_M=cfg.group_m, FUSE_SCALE=cfg.fuse_scale,
            SWAP_AB=cfg.swap_ab, MAGIC=K._magic(4, dtype), COMPUTE=tl.float16 if act == "fp16" else tl.bfloat16,
            HALF_SCALE=act == "fp16",
        )  # fmt: skip
    sig.update(dict.fromkeys(const, "constexpr"))
    hints = [a for a in fn.arg_names if a.endswith("_ptr")] + DIVISIBLE
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in hints}
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=TARGET, options=options), plan


def loop_body(sass: str) -> list[str]:
    """Instructions of the longest loop (a backward branch) in the SASS listing."""
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best: list[str] = []
    for addr, text in ins:
        target = re.search(r"BRA (?:\S+ )?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            body = [t for a, t in ins if int(target.group(1), 16) <= a <= addr]
            best = body if len(body) > len(best) else best
    return best


def machine_code(kernel) -> tuple[int, int, str]:
    """(registers, stack bytes (non-zero: spills), SASS listing) of a kernel compiled by ``triton.compile``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1)), sass


def report(cfg: C.KernelConfig, group: int, dtype: torch.dtype, split: bool) -> str:
    kernel, plan = compile_kernel(cfg, group, dtype, split)
    regs, stack, sass = machine_code(kernel)
    body = loop_body(sass)
    per_weight = len(body) * cfg.num_warps * 32 / (plan.block_k * cfg.block_n)
    ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
    ttgir = kernel.asm["ttgir"]
    mma = "wgmma" if "warp_group_dot" in ttgir else "mma.sync" if "tt.dot" in ttgir else "none"
    top = " ".join(f"{op}:{n}" for op, n in ops.most_common(10))
    return (
        f"{cfg.name:<24} g{group:<3} regs {regs:>3} stack {stack:>3} smem {kernel.metadata.shared:>6} {mma:<8} "
        f"loop {len(body):>4} per weight {per_weight:5.2f} | {top}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--bf16", action="store_true", help="bf16 activations instead of fp16")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.bf16 else torch.float16
    configs = [cfg for _, cfg in C.CONFIG_TABLE]
    if not args.table_only:
        configs += [c for _, _, cands in SWEEP.values() for c in cands if c not in configs]
    print(f"triton {triton.__version__}, target sm_90, {dtype}, 4-bit")
    for cfg in configs:
        if cfg.method == "dequant":
            continue
        for group in (128, 64):
            print(report(cfg, group, dtype, split=cfg.split_waves > 0))


if __name__ == "__main__":
    main()
