"""Probe: a W4A16 tensor-core kernel whose dequantized weight tile never leaves the registers (wgmma with A in
registers), fed by a fragment-ordered weight layout.

    python benchmarks/probes/probe_rega.py [--out DIR] [--ms 1,2,4,8,16,32,64,128,256] [--groups 128] [--set asm|stages]

Why: the committed swapped kernel (``w4a16.py``, SWAP_AB) dequantizes a [BLOCK_K, BLOCK_N] tile in a blocked layout,
stores it to shared memory and reads it back for the wgmma's A operand (STS + LDS/LDSM and a CTA barrier per tile;
``benchmarks/sass_w4a16.py``). Hopper's wgmma can take A from registers, and Triton 3.6 keeps it there when the
tile's layout can be reached from the loaded one without moving data between threads: a static compile for sm_90
(2026-12-03) showed that a tile built from packed words by bit operations, ``tl.join``, ``tl.permute`` and
``tl.reshape`` reaches the wgmma's register operand directly, with only the packed words pipelined through shared
memory (cp.async), if each thread's words hold exactly the codes of its fragment. For the m64nNk16 A fragment
(fp16) a thread owns, in each 16-deep K step, the pairs k = 2t, 2t + 1 and 8 + 2t, 9 + 2t (t = lane % 4) of two
rows. The layout here ("frag", [N, K/8] int32, row n's K tiles of BLOCK_K codes one after the other): word
(t, j) of a tile (stored at t * J + j, J = BLOCK_K / 32, so a thread's J words are one 16-byte load at J = 4) holds
the codes k = 32 j + 16 a + 8 b + 2 t + p at nibble 4 p + 2 a + b, so (w >> 4 s) & 0x000F000F | 0x64006400 is the
fp16 pair (1024 + code(a, b, 0), 1024 + code(a, b, 1)) for s = 2 a + b: one AND/OR per two codes (one LOP3 with
``--set asm``, where zero and scale are applied per 32-bit pair in PTX; two in the tl mode), the idea of Marlin's
layout for mma.sync on Ampere. ``--set stages`` varies how the words travel (cp.async stages or straight loads).

The probe's kernel serves fp16, 4-bit, asymmetric groups that are multiples of BLOCK_K, N and K multiples of the
tiles (the benchmark shapes); split-K with ``w4a16_epilogue._finish_tile``. Timing as bench_w4a16.py (CUDA graphs
over rotated operands, L2 flushed, medians); each candidate is checked against float64 first (within 2x cuBLAS
fp16's own error). The committed path of each M is timed in the same run. Rows printed and the JSON rewritten as
they come.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16
from bench_w4a16 import SHAPES, Layer, Timer, fp16_calls
from quantkit.kernels import w4a16_configs as C
from quantkit.kernels.w4a16_epilogue import _finish_tile
from quantkit.kernels.w4a16_weight import W4A16Weight, as_int32_words, interpreting, num_sms, unpack_gptq_codes

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, split_waves)
SKINNY = [
    (16, 64, 128, 4, 4, 4),
    (16, 128, 128, 4, 4, 4),
    (16, 128, 128, 8, 4, 4),
    (16, 64, 64, 4, 6, 4),
    (16, 128, 128, 4, 4, 8),
    (16, 256, 128, 8, 3, 2),
]
MEDIUM = [
    (32, 128, 128, 4, 4, 2),
    (64, 64, 128, 4, 4, 2),
    (64, 128, 128, 4, 3, 2),
    (64, 128, 128, 8, 4, 2),
]
LARGE = [
    (128, 128, 64, 4, 4, 1),
    (128, 128, 128, 8, 3, 1),
    (128, 256, 64, 8, 3, 1),
    (256, 128, 64, 8, 3, 1),
]


# --set asm: the zero and scale applied per 32-bit pair in PTX (``_pair_asm``), next to the best tl config
ASM = {
    "skinny": [(16, 64, 128, 4, 4, 4), (16, 64, 128, 4, 4, 4, "asm"), (16, 128, 128, 4, 4, 4, "asm"),
               (16, 128, 128, 8, 4, 4, "asm"), (16, 128, 128, 4, 4, 8, "asm"), (16, 64, 128, 4, 4, 8, "asm")],
    "medium": [(32, 128, 128, 4, 4, 2), (32, 128, 128, 4, 4, 2, "asm"), (64, 128, 128, 8, 4, 2, "asm"),
               (64, 64, 128, 4, 4, 2, "asm"), (32, 64, 128, 4, 4, 4, "asm")],
    "large": [(128, 128, 128, 8, 3, 1), (128, 128, 128, 8, 3, 1, "asm"), (128, 128, 64, 4, 4, 1, "asm")],
}  # fmt: skip
# --set stages: the PTX pairs with the words loaded straight into registers (num_stages 1: no cp.async, no shared
# memory for them; what the CUDA-core gemv does) or 2 stages, against the 4-stage config
STAGES = [(16, 64, 128, 4, 4, 4, "asm"), (16, 64, 128, 4, 1, 4, "asm"), (16, 64, 128, 4, 1, 8, "asm"),
          (16, 64, 128, 4, 2, 4, "asm"), (16, 128, 128, 4, 1, 4, "asm"), (16, 64, 64, 4, 1, 8, "asm")]  # fmt: skip


def frag_pack(qweight: torch.Tensor, k: int, block_k: int) -> torch.Tensor:
    """GPTQ-v2 4-bit qweight [K/8, N] -> the "frag" layout int32 [N, K/8] for tiles of ``block_k`` codes."""
    j = block_k // 32
    codes = unpack_gptq_codes(qweight, 4, k).t().long()  # [N, K]
    n = codes.shape[0]
    c = codes.reshape(n, k // block_k, j, 2, 2, 4, 2)  # k = 32 j + 16 a + 8 b + 2 t + p -> [N, T, j, a, b, t, p]
    c = c.permute(0, 1, 5, 2, 6, 3, 4)  # [N, T, t, j, p, a, b]: word t * J + j, nibble 4 p + 2 a + b
    c = c.reshape(n, k // 8, 8)
    words = (c << (4 * torch.arange(8, device=c.device))).sum(-1)
    return as_int32_words(words)


def sz_pack(w: W4A16Weight) -> torch.Tensor:
    """fp16 scales [n_g, N] and packed zeros -> int32 [n_g, N]: scale bits low, the fp16 pattern of 1024 + zero high
    (one load per row and tile; the kernel reads both halves as fp16)."""
    n = w.out_features
    z = unpack_gptq_codes(w.qzeros.t().contiguous(), 4, n).t().long()  # [n_g, N]
    words = (w.scales.view(torch.int16).long() & 0xFFFF) | ((0x6400 + z) << 16)
    return as_int32_words(words)


@triton.jit
def _frag_order(a0, a1, a2, a3):
    """Four int32 pair words [BN, 4, J] (pair s = 2 a + b: code p = 0 in the low half, p = 1 in the high half) ->
    the tile [BN, 32 J] in natural k order (k = 32 j + 16 a + 8 b + 2 t + p), each half read as fp16."""
    v = tl.join(tl.join(tl.join(a0, a0 >> 16), tl.join(a1, a1 >> 16)),
                tl.join(tl.join(a2, a2 >> 16), tl.join(a3, a3 >> 16)))  # fmt: skip
    v = tl.permute(v, (0, 2, 5, 4, 1, 3))  # [BN, t, J, p, b, a] -> [BN, J, a, b, t, p]
    v = tl.reshape(v, (a0.shape[0], a0.shape[1] * a0.shape[2] * 8))
    return v.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _frag_tile(words):
    """words [BN, 4, J] int32 (frag layout) -> [BN, 32 J] fp16 values 1024 + code in natural tile k order.

    The magic constant is a compile-time one: as a run-time scalar (the committed kernels' way to get one LOP3 per
    pair) Triton 3.6 no longer carries the wgmma operand's layout back to the load and converts the tile through
    shared memory instead (static check, sm_90). The zero/scale arithmetic on this tile costs one PRMT per pair in
    SASS (re-pairing the fp16 halves); joining p last instead of first compiles to the same 64 PRMTs per 64 x 128
    tile (static check)."""
    return _frag_order((words & 0x000F000F) | 0x64006400, ((words >> 4) & 0x000F000F) | 0x64006400,
                       ((words >> 8) & 0x000F000F) | 0x64006400, ((words >> 12) & 0x000F000F) | 0x64006400)  # fmt: skip


@triton.jit
def _pair_asm(shifted, sz):
    """One fp16 pair (q0 - z) * s, (q1 - z) * s from ``shifted`` (codes at bits 0-3 and 16-19, higher bits ignored)
    and ``sz`` (scale | (1024 + z) << 16), as an int32: LOP3 + HSUB2 + HMUL2 (the PRMTs of z and s depend on the row
    only). Explicit .rn keeps ptxas from contracting the two into an FMA: the product is rounded once, of an exact
    difference, like the tl path."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 q, z, s;
        lop3.b32 q, $1, 0x000F000F, 0x64006400, 0xEA;
        prmt.b32 z, $2, 0, 0x3232;
        prmt.b32 s, $2, 0, 0x1010;
        sub.rn.f16x2 q, q, z;
        mul.rn.f16x2 $0, q, s;
        }""",
        constraints="=r,r,r",
        args=[shifted, sz],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _frag_tile_asm(words, sz):
    """``_frag_tile`` with the zero and scale applied to each 32-bit pair in PTX (``_pair_asm``): the arithmetic then
    never splits a pair, which is where the tl path's PRMTs came from. sz [BN, 1, 1]. GPU only (inline PTX)."""
    return _frag_order(_pair_asm(words, sz), _pair_asm(words >> 4, sz), _pair_asm(words >> 8, sz),
                       _pair_asm(words >> 12, sz))  # fmt: skip


@triton.jit(do_not_specialize=["M", "group_size", "tiles_per_split"])
def _rega_kernel(x_ptr, wf_ptr, sz_ptr, out_ptr, part_ptr, lock_ptr, M, N, K, group_size, tiles_per_split,
                 stride_xm, stride_wn, stride_szg, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                 FIXUP: tl.constexpr, MODE: tl.constexpr):  # fmt: skip
    J: tl.constexpr = BLOCK_K // 32
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    w_ptrs = (wf_ptr + offs_n[:, None, None] * stride_wn + tl.arange(0, 4)[None, :, None] * J
              + tl.arange(0, J)[None, None, :])  # fmt: skip
    xt_ptrs = x_ptr + offs_k[:, None] + offs_m[None, :] * stride_xm  # x.T tile [BLOCK_K, BLOCK_M]
    k_tiles = tl.cdiv(K, BLOCK_K)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, k_tiles)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for t in range(t_begin, t_end):
        words = tl.load(w_ptrs + t * (BLOCK_K // 8))
        xt = tl.load(xt_ptrs + t * BLOCK_K, mask=m_mask[None, :], other=0.0)
        sz = tl.load(sz_ptr + (t * BLOCK_K) // group_size * stride_szg + offs_n[:, None])
        if MODE == "asm":
            w = _frag_tile_asm(words, tl.expand_dims(sz, 2))
        elif MODE == "nodq":  # ablation: codes read as 1024 + q, no zero or scale (wrong values, same bytes)
            w = _frag_tile(words) + sz.to(tl.int16).to(tl.float16, bitcast=True) * 0
        else:
            scales = sz.to(tl.int16).to(tl.float16, bitcast=True)
            z = (sz >> 16).to(tl.int16).to(tl.float16, bitcast=True)
            w = (_frag_tile(words) - z) * scales
        acc = tl.dot(w, xt, acc)
    acc = tl.trans(acc)
    _finish_tile(acc, out_ptr, out_ptr, part_ptr, lock_ptr, pid, offs_m, offs_n, M, N, stride_om, 1, SPLIT,
                 False, False, FIXUP)  # fmt: skip


def rega_linear(x: torch.Tensor, w: W4A16Weight, wf: tuple, variant: tuple, out: torch.Tensor):
    """``wf``: (frag_pack's words, sz_pack's scale-zero words)."""
    bm, bn, bk, warps, stages, waves, *mode = variant
    m, k = x.shape
    n = w.out_features
    assert w.bits == 4 and w.group_size % bk == 0 and k % bk == 0 and n % bn == 0 and x.dtype == torch.float16
    cfg = C.KernelConfig("fused", bm, bn, bk, warps, stages, split_waves=waves)
    plan = C.plan_launch(cfg, m, n, k, w.group_size, num_sms(x.device))
    part = out
    if plan.split_k > 1:
        part = torch.empty(plan.split_k, m, n, device=x.device, dtype=torch.float32)
    _rega_kernel[plan.grid](
        x, wf[0], wf[1], out, part, w.locks, m, n, k, w.group_size, plan.tiles_per_split,
        x.stride(0), wf[0].stride(0), wf[1].stride(0), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=plan.split_k > 1, FIXUP=C.fixup_unroll(cfg),
        MODE=mode[0] if mode else "tl", num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def name(v: tuple) -> str:
    bm, bn, bk, warps, stages, waves, *mode = v
    return f"rega-m{bm}n{bn}k{bk}w{warps}s{stages}sw{waves}" + (f"-{mode[0]}" if mode and mode[0] != "tl" else "")


def variants_for(m: int, which: str = "tl") -> list[tuple]:
    if which == "asm":
        return ASM["skinny" if m <= 16 else "medium" if m <= 64 else "large"]
    if which == "stages":
        return STAGES
    if m <= 16:
        return SKINNY
    if m <= 64:
        return [v for v in MEDIUM if v[0] >= m] + [(16, 128, 128, 4, 4, 4)] * (m <= 32)
    return [v for v in LARGE if v[0] <= max(m, 128)]


def check(x, w, wf, v, ref, torch_err) -> bool:
    out = torch.full((x.shape[0], w.out_features), float("nan"), device=x.device, dtype=torch.float16)
    err = (rega_linear(x, w, wf, v, out).double() - ref).abs().max().item()
    return err <= 2 * torch_err + 2**-20 * ref.abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--ms", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--groups", default="128")
    ap.add_argument("--shapes", default="", help="N:K,... (default: the six issue shapes)")
    ap.add_argument("--set", default="tl", choices=["tl", "asm", "stages"],
                    help="asm: PTX pair arithmetic (ASM); stages: the same, words straight to registers")  # fmt: skip
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    ms = [int(v) for v in args.ms.split(",")]
    timer, rows = Timer(False), []
    for n, k in shapes:
        base = {m: timer.per_call(fp16_calls(n, k, m, "cuda", torch.Generator("cuda").manual_seed(n))) for m in ms}
        for group in [int(g) for g in args.groups.split(",")]:
            layer = Layer(n, k, group, "cuda", seed=n + k + group)
            packed = {}
            for m in ms:
                fp16 = base[m]
                committed = timer.per_call(layer.calls(m, None))
                row = {"n": n, "k": k, "group": group, "m": m, "fp16_us": fp16, "committed_us": committed,
                       "committed": C.config_for(m, n).name}  # fmt: skip
                x = torch.randn(m, k, device="cuda", generator=layer.gen).half()
                ref = x.double() @ layer.w64()
                torch_err = ((x @ layer.w64().half()).double() - ref).abs().max().item()
                for v in variants_for(m, args.set):
                    try:
                        bk = v[2]
                        if bk not in packed:
                            packed[bk] = [(frag_pack(w.qweight, k, bk), sz_pack(w)) for w in layer.weights]
                        row[f"{name(v)}_ok"] = check(x, layer.weights[0], packed[bk][0], v, ref, torch_err)
                        xs = [torch.randn(m, k, device="cuda", generator=layer.gen).half() for _ in layer.weights]
                        outs = [torch.empty(m, n, device="cuda", dtype=torch.float16) for _ in layer.weights]
                        calls = [
                            (lambda x=x, w=w, wf=wf, o=o, v=v: rega_linear(x, w, wf, v, o))
                            for x, w, wf, o in zip(xs, layer.weights, packed[bk], outs, strict=True)
                        ]
                        row[f"{name(v)}_us"] = timer.per_call(calls)
                    except Exception as exc:  # a variant that does not compile or fit is reported, not fatal
                        row[f"{name(v)}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                rows.append(row)
                cells = " ".join(
                    f"{name(v)} {fp16 / row[f'{name(v)}_us']:.2f}x{'' if row[f'{name(v)}_ok'] else ' WRONG'}"
                    if f"{name(v)}_us" in row else f"{name(v)} ERROR"
                    for v in variants_for(m, args.set)
                )  # fmt: skip
                print(f"{n}x{k} g{group} M={m}: fp16 {fp16:.1f} us, committed {fp16 / committed:.2f}x | {cells}",
                      flush=True)  # fmt: skip
                if args.out:  # after every row: a run cut short keeps what it measured
                    args.out.mkdir(parents=True, exist_ok=True)
                    name_json = f"probe_rega{'' if args.set == 'tl' else '-' + args.set}.json"
                    (args.out / name_json).write_text(json.dumps(rows, indent=1))
            del layer, packed
            torch.cuda.empty_cache()
    for row in rows:
        for key, val in row.items():
            if key.endswith("_error"):
                print(f"{row['n']}x{row['k']} M={row['m']} {key[:-6]}: {val}")


def interpreter_check() -> None:
    """CPU self-check under TRITON_INTERPRET=1: the frag layout and kernel against float64 on a small layer."""
    assert interpreting(), "run with TRITON_INTERPRET=1"
    from bench_w4a16 import dequant64, random_weight

    gen = torch.Generator().manual_seed(0)
    for n, k, group, m, v in [(128, 256, 128, 3, (16, 64, 128, 4, 4, 4)), (256, 512, 128, 20, (32, 128, 64, 4, 3, 2)),
                              (128, 256, 64, 1, (16, 64, 64, 4, 3, 8))]:  # fmt: skip
        w = random_weight(n, k, group, "cpu", gen)
        x = torch.randn(m, k, generator=gen).half()
        ref = x.double() @ dequant64(w)
        torch_err = ((x.float() @ dequant64(w).float()).half().double() - ref).abs().max().item()
        ok = check(x, w, (frag_pack(w.qweight, k, v[2]), sz_pack(w)), v, ref, torch_err)
        print(n, k, group, m, name(v), "ok" if ok else "WRONG")


if __name__ == "__main__":
    if interpreting():
        interpreter_check()
    else:
        main()
