"""Seconds per call of a list of rotated calls, the way the kernel benchmarks time them.

On a GPU: warm up (and compile) off the capture stream, capture every call into one CUDA graph, and take the median
replay time of ``triton.testing.do_bench``, divided by the number of calls (launch overhead amortized as in a decode
graph; operands rotated by the caller so that the weights come from device memory, not L2). In ``smoke`` mode
(CPU plumbing checks): wall-clock time of one pass.
"""

from __future__ import annotations

import time

import torch
import triton
import triton.testing


def seconds_per_call(calls: list, smoke: bool, warmup_ms: int, rep_ms: int) -> float:
    if smoke:
        t0 = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t0) / len(calls)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture stream, as torch.cuda.graphs recommends
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    ms = triton.testing.do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    del graph
    return ms * 1e-3 / len(calls)
