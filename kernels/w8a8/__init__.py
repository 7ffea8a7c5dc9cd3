"""W8A8 linear layers: 8-bit activations x 8-bit weights with per-token x per-output-channel scales, int8 or fp8.

``w8a8_linear`` quantizes x (``quant.py``) and runs the GEMM that ``dispatch.PATHS`` picks: the warp-specialized fp8
kernel (``ws.py``, Hopper, M > 256) or the Triton tiles (``gemm.py``) with a tile config from ``configs.py``.
"""

from quantkit.kernels.w8a8.configs import (
    CONFIG_KEYS,
    CONFIGS,
    M_REGIMES,
    TMA_MODES,
    TileConfig,
    config_for,
    l2_ahead_for,
    m_regime,
    pick_config,
)
from quantkit.kernels.w8a8.dispatch import PATHS, choose, use_pdl, w8a8_linear, w8a8_matmul
from quantkit.kernels.w8a8.gemm import check_matmul_operands, scaled_epilogue_reference, w8a8_matmul_reference
from quantkit.kernels.w8a8.problem import Plan, Product
from quantkit.kernels.w8a8.quant import (
    DTYPE_OF_FORMAT,
    E4M3_MAX,
    FORMAT_OF_DTYPE,
    INT8_MAX,
    MIN_AMAX,
    QMAX_OF_FORMAT,
    quantize_activations,
    quantize_activations_reference,
    quantize_rows_reference,
)
from quantkit.kernels.w8a8.ws import fp8_ws_matmul

__all__ = [
    "CONFIGS",
    "CONFIG_KEYS",
    "DTYPE_OF_FORMAT",
    "E4M3_MAX",
    "FORMAT_OF_DTYPE",
    "INT8_MAX",
    "MIN_AMAX",
    "M_REGIMES",
    "PATHS",
    "QMAX_OF_FORMAT",
    "TMA_MODES",
    "Plan",
    "Product",
    "TileConfig",
    "check_matmul_operands",
    "choose",
    "config_for",
    "fp8_ws_matmul",
    "l2_ahead_for",
    "m_regime",
    "pick_config",
    "quantize_activations",
    "quantize_activations_reference",
    "quantize_rows_reference",
    "scaled_epilogue_reference",
    "use_pdl",
    "w8a8_linear",
    "w8a8_matmul",
    "w8a8_matmul_reference",
]
