"""Test-suite set-up shared by every directory.

Without a CUDA device the Triton kernels run in Triton's CPU interpreter. ``@triton.jit`` reads TRITON_INTERPRET
when a kernel module is imported, and any test module may import one indirectly (quantkit.nn imports the kernel
dispatch), so the variable is set here, before pytest imports the first test module of any directory.

The benchmarks are scripts, not a package: their folder goes on sys.path so that a test imports one as its script
does (``import bench_w4a16``, which imports ``common``).
"""

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread_in_runtime_tests(request):
    """Runtime tests run torch on one CPU thread: their tensors are tiny, and on a shared 2-core machine thread
    contention made them ~50x slower."""
    if "runtime" not in request.path.relative_to(Path(__file__).parent).parts:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def rtn_checkpoint(tmp_path_factory):
    """(folder, model): the tiny Llama quantized with RTN (4-bit, groups of 32, asymmetric) and saved; shared by
    the checkpoint tests of one module."""
    import quantkit
    from tests.tiny_models import tiny_model, tiny_tokenizer

    model = tiny_model("llama")
    quantkit.quantize(model, {"scheme": {"bits": 4, "group_size": 32, "sym": False}, "stages": [{"method": "rtn"}]})
    folder = quantkit.save_quantized(model, tmp_path_factory.mktemp("ckpt") / "q", tokenizer=tiny_tokenizer(320))
    return folder, model
