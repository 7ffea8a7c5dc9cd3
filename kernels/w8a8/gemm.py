"""W8A8 GEMM: 8-bit activations x 8-bit weights with per-token x per-output-channel scales, int8 or fp8 e4m3.

Computes ``y[m, n] = (acc[m, n] * a_scale[m]) * w_scale[n] (+ bias[n])`` with ``acc = sum_k qa[m, k] * qw[n, k]``
on codes from ``quant.quantize_activations`` (activations) and ``quantize_rows_reference`` (weights).

How
    qa [M, K] x qw [N, K]^T in tiles of BLOCK_M x BLOCK_N, grouped along M (GROUP_M) for L2 reuse, and a K loop of
    BLOCK_K (``configs.TileConfig``). Two kernels share the accumulate and epilogue code: operand tiles fetched by
    the TMA unit through host-built tensor descriptors (config ``USE_TMA``; needs K % 16 == 0), or by pointer loads
    with an unmasked EVEN_K fast path (any K). ``USE_TMA`` 2 runs the TMA product persistently (one program per SM
    walking the output tiles, so a program's next loads overlap its epilogue; 3 and 4: two and three programs per
    SM). Triton 3.6's automatic warp specialization of that loop (``tl.range(..., warp_specialize=True)``) compiles
    for sm_90 but hung on the H200 (128 x 256 tiles, int8): not offered.
    int8 accumulates in int32 (exact while 128 * 128 * K < 2**31, i.e. K <= 131_071; weights from GPTQ may use the
    code -128). fp8 accumulates in fp32; Hopper's fp8 tensor cores add with reduced precision, so by default each
    128-long partial sum is promoted into a full fp32 accumulator (DeepSeek-V3's fix, promotion interval 128, inside
    the small-M configs' 256-deep K steps too);
    ``fp8_fast_accum=True`` keeps the whole K loop in the tensor core (Triton's sm_90 default, like cuBLAS
    ``use_fast_accum=True``). The epilogue converts the accumulator to fp32, applies both scales and the bias in
    registers and stores fp16/bf16/fp32 once: the int32 accumulator never goes to memory.
    Programmatic dependent launch (``PDL``): the grid may start while the activation quantizer still runs; it asks
    L2 for the first ``PREFETCH_K`` bytes of its weight rows, then waits (griddepcontrol.wait) for the codes.
    L2 prefetch ahead (``L2_AHEAD``): inside the K loop each program asks L2 for its weight tile that many steps
    ahead (``_device.prefetch_block_l2``), which pays where few programs stream long weight rows.
    Which config, fetch mode and kernel serve a product is ``dispatch.py``'s table; on Hopper, fp8 with the promoted
    accumulation at M > 256 runs the warp-specialized Gluon kernel (``ws.py``) instead of these tiles.

Weight layout: ``qw`` [N, K] row-major, K contiguous (``Layout.INT8_ROWMAJOR`` / ``Layout.FP8_ROWMAJOR`` v1). That is
the K-major B operand Hopper's int8/fp8 wgmma needs (only 16-bit types may read a transposed shared-memory operand)
and the layout cuBLAS's fast int8 path wants (``torch._int_mm(a, w.t())``), so no re-layout is needed.

Limits: 2-D operands, K-contiguous ``qa`` and ``qw``, every tensor under 2**31 elements (32-bit offsets).
Hardware: tuned on the H200 (sm_90, 132 SMs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quantkit.kernels._device import GPU, interpreting, num_sms, prefetch_block_l2, prefetch_l2, threads
from quantkit.kernels.w8a8.configs import TileConfig
from quantkit.kernels.w8a8.quant import FLOAT_DTYPES, FORMAT_OF_DTYPE, MAX_NUMEL, require
from triton.tools.tensor_descriptor import TensorDescriptor

PROMOTE_EVERY = tl.constexpr(128)  # fp8 products that accumulate inside the tensor core before joining fp32

INT32_SAFE_K = (2**31 - 1) // (128 * 128)  # 131_071: the int8 accumulator cannot overflow up to this K


# ----------------------------------------------------------------------------------------------------------------
# Reference (plain PyTorch): defines the numerics the kernels reproduce.
# ----------------------------------------------------------------------------------------------------------------


def scaled_epilogue_reference(
    acc: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """acc [M, N] (int32 or fp32) -> (acc * a_scale[m]) * w_scale[n] (+ bias[n]) in fp32, then ``out_dtype``."""
    a = a_scale.float().reshape(-1, 1)  # [M, 1] or [1, 1]
    y = acc.float() * a * w_scale.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def w8a8_matmul_reference(
    qa: torch.Tensor,
    a_scale: torch.Tensor,
    qw: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """The GEMM on quantized operands (int8: exact, as integer sums below 2**53 in fp64; fp8: fp32 accumulation),
    then the fp32 epilogue."""
    acc_dtype = torch.float64 if qa.dtype == torch.int8 else torch.float32
    acc = qa.to(acc_dtype) @ qw.to(acc_dtype).t()
    return scaled_epilogue_reference(acc, a_scale, w_scale, bias, out_dtype)


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def await_activations(w_ptr, stride_wn, stride_wk, pid_n, N, K,
                      PDL: tl.constexpr, PREFETCH_K: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Under programmatic dependent launch this grid may start while the activation quantizer still runs: first
    ask L2 for the first PREFETCH_K columns of this tile's weight rows (they do not depend on it), then wait for
    the quantizer's writes (griddepcontrol.wait)."""
    if PDL:
        if PREFETCH_K > 0:
            rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
            cols = tl.arange(0, PREFETCH_K // 128) * 128  # one address per 128-byte line
            ptrs = w_ptr + rows[:, None] * stride_wn + (cols % K)[None, :] * stride_wk
            prefetch_l2(ptrs, tl.full(ptrs.shape, 1, tl.int32))
        tl.extra.cuda.gdc_wait()


@triton.jit
def _prefetch_ahead_start(w_ptr, stride_wn, pid_n, N, K, L2_AHEAD: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, THREADS: tl.constexpr):  # fmt: skip
    """L2 prefetch (``_device.py``) of this tile's weight K tiles 1 .. L2_AHEAD - 1, before the K loop."""
    for d in tl.static_range(1, L2_AHEAD):
        prefetch_block_l2(w_ptr, pid_n * BLOCK_N, N, stride_wn, d * BLOCK_K, K, d * BLOCK_K < K, BLOCK_N, BLOCK_K,
                          THREADS)  # fmt: skip


@triton.jit
def _prefetch_ahead(w_ptr, stride_wn, pid_n, N, K, k0, L2_AHEAD: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, THREADS: tl.constexpr):  # fmt: skip
    """Inside the K loop at column k0: prefetch the weight K tile L2_AHEAD steps ahead."""
    if L2_AHEAD > 0:
        ahead = k0 + L2_AHEAD * BLOCK_K
        prefetch_block_l2(w_ptr, pid_n * BLOCK_N, N, stride_wn, ahead, K, ahead < K, BLOCK_N, BLOCK_K, THREADS)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """tile number -> (pid_m, pid_n), GROUP_M row-tiles at a time so that their weight tiles are reused from L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_pid_m = (pid // pids_per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    return first_pid_m + (pid % pids_per_group) % group_rows, (pid % pids_per_group) // group_rows


@triton.jit
def _mma(a, w, acc, IS_FP8: tl.constexpr, FP8_FAST_ACCUM: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += a [BLOCK_M, BLOCK_K] @ w [BLOCK_K, BLOCK_N] in int32 (int8) or fp32 (fp8)."""
    if IS_FP8 and FP8_FAST_ACCUM:
        return tl.dot(a, w, acc)  # sm_90: the whole K loop accumulates inside the tensor core (reduced precision)
    elif IS_FP8:
        # promoted to full fp32 every 128 products (DeepSeek-V3's interval), also inside a 256-deep small-M step
        PROMOTE: tl.constexpr = BLOCK_K if BLOCK_K < PROMOTE_EVERY else PROMOTE_EVERY
        return tl.dot(a, w, acc, max_num_imprecise_acc=PROMOTE)
    else:
        return tl.dot(a, w, acc, out_dtype=tl.int32)


@triton.jit
def _scale_bias_store(
    acc, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, stride_cm, stride_cn, offs_m, offs_n,
    A_SCALE_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """Epilogue in registers: (acc * a_scale[m]) * w_scale[n] (+ bias[n]) in fp32 -> one masked store."""
    mask_m = offs_m < M
    mask_n = offs_n < N
    y = acc.to(tl.float32)
    if A_SCALE_PER_ROW:
        y = y * tl.load(a_scale_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
    else:
        y = y * tl.load(a_scale_ptr)
    y = y * tl.load(w_scale_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, y.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _w8a8_matmul_kernel(
    # pointers
    a_ptr,
    w_ptr,
    c_ptr,
    a_scale_ptr,
    w_scale_ptr,
    bias_ptr,
    # sizes
    M,
    N,
    K,
    # strides
    stride_am,
    stride_ak,
    stride_wn,
    stride_wk,
    stride_cm,
    stride_cn,
    # meta-parameters
    A_SCALE_PER_ROW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_FAST_ACCUM: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_K: tl.constexpr,
    L2_AHEAD: tl.constexpr,
    THREADS: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    await_activations(w_ptr, stride_wn, stride_wk, pid_n, N, K, PDL, PREFETCH_K, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # rows past M / N wrap onto valid rows: loads need no M/N mask, the store drops them
    a_ptrs = a_ptr + (offs_m % M)[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + (offs_n % N)[None, :] * stride_wn  # [BLOCK_K, BLOCK_N]

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32 if IS_FP8 else tl.int32)
    _prefetch_ahead_start(w_ptr, stride_wn, pid_n, N, K, L2_AHEAD, BLOCK_N, BLOCK_K, THREADS)
    for k0 in range(0, K, BLOCK_K):
        _prefetch_ahead(w_ptr, stride_wn, pid_n, N, K, k0, L2_AHEAD, BLOCK_N, BLOCK_K, THREADS)
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(k0 + offs_k)[None, :] < K, other=0.0)
            w = tl.load(w_ptrs, mask=(k0 + offs_k)[:, None] < K, other=0.0)
        acc = _mma(a, w, acc, IS_FP8, FP8_FAST_ACCUM, BLOCK_K)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    _scale_bias_store(
        acc, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, stride_cm, stride_cn, offs_m, offs_n,
        A_SCALE_PER_ROW, HAS_BIAS,
    )  # fmt: skip


@triton.jit
def _w8a8_matmul_tma_kernel(
    # tensor descriptors (TMA): qa [M, K] in blocks [BLOCK_M, BLOCK_K], qw [N, K] in blocks [BLOCK_N, BLOCK_K]
    a_desc,
    w_desc,
    # pointers
    c_ptr,
    a_scale_ptr,
    w_scale_ptr,
    bias_ptr,
    w_ptr,  # qw itself: only the L2 prefetch under PDL reads through it
    # sizes
    M,
    N,
    K,
    # strides
    stride_cm,
    stride_cn,
    stride_wn,
    # meta-parameters
    A_SCALE_PER_ROW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_FAST_ACCUM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_K: tl.constexpr,
    PERSISTENT: tl.constexpr,
    NUM_PROGRAMS,  # PERSISTENT: the grid size
    L2_AHEAD: tl.constexpr,
    THREADS: tl.constexpr,
):
    """The same product with operand tiles fetched by the TMA unit (bulk async copies; out-of-bounds reads are
    zero-filled, so ragged M/N/K need no masks). PERSISTENT: one to three programs per SM walk the output tiles
    NUM_PROGRAMS apart, so the loads of a program's next tile overlap the epilogue of its current one; under PDL
    it waits once, before its first tile (the prefetch covers that tile's weight rows)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    await_activations(w_ptr, stride_wn, 1, pid_n, N, K, PDL, PREFETCH_K, BLOCK_N)
    if PERSISTENT:
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=True):
            pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            _tma_tile(a_desc, w_desc, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, w_ptr, M, N, K, stride_cm, stride_cn,
                      stride_wn, pid_m, pid_n, A_SCALE_PER_ROW, HAS_BIAS, IS_FP8, FP8_FAST_ACCUM, BLOCK_M, BLOCK_N,
                      BLOCK_K, L2_AHEAD, THREADS)  # fmt: skip
    else:
        _tma_tile(a_desc, w_desc, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, w_ptr, M, N, K, stride_cm, stride_cn,
                  stride_wn, pid_m, pid_n, A_SCALE_PER_ROW, HAS_BIAS, IS_FP8, FP8_FAST_ACCUM, BLOCK_M, BLOCK_N,
                  BLOCK_K, L2_AHEAD, THREADS)  # fmt: skip


@triton.jit
def _tma_tile(a_desc, w_desc, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, w_ptr, M, N, K, stride_cm, stride_cn,
              stride_wn, pid_m, pid_n, A_SCALE_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, IS_FP8: tl.constexpr,
              FP8_FAST_ACCUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              L2_AHEAD: tl.constexpr, THREADS: tl.constexpr):  # fmt: skip
    """One output tile from TMA-fetched operand tiles: the K loop, then the scaled store."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32 if IS_FP8 else tl.int32)
    _prefetch_ahead_start(w_ptr, stride_wn, pid_n, N, K, L2_AHEAD, BLOCK_N, BLOCK_K, THREADS)
    for k0 in range(0, K, BLOCK_K):
        _prefetch_ahead(w_ptr, stride_wn, pid_n, N, K, k0, L2_AHEAD, BLOCK_N, BLOCK_K, THREADS)
        a = a_desc.load([pid_m * BLOCK_M, k0])
        w = w_desc.load([pid_n * BLOCK_N, k0])
        acc = _mma(a, w.T, acc, IS_FP8, FP8_FAST_ACCUM, BLOCK_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _scale_bias_store(
        acc, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, stride_cm, stride_cn, offs_m, offs_n,
        A_SCALE_PER_ROW, HAS_BIAS,
    )  # fmt: skip


def check_matmul_operands(
    qa: torch.Tensor,
    a_scale: torch.Tensor,
    qw: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """``w8a8_matmul``'s operand checks (shapes, dtypes, strides, devices, sizes, with messages that name the
    operand); returns ``out``, allocated when None."""
    require(qa.dim() == 2 and qw.dim() == 2, f"qa and qw must be 2-D, got {tuple(qa.shape)} and {tuple(qw.shape)}")
    require(qa.dtype in FORMAT_OF_DTYPE, f"qa must be int8 or float8_e4m3fn, got {qa.dtype}")
    require(qw.dtype == qa.dtype, f"qa and qw must share a dtype, got {qa.dtype} and {qw.dtype}")
    m, k = qa.shape
    n = qw.shape[0]
    require(qw.shape[1] == k, f"qw must be [N, K={k}] (Layout int8/fp8_rowmajor), got {tuple(qw.shape)}")
    require(qa.stride(1) == 1 and qw.stride(1) == 1, "qa and qw must be contiguous along K (stride 1 in dim 1)")
    require(k > 0, "K must be positive")
    require(
        qa.dtype != torch.int8 or k <= INT32_SAFE_K, f"K={k} may overflow the int32 accumulator (limit {INT32_SAFE_K})"
    )
    require(
        a_scale.dtype == torch.float32 and a_scale.is_contiguous() and a_scale.numel() in (1, m),
        f"a_scale must be contiguous fp32 [{m}] or [1], got {a_scale.dtype} {tuple(a_scale.shape)}",
    )
    require(
        w_scale.dtype == torch.float32 and w_scale.is_contiguous() and w_scale.shape == (n,),
        f"w_scale must be contiguous fp32 [{n}], got {w_scale.dtype} {tuple(w_scale.shape)}",
    )
    require(bias is None or (bias.shape == (n,) and bias.is_contiguous()), f"bias must be contiguous [{n}]")
    require(out_dtype in FLOAT_DTYPES, f"out_dtype must be fp16, bf16 or fp32, got {out_dtype}")
    tensors = [qa, qw, a_scale, w_scale] + ([bias] if bias is not None else [])
    require(all(t.device == qa.device for t in tensors), "all operands must be on one device")
    require(max(qa.numel(), qw.numel(), m * n) <= MAX_NUMEL, f"operands exceed {MAX_NUMEL} elements")
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=qa.device)
    require(
        out.shape == (m, n) and out.dtype == out_dtype and out.device == qa.device,
        f"out must be {out_dtype} {(m, n)}, got {out.dtype} {tuple(out.shape)}",
    )
    return out


def tma_compatible(qa: torch.Tensor, qw: torch.Tensor) -> bool:
    """TMA descriptors need 16-byte aligned base addresses and row strides (8-bit operands: K % 16 == 0), K
    contiguous; the Triton TMA kernels and the warp-specialized kernel (``ws.py``) both ask it."""
    return all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 and t.stride(1) == 1 for t in (qa, qw))


def persistent_fits(cfg: TileConfig, out_bytes: int, gpu: GPU | None) -> bool:
    """Whether the persistent kernel's shared memory fits: its programs keep the next tile's pipeline stages (8-bit
    operand tiles) while the epilogue converts the accumulator's layout through a buffer of the output tile, so an
    fp32 output of 128 x 256 (128 KB beside 144 KB of stages; Triton asks for 278,552 bytes on the H200) does not.
    Off CUDA (the interpreter) everything fits."""
    if gpu is None:
        return True
    operands = cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k
    barriers_and_alignment = 1024  # Triton's request exceeded this estimate by 24 bytes in every measured case
    return operands + cfg.block_m * cfg.block_n * out_bytes + barriers_and_alignment <= gpu.shared_memory


def launch_tiles(qa, a_scale, qw, w_scale, bias, out, cfg: TileConfig, fetch: int, fp8_fast_accum: bool, pdl: bool,
                 prefetch_k: int, l2_ahead: int) -> torch.Tensor:  # fmt: skip
    """The Triton GEMM with tile config ``cfg`` and fetch mode ``fetch`` (0 pointer loads, 1 TMA, 2-4 TMA with
    ``fetch - 1`` persistent programs per SM) on operands ``check_matmul_operands`` accepted."""
    m, k = qa.shape
    n = qw.shape[0]
    fmt = FORMAT_OF_DTYPE[qa.dtype]
    tiles = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m}
    launch = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    epilogue = (out, a_scale, w_scale, bias if bias is not None else w_scale)  # bias never read without HAS_BIAS
    meta = {
        "A_SCALE_PER_ROW": a_scale.numel() == m,  # for M == 1 both readings are the same value
        "HAS_BIAS": bias is not None,
        "IS_FP8": fmt == "fp8",
        "FP8_FAST_ACCUM": fp8_fast_accum and fmt == "fp8",
        "PDL": pdl,
        "PREFETCH_K": prefetch_k,
        "L2_AHEAD": 0 if interpreting() else l2_ahead,
        "THREADS": threads(cfg.num_warps),
    }
    if pdl:
        launch["launch_pdl"] = True
    if fetch:
        a_desc = TensorDescriptor.from_tensor(qa, [cfg.block_m, cfg.block_k])
        w_desc = TensorDescriptor.from_tensor(qw, [cfg.block_n, cfg.block_k])
        persistent = fetch >= 2
        if persistent:
            grid = (min(grid[0], num_sms(qa.device) * (fetch - 1)),)
        _w8a8_matmul_tma_kernel[grid](
            a_desc, w_desc, *epilogue, qw, m, n, k, out.stride(0), out.stride(1), qw.stride(0), **meta, **tiles,
            PERSISTENT=persistent, NUM_PROGRAMS=grid[0] if persistent else 1, **launch,
        )  # fmt: skip
    else:
        _w8a8_matmul_kernel[grid](
            qa, qw, *epilogue, m, n, k, qa.stride(0), qa.stride(1), qw.stride(0), qw.stride(1),
            out.stride(0), out.stride(1), EVEN_K=k % cfg.block_k == 0, **meta, **tiles, **launch,
        )  # fmt: skip
    return out
