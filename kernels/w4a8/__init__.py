"""W4A8 linear layers: 4-bit GPTQ weights (the W4A16 kernel layout) with 8-bit per-token activations, int8 or fp8.

``w4a8_linear`` (``dispatch.py``) permutes x for act-order, quantizes it per token with W8A8's quantizer
(``w8a8/quant.py``) and runs the GEMM of ``gemm.py``, whose 4-bit codes become int8 or e4m3 operands in registers;
``dispatch.CONFIG_TABLE`` picks its tiles by M (the small-M path: swap-AB tiles with split-K; H100 figures in
docs/results/w4a8.md). ``flat.py`` is the same product in one software-pipelined K loop, the unpacked weight tile the
wgmma's register operand: the default above M = 16 (``dispatch.FLAT_TABLE``, ``W4A8Config.flat``; faster than the
group loop of ``gemm.py`` at every M measured, ``dispatch.GROUP_LOOP_TABLE`` keeps that one selectable).
``progressive.py`` is QServe's format, a ``ProgressiveWeight`` (int8 per-channel level, 4-bit groups with integer
scales): the same entry points run it with one int32 accumulator over K (``dispatch.PROGRESSIVE_TABLE``; int8
activations). ``gemv.py`` serves one row of x on a progressive weight with dp4a on CUDA cores where asked
(``w4a8_linear(gemv=True)``; ``dispatch.PROGRESSIVE_GEMV``: measured behind the tiles with programmatic dependent
launch, so off).
"""

from quantkit.kernels.w4a8.dispatch import (
    CONFIG_TABLE,
    FLAT_TABLE,
    GROUP_LOOP_TABLE,
    PROGRESSIVE_TABLE,
    SMALL_M,
    LaunchPlan,
    Plan,
    W4A8Config,
    choose,
    config_for,
    explain,
    plan_launch,
    w4a8_linear,
    w4a8_matmul,
)
from quantkit.kernels.w4a8.gemm import check_w4a8_operands, signed_codes, w4a8_reference
from quantkit.kernels.w4a8.progressive import (
    ProgressiveWeight,
    dequantize,
    int8_weight,
    progressive_reference,
    quantize_progressive,
)

__all__ = [
    "CONFIG_TABLE",
    "FLAT_TABLE",
    "GROUP_LOOP_TABLE",
    "PROGRESSIVE_TABLE",
    "SMALL_M",
    "LaunchPlan",
    "Plan",
    "ProgressiveWeight",
    "W4A8Config",
    "check_w4a8_operands",
    "choose",
    "config_for",
    "dequantize",
    "explain",
    "int8_weight",
    "plan_launch",
    "progressive_reference",
    "quantize_progressive",
    "signed_codes",
    "w4a8_linear",
    "w4a8_matmul",
    "w4a8_reference",
]
