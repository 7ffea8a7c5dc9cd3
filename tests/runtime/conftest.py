"""Runtime tests run the Triton kernels in Triton's interpreter when no CUDA device is present (set before any
kernel module is imported), and run torch on one CPU thread: the tensors are tiny, and on a shared 2-core machine
thread contention made the tests ~50x slower."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
