"""Probe: the M = 1-2 W4A16 gemv with its packed words brought in by the TMA unit, pipelined over K tiles.

    python benchmarks/probes/probe_gemv_tma.py [--out DIR] [--ms 1,2] [--groups 128]

Why: inside the runtime's batch-1 decode step the committed gemv moves 4-bit weights at 1.75 TB/s (76% of the
step; results/decode-pdl-h200-2026-12-03.md) while the float gemv moves bf16 ones at 3.9 TB/s. Its header says the
loop is latency bound: ptxas issues each packed-word load just before its use, so a CTA has little in flight, and
Triton's cp.async pipelining (num_stages >= 2) was slower. Here the same arithmetic (``w4a16_gemv._mac``, folded
4-bit path, x read four activations per load) and split-K fix-up (``_finish_tile``) read each K tile's words
[BLOCK_K / 8, BLOCK_N] from a TMA descriptor inside a ``tl.range(num_stages=S)`` loop: one bulk copy per tile,
S - 1 tiles in flight per CTA, no per-thread address arithmetic. BLOCK_N = 128 x num_warps keeps every thread
on whole columns (4 of them), as the committed kernel does. Scales and zeros stay plain loads.

Timing as bench_w4a16.py (CUDA graphs over rotated weights, L2 flushed by rotation, medians), cuBLAS fp16 and the
committed path in the same run; every cell checked against float64 (within 2x cuBLAS fp16's own error).
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
from quantkit.kernels import w4a16_configs as C
from quantkit.kernels.w4a16_epilogue import _finish_tile
from quantkit.kernels.w4a16_gemv import MAGIC_F32, _mac, _program_tile
from quantkit.kernels.w4a16_weight import num_sms

# the four largest issue shapes, the decode step's fused q/k/v and gate/up, and the small ones
SHAPES = [(28672, 8192), (8192, 28672), (8192, 8192), (14336, 4096), (4096, 14336), (4096, 4096), (6144, 4096),
          (28672, 4096)]  # fmt: skip
# (BLOCK_N, BLOCK_K, num_warps, num_stages, split_waves)
VARIANTS = [
    (256, 128, 2, 3, 4),
    (256, 128, 2, 4, 4),
    (256, 128, 2, 3, 8),
    (256, 64, 2, 4, 4),
    (256, 64, 2, 4, 8),
    (128, 128, 1, 3, 8),
    (128, 128, 1, 4, 8),
    (512, 64, 4, 3, 4),
]


@triton.jit(do_not_specialize=["M", "group_size", "tiles_per_split", "magic", "sixteen"])
def _gemv_tma_kernel(
    x_ptr, w_desc, qz_ptr, s_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, K, group_size, tiles_per_split, magic, sixteen,
    stride_xm, stride_xk, stride_qzg, stride_qzn, stride_sg, stride_sn, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    SPLIT: tl.constexpr, X_VEC: tl.constexpr, FIXUP: tl.constexpr,
):  # fmt: skip
    BKW: tl.constexpr = BLOCK_K // 8
    pid, m0, offs_n, _, t_begin, t_end = _program_tile(N, K, tiles_per_split, BLOCK_M, BLOCK_N, BLOCK_K)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in tl.range(t_begin, t_end, num_stages=STAGES):
        words = w_desc.load([t * BKW, (pid % tl.cdiv(N, BLOCK_N)) * BLOCK_N])
        grp = (t * BLOCK_K) // group_size
        scales = tl.load(s_ptr + grp * stride_sg + offs_n * stride_sn, mask=n_mask, other=0.0)
        zw = tl.load(qz_ptr + grp * stride_qzg + (offs_n // 8) * stride_qzn, mask=n_mask, other=0)
        zeros = (zw >> ((offs_n % 8) * 4)) & 15
        acc = _mac(acc, words, scales, zeros, x_ptr, t, m0, M, K, stride_xm, stride_xk, magic, sixteen,
                   4, BLOCK_K, True, True, X_VEC)  # fmt: skip
    _finish_tile(acc, out_ptr, out_ptr, part_ptr, lock_ptr, pid, offs_m, offs_n, M, N, stride_om, stride_on,
                 SPLIT, False, False, FIXUP)  # fmt: skip


def gemv_tma(x: torch.Tensor, w, variant: tuple, out: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T through the TMA gemv (4-bit, contiguous groups, K a multiple of BLOCK_K)."""
    bn, bk, warps, stages, split_waves = variant
    m, k = x.shape
    n = w.out_features
    cfg = C.KernelConfig("gemv", 1 if m == 1 else 2, bn, bk, warps, 1, split_waves=split_waves, fold_zero=True,
                         vector_x=True, fixup_unroll=32)  # fmt: skip
    plan = C.plan_launch(cfg, m, n, k, w.group_size, num_sms(x.device))
    assert k % plan.block_k == 0 and w.bits == 4
    out = torch.empty(m, n, device=x.device, dtype=x.dtype) if out is None else out
    part = torch.empty(plan.split_k, m, n, device=x.device, dtype=torch.float32) if plan.split_k > 1 else out
    desc = TensorDescriptor.from_tensor(w.qweight, [plan.block_k // 8, bn])
    _gemv_tma_kernel[plan.grid](
        x, desc, w.qzeros, w.scales, out, part, w.locks,
        m, n, k, w.group_size or 2**30, plan.tiles_per_split, MAGIC_F32, 16,
        x.stride(0), x.stride(1), w.qzeros.stride(0), w.qzeros.stride(1), w.scales.stride(0), w.scales.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=bn, BLOCK_K=plan.block_k, STAGES=stages, SPLIT=plan.split_k > 1,
        X_VEC=x.stride(1) == 1 and x.data_ptr() % 8 == 0 and (m == 1 or x.stride(0) % 4 == 0), FIXUP=32,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def name(v: tuple) -> str:
    bn, bk, w, s, sw = v
    return f"tma-n{bn}k{bk}w{w}s{s}sw{sw}"


def check(layer: Layer, m: int, variant: tuple) -> bool:
    x = torch.randn(m, layer.k, device=layer.device, generator=layer.gen).half()
    ref = x.double() @ layer.w64()
    err = (gemv_tma(x, layer.weights[0], variant).double() - ref).abs().max().item()
    torch_err = ((x @ layer.w64().half()).double() - ref).abs().max().item()
    return err <= 2 * torch_err + 2**-20 * ref.abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--ms", default="1,2")
    ap.add_argument("--groups", default="128")
    args = ap.parse_args()
    timer, dev = Timer(False), "cuda"
    gen = torch.Generator(device=dev).manual_seed(1)
    rows = []
    for n, k in SHAPES:
        for m in map(int, args.ms.split(",")):
            fp16 = timer.per_call(fp16_calls(n, k, m, dev, gen))
            for group in map(int, args.groups.split(",")):
                layer = Layer(n, k, group, dev, seed=n + k)
                table = C.config_for(m, n)
                row = {"n": n, "k": k, "m": m, "group": group, "fp16_us": fp16, "bytes": layer.bytes}
                row["committed_ok"] = layer.check(m, table)["ok"]
                row["committed_us"] = timer.per_call(layer.calls(m, table))
                line = [
                    f"{n}x{k} g{group} M={m}: fp16 {fp16:.1f} us, committed {row['committed_us']:.1f} us "
                    f"({fp16 / row['committed_us']:.2f}x, {layer.bytes / row['committed_us'] / 1e6:.2f} TB/s)"
                ]
                for v in VARIANTS:
                    try:
                        ok = check(layer, m, v)
                        r = len(layer.weights)
                        xs = [torch.randn(m, k, device=dev, generator=gen).half() for _ in range(r)]
                        outs = [torch.empty(m, n, device=dev, dtype=torch.float16) for _ in range(r)]
                        calls = [(lambda x=x, w=w, o=o, v=v: gemv_tma(x, w, v, o))
                                 for x, w, o in zip(xs, layer.weights, outs, strict=True)]  # fmt: skip
                        us = timer.per_call(calls)
                    except Exception as exc:  # a variant that fails to compile or launch: the others still run
                        row[name(v) + "_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                        line.append(f"{name(v)}: FAILED {row[name(v) + '_error'][:120]}")
                        continue
                    row[name(v) + "_ok"], row[name(v) + "_us"] = ok, us
                    line.append(f"{name(v):<24} {us:7.1f} us {fp16 / us:5.2f}x {layer.bytes / us / 1e6:5.2f} TB/s"
                                f"{'' if ok else ' WRONG'}")  # fmt: skip
                rows.append(row)
                print("\n    ".join(line), flush=True)
                del layer
                torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_gemv_tma.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
