"""The activation quantizer's split rows: a long row quantized by several programs that share its abs-max.

The codes and scales must be the one-program path's bit for bit (a max is exact in any order), the workspace must
be zeros again after every launch (the next launch counts from it), and the rule and the argument checks must say
what they do. In Triton's interpreter a split launch runs as two launches (publish, then quantize); the GPU test at
the bottom runs the one launch whose programs wait for each other.
"""

from __future__ import annotations

import pytest
import torch
from quantkit.kernels import w8a8 as K
from quantkit.kernels.w8a8 import quant as Q

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def rows(m: int, k: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """Rows of different magnitudes, the largest entry of each in a different block, the last row all zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m).reshape(m, 1)
    for i in range(m):
        x[i, (i * 997) % k] = 40.0 * (i + 1) * (-1) ** i
    x[-1] = 0
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k,split", [(1, 300, 3), (3, 1000, 4), (2, 129, 2), (2, 16400, None)])
def test_split_rows_match_one_program(fmt, dtype, m, k, split):
    x = rows(m, k, dtype, seed=m + k)
    q, scale = K.quantize_activations(x, fmt, split=split)
    q_one, scale_one = K.quantize_activations(x, fmt, split=1)
    q_ref, scale_ref = K.quantize_activations_reference(x, fmt)
    assert same_bits(q, q_one) and same_bits(q, q_ref)
    assert torch.equal(scale, scale_one) and torch.equal(scale, scale_ref)
    assert not Q.split_workspace(x.device).any(), "a split launch must leave its workspace zeroed"


def test_consecutive_split_launches_do_not_see_each_other():
    """The second launch's rows are smaller than the first's: a max left over from the first would show."""
    big, small = rows(2, 640, seed=1) * 100, rows(2, 640, seed=2)
    K.quantize_activations(big, "int8", split=5)
    q, scale = K.quantize_activations(small, "int8", split=5)
    q_ref, scale_ref = K.quantize_activations_reference(small, "int8")
    assert same_bits(q, q_ref) and torch.equal(scale, scale_ref)


def test_split_rule():
    assert Q.split_rows(1, Q.SPLIT_MIN_K - 1, 132) == 1  # short rows: one program
    assert Q.split_rows(Q.SPLIT_MAX_M + 1, 28672, 132) == 1  # many rows fill the GPU already
    assert Q.split_rows(1, 28672, 132) == 28672 // Q.SPLIT_BLOCK_K
    assert Q.split_rows(16, 28672, 132) == 132 // 16  # one wave: a row's programs wait for each other
    assert Q.split_rows(16, 16384, 16) == 1
    assert Q.split_rows(1, 28672, 132, pdl=True) == 1  # lost to one program before the GEMM (module doc)


@pytest.mark.parametrize(
    "kwargs,m",
    [({"split": 0}, 1), ({"split": 2, "block_k": 64}, 1), ({"split": 2}, Q.SPLIT_MAX_M + 1),
     ({"split": 2, "input_scale": "one"}, 1)],
)  # fmt: skip
def test_split_refusals(kwargs, m):
    x = rows(m, 256)
    if kwargs.get("input_scale") == "one":
        kwargs = dict(kwargs, input_scale=torch.ones(1, device=DEVICE))
    with pytest.raises(ValueError, match="split"):
        K.quantize_activations(x, "int8", **kwargs)


def test_explicit_split_is_never_dropped(monkeypatch):
    """Without a workspace (a first call inside a CUDA graph capture) the rule's split quietly becomes one program
    (the same numbers), an explicit one is refused; a split that is no int is refused too."""
    monkeypatch.setattr(Q, "split_workspace", lambda device: None)
    monkeypatch.setattr(Q, "num_sms", lambda device: 132)
    assert Q.split_plan(None, 1, 28672, torch.device(DEVICE), True, False, "q") == (1, None)
    with pytest.raises(ValueError, match="workspace"):
        Q.split_plan(4, 1, 28672, torch.device(DEVICE), True, False, "q")
    with pytest.raises(ValueError, match="positive int"):
        Q.split_plan(2.5, 1, 28672, torch.device(DEVICE), True, False, "q")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("m,k", [(1, 28672), (1, 14336), (16, 28672), (5, 8192 + 100)])
def test_gpu_split_rows_wait_for_each_other(m, k, pdl):
    """On the GPU a row's programs spin on its counter; repeated launches (the workspace reset each time), in a
    CUDA graph too, give the reference's bits."""
    if pdl and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    x = rows(m, k, seed=k)
    split = min(-(-k // Q.SPLIT_BLOCK_K), torch.cuda.get_device_properties(0).multi_processor_count // m)
    q_ref, scale_ref = K.quantize_activations_reference(x, "int8")
    for _ in range(3):
        q, scale = K.quantize_activations(x, "int8", pdl=pdl, split=split)
        assert same_bits(q, q_ref) and torch.equal(scale, scale_ref)
    out, out_scale = torch.empty_like(q), torch.empty_like(scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(4):
            K.quantize_activations(x, "int8", out=out, out_scale=out_scale, pdl=pdl, split=split)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits(out, q_ref) and torch.equal(out_scale, scale_ref)
    assert not Q.split_workspace(x.device).any()
