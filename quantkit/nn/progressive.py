"""Progressive W4A8 linear layer: QServe's two-level 4-bit weights with int8 activations quantized per token.

The format is ``quantkit.kernels.w4a8.progressive``'s (Lin et al. 2024, arXiv 2405.04532): W[n, k] = s1[n] * d[n, k]
with the int8 value d = s2[g, n] * (q[n, k] - z[g, n]) of input channel k's group g. Buffers
(``Layout.PROGRESSIVE_W4A8``; N = out_features, K = in_features, n_g = ceil(K / G)):

- ``qweight``      int32 [ceil(K/32)*4, N]: the 4-bit codes in the kernel's packing (``pack_codes``), in kernel
  channel order (act-order: ``perm``'s), groups contiguous
- ``weight_scale`` fp32  [N]: level 1, the per-channel scale s1
- ``group_scale``  uint8 [n_g, N]: level 2, the integer group scale s2 in [1, 15]
- ``group_zero``   uint8 [n_g, N]: level 2, the integer zero point z in [0, 15]
- ``perm``         int32 [K]: the input channel of each kernel position (the identity without act-order)
- ``bias``         [N] in the model dtype, when the layer has one

Every code of every group decodes to d in [-128, 127] (checked when a layer is built from a quantized weight).

Numerics: x is permuted by ``perm``, each row quantized to int8 by the reference quantizer
(``quantize_activations_reference``, a_scale = abs-max / 127), then y = (qa * a_scale) @ (s1 * d).T + bias.

- CPU (any non-CUDA device): a faithful simulation: the fake-quantized activations times the exactly dequantized
  weight (s1 * d, one fp32 rounding), in fp32. Same quantized operands as the kernel; only the summation differs.
- CUDA: ``quantkit.kernels.w4a8.w4a8_linear`` on a ``ProgressiveWeight`` built from the buffers once and cached
  (one int32 accumulation over K, int8 activations only). No silent fallback. ``forward_quantized`` takes codes
  already made, as ``W4A8Linear``'s does (``quantkit.nn.w4a8``), with ``w4a8_linear``'s programmatic-launch rule.
"""

from __future__ import annotations

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.kernels.w4a8 import dispatch as w4a8_dispatch
from quantkit.kernels.w4a8.progressive import ProgressiveWeight, dequantize, pack_codes, unpack_codes
from quantkit.kernels.w8a8.quant import quantize_activations_reference
from quantkit.nn.w4a8 import KernelOrSimulated, cuda_w4a8_linear, require_half_activations
from quantkit.quant.packing import Layout
from quantkit.quant.scheme import QuantScheme
from quantkit.quant.tensor import QuantizedWeight

INT8_RANGE = (-128, 127)  # the kernel's packed 4-bit -> int8 step relies on every d lying in it


def decodes_into_int8(s2: torch.Tensor, z: torch.Tensor, codes: torch.Tensor, group: torch.Tensor) -> bool:
    """Whether every code of a weight [N, K] decodes into ``INT8_RANGE``: d = s2[n, g] * (codes[n, k] - z[n, g]) with
    g = group[k], for level-2 scales and zero points s2, z [N, G] (integers, any dtype)."""
    if not codes.numel():
        return True
    d = s2[:, group] * (codes.int() - z[:, group])
    lo, hi = INT8_RANGE
    return lo <= int(d.min()) and int(d.max()) <= hi


def grid_problems(group_scale, group_zero, perm, qweight, group_size: int) -> list[tuple[str, str]]:
    """What puts a layer's buffers off the progressive grid, as (kind, "buffer: what") pairs, kind one of
    ``verify``'s ("scales", "zero_points", "g_idx"): group scales outside [1, 15], zero points outside [0, 15], a
    ``perm`` that is not a permutation of the inputs (then nothing further), codes that decode outside int8."""
    s2, z, perm, k = group_scale.int(), group_zero.int(), perm.long(), perm.numel()
    problems = []
    if s2.numel() and (int(s2.min()) < 1 or int(s2.max()) > 15):
        problems.append(("scales", "group_scale holds scales outside [1, 15]"))
    if z.numel() and (int(z.min()) < 0 or int(z.max()) > 15):
        problems.append(("zero_points", "group_zero holds zero points outside [0, 15]"))
    if not torch.equal(torch.sort(perm).values, torch.arange(k, device=perm.device)):
        return [*problems, ("g_idx", f"perm is not a permutation of its {k} inputs")]
    group = torch.arange(k, device=perm.device) // group_size  # of each kernel position
    if not decodes_into_int8(s2.t(), z.t(), unpack_codes(qweight, k), group):
        problems.append(("zero_points", f"qweight: codes decode outside int8 {list(INT8_RANGE)} (s2 * (q - z))"))
    return problems


def kernel_order(g_idx: torch.Tensor, group_size: int) -> torch.Tensor:
    """perm int64 [K]: the input channels sorted by group (stably), so that group g holds kernel positions
    [g * G, (g + 1) * G); a QuantkitError where the groups are not G channels each (the last one shorter)."""
    perm = torch.argsort(g_idx.long(), stable=True)
    k = g_idx.numel()
    if not torch.equal(g_idx.long()[perm], torch.arange(k, device=g_idx.device) // group_size):
        raise QuantkitError(f"the progressive format needs groups of {group_size} input channels (the last one "
                            "shorter); this weight's g_idx groups them otherwise")  # fmt: skip
    return perm


class ProgressiveW4A8Linear(KernelOrSimulated, nn.Module):
    """Progressive W4A8 weights (see the module doc), simulated on the CPU, the progressive kernel on CUDA."""

    layout = Layout.PROGRESSIVE_W4A8

    def __init__(
        self,
        in_features: int,
        out_features: int,
        scheme: QuantScheme,
        bias: bool = False,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.check_scheme(scheme)
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        k, n, n_g = in_features, out_features, scheme.n_groups(in_features)
        self.register_buffer("qweight", torch.zeros(-(-k // 32) * 4, n, dtype=torch.int32, device=device))
        self.register_buffer("weight_scale", torch.ones(n, dtype=torch.float32, device=device))
        self.register_buffer("group_scale", torch.ones(n_g, n, dtype=torch.uint8, device=device))
        self.register_buffer("group_zero", torch.zeros(n_g, n, dtype=torch.uint8, device=device))
        self.register_buffer("perm", torch.arange(k, dtype=torch.int32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(n, dtype=dtype, device=device))
        else:
            self.bias = None
        self._kernel_state = None  # (source key, ProgressiveWeight), built on first use

    @staticmethod
    def check_scheme(scheme: QuantScheme) -> None:
        if not scheme.progressive:
            raise QuantkitError(f"ProgressiveW4A8Linear needs a progressive W4A8 scheme, got {scheme.name}")

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype):
        """The layer storing ``qw`` (codes on a progressive grid: ``rtn`` / ``gptq`` under a progressive scheme)."""
        cls.check_scheme(qw.scheme)
        if qw.channel_scale is None:
            raise QuantkitError(f"a {qw.scheme.name} weight needs its level-1 scales (quantize it with rtn or gptq)")
        n, k = qw.shape
        mod = cls(k, n, qw.scheme, bias=bias is not None, dtype=dtype, device=qw.q.device)
        perm = kernel_order(qw.g_idx, qw.scheme.group_size)
        s2, z = qw.group_scale, qw.zeros
        if not decodes_into_int8(s2, z, qw.q, qw.g_idx.long()) or (s2.numel() and not 1 <= s2.min() <= s2.max() <= 15):
            raise QuantkitError(f"{qw.scheme.name}: the weight decodes outside int8 or has group scales outside "
                                "[1, 15]: it is not on the progressive grid")  # fmt: skip
        mod.qweight.copy_(pack_codes(qw.q[:, perm]))
        mod.weight_scale.copy_(qw.channel_scale.float())
        mod.group_scale.copy_(s2.t().to(torch.uint8))
        mod.group_zero.copy_(z.t().to(torch.uint8))
        mod.perm.copy_(perm.to(torch.int32))
        if bias is not None:
            mod.bias.copy_(bias.detach().to(dtype))
        return mod

    def grid_problem(self) -> str | None:
        """The first of ``grid_problems`` of the buffers as loaded, or None."""
        problems = grid_problems(self.group_scale, self.group_zero, self.perm, self.qweight, self.scheme.group_size)
        return problems[0][1] if problems else None

    def quantized_weight(self) -> QuantizedWeight:
        """The codes in checkpoint channel order, scales s1 * s2, zeros z, and each input channel's group."""
        perm = self.perm.long()
        q = torch.empty(self.out_features, self.in_features, dtype=torch.uint8, device=self.qweight.device)
        q[:, perm] = unpack_codes(self.qweight, self.in_features)
        g_idx = torch.empty_like(self.perm)
        g_idx[perm] = (torch.arange(self.in_features, device=perm.device) // self.scheme.group_size).to(torch.int32)
        s2 = self.group_scale.t().float()  # [N, n_g]
        return QuantizedWeight(q, self.weight_scale[:, None] * s2, self.group_zero.t().to(torch.int32), g_idx,
                               self.scheme, self.weight_scale.clone())  # fmt: skip

    def kernel_weight(self) -> ProgressiveWeight:
        """The buffers as the kernel's ``ProgressiveWeight`` (sz = z * s2; ``perm`` None when the identity), cached
        and rebuilt when a buffer is replaced or written in place."""
        sources = (self.qweight, self.weight_scale, self.group_scale, self.group_zero, self.perm)
        key = tuple((t.data_ptr(), t._version) for t in sources)
        if self._kernel_state is None or self._kernel_state[0] != key:
            perm = self.perm.long()
            identity = torch.equal(perm, torch.arange(self.in_features, device=perm.device))
            weight = ProgressiveWeight(
                qweight=self.qweight.contiguous(),
                s1=self.weight_scale.contiguous(),
                s2=self.group_scale.contiguous(),
                sz=(self.group_zero.int() * self.group_scale.int()).to(torch.uint8),
                group_size=self.scheme.group_size,
                in_features=self.in_features,
                perm=None if identity else perm,
            )
            self._kernel_state = (key, weight)
        return self._kernel_state[1]

    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K] = s1 * d in checkpoint channel order (``dequantize``: computed exactly, rounded once)."""
        return dequantize(self.kernel_weight(), dtype)

    @classmethod
    def concat(cls, parts: list[ProgressiveW4A8Linear]) -> ProgressiveW4A8Linear:
        """One layer whose output is the parts' outputs side by side (q/k/v or gate/up of one input): every buffer
        is per output channel, so concatenating along N is exact. Missing biases become zeros. ValueError where the
        parts differ in scheme, input width or channel order (act-order permutations)."""
        first = parts[0]
        for p in parts:
            if p.scheme != first.scheme or p.in_features != first.in_features:
                raise ValueError("only layers with one scheme and one input width can be concatenated")
            if not torch.equal(p.perm, first.perm):
                raise ValueError("the layers order their input channels differently (act-order permutations)")
        dtype = next((p.bias.dtype for p in parts if p.bias is not None), torch.float16)
        n = sum(p.out_features for p in parts)
        with torch.device("meta"):  # no storage: the buffers are assigned below
            out = cls(first.in_features, n, first.scheme, bias=any(p.bias is not None for p in parts), dtype=dtype)
        out.qweight = torch.cat([p.qweight for p in parts], dim=1)
        out.weight_scale = torch.cat([p.weight_scale for p in parts])
        out.group_scale = torch.cat([p.group_scale for p in parts], dim=1)
        out.group_zero = torch.cat([p.group_zero for p in parts], dim=1)
        out.perm = first.perm.clone()
        if out.bias is not None:
            out.bias = torch.cat(
                [p.bias if p.bias is not None else p.weight_scale.new_zeros(p.out_features, dtype=dtype) for p in parts]
            )
        return out

    act_format = "int8"  # the activations' format (the kernel's one int32 accumulator takes int8 products)

    def _w4a8_weight(self) -> ProgressiveWeight:
        return self.kernel_weight()

    def quantized_input_pdl(self, x2: torch.Tensor) -> bool:
        """``w4a8_linear``'s rule for a progressive weight (``kernels.w4a8.dispatch.progressive_pdl``)."""
        return w4a8_dispatch.progressive_pdl(x2)

    def quantize_input(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> (qa int8 [M, K], a_scale fp32 [M]) with the reference quantizer (checkpoint channel order)."""
        return quantize_activations_reference(x2, "int8")

    def _forward_cuda(self, x2: torch.Tensor) -> torch.Tensor:
        require_half_activations(x2)
        return cuda_w4a8_linear()(x2, self.kernel_weight(), bias=self.bias, fmt="int8")
