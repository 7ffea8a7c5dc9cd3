"""Quantization schemes, the quantized-weight container and bit packing."""

from quantkit.quant.packing import Layout, pack_rows, unpack_rows
from quantkit.quant.scheme import QuantScheme
from quantkit.quant.tensor import QuantizedWeight, compute_qparams, quantize_with_qparams

__all__ = [
    "Layout",
    "QuantScheme",
    "QuantizedWeight",
    "compute_qparams",
    "pack_rows",
    "quantize_with_qparams",
    "unpack_rows",
]
