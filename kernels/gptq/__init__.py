"""GPTQ's column loop on the GPU (``block``): one block of columns quantized with its error fed forward."""

from quantkit.kernels.gptq.block import MAX_BLOCK, gptq_block, gptq_block_reference

__all__ = ["MAX_BLOCK", "gptq_block", "gptq_block_reference"]
