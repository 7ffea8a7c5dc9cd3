"""Weight-only W4A16 / W8A16 linear layers on GPTQ-v2 buffers: y = x @ W.T + bias with W dequantized in registers.

``w4a16_linear`` (``dispatch.py``) serves a product with the first path of ``dispatch.PATHS`` that plans it: the
mma.sync gemv (``mma_gemv.py``), the register-A wgmma GEMM (``rega.py``), the warp-specialized GEMM (``ws.py``), or
the Triton regime table (``configs.py``: the CUDA-core gemv ``gemv.py``, the tensor-core GEMM ``gemm.py``, or
dequantize + cuBLAS). ``weight.py`` prepares the kernel layout once per layer and checks operands; ``epilogue.py``
holds the Triton kernels' store and split-K fix-up.
"""

from quantkit.kernels.w4a16.configs import CONFIG_TABLE, KernelConfig, LaunchPlan, config_for, plan_launch
from quantkit.kernels.w4a16.dispatch import PATHS, choose, w4a16_linear
from quantkit.kernels.w4a16.gemm import w4a16_dequantize, w4a16_gemm, w4a16_reference
from quantkit.kernels.w4a16.gemv import w4a16_gemv, w4a16_gemv_reference
from quantkit.kernels.w4a16.mma_gemv import w4a16_mma_gemv
from quantkit.kernels.w4a16.problem import Plan, Product
from quantkit.kernels.w4a16.rega import w4a16_rega_gemm
from quantkit.kernels.w4a16.weight import (
    ACT_DTYPES,
    KERNEL_LAYOUT,
    KERNEL_LAYOUT_VERSION,
    W4A16Weight,
    prepare_gptq_weight,
    unpack_gptq_codes,
    unsupported_reason,
)
from quantkit.kernels.w4a16.ws import w4a16_ws_gemm

__all__ = [
    "ACT_DTYPES",
    "CONFIG_TABLE",
    "KERNEL_LAYOUT",
    "KERNEL_LAYOUT_VERSION",
    "PATHS",
    "KernelConfig",
    "LaunchPlan",
    "Plan",
    "Product",
    "W4A16Weight",
    "choose",
    "config_for",
    "plan_launch",
    "prepare_gptq_weight",
    "unpack_gptq_codes",
    "unsupported_reason",
    "w4a16_dequantize",
    "w4a16_gemm",
    "w4a16_gemv",
    "w4a16_gemv_reference",
    "w4a16_linear",
    "w4a16_mma_gemv",
    "w4a16_reference",
    "w4a16_rega_gemm",
    "w4a16_ws_gemm",
]
