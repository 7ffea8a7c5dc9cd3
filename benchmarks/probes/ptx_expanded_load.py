"""Static probe (no GPU): does a W4A16 tile dequantized by elementwise ops alone reach wgmma without shared memory?

    PYTHONPATH=<dir with triton==3.6.0> python benchmarks/probes/ptx_expanded_load.py [BLOCK_M BLOCK_N BLOCK_K]

The committed swap-AB kernel unpacks eight codes per word with joins and reshapes, and Triton moves the dequantized
tile registers -> shared memory -> wgmma operand. Triton can keep an MMA operand in registers when only elementwise
ops lie between its load and the dot, so this kernel loads the packed words already expanded to the tile's shape
(element (n, k) reads word (k // 8, n)) and dequantizes with shifts, masks, a subtraction and a multiply. It is
compiled for sm_90 and the PTX counted: wgmma with a register A operand, shared-memory stores and loads.

Finding (2026-12-02, Triton 3.6, 16 x 64 x 64): wgmma does take A from registers (m64n16k16, four registers per
operand), but the dequantized tile still goes through shared memory on the way (a convert_layout from the load's
blocked layout to the operand's, 4 st.shared / 14 ld.shared), and the pipeliner stages the expanded words in shared
memory at 8x the packed size. The committed configs compile the same way (m16n64k64: register-A wgmma after 9
st.shared / 4 ldmatrix per loop body; m64n64k128: 17 / 8). Not timed: it keeps the round trip it was meant to remove.
"""

from __future__ import annotations

import re
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)


@triton.jit
def _expanded_kernel(x_ptr, qw_ptr, s_ptr, out_ptr, N, K, stride_xm, stride_qwk, stride_sg, stride_om,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """y.T [BN, BM] = W.T tile @ x.T, symmetric 4-bit codes (zero 8), group 128, K a multiple of BK."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    acc = tl.zeros((BN, BM), tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + offs_k
        words = tl.load(qw_ptr + (kk // 8)[None, :] * stride_qwk + offs_n[:, None])  # [BN, BK], each word 8 times
        q = (words >> ((kk % 8) * 4)[None, :]) & 0xF
        s = tl.load(s_ptr + (k0 // 128) * stride_sg + offs_n)[:, None]
        w = (q - 8).to(tl.float16) * s
        x = tl.load(x_ptr + offs_m[None, :] * stride_xm + kk[:, None])  # [BK, BM]
        acc = tl.dot(w, x, acc)
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(tl.float16))


def compile_for_sm90(bm: int, bn: int, bk: int, num_warps: int = 4, num_stages: int = 3):
    fn = _expanded_kernel
    ints = ("N", "K", "stride_xm", "stride_qwk", "stride_sg", "stride_om")
    sig = {"x_ptr": "*fp16", "qw_ptr": "*i32", "s_ptr": "*fp16", "out_ptr": "*fp16", **dict.fromkeys(ints, "i32")}
    const = {"BM": bm, "BN": bn, "BK": bk}
    sig.update(dict.fromkeys(const, "constexpr"))
    hints = [a for a in sig if sig[a] != "constexpr"]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in hints}
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=TARGET, options=options)


def main() -> None:
    bm, bn, bk = (int(v) for v in sys.argv[1:4]) if len(sys.argv) == 4 else (16, 64, 64)
    ptx = compile_for_sm90(bm, bn, bk).asm["ptx"]
    wgmma = re.findall(r"wgmma\.mma_async[^\n]*", ptx)
    register_a = [w for w in wgmma if re.search(r"\}, \{%r", w)]
    print(f"triton {triton.__version__}, sm_90, tile {bm} x {bn} x {bk}")
    print(f"wgmma: {len(wgmma)} (A from registers: {len(register_a)}), st.shared: {ptx.count('st.shared')}, "
          f"ld.shared: {ptx.count('ld.shared')}, cp.async: {ptx.count('cp.async')}")  # fmt: skip
    for w in wgmma[:2]:
        print("  " + w[:160])


if __name__ == "__main__":
    main()
