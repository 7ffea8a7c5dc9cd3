"""Per-linear statistics collected from calibration activations by forward pre-hooks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")  # torch.mm(a, b, out_dtype=...) (CUDA, torch >= 2.8)


@dataclass
class LinearStats:
    """What the algorithms need to know about the inputs X [n_tokens, K] of one linear.

    - ``xtx``: fp32 [K, K] sum of x^T x over tokens (None when not requested); GPTQ's H = 2 * xtx / n_tokens
    - ``n_tokens``: number of tokens seen
    - ``absmax``: fp32 [K] per-input-channel max |x|
    - ``abssum``: fp32 [K] per-input-channel sum |x| (``mean_abs = abssum / n_tokens``)

    While a :class:`StatsCollector` accumulates, ``xtx`` and ``abssum`` are float64 sums of each call's fp32
    products (:meth:`finish` rounds them to fp32 once): a float64 sum of a few hundred fp32 terms is exact but in
    rare entries, so the result does not depend on how the calibration batches were split between processes
    (:mod:`quantkit.distributed`). Costs one more fp32 [K, K] per call and a float64 accumulator.
    """

    xtx: torch.Tensor | None
    n_tokens: int
    absmax: torch.Tensor
    abssum: torch.Tensor

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abssum / max(self.n_tokens, 1)

    def finish(self) -> LinearStats:
        """The accumulators rounded to fp32 (in place; a second call changes nothing)."""
        if self.xtx is not None:
            self.xtx = self.xtx.float()
        self.abssum = self.abssum.float()
        return self

    def hessian(self) -> torch.Tensor:
        """GPTQ's H = 2 X^T X / n (fp32 [K, K])."""
        if self.xtx is None:
            raise ValueError("the Hessian was not collected")
        return self.xtx * (2.0 / max(self.n_tokens, 1))


class StatsCollector:
    """Accumulates :class:`LinearStats` for a set of linears while the layer runs.

    Linears fed by the same tensor (q/k/v after one norm, gate/up) share one :class:`LinearStats` object: the
    statistics are identical, so X^T X is computed once. Consumers must treat stats as read-only.

    On leaving the ``with`` block, ``reduce(stats)`` runs (across processes: the sums over every rank), then the
    sums are rounded to fp32 (:meth:`LinearStats.finish`).
    """

    def __init__(self, modules: dict[str, nn.Linear], hessian: bool = True, reduce=None) -> None:
        self.modules = modules
        self.hessian = hessian
        self.reduce = reduce
        self.stats: dict[str, LinearStats] = {}
        self._handles = []
        self._last_input: dict[str, torch.Tensor] = {}  # module -> the input tensor of its latest call
        self._same_input_as: dict[str, str] = {}  # module -> the module whose stats it shares

    def _shares_input(self, name: str, x: torch.Tensor) -> bool:
        """True when ``x`` is the very tensor another hooked module received in this call (held by reference,
        so its memory cannot have been reused)."""
        if name in self._same_input_as:
            if self._last_input.get(self._same_input_as[name]) is not x:
                raise RuntimeError(f"{name} stopped sharing its input with {self._same_input_as[name]}")
            return True
        if name in self.stats:  # already accumulating on its own
            return False
        for other, seen in self._last_input.items():
            if seen is x and other != name and other not in self._same_input_as:
                self._same_input_as[name] = other
                self.stats[name] = self.stats[other]
                return True
        return False

    def _hook(self, name: str):
        def hook(module: nn.Linear, args):
            if self._shares_input(name, args[0]):
                return
            self._last_input[name] = args[0]
            x = args[0].detach().reshape(-1, module.in_features)
            st = self.stats.get(name)
            if st is None:
                k = module.in_features
                st = self.stats[name] = LinearStats(
                    xtx=torch.zeros(k, k, dtype=torch.float64, device=x.device) if self.hessian else None,
                    n_tokens=0,
                    absmax=torch.zeros(k, dtype=torch.float32, device=x.device),
                    abssum=torch.zeros(k, dtype=torch.float64, device=x.device),
                )
            if self.hessian:
                if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and _MM_OUT_DTYPE:
                    # 16-bit operands, exact products and fp32 accumulation on tensor cores: an fp32-accurate
                    # X^T X (within ~1e-5 relative on the H200) many times faster than an fp32 GEMM
                    st.xtx += torch.mm(x.t(), x, out_dtype=torch.float32)
                else:
                    xf = x.float()
                    st.xtx += xf.t() @ xf  # this call's fp32 product, summed in float64
            a = x.abs()  # abs and max are exact in any dtype; each call's sum is fp32, the total float64
            torch.maximum(st.absmax, a.amax(dim=0).float(), out=st.absmax)
            st.abssum += a.sum(dim=0, dtype=torch.float32)
            st.n_tokens += x.shape[0]

        return hook

    def __enter__(self) -> StatsCollector:
        self._handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in self.modules.items()]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._last_input.clear()
        if exc[0] is None:
            if self.reduce is not None:
                self.reduce(self.stats)
            for st in self.stats.values():
                st.finish()
