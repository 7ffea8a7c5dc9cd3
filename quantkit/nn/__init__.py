"""Quantized linear modules that replace ``nn.Linear`` in a quantized model."""

from quantkit.nn.qlinear import QuantLinear

__all__ = ["QuantLinear"]
