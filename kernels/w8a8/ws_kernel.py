"""Warp-specialized fp8 GEMM for Hopper (sm_90), written in Gluon: W8A8 fp8 with DeepSeek-V3's promotion, M > 256;
also block-wise fp8 (``block.py``'s product, B = 128), whose per-block scales are applied at the same promotion.

What it computes
    ``dispatch.w8a8_matmul``'s product for float8_e4m3fn operands: y[m, n] = (acc[m, n] * a_scale[m or 0]) * w_scale[n]
    (+ bias[n]) with acc = sum over K chunks of 128 of the chunk's partial sum qa[m, chunk] . qw[n, chunk]. Each
    128-long partial sum runs in the tensor core (whose fp8 adder keeps ~14 mantissa bits, DeepSeek-V3, arXiv
    2412.19437, sec. 3.3.2) and is then added to a full fp32 accumulator: the promotion interval of 128 that the
    Triton kernel's default (``max_num_imprecise_acc=BLOCK_K``) also has, so both err alike (~1.3e-4 of the largest
    output against the float64 product of the same codes on the benchmark's layer shapes).

Why a second kernel
    In Triton's single-partition loop each promotion waits for the tile's wgmma, and the tensor cores idle while the
    64 additions run (offline SASS). Here the tile's rows belong to two
    consumer warp groups in their own partitions, so one group's additions overlap the other's wgmma. H200, end to
    end with the quantizer, geomean of the six benchmark layers x M in {1024, 4096, 16384} over bf16 cuBLAS: 1.45x
    against 1.27-1.28x for the Triton promoted path in the same runs (two runs).

How (persistent: min(tiles, SMs) programs walk the tiles SMs apart, GROUP_M row tiles at a time for L2 reuse)
    - loader (1 warp, 24 registers): TMA copies of the two 64-row activation tiles [64, 128] and the weight tile
      [256, 128] of each K step into a ring of STAGES slots, as soon as both consumers released a slot; it runs on
      into the next tile while the consumers store the current one.
    - consumers (two warp groups, 232 registers each; rows 0-63 and 64-127 of the tile): per K step and 128-column
      half, a fresh m64n128k32 wgmma chain over the 128-deep step (``use_acc=False``: the partial sum), wait, add it
      to that half's fp32 accumulator; then release the slot. The halves run one after the other: two accumulators
      and one partial, 192 registers (a full-width partial would need 256). After the last step: scales, bias, one
      masked store per half in the output's dtype.

Layouts: qa [M, K] and qw [N, K] float8_e4m3fn, K contiguous, 16-byte aligned rows (TMA, K % 16 == 0: out-of-bounds
rows and the K tail are zero-filled); a_scale fp32 [M] or [1]; w_scale fp32 [N]; bias [N] any float dtype; y [M, N]
with unit column stride.

Limits: CUDA sm_90 only (TMA, wgmma, setmaxnreg); written for Triton 3.6's Gluon (``ws.WS_TRITON``); Gluon has
no interpreter mode, so the CPU tests cover the dispatch rule and ``w8a8_ws_reference``, the GPU tests the kernel.
192 KB of shared memory per program (four stages of 48 KB). int32 offsets.
"""

from __future__ import annotations

import torch
from quantkit.kernels.w8a8.gemm import scaled_epilogue_reference
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

ROWS = 64  # rows of one consumer warp group (one m64 wgmma)
HALF_N = 128  # columns of one accumulator half
BLOCK_K = 128  # the promotion interval
BLOCK_M = 2 * ROWS
BLOCK_N = 2 * HALF_N
STAGES = 4
CONSUMER_REGS = 232
LOADER_REGS = 24
GROUP_M = 8


def w8a8_ws_reference(
    qa: torch.Tensor,
    a_scale: torch.Tensor,
    qw: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch: fp32 partial sums over K chunks of BLOCK_K, added in fp32 in K order, then
    the fp32 epilogue (the tensor core's reduced-precision adder inside a chunk is not modelled)."""
    acc = torch.zeros(qa.shape[0], qw.shape[0], dtype=torch.float32, device=qa.device)
    for k0 in range(0, qa.shape[1], BLOCK_K):
        acc += qa[:, k0 : k0 + BLOCK_K].float() @ qw[:, k0 : k0 + BLOCK_K].float().t()
    return scaled_epilogue_reference(acc, a_scale, w_scale, bias, out_dtype)


@gluon.jit
def _tile_offsets(tile, M, N, GROUP: gl.constexpr):
    """tile number -> (first row, first column), GROUP row tiles at a time (they share weight tiles in L2)."""
    num_m = gl.cdiv(M, 2 * 64)
    per_group = GROUP * gl.cdiv(N, 2 * 128)
    first_m = (tile // per_group) * GROUP
    group_rows = gl.minimum(num_m - first_m, GROUP)
    return (first_m + (tile % per_group) % group_rows) * (2 * 64), ((tile % per_group) // group_rows) * (2 * 128)


@gluon.jit
def _loader(a_desc, w_desc, a_smem, w_smem, ready, empty, M, N, K, BK: gl.constexpr, NSTAGES: gl.constexpr,
            GROUP: gl.constexpr):  # fmt: skip
    """One warp: each K step of each of the program's tiles into slot it % NSTAGES (it counts steps over all the
    program's tiles), once both consumers released the slot."""
    nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + w_desc.block_type.nbytes
    num_tiles = gl.cdiv(M, 2 * 64) * gl.cdiv(N, 2 * 128)
    k_steps = gl.cdiv(K, BK)
    it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = _tile_offsets(tile, M, N, GROUP)
        for t in range(k_steps):
            s = it % NSTAGES
            mbarrier.wait(empty.index(s), ((it // NSTAGES) & 1) ^ 1)  # a fresh barrier's "previous phase" is done
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, t * BK], ready.index(s), a_smem.index(2 * s))
            tma.async_copy_global_to_shared(a_desc, [off_m + 64, t * BK], ready.index(s), a_smem.index(2 * s + 1))
            tma.async_copy_global_to_shared(w_desc, [off_n, t * BK], ready.index(s), w_smem.index(s))
            it += 1


@gluon.jit
def _scaled_store(acc, rows, sa, off_n, c_ptr, w_scale_ptr, bias_ptr, M, N, stride_cm, layout: gl.constexpr,
                  HAS_BIAS: gl.constexpr, SCALED: gl.constexpr = True):  # fmt: skip
    """(acc * a_scale) * w_scale (SCALED; else acc as it is) (+ bias) in fp32 for 64 rows x 128 columns from off_n,
    one masked store."""
    cols = off_n + gl.arange(0, 128, layout=gl.SliceLayout(0, layout))
    cmask = cols < N
    y = acc
    if SCALED:
        y = y * gl.expand_dims(sa, 1) * gl.expand_dims(gl.load(w_scale_ptr + cols, mask=cmask, other=0.0), 0)
    if HAS_BIAS:
        y = y + gl.expand_dims(gl.load(bias_ptr + cols, mask=cmask, other=0.0).to(gl.float32), 0)
    ptrs = c_ptr + gl.expand_dims(rows, 1) * stride_cm + gl.expand_dims(cols, 0)
    gl.store(ptrs, y.to(c_ptr.dtype.element_ty), mask=gl.expand_dims(rows < M, 1) & gl.expand_dims(cmask, 0))


@gluon.jit
def _consumer(a_smem, w_smem, ready, empty, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K, stride_cm,
              ROLE: gl.constexpr, BK: gl.constexpr, NSTAGES: gl.constexpr, GROUP: gl.constexpr,
              A_SCALE_PER_ROW: gl.constexpr, HAS_BIAS: gl.constexpr):  # fmt: skip
    """One warp group, rows ROLE * 64 ... of each tile: per K step and column half, the step's partial sum in a
    fresh wgmma chain, then added to the half's fp32 accumulator; the slot is released after both halves."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    zero = gl.zeros([64, 128], gl.float32, layout)
    num_tiles = gl.cdiv(M, 2 * 64) * gl.cdiv(N, 2 * 128)
    k_steps = gl.cdiv(K, BK)
    it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = _tile_offsets(tile, M, N, GROUP)
        acc0 = zero
        acc1 = zero
        for _t in range(k_steps):
            s = it % NSTAGES
            mbarrier.wait(ready.index(s), (it // NSTAGES) & 1)
            a = a_smem.index(2 * s + ROLE)
            w = w_smem.index(s)
            acc0 += warpgroup_mma(a, w.slice(0, 128, dim=0).permute((1, 0)), zero, use_acc=False)
            acc1 += warpgroup_mma(a, w.slice(128, 128, dim=0).permute((1, 0)), zero, use_acc=False)
            mbarrier.arrive(empty.index(s))
            it += 1
        rows = off_m + ROLE * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        if A_SCALE_PER_ROW:
            sa = gl.load(a_scale_ptr + rows, mask=rows < M, other=0.0)
        else:
            sa = gl.load(a_scale_ptr + rows * 0)
        _scaled_store(acc0, rows, sa, off_n, c_ptr, w_scale_ptr, bias_ptr, M, N, stride_cm, layout, HAS_BIAS)
        _scaled_store(acc1, rows, sa, off_n + 128, c_ptr, w_scale_ptr, bias_ptr, M, N, stride_cm, layout, HAS_BIAS)


@gluon.jit
def _block_consumer(a_smem, w_smem, ready, empty, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K, stride_cm,
                    stride_as, stride_ws, ROLE: gl.constexpr, BK: gl.constexpr, NSTAGES: gl.constexpr,
                    GROUP: gl.constexpr, HAS_BIAS: gl.constexpr):  # fmt: skip
    """``_consumer`` for block-wise fp8 (B = BK = 128): each K step's partial sum of a column half (one weight
    block) joins the accumulator times a_scale[row, step] * w_scale[block, step]; each step's scales are read one
    step ahead, so their latency hides behind the previous step's wgmma."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    zero = gl.zeros([64, 128], gl.float32, layout)
    num_tiles = gl.cdiv(M, 2 * 64) * gl.cdiv(N, 2 * 128)
    k_steps = gl.cdiv(K, BK)
    last_block = gl.cdiv(N, BK) - 1
    it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = _tile_offsets(tile, M, N, GROUP)
        rows = off_m + ROLE * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        sa_ptrs = a_scale_ptr + rows * stride_as
        rmask = rows < M
        sw0_ptr = w_scale_ptr + (off_n // BK) * stride_ws
        sw1_ptr = w_scale_ptr + gl.minimum(off_n // BK + 1, last_block) * stride_ws  # past N: any valid block
        acc0 = zero
        acc1 = zero
        sa = gl.load(sa_ptrs, mask=rmask, other=0.0)
        sw0 = gl.load(sw0_ptr)
        sw1 = gl.load(sw1_ptr)
        for t in range(k_steps):
            scale0 = gl.expand_dims(sa * sw0, 1)
            scale1 = gl.expand_dims(sa * sw1, 1)
            nxt = gl.minimum(t + 1, k_steps - 1)  # the next step's scales, a whole step ahead of their use
            sa = gl.load(sa_ptrs + nxt, mask=rmask, other=0.0)
            sw0 = gl.load(sw0_ptr + nxt)
            sw1 = gl.load(sw1_ptr + nxt)
            s = it % NSTAGES
            mbarrier.wait(ready.index(s), (it // NSTAGES) & 1)
            a = a_smem.index(2 * s + ROLE)
            w = w_smem.index(s)
            acc0 += warpgroup_mma(a, w.slice(0, 128, dim=0).permute((1, 0)), zero, use_acc=False) * scale0
            acc1 += warpgroup_mma(a, w.slice(128, 128, dim=0).permute((1, 0)), zero, use_acc=False) * scale1
            mbarrier.arrive(empty.index(s))
            it += 1
        _scaled_store(acc0, rows, rows, off_n, c_ptr, w_scale_ptr, bias_ptr, M, N, stride_cm, layout, HAS_BIAS, False)
        _scaled_store(acc1, rows, rows, off_n + 128, c_ptr, w_scale_ptr, bias_ptr, M, N, stride_cm, layout, HAS_BIAS,
                      False)  # fmt: skip


@gluon.jit
def _fp8_block_ws_kernel(
    a_desc, w_desc, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr,
    M, N, K,
    stride_cm, stride_as, stride_ws,
    BK: gl.constexpr, NSTAGES: gl.constexpr, GROUP: gl.constexpr, HAS_BIAS: gl.constexpr, CONS_REGS: gl.constexpr,
    LOAD_REGS: gl.constexpr,
):  # fmt: skip
    a_smem, w_smem, ready, empty = _ring(a_desc, w_desc, BK, NSTAGES)
    gl.warp_specialize([
        (_block_consumer, (a_smem, w_smem, ready, empty, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K,
                           stride_cm, stride_as, stride_ws, 0, BK, NSTAGES, GROUP, HAS_BIAS)),
        (_block_consumer, (a_smem, w_smem, ready, empty, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K,
                           stride_cm, stride_as, stride_ws, 1, BK, NSTAGES, GROUP, HAS_BIAS)),
        (_loader, (a_desc, w_desc, a_smem, w_smem, ready, empty, M, N, K, BK, NSTAGES, GROUP)),
    ], [4, 1], [CONS_REGS, LOAD_REGS])  # fmt: skip


@gluon.jit
def _ring(a_desc, w_desc, BK: gl.constexpr, NSTAGES: gl.constexpr):
    """The shared-memory ring: two 64-row activation tiles and one 256-row weight tile per stage, and its barriers
    (``ready``: the loader's copies landed; ``empty``: both consumers released the slot)."""
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [2 * NSTAGES, 64, BK], a_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.float8e4nv, [NSTAGES, 2 * 128, BK], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NSTAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NSTAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NSTAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers
    fence_async_shared()
    return a_smem, w_smem, ready, empty


@gluon.jit
def _w8a8_fp8_ws_kernel(
    a_desc, w_desc,  # TMA descriptors: qa in [64, BK] blocks, qw in [256, BK] blocks
    c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr,
    M, N, K,
    stride_cm,
    BK: gl.constexpr, NSTAGES: gl.constexpr, GROUP: gl.constexpr, A_SCALE_PER_ROW: gl.constexpr,
    HAS_BIAS: gl.constexpr, CONS_REGS: gl.constexpr, LOAD_REGS: gl.constexpr,
):  # fmt: skip
    a_smem, w_smem, ready, empty = _ring(a_desc, w_desc, BK, NSTAGES)
    gl.warp_specialize([
        (_consumer, (a_smem, w_smem, ready, empty, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K, stride_cm,
                     0, BK, NSTAGES, GROUP, A_SCALE_PER_ROW, HAS_BIAS)),
        (_consumer, (a_smem, w_smem, ready, empty, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K, stride_cm,
                     1, BK, NSTAGES, GROUP, A_SCALE_PER_ROW, HAS_BIAS)),
        (_loader, (a_desc, w_desc, a_smem, w_smem, ready, empty, M, N, K, BK, NSTAGES, GROUP)),
    ], [4, 1], [CONS_REGS, LOAD_REGS])  # fmt: skip


def descriptors(qa: torch.Tensor, qw: torch.Tensor) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of qa [M, K] in [64, BLOCK_K] tiles and qw [N, K] in [256, BLOCK_K] tiles (128-byte swizzle)."""
    a_layout = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_K], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.float8e4nv)
    return (
        TensorDescriptor.from_tensor(qa, [ROWS, BLOCK_K], a_layout),
        TensorDescriptor.from_tensor(qw, [BLOCK_N, BLOCK_K], w_layout),
    )


def launch(qa, a_scale, qw, w_scale, bias, out, sms: int) -> torch.Tensor:
    """The launch for operands ``ws.fp8_ws_matmul`` checked: min(tiles, sms) persistent programs."""
    m, k = qa.shape
    n = qw.shape[0]
    tiles = -(-m // BLOCK_M) * -(-n // BLOCK_N)
    a_desc, w_desc = descriptors(qa, qw)
    _w8a8_fp8_ws_kernel[(min(tiles, sms),)](
        a_desc, w_desc, out, a_scale, w_scale, bias if bias is not None else w_scale, m, n, k, out.stride(0),
        BK=BLOCK_K, NSTAGES=STAGES, GROUP=GROUP_M, A_SCALE_PER_ROW=a_scale.numel() == m, HAS_BIAS=bias is not None,
        CONS_REGS=CONSUMER_REGS, LOAD_REGS=LOADER_REGS, num_warps=4,
    )  # fmt: skip
    return out


def launch_block(qa, a_scale, qw, w_scale, bias, out, sms: int) -> torch.Tensor:
    """The block-fp8 launch (B = BLOCK_K = 128) for operands ``block.fp8_block_matmul`` checked."""
    m, k = qa.shape
    n = qw.shape[0]
    tiles = -(-m // BLOCK_M) * -(-n // BLOCK_N)
    a_desc, w_desc = descriptors(qa, qw)
    _fp8_block_ws_kernel[(min(tiles, sms),)](
        a_desc, w_desc, out, a_scale, w_scale, bias if bias is not None else w_scale, m, n, k, out.stride(0),
        a_scale.stride(0), w_scale.stride(0), BK=BLOCK_K, NSTAGES=STAGES, GROUP=GROUP_M, HAS_BIAS=bias is not None,
        CONS_REGS=CONSUMER_REGS, LOAD_REGS=LOADER_REGS, num_warps=4,
    )  # fmt: skip
    return out
