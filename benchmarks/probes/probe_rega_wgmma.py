"""Probe: a W4A16 product for M = 16-64 where each thread unpacks its packed words straight into the register A
operand of an asynchronous wgmma (weights as A, "swap AB"), in Gluon, so that unpacking tile t + 1 runs while the
tensor cores multiply tile t.

    python benchmarks/probes/probe_rega_wgmma.py [--out DIR] [--ms 16,32,64] [--groups 128] [--shapes all|big]
        [--variants rw-n64k128s4,...]
    PYTHONPATH=<triton 3.6>:benchmarks python benchmarks/probes/probe_rega_wgmma.py --compile   # no GPU

Result (H200, results/w4a16-rega-wgmma-h200-2026-12-04.md): 1.46-1.52x cuBLAS fp16 at M = 64 on 28672 x 8192 /
8192 x 28672 (committed Triton tiles 0.91x / 1.18x), 1.74x / 1.81x at M = 32; behind the mma.sync gemv at M = 16 and
on 4096 x 4096. Not in the dispatch.

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
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16
sys.path.insert(0, str(Path(__file__).resolve().parent))  # probe_mma_gemv
from probe_mma_gemv import walk
from quantkit.kernels.w4a16_weight import W4A16Weight, num_sms


def _pairs_ptx(bf16: bool) -> str:
    """PTX: word $4, zero pair $5 (two 16-bit magic + z), scale $6 (fp16 pair, or fp32 for bf16) -> $0..$3, the
    dequantized codes (j, j + 4) of the word as one 16-bit pair each (low half code j)."""
    kind, magic = ("bf16", 0x43004300) if bf16 else ("f16", 0x64006400)
    lines = ["{", ".reg .b32 u, l, h;"]
    for j in range(4):
        src = "$4"
        if j:
            lines.append(f"shr.u32 u, $4, {4 * j};")
            src = "u"
        lines += [f"lop3.b32 ${j}, {src}, 0x000F000F, {magic:#010x}, 0xea;", f"sub.rn.{kind}x2 ${j}, ${j}, $5;"]
        if bf16:  # exact q - z widened to fp32, times the fp32 scale, rounded once per value
            lines += [f"shl.b32 l, ${j}, 16;", f"and.b32 h, ${j}, 0xFFFF0000;", "mul.rn.f32 l, l, $6;",
                      "mul.rn.f32 h, h, $6;", f"cvt.rn.bf16x2.f32 ${j}, h, l;"]  # fmt: skip
        else:
            lines.append(f"mul.rn.f16x2 ${j}, ${j}, $6;")
    return "\n".join([*lines, "}"])


_F16_PAIRS = gl.constexpr(_pairs_ptx(False))
_BF16_PAIRS = gl.constexpr(_pairs_ptx(True))


@gluon.jit
def _fragment(words, zz, ss, BN: gl.constexpr, BK: gl.constexpr, a_layout: gl.constexpr, BF16: gl.constexpr):
    """words [BN, BK / 8] (word row 4 b + c of each weight row), zero pairs and scales [BN, 1] -> the A tile
    [BN, BK] in the wgmma's register layout, K in the permuted order (16 t + 8 h + 2 c + e <- code 2 t + h + 4 e of
    word c)."""
    zb, _ = gl.broadcast(zz, words)
    sb, _ = gl.broadcast(ss, words)
    if BF16:
        p0, p1, p2, p3 = gl.inline_asm_elementwise(
            _BF16_PAIRS,
            "=r,=r,=r,=r,r,r,f",
            [words, zb, sb],
            (gl.int32, gl.int32, gl.int32, gl.int32),
            is_pure=True,
            pack=1,
        )
    else:
        p0, p1, p2, p3 = gl.inline_asm_elementwise(
            _F16_PAIRS,
            "=r,=r,=r,=r,r,r,r",
            [words, zb, sb],
            (gl.int32, gl.int32, gl.int32, gl.int32),
            is_pure=True,
            pack=1,
        )
    v = gl.join(gl.join(p0, p1), gl.join(p2, p3))  # [BN, BK / 8, h, t]
    v = gl.join(v & 0xFFFF, v >> 16)  # [BN, BK / 8, h, t, e]
    v = gl.reshape(v, [BN, BK // 32, 4, 2, 2, 2])  # [n, b, c, h, t, e]
    v = gl.permute(v, [0, 1, 4, 3, 2, 5])  # [n, b, t, h, c, e]
    v = gl.reshape(v, [BN, BK]).to(gl.int16)
    if BF16:
        v = v.to(gl.bfloat16, bitcast=True)
    else:
        v = v.to(gl.float16, bitcast=True)
    return gl.convert_layout(v, a_layout, assert_trivial=True)


# eight 16-bit values ($4-$7) stored if M ($8) < 0, never true: a use of the registers ptxas cannot remove
_KEEP_ASM = gl.constexpr(
    "{\n.reg .pred p;\nsetp.lt.s32 p, $8, 0;\n@p st.global.v4.b32 [$16], {$4, $5, $6, $7};\n"
    "mov.b32 $0, 0;\nmov.b32 $1, 0;\nmov.b32 $2, 0;\nmov.b32 $3, 0;\n}"
)
_KEEP_CONSTRAINTS = gl.constexpr("=r,=r,=r,=r,r,r,r,r," + ",".join(["r"] * 8) + "," + ",".join(["l"] * 8))


@gluon.jit
def _keep(a, M, ptr):
    """A use of every register of fragment ``a`` that ptxas cannot drop (a store predicated on M < 0, never true):
    placed after the wgmma_wait that retires the wgmma reading ``a``, it keeps those registers from being handed to
    the next fragment while that wgmma may still read them. PTX leaves rewriting them before the wait undefined, and
    ptxas 12.8 does rewrite them (triton-lang/triton#9433; measured here: wrong results at M > 16 without it)."""
    mb = gl.full(a.shape, 0, gl.int32, layout=a.type.layout) + M
    pb = gl.full(a.shape, 0, gl.int64, layout=a.type.layout) + ptr.to(gl.int64, bitcast=True)
    gl.inline_asm_elementwise(_KEEP_ASM, _KEEP_CONSTRAINTS, [a, mb, pb], a.dtype, is_pure=False, pack=8)


@gluon.jit
def _group_pairs(qz_ptr, s_ptr, rows, z_shift, g, stride_qzg, stride_sg, BF16: gl.constexpr):
    """Group g's zero pairs (two 16-bit magic + z) and scales (fp16 pair, or fp32 for bf16) as [BN, 1]."""
    MAGIC: gl.constexpr = 0x4300 if BF16 else 0x6400
    zw = gl.load(qz_ptr + g * stride_qzg + rows // 8)
    zv = ((zw >> z_shift) & 0xF) | MAGIC
    zz = gl.expand_dims(zv | (zv << 16), 1)
    if BF16:
        ss = gl.expand_dims(gl.load(s_ptr + g * stride_sg + rows).to(gl.float32), 1)
    else:
        sv = gl.load(s_ptr + g * stride_sg + rows).to(gl.int32) & 0xFFFF
        ss = gl.expand_dims(sv | (sv << 16), 1)
    return zz, ss


@gluon.jit
def _refill(x_desc, x_smem, bars, nt, k0, k_tiles, BK: gl.constexpr, STAGES: gl.constexpr):
    """After a CTA barrier (every warp group past the wgmma that read it): x tile nt into its slot."""
    gl.thread_barrier()
    ns = nt % STAGES
    pred = nt < k_tiles
    mbarrier.expect(bars.index(ns), x_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(x_desc, [0, k0 + nt * BK], bars.index(ns), x_smem.index(ns), pred=pred)


@gluon.jit
def _tile(t, words, w_ptrs, acc, a_prev, x_desc, x_smem, bars, qz_ptr, s_ptr, rows, z_shift, k0, k_tiles, M,
          out_ptr, stride_qzg, stride_sg, stride_qwk, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
          GROUP: gl.constexpr, BF16: gl.constexpr, a_layout: gl.constexpr):  # fmt: skip
    """One K tile of the overlapped loop: unpack tile t (its words loaded a tile ago) while wgmma t - 1 runs, issue
    wgmma t, wait for t - 1 only, keep t - 1's fragment ``a_prev`` alive up to that wait. Returns the accumulator,
    this tile's fragment and the next tile's words."""
    zz, ss = _group_pairs(qz_ptr, s_ptr, rows, z_shift, (k0 + t * BK) // GROUP, stride_qzg, stride_sg, BF16)
    words_next = gl.load(w_ptrs + gl.minimum(t + 1, k_tiles - 1) * (BK // 8) * stride_qwk)
    a = _fragment(words, zz, ss, BN, BK, a_layout, BF16)
    slot = t % STAGES
    mbarrier.wait(bars.index(slot), (t // STAGES) & 1)
    acc = warpgroup_mma(a, x_smem.index(slot).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    _keep(a_prev, M, out_ptr)
    _refill(x_desc, x_smem, bars, t + STAGES - 1, k0, k_tiles, BK, STAGES)
    return acc, a, words_next


@gluon.jit
def _rega_wgmma_kernel(
    x_desc, qw_ptr, qz_ptr, s_ptr, out_ptr,
    M, N, K, stride_qwk, stride_qzg, stride_sg, stride_om, stride_os,
    BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr,
    BF16: gl.constexpr, OVERLAP: gl.constexpr, ACC_LAYOUT: gl.constexpr, A_LAYOUT: gl.constexpr, W_LAYOUT: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    KW: gl.constexpr = BK // 8
    act: gl.constexpr = x_desc.dtype
    acc_layout: gl.constexpr = ACC_LAYOUT
    a_layout: gl.constexpr = A_LAYOUT
    w_layout: gl.constexpr = W_LAYOUT
    row_layout: gl.constexpr = gl.SliceLayout(1, w_layout)

    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    k_tiles = K // BK // gl.num_programs(1)
    k0 = pid_k * k_tiles * BK
    off_n = pid_n * BN

    rows = off_n + gl.arange(0, BN, layout=row_layout)
    wcols = gl.arange(0, KW, layout=gl.SliceLayout(0, w_layout))
    w_ptrs = qw_ptr + gl.expand_dims(wcols, 0) * stride_qwk + gl.expand_dims(rows, 1) + (k0 // 8) * stride_qwk
    z_shift = (rows % 8) * 4

    x_smem = gl.allocate_shared_memory(act, [STAGES, BM, BK], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES - 1):
        pred = i < k_tiles
        mbarrier.expect(bars.index(i), x_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(x_desc, [0, k0 + i * BK], bars.index(i), x_smem.index(i), pred=pred)

    words = gl.load(w_ptrs)
    acc = gl.zeros([BN, BM], gl.float32, layout=acc_layout)
    gl.assume(k_tiles > 0)
    if OVERLAP:  # unpack tile t while wgmma t - 1 runs; two fragments, even and odd tiles
        a1 = gl.zeros([BN, BK], act, layout=a_layout)
        for t in range(0, k_tiles, 2):
            acc, a0, words = _tile(t, words, w_ptrs, acc, a1, x_desc, x_smem, bars, qz_ptr, s_ptr, rows, z_shift,
                                   k0, k_tiles, M, out_ptr, stride_qzg, stride_sg, stride_qwk, BN, BK, STAGES, GROUP,
                                   BF16, a_layout)  # fmt: skip
            acc, a1, words = _tile(t + 1, words, w_ptrs, acc, a0, x_desc, x_smem, bars, qz_ptr, s_ptr, rows, z_shift,
                                   k0, k_tiles, M, out_ptr, stride_qzg, stride_sg, stride_qwk, BN, BK, STAGES, GROUP,
                                   BF16, a_layout)  # fmt: skip
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    else:  # each wgmma retired within its iteration: overlap comes from other CTAs only
        for t in range(k_tiles):
            zz, ss = _group_pairs(qz_ptr, s_ptr, rows, z_shift, (k0 + t * BK) // GROUP, stride_qzg, stride_sg, BF16)
            words_next = gl.load(w_ptrs + gl.minimum(t + 1, k_tiles - 1) * KW * stride_qwk)
            a = _fragment(words, zz, ss, BN, BK, a_layout, BF16)
            slot = t % STAGES
            mbarrier.wait(bars.index(slot), (t // STAGES) & 1)
            acc = warpgroup_mma(a, x_smem.index(slot).permute((1, 0)), acc, is_async=True)
            acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
            words = words_next
            _refill(x_desc, x_smem, bars, t + STAGES - 1, k0, k_tiles, BK, STAGES)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    orow = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_layout))
    ocol = gl.arange(0, BM, layout=gl.SliceLayout(0, acc_layout))
    ptrs = out_ptr + pid_k * stride_os + gl.expand_dims(ocol, 0) * stride_om + gl.expand_dims(orow, 1)
    mask = gl.expand_dims(ocol < M, 0) & gl.expand_dims(orow < N, 1)
    gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class RegaConfig:
    block_n: int = 64
    block_k: int = 128
    stages: int = 4
    num_warps: int = 4
    split_waves: float = 1.0  # split K until the grid holds this many CTAs per SM (partials summed by PyTorch)
    overlap: bool = True  # unpack tile t while wgmma t - 1 runs (False: wait for it first); even tile count

    @property
    def name(self) -> str:
        base = f"rw-n{self.block_n}k{self.block_k}s{self.stages}w{self.num_warps}v{self.split_waves:g}"
        return base + ("" if self.overlap else "-w0")


def parse_variant(name: str) -> RegaConfig:
    hit = re.fullmatch(r"rw-n(\d+)k(\d+)s(\d+)w(\d+)v([\d.]+)(-w0)?", name)
    if not hit:
        raise SystemExit(f"--variants: cannot read {name!r} (expected e.g. rw-n64k128s4w4v1 or ...-w0)")
    n, k, s, w, v, w0 = hit.groups()
    return RegaConfig(int(n), int(k), int(s), int(w), float(v), overlap=not w0)


def layouts(bm: int, bn: int, bk: int, num_warps: int) -> tuple:
    """(accumulator [BN, BM], A operand [BN, BK], packed words [BN, BK / 8]) register layouts. Thread
    (warp w, lane 4 g + c) holds the words of rows 16 w + g, 16 w + g + 8 (+ 16 num_warps r) and word rows 4 b + c:
    the A fragment's rows and, in the permuted K order, its codes."""
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, bm, 16])
    a = gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)
    log2 = int.bit_length
    reg = [[8, 0]] + [[0, 4 << i] for i in range(log2(bk // 32) - 1)]
    reg += [[16 * num_warps << i, 0] for i in range(log2(bn // (16 * num_warps)) - 1)]
    words = gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
                                       warp_bases=[[16 << i, 0] for i in range(log2(num_warps) - 1)], block_bases=[],
                                       shape=[bn, bk // 8])  # fmt: skip
    return acc, a, words


def permute_x(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> x with each 32-block in the order the kernel's fragments take the codes (see the header)."""
    m, k = x.shape
    return x.view(m, k // 32, 4, 2, 2, 2).permute(0, 1, 4, 5, 2, 3).reshape(m, k)


def block_m(m: int) -> int:
    """The wgmma's N (x rows per tile) for M rows: 16, 32 or 64."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def rega_split(cfg: RegaConfig, n: int, k: int, sms: int) -> int:
    """Split-K factor: doubled while the grid holds fewer than ``split_waves`` CTAs per SM, K splits into whole
    tiles and each part keeps at least 512 of K (``rega_wgmma`` refuses an odd tile count for the overlapped loop)."""
    tiles = n // cfg.block_n
    split = 1
    while tiles * split < cfg.split_waves * sms and k % (cfg.block_k * split * 2) == 0 and k // (split * 2) >= 512:
        split *= 2
    return split


def rega_wgmma(x: torch.Tensor, w: W4A16Weight, config: RegaConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    m, k = x.shape
    n = w.out_features
    group = w.group_size or k
    if w.bits != 4 or w.perm is not None or group % config.block_k or n % config.block_n or m > 64:
        raise ValueError(f"{config.name}: 4-bit, no act-order, group a multiple of {config.block_k}, "
                         f"N a multiple of {config.block_n}, M <= 64")  # fmt: skip
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    bm = block_m(m)
    act = gl.float16 if x.dtype == torch.float16 else gl.bfloat16
    xp = permute_x(x)
    x_desc = TensorDescriptor.from_tensor(xp, [bm, config.block_k],
                                          gl.NVMMASharedLayout.get_default_for([bm, config.block_k], act))  # fmt: skip
    split = rega_split(config, n, k, num_sms(x.device))
    if config.overlap and (k // (config.block_k * split)) % 2:
        raise ValueError(f"{config.name}: the overlapped loop takes K tiles in pairs")
    target = out if split == 1 else torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    scales = w.scales if x.dtype == torch.bfloat16 else w.scales.view(torch.int16)
    _rega_wgmma_kernel[(n // config.block_n, split)](
        x_desc, w.qweight, w.qzeros, scales, target,
        m, n, k, w.qweight.stride(0), w.qzeros.stride(0), w.scales.stride(0), n, m * n if split > 1 else 0,
        BM=bm, BN=config.block_n, BK=config.block_k, STAGES=config.stages, GROUP=group,
        BF16=x.dtype == torch.bfloat16, OVERLAP=config.overlap, num_warps=config.num_warps,
        **dict(zip(("ACC_LAYOUT", "A_LAYOUT", "W_LAYOUT"), layouts(bm, config.block_n, config.block_k,
                                                                   config.num_warps), strict=True)),
    )  # fmt: skip
    if split > 1:
        out.copy_(target.sum(0))
    return out


def linear(x, w, config, out=None):
    return rega_wgmma(x, w, config, out)


VARIANTS = [
    RegaConfig(64, 128, 4, 4, 1.0),
    RegaConfig(64, 128, 4, 4, 2.0),
    RegaConfig(128, 128, 4, 4, 1.0),
    RegaConfig(128, 128, 4, 8, 1.0),
    RegaConfig(64, 64, 6, 4, 2.0),
]

SHAPES = [(28672, 8192), (8192, 28672), (8192, 8192), (14336, 4096), (4096, 14336), (4096, 4096)]


def report_compile(variants) -> None:
    """Offline sm_90 compile (Triton 3.6 on PYTHONPATH, no GPU): registers, spills, SASS of the K loop (two tiles
    when overlapped) and instructions per thread and weight."""
    from collections import Counter

    from sass_w4a16 import loop_body, machine_code
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    fn = _rega_wgmma_kernel
    for cfg in variants:
        for m in (16, 64):
            for bf16 in (False, True):
                dtype = torch.bfloat16 if bf16 else torch.float16
                act = gl.bfloat16 if bf16 else gl.float16
                bm = block_m(m)
                x = torch.empty(m, 4096, dtype=dtype)
                x_desc = TensorDescriptor.from_tensor(
                    x, [bm, cfg.block_k], gl.NVMMASharedLayout.get_default_for([bm, cfg.block_k], act)
                )
                sig = dict.fromkeys(fn.arg_names, "i32")
                sig.update(x_desc=mangle_type(x_desc), qw_ptr="*i32", qz_ptr="*i32",
                           s_ptr="*bf16" if bf16 else "*i16", out_ptr="*bf16" if bf16 else "*fp16")  # fmt: skip
                const = dict(BM=bm, BN=cfg.block_n, BK=cfg.block_k, STAGES=cfg.stages, GROUP=128, BF16=bf16,
                             OVERLAP=cfg.overlap, num_warps=cfg.num_warps)  # fmt: skip
                const.update(
                    zip(
                        ("ACC_LAYOUT", "A_LAYOUT", "W_LAYOUT"),
                        layouts(bm, cfg.block_n, cfg.block_k, cfg.num_warps),
                        strict=True,
                    )
                )
                sig.update(dict.fromkeys(const, "constexpr"))
                aligned = ["qw_ptr", "qz_ptr", "s_ptr", "out_ptr", "N", "K", "stride_qwk", "stride_qzg", "stride_sg",
                           "stride_om", "stride_os"]  # fmt: skip
                attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
                kernel = triton.compile(GluonASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                                        options={"num_warps": cfg.num_warps})  # fmt: skip
                regs, stack, sass = machine_code(kernel)
                body = loop_body(sass)
                ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0] for i in body)
                tiles = 2 if cfg.overlap else 1  # the overlapped loop is unrolled by two
                per_weight = len(body) * cfg.num_warps * 32 / (cfg.block_n * cfg.block_k * tiles)
                top = " ".join(f"{op}:{c}" for op, c in ops.most_common(14))
                print(f"{cfg.name} M={m} {'bf16' if bf16 else 'fp16'}: regs {regs} stack {stack} "
                      f"smem {kernel.metadata.shared} loop {len(body)} ({per_weight:.2f}/weight) {top}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--ms", default="16,32,64")
    ap.add_argument("--groups", default="128")
    ap.add_argument("--shapes", default="all")
    ap.add_argument("--variants", help="comma-separated config names, e.g. rw-n64k128s4w4v1")
    ap.add_argument("--compile", action="store_true", help="offline sm_90 compile report, no GPU")
    args = ap.parse_args()
    variants = [parse_variant(v) for v in args.variants.split(",")] if args.variants else VARIANTS
    if args.compile:
        return report_compile(variants)
    walk(args, SHAPES if args.shapes == "all" else SHAPES[:3], variants, linear, "probe_rega_wgmma.json")


if __name__ == "__main__":
    main()
