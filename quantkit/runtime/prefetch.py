"""Weights streamed into L2 on a side stream while a decode step's small kernels run (CUDA decode graphs only).

At batch 1 a decode step alternates weight-streaming GEMMs with kernels that read almost nothing from DRAM
(RMSNorm, rotary, KV store, attention, SiLU product): DRAM idles through them, and a GEMM of a few MB (o_proj: 8.4 MB
at 4 bits for an 8B model) then spends most of its time on latency instead of bandwidth. ``WeightPrefetcher`` forks a
side stream at fixed points of the forward pass and asks L2 for the weight of a GEMM that comes a few kernels later
(``kernels.l2_prefetch.prefetch_buffers_l2``); the GEMM then finds its lines in L2. Nothing waits for a prefetch and
no value changes: the side stream joins the main one at the end of the forward pass, so a CUDA graph captures the
fork and join like any other dependency.

Points (``config.PREFETCH_POINTS``) and what is fetched there:

- ``attention``: after the q/k/v projection, this layer's ``o_proj`` (while rotary, KV store and attention run).
- ``down``: before the down projection, the next layer's q/k/v projection (while the down projection streams its own
  weight: the two share the bandwidth and the 50 MB L2).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.kernels.l2_prefetch import MAX_BUFFERS, load_buffers_l2, prefetch_buffers_l2
from quantkit.runtime.config import PREFETCH_POINTS

PROGRAMS = 132  # CTAs of each prefetch launch (two warps each): one per SM of an H100 / H200
MODE = "prefetch"  # "prefetch": PTX prefetch hints; "load": plain loads of every word (kernels.l2_prefetch)


def weight_buffers(module: nn.Module) -> list[torch.Tensor]:
    """The tensors a linear's GEMM reads: the kernel-ready weight of a ``QuantLinear`` once it has run on CUDA (else
    its packed buffers), a W8A8 layer's weight and scales, a float layer's weight; bias and index tensors are left
    out (they are small)."""
    state = getattr(module, "_kernel_state", None)
    if state is not None and state[1] is not None:
        w = state[1]
        return [t for t in (w.qweight, w.scales, w.qzeros) if t is not None]
    names = ("qweight", "scales", "qzeros", "weight", "weight_scale")
    return [t for n in names if isinstance(t := getattr(module, n, None), torch.Tensor) and t.is_contiguous()]


class WeightPrefetcher:
    """Prefetch plan of one model: ``hook(i)`` gives layer i's modules a callback ``fetch(point)``; ``join()`` ends
    the side stream's work into the current stream (call it once per forward pass, after the last layer)."""

    def __init__(self, layers: nn.ModuleList, points: Iterable[str] = ("attention",), programs: int | None = None):
        points = tuple(points)
        bad = [p for p in points if p not in PREFETCH_POINTS]
        if bad:
            raise QuantkitError(f"unknown prefetch point {bad[0]!r}; known: {', '.join(PREFETCH_POINTS)}")
        self.points = points
        self.programs = programs or PROGRAMS
        self.stream = None  # made at the first fetch (a CUDA stream)
        self.mode = MODE
        self.sink = None
        self.plan: dict[tuple[int, str], nn.Module] = {}
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            if "attention" in points:
                self.plan[(i, "attention")] = attn.o_proj
            if "down" in points and i + 1 < len(layers):
                nxt = layers[i + 1].self_attn
                self.plan[(i, "down")] = nxt.qkv_proj if nxt.qkv_proj is not None else nxt.q_proj

    def hook(self, layer: int) -> Callable[[str], None]:
        return lambda point: self.fetch(self.plan.get((layer, point)))

    def fetch(self, module: nn.Module | None) -> None:
        if module is None:
            return
        buffers = weight_buffers(module)[:MAX_BUFFERS]
        if not buffers:
            return
        if self.stream is None:
            self.stream = torch.cuda.Stream(buffers[0].device)
            self.sink = torch.zeros(1, dtype=torch.int32, device=buffers[0].device)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            if self.mode == "load":
                load_buffers_l2(buffers, self.sink)
            else:
                prefetch_buffers_l2(buffers, programs=self.programs)

    def join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)
