"""Probe: a persistent W4A16 tensor-core GEMM fed by the TMA unit, for the medium and large M regimes.

    python benchmarks/probes/probe_w4a16_tma.py [--out DIR] [--ms 64,128,256,1024,4096]

The committed W4A16 path above M = 64 dequantizes the weight to [N, K] and calls cuBLAS (0.5-0.9x cuBLAS fp16,
results/w4a16-h200-2026-12-02b.md); its fused kernel loads tiles with cp.async and ran at ~0.45x for M = 128.
This prototype loads x [BM, BK] and the packed words [BK/8, BN] through the TMA unit (scales and packed zeros
with pointer loads: through TMA, as [1, BN] and [1, BN/8] boxes, every launch failed on the H200 with a misaligned
address), one program per SM walking the output tiles, the dequantization of
``w4a16._dequant_tile`` (fp16 magic-number unpacking, W = (q - z) s rounded once to fp16) and tl.dot, optionally
swapped (y.T = W.T x.T, the weight tile on the MMA's M side). fp16, group 128, K and N multiples of the tiles.
Triton 3.6's automatic warp specialization does not compile this loop (NVGPUWarpSpecialization fails on it, with
or without the swap), so the prototype is not warp-specialized. Timing as bench_w4a16.py; every cell is checked
against float64 (within 2x cuBLAS fp16's own error).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16
from bench_w4a16 import Layer, Timer, fp16_calls
from quantkit.kernels import w4a16 as K
from quantkit.kernels.w4a16 import _dequant_tile, _load_group
from quantkit.kernels.w4a16_weight import num_sms

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (28672, 8192), (8192, 28672)]
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, swap)
VARIANTS = [
    (128, 128, 64, 4, 3, False),
    (128, 128, 64, 8, 4, False),
    (128, 256, 64, 8, 3, False),
    (64, 128, 64, 4, 4, True),
    (128, 128, 64, 4, 3, True),
    (128, 256, 64, 8, 3, True),
]
SKINNY = [  # M <= 32: swapped only (the weight tile on the MMA's 64-row side); the first H200 run of
    # (16, 64, 64, 4, 4, True) at M = 16 on 4096 x 4096 failed with a misaligned address: not in the default --ms
    (16, 64, 64, 4, 4, True),
    (16, 128, 64, 4, 4, True),
    (16, 128, 128, 4, 3, True),
    (32, 128, 64, 4, 4, True),
]


@triton.jit
def _tma_gemm_kernel(x_desc, w_desc, qz_ptr, s_ptr, out_ptr, M, N, K, group_size, magic_pair, stride_om, stride_qzg,
                     stride_sg, NUM_PROGRAMS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, SWAP: tl.constexpr):  # fmt: skip
    BLOCK_KW: tl.constexpr = BLOCK_K // 8
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=False):
        in_group = GROUP_M * num_pid_n
        first_m = (tile // in_group) * GROUP_M
        rows = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % in_group) % rows
        pid_n = (tile % in_group) // rows
        if SWAP:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        for t in range(k_tiles):
            x = x_desc.load([pid_m * BLOCK_M, t * BLOCK_K])
            words = w_desc.load([t * BLOCK_KW, pid_n * BLOCK_N])
            zeros, scales = _load_group(qz_ptr, s_ptr, (t * BLOCK_K) // group_size, offs_n[None, :],
                                        (offs_n < N)[None, :], stride_qzg, 1, stride_sg, 1, 4)  # fmt: skip
            w = _dequant_tile(words, zeros, scales, magic_pair, tl.float16, tl.float16, 4, 0x6400, True, True, False)
            if SWAP:
                acc = tl.dot(tl.trans(w), tl.trans(x), acc)
            else:
                acc = tl.dot(x, w, acc)
        if SWAP:
            acc = tl.trans(acc)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(tl.float16), mask=mask)


def tma_linear(x: torch.Tensor, w: K.W4A16Weight, variant: tuple, out: torch.Tensor) -> torch.Tensor:
    bm, bn, bk, warps, stages, swap = variant
    m, k = x.shape
    n = w.out_features
    assert w.bits == 4 and w.group_size % bk == 0 and k % bk == 0 and n % bn == 0 and x.dtype == torch.float16
    descs = (
        TensorDescriptor.from_tensor(x, [bm, bk]),
        TensorDescriptor.from_tensor(w.qweight, [bk // 8, bn]),
    )
    programs = min(triton.cdiv(m, bm) * (n // bn), num_sms(x.device))
    _tma_gemm_kernel[(programs,)](
        *descs, w.qzeros, w.scales, out, m, n, k, w.group_size, 0x64006400, out.stride(0), w.qzeros.stride(0),
        w.scales.stride(0), programs,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SWAP=swap, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def name(v: tuple) -> str:
    bm, bn, bk, warps, stages, swap = v
    return f"tma-m{bm}n{bn}k{bk}w{warps}s{stages}{'t' if swap else ''}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--ms", default="64,128,256,1024,4096")
    args = ap.parse_args()
    timer, rows = Timer(False), []
    for n, k in SHAPES:
        layer = Layer(n, k, 128, "cuda", seed=0)
        for m in [int(v) for v in args.ms.split(",")]:
            fp16 = timer.per_call(fp16_calls(n, k, m, "cuda", layer.gen))
            committed = timer.per_call(layer.calls(m, None))
            row = {"n": n, "k": k, "m": m, "fp16_us": fp16, "committed_us": committed}
            x = torch.randn(m, k, device="cuda", generator=layer.gen).half()
            ref = x.double() @ layer.w64()
            torch_err = ((x @ layer.w64().half()).double() - ref).abs().max().item()
            variants = SKINNY if m <= 32 else VARIANTS
            for v in variants:
                try:
                    out = torch.empty(m, n, device="cuda", dtype=torch.float16)
                    err = (tma_linear(x, layer.weights[0], v, out).double() - ref).abs().max().item()
                    row[f"{name(v)}_ok"] = err <= 2 * torch_err + 2**-20 * ref.abs().max().item()
                    xs = [torch.randn(m, k, device="cuda", generator=layer.gen).half() for _ in layer.weights]
                    outs = [torch.empty(m, n, device="cuda", dtype=torch.float16) for _ in layer.weights]
                    calls = [
                        (lambda x=x, w=w, o=o, v=v: tma_linear(x, w, v, o))
                        for x, w, o in zip(xs, layer.weights, outs, strict=True)
                    ]
                    row[f"{name(v)}_us"] = timer.per_call(calls)
                except Exception as exc:  # a variant that does not compile or fit is reported, not fatal
                    row[f"{name(v)}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            timed = {name(v): row[f"{name(v)}_us"] for v in variants if f"{name(v)}_us" in row}
            cells = " ".join(f"{nm} {fp16 / us:.2f}x{'' if row[f'{nm}_ok'] else ' WRONG'}" for nm, us in timed.items())
            print(f"{n}x{k} M={m}: fp16 {fp16:.1f} us, committed {fp16 / committed:.2f}x | {cells}", flush=True)
            if args.out:  # after every row: a run cut short keeps what it measured
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "probe_w4a16_tma.json").write_text(json.dumps(rows, indent=1))
        del layer
        torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_w4a16_tma.json").write_text(json.dumps(rows, indent=1))
        for row in rows:
            for v in VARIANTS + SKINNY:
                if f"{name(v)}_error" in row:
                    print(f"{row['n']}x{row['k']} M={row['m']} {name(v)}: {row[f'{name(v)}_error']}")


if __name__ == "__main__":
    main()
