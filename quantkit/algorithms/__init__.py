"""Quantization algorithms as pure functions on tensors."""
