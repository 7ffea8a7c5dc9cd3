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
    - block-wise fp8 runs 128 x 128 tiles (one weight block wide; ``_block_*``), or 192 x 128 with a third consumer
      group (``block.WS3_FROM_M``): the loader also copies the step's activation scales (a_scale stored M-major, one
      [1, 256] TMA box), each consumer keeps one accumulator and one partial and scales the partial as it promotes
      it. At 128 x 256 the extra per-row scale registers made ptxas spill accumulators inside the K loop (130 local
      loads and stores, ``LDL``/``STL`` in ``cuobjdump -sass`` of the kernel compiled for sm_90 by Triton 3.6;
      0.72-0.78x bf16 cuBLAS on the H100); at 128 x 128 the consumers use about 150 registers, none spilled.

Layouts: qa [M, K] and qw [N, K] float8_e4m3fn, K contiguous, 16-byte aligned rows (TMA, K % 16 == 0: out-of-bounds
rows and the K tail are zero-filled); a_scale fp32 [M] or [1] (block: [M, ceil(K/128)] M-major, ``ws.m_major_scales``);
w_scale fp32 [N] (block: [ceil(N/128), ceil(K/128)]); bias [N] any float dtype; y [M, N] with unit column stride.

Limits: CUDA sm_90 only (TMA, wgmma, setmaxnreg); written for Triton 3.6's Gluon (``ws.WS_TRITON``); Gluon has
no interpreter mode, so the CPU tests cover the dispatch rule and ``w8a8_ws_reference``, the GPU tests the kernel.
192 KB of shared memory per program (four stages of 48 KB; block: six of 33 KB with two consumer groups, five of
41 KB with three). int32 offsets.
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
def _tile_offsets(tile, M, N, GROUP: gl.constexpr, BM: gl.constexpr = 2 * 64, BN: gl.constexpr = 2 * 128):
    """tile number -> (first row, first column) of BM x BN tiles, GROUP row tiles at a time (they share weight tiles
    in L2)."""
    num_m = gl.cdiv(M, BM)
    per_group = GROUP * gl.cdiv(N, BN)
    first_m = (tile // per_group) * GROUP
    group_rows = gl.minimum(num_m - first_m, GROUP)
    return (first_m + (tile % per_group) % group_rows) * BM, ((tile % per_group) // group_rows) * BN


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
def _block_loader(a_desc, w_desc, s_desc, a_smem, w_smem, s_smem, ready, empty, M, N, K, BK: gl.constexpr,
                  NSTAGES: gl.constexpr, GROUP: gl.constexpr, CONSUMERS: gl.constexpr):  # fmt: skip
    """``_loader`` for block-wise fp8's (64 * CONSUMERS) x 128 tiles: each K step's activation tiles (one per
    consumer), its weight tile and the tile rows' activation scales of that step (a_scale M-major: one [1, 256]
    box: rows past M are zero-filled, rows of the next tile below M are copied and not used) into one slot."""
    nbytes: gl.constexpr = CONSUMERS * a_desc.block_type.nbytes + w_desc.block_type.nbytes + s_desc.block_type.nbytes
    num_tiles = gl.cdiv(M, 64 * CONSUMERS) * gl.cdiv(N, 128)
    k_steps = gl.cdiv(K, BK)
    it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = _tile_offsets(tile, M, N, GROUP, 64 * CONSUMERS, 128)
        for t in range(k_steps):
            s = it % NSTAGES
            mbarrier.wait(empty.index(s), ((it // NSTAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            for i in gl.static_range(CONSUMERS):
                tma.async_copy_global_to_shared(
                    a_desc, [off_m + 64 * i, t * BK], ready.index(s), a_smem.index(CONSUMERS * s + i)
                )
            tma.async_copy_global_to_shared(w_desc, [off_n, t * BK], ready.index(s), w_smem.index(s))
            tma.async_copy_global_to_shared(s_desc, [t, off_m], ready.index(s), s_smem.index(s))
            it += 1


@gluon.jit
def _block_consumer(a_smem, w_smem, s_smem, ready, empty, c_ptr, w_scale_ptr, bias_ptr, M, N, K, stride_cm,
                    stride_ws, ROLE: gl.constexpr, BK: gl.constexpr, NSTAGES: gl.constexpr, GROUP: gl.constexpr,
                    HAS_BIAS: gl.constexpr, CONSUMERS: gl.constexpr):  # fmt: skip
    """One warp group, rows ROLE * 64 ... of each tile (one weight block wide): per K step the partial sum in a
    fresh wgmma chain, then added to the fp32 accumulator times a_scale[row, step] * w_scale[block, step]. The
    activation scales arrive with the step's operands in shared memory and are read once the partial sum is done;
    the weight scale is a uniform load issued before the wait. One 64-register accumulator and one partial: the
    128 x 256 tiles of ``_consumer`` would need three such blocks per thread, and ptxas spilled them to local
    memory in the loop (0.72-0.78x bf16 cuBLAS on the H100)."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    zero = gl.zeros([64, 128], gl.float32, layout)
    num_tiles = gl.cdiv(M, 64 * CONSUMERS) * gl.cdiv(N, 128)
    k_steps = gl.cdiv(K, BK)
    it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = _tile_offsets(tile, M, N, GROUP, 64 * CONSUMERS, 128)
        sw_ptr = w_scale_ptr + (off_n // BK) * stride_ws
        acc = zero
        for t in range(k_steps):
            sw = gl.load(sw_ptr + t)
            s = it % NSTAGES
            mbarrier.wait(ready.index(s), (it // NSTAGES) & 1)
            a = a_smem.index(CONSUMERS * s + ROLE)
            p = warpgroup_mma(a, w_smem.index(s).permute((1, 0)), zero, use_acc=False)
            sa = s_smem.index(s).reshape([256]).slice(ROLE * 64, 64).load(gl.SliceLayout(1, layout))
            mbarrier.arrive(empty.index(s))
            acc += p * gl.expand_dims(sa * sw, 1)
            it += 1
        rows = off_m + ROLE * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        _scaled_store(acc, rows, rows, off_n, c_ptr, w_scale_ptr, bias_ptr, M, N, stride_cm, layout, HAS_BIAS, False)


@gluon.jit
def _fp8_block_ws_kernel(
    a_desc, w_desc, s_desc, c_ptr, w_scale_ptr, bias_ptr,
    M, N, K,
    stride_cm, stride_ws,
    BK: gl.constexpr, NSTAGES: gl.constexpr, GROUP: gl.constexpr, HAS_BIAS: gl.constexpr, CONS_REGS: gl.constexpr,
    LOAD_REGS: gl.constexpr, CONSUMERS: gl.constexpr,
):  # fmt: skip
    a_smem, w_smem, ready, empty = _ring(a_desc, w_desc, BK, NSTAGES, CONSUMERS, 128)
    s_smem = gl.allocate_shared_memory(gl.float32, [NSTAGES, 1, 256], s_desc.layout)
    if CONSUMERS == 3:
        gl.warp_specialize([
            (_block_consumer, (a_smem, w_smem, s_smem, ready, empty, c_ptr, w_scale_ptr, bias_ptr, M, N, K, stride_cm,
                               stride_ws, 0, BK, NSTAGES, GROUP, HAS_BIAS, CONSUMERS)),
            (_block_consumer, (a_smem, w_smem, s_smem, ready, empty, c_ptr, w_scale_ptr, bias_ptr, M, N, K, stride_cm,
                               stride_ws, 1, BK, NSTAGES, GROUP, HAS_BIAS, CONSUMERS)),
            (_block_consumer, (a_smem, w_smem, s_smem, ready, empty, c_ptr, w_scale_ptr, bias_ptr, M, N, K, stride_cm,
                               stride_ws, 2, BK, NSTAGES, GROUP, HAS_BIAS, CONSUMERS)),
            (_block_loader, (a_desc, w_desc, s_desc, a_smem, w_smem, s_smem, ready, empty, M, N, K, BK, NSTAGES,
                             GROUP, CONSUMERS)),
        ], [4, 4, 1], [CONS_REGS, CONS_REGS, LOAD_REGS])  # fmt: skip
    else:
        gl.warp_specialize([
            (_block_consumer, (a_smem, w_smem, s_smem, ready, empty, c_ptr, w_scale_ptr, bias_ptr, M, N, K, stride_cm,
                               stride_ws, 0, BK, NSTAGES, GROUP, HAS_BIAS, CONSUMERS)),
            (_block_consumer, (a_smem, w_smem, s_smem, ready, empty, c_ptr, w_scale_ptr, bias_ptr, M, N, K, stride_cm,
                               stride_ws, 1, BK, NSTAGES, GROUP, HAS_BIAS, CONSUMERS)),
            (_block_loader, (a_desc, w_desc, s_desc, a_smem, w_smem, s_smem, ready, empty, M, N, K, BK, NSTAGES,
                             GROUP, CONSUMERS)),
        ], [4, 1], [CONS_REGS, LOAD_REGS])  # fmt: skip


@gluon.jit
def _ring(a_desc, w_desc, BK: gl.constexpr, NSTAGES: gl.constexpr, CONSUMERS: gl.constexpr = 2,
          W_ROWS: gl.constexpr = 2 * 128):  # fmt: skip
    """The shared-memory ring: per stage one 64-row activation tile per consumer and one W_ROWS-row weight tile
    (the per-token kernel: 2 and 256; the block kernel: 2 or 3 and 128), and its barriers (``ready``: the loader's
    copies landed; ``empty``: every consumer released the slot)."""
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [CONSUMERS * NSTAGES, 64, BK], a_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.float8e4nv, [NSTAGES, W_ROWS, BK], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NSTAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NSTAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NSTAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
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


# consumer warp groups -> (pipeline stages, registers per consumer thread): 128 x 128 tiles take 6 stages of 33 KB,
# 192 x 128 tiles 5 of 41 KB; three consumers and the loader's group fit the register file at 160 registers each
# (offline SASS: about 140 used, none spilled).
BLOCK_PLANS = {2: (6, CONSUMER_REGS), 3: (5, 160)}


def launch_block(qa, a_scale, qw, w_scale, bias, out, sms: int, consumers: int = 2) -> torch.Tensor:
    """The block-fp8 launch (B = BLOCK_K = 128) for operands ``block.fp8_block_matmul`` checked and a_scale as
    ``ws.m_major_scales`` returns it: (64 * consumers) x 128 tiles, min(tiles, sms) persistent programs."""
    m, k = qa.shape
    n = qw.shape[0]
    stages, regs = BLOCK_PLANS[consumers]
    tiles = -(-m // (64 * consumers)) * -(-n // BLOCK_K)
    a_layout = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_K], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_K], gl.float8e4nv)
    s_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    a_desc = TensorDescriptor.from_tensor(qa, [ROWS, BLOCK_K], a_layout)
    w_desc = TensorDescriptor.from_tensor(qw, [BLOCK_K, BLOCK_K], w_layout)
    s_desc = TensorDescriptor.from_tensor(a_scale.t(), [1, 256], s_layout)  # ws.m_major_scales made it so
    _fp8_block_ws_kernel[(min(tiles, sms),)](
        a_desc, w_desc, s_desc, out, w_scale, bias if bias is not None else w_scale, m, n, k, out.stride(0),
        w_scale.stride(0), BK=BLOCK_K, NSTAGES=stages, GROUP=GROUP_M, HAS_BIAS=bias is not None, CONS_REGS=regs,
        LOAD_REGS=LOADER_REGS, CONSUMERS=consumers, num_warps=4,
    )  # fmt: skip
    return out
