"""Offline look (no GPU) at how Triton 3.6 schedules the promoted fp8 GEMM loop for sm_90, and at a deferred add.

    PYTHONPATH=<dir with triton==3.6.0> python benchmarks/probes/sass_fp8_promote.py

The committed promoted path (``w8a8._mma``: ``tl.dot(..., max_num_imprecise_acc=BLOCK_K)``) adds each 128-deep
partial product into the fp32 accumulator. Printed per variant: registers, spill stack, ptxas performance notes,
and the main loop's MMA, wait and FADD instructions in order. Findings (2026-12-03, Triton 3.6): with the committed
256 x 128 tiles ptxas serializes every QGMMA (C7514: a wait after each), then the 64 FADDs; with 128 x 128 tiles the
loop issues its QGMMAs and waits for all of them before the FADDs, so the tensor cores idle during every promotion.
The deferred variant (issue step t's partial product, add step t - 1's) moves the adds among the QGMMA issues but
still waits for step t's QGMMAs in the same iteration (Triton's pipeliner keeps a dot in flight across iterations
only when its result is the next dot's accumulator) and then copies the 64-register partial; with 256 x 128 tiles its
third register tile spills. Overlapping promotion with MMA needs warp specialization (two MMA groups). Not timed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # sass_w4a16
from quantkit.kernels import w8a8 as W
from sass_w4a16 import loop_body, machine_code

PTXAS = Path(triton.backends.nvidia.__file__).parent / "bin" / "ptxas"


@triton.jit
def _deferred_kernel(a_desc, w_desc, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K, stride_cm, stride_cn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """The committed TMA tile's loop with the promotion deferred by one step."""
    pid_m, pid_n = W._tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, 8)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        new = tl.dot(a_desc.load([pid_m * BLOCK_M, k0]), w_desc.load([pid_n * BLOCK_N, k0]).T)
        acc += part
        part = new
    acc += part
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    W._scale_bias_store(acc, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, stride_cm, stride_cn, offs_m, offs_n,
                        True, False)  # fmt: skip


def compile_tma(fn, bm: int, bn: int, bk: int, warps: int, stages: int, const: dict):
    sig = dict.fromkeys(fn.arg_names, "i32")
    sig.update(a_desc=f"tensordesc<fp8e4nv[{bm}, {bk}]>", w_desc=f"tensordesc<fp8e4nv[{bn}, {bk}]>", c_ptr="*bf16",
               a_scale_ptr="*fp32", w_scale_ptr="*fp32", bias_ptr="*bf16")  # fmt: skip
    if "w_ptr" in fn.arg_names:
        sig["w_ptr"] = "*fp8e4nv"
    const = {k: v for k, v in dict(const, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk).items() if k in fn.arg_names}
    sig.update(dict.fromkeys(const, "constexpr"))
    hints = [a for a in ("c_ptr", "a_scale_ptr", "w_scale_ptr", "bias_ptr", "w_ptr", "M", "N", "K", "stride_cm",
                         "stride_wn") if a in fn.arg_names]  # fmt: skip
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in hints}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})  # fmt: skip


def report(name: str, kernel) -> None:
    regs, stack, sass = machine_code(kernel)
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as f, tempfile.NamedTemporaryFile(suffix=".o") as o:
        f.write(kernel.asm["ptx"])
        f.flush()
        r = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", o.name], capture_output=True, text=True)
    notes = sorted(set(re.findall(r"\((C\d+)\) Potential", r.stderr)))
    order: list[str] = []
    for ins in loop_body(sass):
        op = re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0]
        tag = "FADD" if op == "FADD" else op if any(s in op for s in ("GMMA", "WARPGROUP")) else None
        if tag and order and order[-1].split(" x")[0] == tag:
            order[-1] = f"{tag} x{int(order[-1].split(' x')[1]) + 1}"
        elif tag:
            order.append(f"{tag} x1")
    print(f"{name}: regs {regs}, stack {stack}, ptxas notes {notes or 'none'}\n    loop: {' | '.join(order)}")


def main() -> None:
    base = dict(A_SCALE_PER_ROW=True, HAS_BIAS=False, IS_FP8=True, GROUP_M=8, PDL=False, PREFETCH_K=0,
                PERSISTENT=0, L2_AHEAD=0, stride_cn=1)  # fmt: skip
    print(f"triton {triton.__version__}, sm_90")
    for bm, bn, warps, stages in ((256, 128, 8, 3), (128, 128, 8, 4)):
        for fast in (False, True):
            const = dict(base, FP8_FAST_ACCUM=fast, THREADS=warps * 32)
            kernel = compile_tma(W._w8a8_matmul_tma_kernel, bm, bn, 128, warps, stages, const)
            report(f"committed {bm}x{bn}x128 w{warps} s{stages} {'fast' if fast else 'promoted'}", kernel)
        report(f"deferred  {bm}x{bn}x128 w{warps} s{stages}",
               compile_tma(_deferred_kernel, bm, bn, 128, warps, stages, {}))  # fmt: skip


if __name__ == "__main__":
    main()
