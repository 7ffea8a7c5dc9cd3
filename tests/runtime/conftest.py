"""Runtime tests run torch on one CPU thread: the tensors are tiny, and on a shared 2-core machine thread contention
made the tests ~50x slower. (TRITON_INTERPRET is set by tests/conftest.py.)"""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
