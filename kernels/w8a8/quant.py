"""Activation quantizer of the W8A8 family: x [M, K] -> 8-bit codes and scales, int8 or fp8 e4m3.

``quantize_activations``: one program per row of x [M, K] (fp16/bf16/fp32). Dynamic (per token): the row's abs-max
gives ``a_scale[m] = amax / QMAX`` and ``qa = clamp(round(x * (QMAX / amax)), -QMAX, QMAX)``; short rows are read
once and kept in registers, long ones in two sweeps (``quantize_launch_params``). Static (per tensor): ``qa =
clamp(round(x * (1 / input_scale)))`` with the calibrated fp32 ``input_scale`` [1]. QMAX = 127 for int8 (symmetric,
-128 unused) and 448 for e4m3fn (largest finite). ``amax`` is floored at ``MIN_AMAX`` so that all-zero rows give
zeros, not NaN. Rounding is half-to-even, to the integers (int8) or to the e4m3 grid (fp8), computed explicitly in
fp32 so the GPU and Triton's interpreter agree with ``torch.round`` / ``Tensor.to(torch.float8_e4m3fn)`` bit for bit
(the interpreter's own fp32 -> fp8 cast does not round to nearest even). With ``pdl`` the GEMM launched after it
(programmatic dependent launch) may start at once and waits for the codes itself.

Split rows (``split_rows``): at few rows a long row is one program's serial work while the rest of the GPU idles. There,
dynamic rows of at least ``SPLIT_MIN_K`` elements may be cut into blocks of about ``SPLIT_BLOCK_K``, one program each,
all resident at once (M x programs <= SMs). Each program publishes its block's abs-max (``atomic_max`` on the fp32 bits:
non-negative floats order as their bit patterns), counts itself in on its row's counter and waits until the row's
programs are all in; the last one out resets the row's three words of ``split_workspace``. The max is exact in any
order, so the codes and scales are the one-program path's, bit for bit. The interpreter runs programs one after another,
so there a split launch is two launches (publish, then quantize and reset): the same code without the wait. Measured
(``benchmarks/bench_quantizer.py``; H100, bf16, CUDA graphs, the quantizer alone, one program / split): M = 1 K = 8192
3.1 / 4.0 us, 14336 4.0 / 4.1, 28672 6.0 / 4.3; M = 16 K = 28672 6.3 / 4.9. But under programmatic dependent launch,
before the progressive W4A8 GEMM, the split lost every time (8192 x 28672 at M = 1: 65.9 us against 60.2; at M = 16 4096
x 14336: 27.4 against 20.5): the GEMM's programs start at once and stream weights while the row's programs wait on each
other. So the rule splits rows of 16384 or more only where ``pdl`` is off (pre-Hopper GPUs, one-level W4A8 layers,
direct calls); ``split`` asks for it anywhere. Bit for bit holds for finite inputs: the split's max over the bit
patterns ranks NaN above infinity.
Limits: the workspace is per device, so split launches on two streams of one device at once are not supported (the
runtime and the benchmarks run one stream); it is allocated on the first split call, which therefore must not be
inside a CUDA graph capture (a capture that finds none takes the one-program path, same numbers, where the rule
chose the split; an explicit ``split`` is refused there).

The plain PyTorch references here define the numerics; ``quantize_rows_reference`` also quantizes weights (rows =
output channels) for ``quantkit.nn.W8A8Linear``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quantkit.kernels._device import interpreting, num_sms, round_half_even

INT8_MAX = 127.0
E4M3_MAX = 448.0
MIN_AMAX = 1e-30  # keeps QMAX / amax finite in fp32 for all-zero (or subnormal) rows
ONE_PASS_MAX_K = 32768  # rows up to this length may be quantized from registers after a single read
SWEEP_BLOCK_K = 8192  # the block of the two-sweep path (abs-max sweep, then quantizing sweep) for longer rows
MAX_NUMEL = 2**31 - 1  # 32-bit offsets
SPLIT_MIN_K = 16384  # dynamic rows at least this long, at few rows and without pdl, are split (module doc)
SPLIT_BLOCK_K = 2048  # elements per program of a split row (rounded up to a power of two)
SPLIT_MAX_M = 16  # more rows fill the GPU with one program each

FORMAT_OF_DTYPE = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}
DTYPE_OF_FORMAT = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QMAX_OF_FORMAT = {"int8": INT8_MAX, "fp8": E4M3_MAX}
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # of x and of the GEMM's output

_MIN_AMAX = tl.constexpr(MIN_AMAX)


def require(cond: bool, msg: str) -> None:
    """Raise ValueError(msg) unless ``cond``: the family's operand checks."""
    if not cond:
        raise ValueError(msg)


# ----------------------------------------------------------------------------------------------------------------
# Reference (plain PyTorch): defines the numerics the kernels reproduce.
# ----------------------------------------------------------------------------------------------------------------


def _cast_codes(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values already clamped to [-QMAX, QMAX] -> int8 codes (half-to-even) or e4m3 (nearest even)."""
    if fmt == "int8":
        return torch.round(v).to(torch.int8)
    return v.to(torch.float8_e4m3fn)


def quantize_rows_reference(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization: x [R, C] float -> (q [R, C] int8 | float8_e4m3fn, scale fp32 [R]).

    ``x ~= q * scale[:, None]``. Used for activations (rows = tokens) and for weights (rows = output channels).
    """
    xf = x.float()
    amax = xf.abs().amax(dim=1).clamp(min=MIN_AMAX)  # [R]
    qmax = torch.full_like(amax, QMAX_OF_FORMAT[fmt])
    # tensor / tensor divides correctly rounded, like the kernel's div_rn; a Python-scalar numerator or divisor
    # may be computed through a reciprocal (scalar / t is t.reciprocal() * scalar), rounding twice
    scale = amax / qmax
    inv = qmax / amax
    q = _cast_codes((xf * inv[:, None]).clamp(-QMAX_OF_FORMAT[fmt], QMAX_OF_FORMAT[fmt]), fmt)
    return q, scale


def quantize_activations_reference(
    x: torch.Tensor, fmt: str, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (qa [M, K], a_scale fp32 [M] when dynamic, or ``input_scale`` [1] when static)."""
    if input_scale is None:
        return quantize_rows_reference(x, fmt)
    qmax = QMAX_OF_FORMAT[fmt]
    scale = input_scale.float().reshape(1)
    inv = torch.ones_like(scale) / scale
    q = _cast_codes((x.float() * inv).clamp(-qmax, qmax), fmt)
    return q, scale


# ----------------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def round_to_e4m3_grid(v):
    """Round fp32 with |v| <= 448 to the nearest e4m3fn value (ties to even), still as fp32.

    The spacing of e4m3 values in |v|'s binade is 2**(e - 3) (3 mantissa bits), and 2**-9 below the smallest
    normal 2**-6; scaling by powers of two built from the exponent bits is exact, so only the integer rounding
    rounds. The sign is copied back bitwise so that negatives rounding to zero give -0, as a hardware cast does.
    """
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - e + 3) << 23).to(tl.float32, bitcast=True)
    r = round_half_even(tl.abs(v) * inv_step) * step
    return (r.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def store_codes(q_ptrs, v, mask, QMAX: tl.constexpr, IS_FP8: tl.constexpr):
    """v fp32 = x * (1 / scale): clamp to [-QMAX, QMAX], round, store as int8 or e4m3."""
    v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
    if IS_FP8:
        tl.store(q_ptrs, round_to_e4m3_grid(v).to(q_ptrs.dtype.element_ty), mask=mask)
    else:
        tl.store(q_ptrs, round_half_even(v).to(tl.int8), mask=mask)


@triton.jit
def quantize_row_dynamic(q_ptrs, scale_ptr, x, mask, QMAX: tl.constexpr, IS_FP8: tl.constexpr):
    """A whole row x fp32 (zeros where masked): its scale amax / QMAX at ``scale_ptr``, its codes at ``q_ptrs``."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), _MIN_AMAX)
    tl.store(scale_ptr, tl.math.div_rn(amax, QMAX))
    store_codes(q_ptrs, x * tl.math.div_rn(QMAX, amax), mask, QMAX, IS_FP8)


@triton.jit
def _quantize_rows_kernel(
    # pointers
    x_ptr,
    q_ptr,
    scale_ptr,
    # sizes
    K,
    # strides
    stride_xm,
    stride_xk,
    stride_qm,
    stride_qk,
    # meta-parameters
    QMAX: tl.constexpr,
    IS_FP8: tl.constexpr,
    DYNAMIC: tl.constexpr,
    ONE_PASS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # the GEMM that follows may start now: it waits for this grid's writes before reading them
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    offs = tl.arange(0, BLOCK_K)

    if ONE_PASS:  # the whole row fits in one block: read it once
        mask = offs < K
        x = tl.load(x_row + offs * stride_xk, mask=mask, other=0.0).to(tl.float32)
        if DYNAMIC:
            quantize_row_dynamic(q_row + offs * stride_qk, scale_ptr + row, x, mask, QMAX, IS_FP8)
        else:
            store_codes(q_row + offs * stride_qk, x * tl.math.div_rn(1.0, tl.load(scale_ptr)), mask, QMAX, IS_FP8)
    else:  # long rows: abs-max sweep, then a quantizing sweep (the row is in L2 by then)
        if DYNAMIC:
            running = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                mask = k0 + offs < K
                x = tl.load(x_row + (k0 + offs) * stride_xk, mask=mask, other=0.0).to(tl.float32)
                running = tl.maximum(running, tl.abs(x))
            amax = tl.maximum(tl.max(running, axis=0), _MIN_AMAX)
            tl.store(scale_ptr + row, tl.math.div_rn(amax, QMAX))
            inv = tl.math.div_rn(QMAX, amax)
        else:
            inv = tl.math.div_rn(1.0, tl.load(scale_ptr))
        for k0 in range(0, K, BLOCK_K):
            mask = k0 + offs < K
            x = tl.load(x_row + (k0 + offs) * stride_xk, mask=mask, other=0.0).to(tl.float32)
            store_codes(q_row + (k0 + offs) * stride_qk, x * inv, mask, QMAX, IS_FP8)


@triton.jit
def row_amax_across_programs(ws_ptr, ws_rows, row, partial, parts, PHASE: tl.constexpr):
    """The abs-max of a row split over ``parts`` programs (grid axis 1), each holding the ``partial`` abs-max (fp32,
    >= 0) of its block; the result is floored at MIN_AMAX. ``ws_ptr``: int32 [3, ws_rows], zeros between launches
    (the row's max bits, arrivals, departures). PHASE 0: publish, wait for the row's programs, read, leave (the last
    one out resets the row's words); 1: publish only; 2: read and leave (1 then 2 in two launches: the interpreter's
    way)."""
    amax_ptr = ws_ptr + row
    arrive_ptr = ws_ptr + ws_rows + row
    leave_ptr = ws_ptr + 2 * ws_rows + row
    if PHASE != 2:
        tl.atomic_max(amax_ptr, partial.to(tl.int32, bitcast=True), sem="relaxed", scope="gpu")
        tl.atomic_add(arrive_ptr, 1, sem="release", scope="gpu")
    if PHASE == 0:
        arrived = tl.atomic_add(arrive_ptr, 0, sem="acquire", scope="gpu")
        while arrived < parts:
            arrived = tl.atomic_add(arrive_ptr, 0, sem="acquire", scope="gpu")
    bits = tl.atomic_add(amax_ptr, 0, sem="acquire", scope="gpu")
    if PHASE != 1:
        left = tl.atomic_add(leave_ptr, 1, sem="acq_rel", scope="gpu")
        if left == parts - 1:  # every program of the row has read the max: ready for the next launch
            tl.atomic_xchg(amax_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(arrive_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(leave_ptr, 0, sem="relaxed", scope="gpu")
    return tl.maximum(bits.to(tl.float32, bitcast=True), _MIN_AMAX)


@triton.jit
def quantize_split_block(q_ptrs, scale_ptr, x, mask, ws_ptr, ws_rows, row, QMAX: tl.constexpr, IS_FP8: tl.constexpr,
                         PHASE: tl.constexpr):  # fmt: skip
    """Block ``program_id(1)`` of split row ``row`` (x fp32, zeros where masked): the row's scale at ``scale_ptr``
    (written by block 0) and this block's codes at ``q_ptrs`` (``row_amax_across_programs``'s PHASE)."""
    amax = row_amax_across_programs(ws_ptr, ws_rows, row, tl.max(tl.abs(x), axis=0), tl.num_programs(1), PHASE)
    if PHASE != 1:
        if tl.program_id(1) == 0:
            tl.store(scale_ptr, tl.math.div_rn(amax, QMAX))
        store_codes(q_ptrs, x * tl.math.div_rn(QMAX, amax), mask, QMAX, IS_FP8)


@triton.jit
def _quantize_split_kernel(
    x_ptr, q_ptr, scale_ptr, ws_ptr, K, ws_rows, stride_xm, stride_xk, stride_qm, stride_qk,
    QMAX: tl.constexpr, IS_FP8: tl.constexpr, PHASE: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Dynamic quantization of row ``program_id(0)``'s block ``program_id(1)`` (see ``row_amax_across_programs``)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs * stride_xk, mask=mask, other=0.0).to(tl.float32)
    quantize_split_block(q_ptr + row * stride_qm + offs * stride_qk, scale_ptr + row, x, mask, ws_ptr, ws_rows, row,
                         QMAX, IS_FP8, PHASE)  # fmt: skip


_SPLIT_WORKSPACE: dict[torch.device, torch.Tensor] = {}


def split_workspace(device: torch.device) -> torch.Tensor | None:
    """The split rows' int32 [3, SPLIT_MAX_M] words of ``device`` (zeros between launches), made on first use; None
    where there is none yet and the current stream is capturing a CUDA graph (nothing may be allocated for it)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ws = _SPLIT_WORKSPACE.get(device)
    if ws is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        ws = _SPLIT_WORKSPACE[device] = torch.zeros(3, SPLIT_MAX_M, dtype=torch.int32, device=device)
    return ws


def split_rows(m: int, k: int, sms: int, pdl: bool = False) -> int:
    """Programs per row of dynamic quantization: 1, or without ``pdl`` for rows of at least ``SPLIT_MIN_K`` elements
    at M <= ``SPLIT_MAX_M``, one per block of ``SPLIT_BLOCK_K`` as long as the M x programs fit one wave (<= sms)."""
    if pdl or m > SPLIT_MAX_M or k < SPLIT_MIN_K:
        return 1
    parts = min(triton.cdiv(k, SPLIT_BLOCK_K), sms // max(m, 1))
    return parts if parts >= 2 else 1


def split_phases() -> tuple[int, ...]:
    """The PHASE of each launch of a split grid: one launch whose programs wait for each other on a GPU, two in the
    interpreter (which runs programs one after another): publish the blocks' maxima, then quantize."""
    return (1, 2) if interpreting() else (0,)


def split_plan(
    split: int | None, m: int, k: int, device: torch.device, allowed: bool, pdl: bool, name: str
) -> tuple[int, torch.Tensor | None]:
    """(programs per row, the workspace; None for one program): ``split_rows``'s where ``split`` is None (one where
    not ``allowed``: static scales or a forced block), else ``split`` checked (a ValueError naming ``name``)."""
    explicit = split is not None
    if not explicit:
        split = split_rows(m, k, num_sms(device), pdl) if allowed else 1
    require(isinstance(split, int) and split >= 1, f"{name}: split must be a positive int, got {split!r}")
    if split == 1:
        return 1, None
    resident = interpreting() or m * split <= num_sms(device)  # a row's programs wait for each other
    require(allowed and m <= SPLIT_MAX_M and resident,
            f"{name}: split 1, or 2 or more programs per row of dynamic quantization without a forced block, at "
            f"most {SPLIT_MAX_M} rows and rows x programs within the SMs; got {split} for {m} rows")  # fmt: skip
    ws = split_workspace(device)
    require(ws is not None or not explicit, f"{name}: split rows need their workspace, made on a first call "
            "outside a CUDA graph capture; call once before capturing")  # fmt: skip
    return (split, ws) if ws is not None else (1, None)


def split_launch(k: int, parts: int) -> tuple[int, int, int]:
    """(elements per program, programs per row, num_warps) of a split row of k elements over about ``parts``
    programs: power-of-two blocks, so fewer programs where they cover k so."""
    block = triton.next_power_of_2(triton.cdiv(k, parts))
    return block, triton.cdiv(k, block), 4 if block <= 2048 else 8


def launch_split(x, out, scale, ws, fmt: str, parts: int, pdl: bool) -> None:
    """``_quantize_split_kernel`` over ``parts`` blocks per row (``split_launch``)."""
    m, k = x.shape
    block_k, programs, num_warps = split_launch(k, parts)
    args = (x, out, scale, ws, k, ws.shape[1], x.stride(0), x.stride(1), out.stride(0), out.stride(1))
    for phase in split_phases():
        _quantize_split_kernel[(m, programs)](*args, QMAX=QMAX_OF_FORMAT[fmt], IS_FP8=fmt == "fp8", PHASE=phase,
                                              BLOCK_K=block_k, PDL=pdl, num_warps=num_warps)  # fmt: skip


def quantize_launch_params(k: int, block_k: int | None, fmt: str, m: int) -> tuple[int, bool, int]:
    """(block_k, one_pass, num_warps) for rows of length k, from an H200 probe.

    Rows up to 16384 are read once. Longer rows are read once only for int8 with few rows (M <= 64): the registers
    of a 32768-wide block (32 warps) spill little there, while fp8's rounding code spilled at 16 warps and, with many
    rows, a CTA that fills an SM's registers alone cannot overlap its load, reduce and store phases (fp8, M = 1024,
    K = 28672: 282 us in one pass, 54 us in two sweeps of 8192). Two sweeps use blocks of 8192 and 16 warps.
    """
    if block_k is None:
        one_pass_max = ONE_PASS_MAX_K if fmt == "int8" and m <= 64 else SWEEP_BLOCK_K * 2
        block_k = triton.next_power_of_2(k) if k <= one_pass_max else SWEEP_BLOCK_K
    one_pass = block_k >= k
    if not one_pass:
        num_warps = 16 if block_k >= SWEEP_BLOCK_K else 8 if block_k >= 4096 else 4
    else:  # fp8's rounding needs more registers: 32 warps keep a 16384 block from spilling
        num_warps = 4 if block_k <= 2048 else 8 if block_k <= 8192 else 16 if block_k <= 16384 and fmt == "int8" else 32
    return block_k, one_pass, num_warps


def quantize_activations(
    x: torch.Tensor,
    fmt: str,
    input_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
    block_k: int | None = None,
    pdl: bool = False,
    split: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp16/bf16/fp32 -> (qa [M, K] int8 | float8_e4m3fn, a_scale fp32 [M]); static when ``input_scale``
    (fp32 [1]) is given, and then the returned scale is ``input_scale`` itself.

    ``pdl``: let the next kernel, launched with programmatic dependent launch (``w8a8_matmul(pdl=True)``), start
    while this one runs (CUDA, sm_90+; not in the interpreter).

    ``out`` / ``out_scale`` may be preallocated (contiguous, right shape and dtype); ``block_k`` overrides the row
    block (a block shorter than K selects the two-sweep path). ``split`` (dynamic only): programs per row, 1 for one
    (None: ``split_rows``'s rule; see the module doc).
    """
    require(fmt in QMAX_OF_FORMAT, f"fmt must be one of {sorted(QMAX_OF_FORMAT)}, got {fmt!r}")
    require(x.dim() == 2, f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    require(x.dtype in FLOAT_DTYPES, f"x must be fp16, bf16 or fp32, got {x.dtype}")
    require(x.numel() <= MAX_NUMEL, f"x has {x.numel()} elements; 32-bit offsets allow {MAX_NUMEL}")
    m, k = x.shape
    require(k > 0, "x has no columns")
    if out is None:
        out = torch.empty(m, k, dtype=DTYPE_OF_FORMAT[fmt], device=x.device)
    require(
        out.shape == (m, k) and out.dtype == DTYPE_OF_FORMAT[fmt] and out.device == x.device,
        f"out must be {DTYPE_OF_FORMAT[fmt]} {(m, k)} on {x.device}, got {out.dtype} {tuple(out.shape)} {out.device}",
    )
    dynamic = input_scale is None
    if dynamic:
        if out_scale is None:
            out_scale = torch.empty(m, dtype=torch.float32, device=x.device)
        require(
            out_scale.shape == (m,) and out_scale.dtype == torch.float32 and out_scale.is_contiguous(),
            f"out_scale must be contiguous fp32 [{m}], got {out_scale.dtype} {tuple(out_scale.shape)}",
        )
        scale = out_scale
    else:
        require(out_scale is None, "out_scale is only for dynamic quantization (input_scale is given)")
        require(
            input_scale.numel() == 1 and input_scale.dtype == torch.float32 and input_scale.device == x.device,
            f"input_scale must be one fp32 value on {x.device}, got {input_scale.dtype} {tuple(input_scale.shape)}",
        )
        scale = input_scale
    if m == 0:
        return out, scale
    split, ws = split_plan(split, m, k, x.device, dynamic and block_k is None, pdl, "quantize_activations")
    if ws is not None:
        launch_split(x, out, scale, ws, fmt, split, pdl)
        return out, scale
    block_k, one_pass, num_warps = quantize_launch_params(k, block_k, fmt, m)
    _quantize_rows_kernel[(m,)](
        x,
        out,
        scale,
        k,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        QMAX=QMAX_OF_FORMAT[fmt],
        IS_FP8=fmt == "fp8",
        DYNAMIC=dynamic,
        ONE_PASS=one_pass,
        BLOCK_K=block_k,
        PDL=pdl,
        num_warps=num_warps,
    )
    return out, scale
