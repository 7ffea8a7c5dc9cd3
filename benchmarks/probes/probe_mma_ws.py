"""Probe: the mma.sync W4A16 gemv fed by a warp-specialized TMA ring (Gluon, sm_90) against the committed dispatch.

    python benchmarks/probes/probe_mma_ws.py [--out DIR] [--ms 1,4,16] [--groups 128,64] [--shapes all|big]
        [--variants ws-p1r16s4,ws-p2r16s4]
    PYTHONPATH=<triton 3.6>:benchmarks python benchmarks/probes/probe_mma_ws.py --compile   # offline, no GPU

Why: the committed gemv (``kernels/w4a16_mma_gemv.py``) streams 4-bit weights at 1.1-2.9 TB/s of the 4.2 TB/s copy
bandwidth; its header puts that down to loads in flight (ptxas keeps about two K steps per thread in registers),
and the two ways tried to raise them lost to registers (prefetch) or to CTA barriers Triton put around a per-thread
cp.async ring. Here one loader warp per CTA brings the packed words in by TMA into a ring of NSTAGES slots of
ROWS word rows (mbarrier handshakes, no CTA-wide barrier in the loop), so the bytes in flight no longer depend on
registers, and the consumer warps run the committed kernel's K step (``_mma_step``: same unpacking, same mma, same
split-K fix-up order) on words read from shared memory.

Bank conflicts: thread (g, c) of a warp reads 16 bytes at word row 4s + c, columns 4g .. 4g + 3 of its warp's 32. With
each warp's 32 columns one 128-byte line, the 128-byte swizzle maps (row r, chunk g) to chunk g ^ (line % 8), and
rows c = 0 .. 3 alone would collide in pairs. The TMA box therefore takes the words as [ROWS, 2, 32] out of the view
[K / 8, N / 32, 32]: two warps' lines interleave row by row, line = 2 r + warp % 2, and g ^ (2c + warp % 2) gives
the 8 threads of each quarter-warp phase 8 distinct chunks. CTAs of 2 PAIRS warps take PAIRS such boxes per slot.

Timing as bench_w4a16.py (CUDA graphs over rotated weights larger than L2, medians); cuBLAS fp16 and the committed
dispatch (``w4a16_linear`` without a config: the mma.sync gemv at these M) in the same run; every variant checked
against float64 first (within 2x cuBLAS fp16's own error, fp16 and bf16), and a wrong or failing variant is reported,
not timed.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_w4a16
from quantkit.kernels.w4a16_mma_gemv import _mma_step, _zero_pairs
from quantkit.kernels.w4a16_weight import W4A16Weight, check_operands, num_sms


@dataclass(frozen=True)
class WsConfig:
    pairs: int = 1  # consumer warps = 2 x pairs, 64 x pairs columns per CTA
    rows: int = 16  # packed word rows per ring slot (4 per 32-deep K step)
    stages: int = 4
    fill: float = 4.0  # split K until the grid has fill x SMs CTAs
    max_split: int = 32
    loader_regs: int = 24
    maxnreg: int = 0  # > 0: registers per thread at launch (warp-specialized: the consumers take what the loader frees)
    ws: bool = False  # a loader warp (warp specialization); else the consumer warps refill the ring themselves

    @property
    def block_n(self) -> int:
        return 64 * self.pairs

    @property
    def name(self) -> str:
        kind = "ws" if self.ws else "tma"
        return f"{kind}-p{self.pairs}r{self.rows}s{self.stages}f{self.fill:g}m{self.max_split}n{self.maxnreg}"


def parse_variant(name: str) -> WsConfig:
    hit = re.fullmatch(r"(ws|tma)-p(\d+)r(\d+)s(\d+)(?:f([\d.]+))?(?:m(\d+))?(?:n(\d+))?", name)
    if not hit:
        raise SystemExit(f"--variants: cannot read {name!r} (expected e.g. tma-p2r16s4f4m32 or ws-p2r16s4n72)")
    kind, p, r, s, f, m, nreg = hit.groups()
    return WsConfig(int(p), int(r), int(s), float(f or 4.0), int(m or 32), maxnreg=int(nreg or 0), ws=kind == "ws")


def ws_split(cfg: WsConfig, n: int, k: int, sms: int) -> int:
    ctas = -(-n // cfg.block_n)
    iters = k // (8 * cfg.rows)
    split = 1
    while ctas * split < cfg.fill * sms and split * 2 <= cfg.max_split and iters % (split * 2) == 0:
        split *= 2
    return split


@gluon.jit
def _axis(size: gl.constexpr, dim: gl.constexpr, LW: gl.constexpr):
    """arange(size) along ``dim`` of the 4-D layout LW, expanded to rank 4 (size 1 elsewhere)."""
    if dim == 0:
        v = gl.arange(0, size, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LW))))
        v = gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 1), 2), 3)
    elif dim == 1:
        v = gl.arange(0, size, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, LW))))
        v = gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 0), 2), 3)
    elif dim == 2:
        v = gl.arange(0, size, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(3, LW))))
        v = gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 0), 0), 3)
    else:
        v = gl.arange(0, size, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, LW))))
        v = gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 0), 0), 0)
    return v


@gluon.jit
def _fill(w_desc, w_smem, ready, i, row0, blk0, ROWS: gl.constexpr, NSTAGES: gl.constexpr, PAIRS: gl.constexpr):
    """TMA of iteration i's words into slot i % NSTAGES, completing on ready[i % NSTAGES]."""
    s = i % NSTAGES
    mbarrier.expect(ready.index(s), w_desc.block_type.nbytes)
    if PAIRS == 1:
        tma.async_copy_global_to_shared(w_desc, [row0 + i * ROWS, blk0, 0, 0], ready.index(s), w_smem.index(s))
    else:
        tma.async_copy_global_to_shared(w_desc, [blk0, row0 + i * ROWS, 0, 0], ready.index(s), w_smem.index(s))


@gluon.jit
def _loader(w_desc, w_smem, ready, empty, row0, blk0, n_iters, ROWS: gl.constexpr, NSTAGES: gl.constexpr,
            PAIRS: gl.constexpr):  # fmt: skip
    """One warp: slot i % NSTAGES gets word rows row0 + i ROWS ... of the CTA's 64 PAIRS columns once released."""
    for i in range(n_iters):
        mbarrier.wait(empty.index(i % NSTAGES), ((i // NSTAGES) & 1) ^ 1)  # a fresh barrier's "previous phase" is done
        _fill(w_desc, w_smem, ready, i, row0, blk0, ROWS, NSTAGES, PAIRS)


@gluon.jit
def _store4(out_ptr, ws_ptr, bias_ptr, acc, m, cols, M, N, stride_om, split, SPLIT_K: gl.constexpr,
            HAS_BIAS: gl.constexpr, FINAL: gl.constexpr):  # fmt: skip
    """``w4a16_mma_gemv._store_rows`` for full-rank index tensors: partial into the workspace, or (FINAL) the
    split-order sum of the partials (+ bias) into y."""
    nmask = cols < N
    mask = (m < M) & nmask
    idx = m * N + cols
    if FINAL:
        total = acc
        if SPLIT_K > 1:
            total = gl.load(ws_ptr + idx, mask=mask, other=0.0, cache_modifier=".cg")
            for i in gl.static_range(1, SPLIT_K):
                total += gl.load(ws_ptr + i * M * N + idx, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            total += gl.load(bias_ptr + cols, mask=nmask, other=0.0).to(gl.float32)
        gl.store(out_ptr + m * stride_om + cols, total.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        gl.store(ws_ptr + split * M * N + idx, acc, mask=mask)


@gluon.jit
def _store_all4(out_ptr, ws_ptr, bias_ptr, acc0, acc1, acc2, acc3, m0, cols, M, N, stride_om, split,
                SPLIT_K: gl.constexpr, HAS_BIAS: gl.constexpr, FINAL: gl.constexpr, MB: gl.constexpr):  # fmt: skip
    _store4(out_ptr, ws_ptr, bias_ptr, acc0, m0, cols, M, N, stride_om, split, SPLIT_K, HAS_BIAS, FINAL)
    _store4(out_ptr, ws_ptr, bias_ptr, acc1, m0 + 1, cols, M, N, stride_om, split, SPLIT_K, HAS_BIAS, FINAL)
    if MB == 2:
        _store4(out_ptr, ws_ptr, bias_ptr, acc2, m0 + 8, cols, M, N, stride_om, split, SPLIT_K, HAS_BIAS, FINAL)
        _store4(out_ptr, ws_ptr, bias_ptr, acc3, m0 + 9, cols, M, N, stride_om, split, SPLIT_K, HAS_BIAS, FINAL)


@gluon.jit
def _consumer(x_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, w_desc, w_smem, ready, empty, M, N, n_iters,
              row0, blk0, stride_xm, stride_qzg, stride_sg, stride_om, ROWS: gl.constexpr, NSTAGES: gl.constexpr,
              PAIRS: gl.constexpr, GROUP: gl.constexpr, MB: gl.constexpr, BF16: gl.constexpr,
              HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr, SELF_LOAD: gl.constexpr):  # fmt: skip
    """2 PAIRS warps: warp 2p + w' owns columns 64p + 32w' ... of the CTA's; per slot, ROWS / 4 K steps of the
    committed kernel's arithmetic on the words in shared memory, then the slot is released (to the loader warp,
    or, SELF_LOAD, refilled by this partition itself with the slot NSTAGES iterations on)."""
    # [pair, c, w', column]: lane = 4 g + c (the mma fragment's), warp = 2 pair + w', 4 adjacent columns per thread
    LW: gl.constexpr = gl.BlockedLayout([1, 1, 1, 4], [1, 4, 1, 8], [PAIRS, 1, 2, 1], [1, 3, 2, 0])
    STEPS: gl.constexpr = ROWS // 4
    SPG: gl.constexpr = GROUP // 32 if GROUP // 32 < STEPS else STEPS
    pid_n = gl.program_id(0)
    split = gl.program_id(1)
    pa = _axis(PAIRS, 0, LW)
    cc = _axis(4, 1, LW)
    wp = _axis(2, 2, LW)
    cl = _axis(32, 3, LW)
    zero_i = (pa + wp + cl) * 0 + cc * 0
    cols = pid_n * (64 * PAIRS) + (2 * pa + wp) * 32 + cl + cc * 0  # [PAIRS, 4, 2, 32]
    nmask = cols < N
    g = cl // 4
    quad = 4 * cc + cl % 4 + zero_i
    x0_ptrs = x_ptr + gl.minimum(g, M - 1) * stride_xm + quad
    x1_ptrs = x_ptr + gl.minimum(g + 8, M - 1) * stride_xm + quad
    zero = gl.zeros([PAIRS, 4, 2, 32], gl.float32, layout=LW)
    acc0 = zero
    acc1 = zero
    acc2 = zero
    acc3 = zero
    it0 = split * n_iters
    if SELF_LOAD:
        for j in gl.static_range(NSTAGES):
            if j < n_iters:
                _fill(w_desc, w_smem, ready, j, row0, blk0, ROWS, NSTAGES, PAIRS)
    for i in range(n_iters):
        s = i % NSTAGES
        mbarrier.wait(ready.index(s), (i // NSTAGES) & 1)
        slot = w_smem.index(s).permute((1, 0, 2, 3)) if PAIRS == 1 else w_smem.index(s)
        for st in gl.static_range(STEPS):
            kw = (it0 + i) * ROWS + 4 * st  # first packed word row of the step
            if st % SPG == 0:
                grp = (kw * 8) // GROUP
                zp, zh = _zero_pairs(gl.load(qz_ptr + grp * stride_qzg + cols // 8, mask=nmask, other=0), cols, BF16)
                sc = gl.load(s_ptr + grp * stride_sg + cols, mask=nmask, other=0.0).to(gl.float32)
                p0 = zero
                p1 = zero
                p2 = zero
                p3 = zero
            words = slot.slice(4 * st, 4, dim=1).load(LW)
            x0 = gl.load(x0_ptrs + 4 * kw)
            x1 = x0
            if MB == 2:
                x1 = gl.load(x1_ptrs + 4 * kw)
            p0, p1, p2, p3 = _mma_step(words, zp, zh, x0, x1, p0, p1, p2, p3, BF16, MB)
            if st % SPG == SPG - 1:
                acc0 += sc * p0
                acc1 += sc * p1
                if MB == 2:
                    acc2 += sc * p2
                    acc3 += sc * p3
        gl.thread_barrier()  # every consumer warp has read the slot
        if SELF_LOAD:
            if i + NSTAGES < n_iters:
                _fill(w_desc, w_smem, ready, i + NSTAGES, row0, blk0, ROWS, NSTAGES, PAIRS)
        else:
            mbarrier.arrive(empty.index(s))

    m0 = 2 * cc + zero_i
    if SPLIT_K > 1:
        _store_all4(out_ptr, ws_ptr, bias_ptr, acc0, acc1, acc2, acc3, m0, cols, M, N, stride_om, split, SPLIT_K,
                    HAS_BIAS, False, MB)  # fmt: skip
        gl.thread_barrier()
        done = gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        gl.thread_barrier()
        if done == SPLIT_K - 1:
            _store_all4(out_ptr, ws_ptr, bias_ptr, acc0, acc1, acc2, acc3, m0, cols, M, N, stride_om, split,
                        SPLIT_K, HAS_BIAS, True, MB)  # fmt: skip
            gl.store(cnt_ptr + pid_n, 0)
    else:
        _store_all4(out_ptr, ws_ptr, bias_ptr, acc0, acc1, acc2, acc3, m0, cols, M, N, stride_om, split, SPLIT_K,
                    HAS_BIAS, True, MB)  # fmt: skip


@gluon.jit
def _mma_ws_kernel(
    w_desc, x_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, n_iters, stride_xm, stride_qzg, stride_sg, stride_om,
    ROWS: gl.constexpr, NSTAGES: gl.constexpr, PAIRS: gl.constexpr, GROUP: gl.constexpr, MB: gl.constexpr,
    BF16: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr, LOAD_REGS: gl.constexpr, SELF_LOAD: gl.constexpr,
):  # fmt: skip
    if PAIRS == 1:  # the descriptor's box is [ROWS, 1, 2, 32] (see ``descriptor``): the same bytes
        w_smem = gl.allocate_shared_memory(gl.int32, [NSTAGES, ROWS, 1, 2, 32], w_desc.layout)
    else:
        w_smem = gl.allocate_shared_memory(gl.int32, [NSTAGES, PAIRS, ROWS, 2, 32], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NSTAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NSTAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NSTAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    row0 = gl.program_id(1) * n_iters * ROWS
    blk0 = gl.program_id(0) * (1 if PAIRS == 1 else PAIRS)
    if SELF_LOAD:
        _consumer(x_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, w_desc, w_smem, ready, empty, M, N,
                  n_iters, row0, blk0, stride_xm, stride_qzg, stride_sg, stride_om, ROWS, NSTAGES, PAIRS, GROUP, MB,
                  BF16, HAS_BIAS, SPLIT_K, True)  # fmt: skip
    else:
        gl.warp_specialize([
            (_consumer, (x_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, w_desc, w_smem, ready, empty, M,
                         N, n_iters, row0, blk0, stride_xm, stride_qzg, stride_sg, stride_om, ROWS, NSTAGES, PAIRS,
                         GROUP, MB, BF16, HAS_BIAS, SPLIT_K, False)),
            (_loader, (w_desc, w_smem, ready, empty, row0, blk0, n_iters, ROWS, NSTAGES, PAIRS)),
        ], [1], [LOAD_REGS])  # fmt: skip


def descriptor(w: W4A16Weight, rows: int, pairs: int) -> TensorDescriptor:
    """TMA descriptor of qweight [K / 8, N] in boxes of ``rows`` word rows x 64 ``pairs`` columns, 128-byte swizzle,
    shared-memory order [pair, row, warp of the pair, column]: pairs = 1 views it as [K / 8, N / 64, 2, 32] (box
    [rows, 1, 2, 32]), more pairs as [N / 64, K / 8, 2, 32] (box [pairs, rows, 2, 32]; strides out of order)."""
    kw, n = w.qweight.shape
    q = w.qweight
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=4)
    if pairs == 1:
        return TensorDescriptor.from_tensor(q.view(kw, n // 64, 2, 32), [rows, 1, 2, 32], layout)
    view = q.as_strided([n // 64, kw, 2, 32], [64, n, 32, 1])
    return TensorDescriptor(q, list(view.shape), list(view.stride()), [pairs, rows, 2, 32], layout)


def ws_gemv(x: torch.Tensor, w: W4A16Weight, bias=None, out=None, config: WsConfig | None = None,
            split: int | None = None) -> torch.Tensor:  # fmt: skip
    """y = x @ W.T (+ bias) for M <= 16, x in kernel channel order; N a multiple of 32, K of 8 x rows."""
    check_operands(x, w, bias, out)
    cfg = config or WsConfig()
    m, k = x.shape
    n = w.out_features
    if w.bits != 4 or m > 16 or n % 64 or k % (8 * cfg.rows) or (w.group_size and w.group_size % 32):
        raise ValueError(f"ws_gemv: unsupported operands (M {m}, N {n}, K {k}, group {w.group_size})")
    ctas = -(-n // cfg.block_n)
    if split is None:
        split = ws_split(cfg, n, k, num_sms(x.device))
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    part = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else out
    _mma_ws_kernel[(ctas, split)](
        descriptor(w, cfg.rows, cfg.pairs), x.view(torch.int32), w.qzeros, w.scales,
        bias if bias is not None else out, out, part, w.locks, m, n, k // (8 * cfg.rows * split), x.stride(0) // 2,
        w.qzeros.stride(0), w.scales.stride(0), out.stride(0),
        ROWS=cfg.rows, NSTAGES=cfg.stages, PAIRS=cfg.pairs, GROUP=w.group_size or 2**30, MB=1 if m <= 8 else 2,
        BF16=x.dtype == torch.bfloat16, HAS_BIAS=bias is not None, SPLIT_K=split, LOAD_REGS=cfg.loader_regs,
        SELF_LOAD=not cfg.ws, num_warps=2 * cfg.pairs, maxnreg=cfg.maxnreg or None,
    )  # fmt: skip
    return out


def compile_offline(cfg: WsConfig, mb: int, group: int, bf16: bool, split: int):
    """sm_90 compile without a GPU (Triton 3.6 on PYTHONPATH)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    q = torch.empty(4096 // 8, 4096, dtype=torch.int32)
    desc = descriptor(W4A16Weight(q, q, q, 4, group, 4096, 4096), cfg.rows, cfg.pairs)
    fn = _mma_ws_kernel
    act = "bf16" if bf16 else "fp16"
    sig = dict.fromkeys(fn.arg_names, "i32")
    sig.update(w_desc=mangle_type(desc), x_ptr="*i32", qz_ptr="*i32", s_ptr="*fp16", bias_ptr=f"*{act}",
               out_ptr=f"*{act}", ws_ptr="*fp32", cnt_ptr="*i32")  # fmt: skip
    const = dict(ROWS=cfg.rows, NSTAGES=cfg.stages, PAIRS=cfg.pairs, GROUP=group, MB=mb, BF16=bf16, HAS_BIAS=False,
                 SPLIT_K=split, LOAD_REGS=cfg.loader_regs, SELF_LOAD=not cfg.ws)  # fmt: skip
    sig.update(dict.fromkeys(const, "constexpr"))
    aligned = [
        "x_ptr",
        "qz_ptr",
        "s_ptr",
        "out_ptr",
        "ws_ptr",
        "N",
        "stride_xm",
        "stride_qzg",
        "stride_sg",
        "stride_om",
    ]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = GluonASTSource(fn, sig, const, attrs)
    options = {"num_warps": 2 * cfg.pairs, "maxnreg": cfg.maxnreg or None}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def report_compile(names: list[str]) -> None:
    from sass_w4a16 import machine_code

    for name in names:
        cfg = parse_variant(name)
        for mb, group in ((1, 128), (1, 64), (2, 128)):
            try:
                ck = compile_offline(cfg, mb, group, False, 4)
            except Exception as e:  # report every variant
                print(f"{name} MB {mb} g{group}: {type(e).__name__}: {str(e)[:3000]}")
                continue
            regs, stack, sass = machine_code(ck)
            print(f"{name} MB {mb} g{group}: regs {regs} stack {stack} smem {ck.metadata.shared} "
                  f"LDS.128 {sass.count('LDS.128')} BAR.SYNC {sass.count('BAR.SYNC')}")  # fmt: skip
            Path(f"/tmp/{name}-mb{mb}-g{group}.sass").write_text(sass)


DEFAULT_VARIANTS = "tma-p2r16s4,tma-p2r16s8,tma-p1r16s4,tma-p2r32s4,ws-p2r16s4n72"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--groups", default="128,64")
    ap.add_argument("--shapes", default="all")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--compile", action="store_true", help="offline sm_90 compile report, no GPU")
    args = ap.parse_args()
    if args.compile:
        return report_compile(args.variants.split(","))
    from probe_mma_gemv import SHAPES, walk

    variants = [parse_variant(v) for v in args.variants.split(",")]
    walk(args, SHAPES if args.shapes == "all" else SHAPES[:4], variants, ws_gemv, "probe_mma_ws.json")


if __name__ == "__main__":
    main()
