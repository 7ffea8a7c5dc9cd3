"""Test-suite set-up shared by every directory.

Without a CUDA device the Triton kernels run in Triton's CPU interpreter. ``@triton.jit`` reads TRITON_INTERPRET
when a kernel module is imported, and any test module may import one indirectly (quantkit.nn imports the kernel
dispatch), so the variable is set here, before pytest imports the first test module of any directory.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
