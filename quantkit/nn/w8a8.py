"""W8A8 linear layer: 8-bit weights and 8-bit activations (int8 as in SmoothQuant, or fp8 e4m3).

Buffers (N = out_features, K = in_features):

- ``weight``       int8 [N, K] (``fmt="int"``) or float8_e4m3fn [N, K] (``fmt="fp8"``), row-major, K contiguous
- ``weight_scale`` fp32 [N]: per-output-channel scale, ``W ~= weight * weight_scale[:, None]``; block-wise fp8
  (scheme ``block_size`` B, DeepSeek-V3's ``w8a8-fp8-block``): fp32 [ceil(N/B), ceil(K/B)], one per B x B block,
  with activations quantized per 1 x B tile of each token (``quantkit.kernels.w8a8.block``)
- ``input_scale``  fp32 [1]: calibrated per-tensor activation scale; registered only for static activations
- ``bias``         [N] in the model dtype, when the layer has one

Layout: ``Layout.INT8_ROWMAJOR``, ``Layout.FP8_ROWMAJOR`` or ``Layout.FP8_BLOCK`` (``quantkit.quant.packing``).

Numerics (one contract, two execution paths): activations are quantized per token (dynamic: scale = row abs-max /
QMAX) or per tensor (static: ``input_scale``), symmetric, QMAX = 127 (int8) or 448 (e4m3), rounding half to even;
``y = (qa @ weight^T) * a_scale[m] * weight_scale[n] + bias`` (see ``quantkit.kernels.w8a8``). ``execution`` picks:

- ``"simulated"`` (default): fake-quantized activations times the dequantized weight, an fp32 matmul; any device,
  both formats.
- ``"integer"``: the 8-bit product itself. CUDA: the Triton kernels (int8 and fp8). CPU: ``torch._int_mm``
  (int8 x int8 -> int32) then the fp32 epilogue; fp8 has no CPU integer path and raises. Block-wise fp8: the block
  GEMM on CUDA, its reference elsewhere (each B-long partial sum in fp32, scaled by its two scales, then summed:
  DeepSeek-V3's promotion every B products).

``fp8_fast_accum`` (fp8 on CUDA only; default off): let Hopper's tensor cores accumulate the whole K loop in their
reduced-precision adder, as cuBLAS ``use_fast_accum=True`` and vLLM's sm90 fp8 kernels for this scheme do, instead of
promoting each 128-long partial sum into fp32 (DeepSeek-V3's rule, the default). Faster at large batches (H200,
M >= 1024: 1.62-1.65x bf16 against 1.28-1.32x), with an accumulation error 10-35x larger (RMS 1.3e-3 of the output
at K = 4096, 4.4e-3 at K = 28672) that adds only 0.06-0.65% to the 3.7% RMS error e4m3 rounding already puts
between the output and the unquantized product (docs/results/w8a8.md); int8 accumulates
exactly either way.

The two paths see identical quantized operands; they differ only by fp32 rounding (summation order and where the
scales are applied) before the final rounding to the output dtype.
"""

from __future__ import annotations

from enum import Enum

import torch
from torch import nn

from quantkit.algorithms.fp8 import dequantize_fp8, quantize_fp8
from quantkit.errors import QuantkitError
from quantkit.kernels import w8a8 as kernels
from quantkit.kernels.w8a8 import block as block_kernels
from quantkit.quant.packing import Layout
from quantkit.quant.scheme import QuantScheme
from quantkit.quant.tensor import QuantizedWeight


class Execution(str, Enum):
    SIMULATED = "simulated"
    INTEGER = "integer"


KERNEL_FORMAT = {"int": "int8", "fp8": "fp8"}  # QuantScheme.fmt -> format name in quantkit.kernels.w8a8
LAYOUT_OF_FORMAT = {"int": Layout.INT8_ROWMAJOR, "fp8": Layout.FP8_ROWMAJOR}


def _check_scheme(scheme: QuantScheme) -> None:
    if scheme.weight_only:
        raise QuantkitError(f"W8A8Linear needs a W8A8 scheme (act_bits=8), got {scheme.name}")


def static_input_scale(absmax: float | torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Per-tensor activation scale fp32 [1] from a calibrated abs-max: ``absmax / QMAX``."""
    _check_scheme(scheme)
    amax = torch.as_tensor(absmax, dtype=torch.float32).reshape(1).clamp(min=kernels.MIN_AMAX)
    return amax / kernels.QMAX_OF_FORMAT[KERNEL_FORMAT[scheme.fmt]]


class W8A8Linear(nn.Module):
    layout: Layout = Layout.INT8_ROWMAJOR  # fp8 instances set Layout.FP8_ROWMAJOR in __init__

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
        _check_scheme(scheme)
        self.in_features = in_features
        self.out_features = out_features
        self.scheme = scheme
        self.dtype = dtype
        self.block = scheme.block_size  # None: per channel
        self.layout = Layout.FP8_BLOCK if self.block else LAYOUT_OF_FORMAT[scheme.fmt]
        self.fmt = KERNEL_FORMAT[scheme.fmt]
        self.execution = Execution.SIMULATED
        self.fp8_fast_accum = False
        wdtype = kernels.DTYPE_OF_FORMAT[self.fmt]
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=wdtype, device=device))
        b = self.block
        scale_shape = (out_features,) if not b else (-(-out_features // b), -(-in_features // b))
        self.register_buffer("weight_scale", torch.ones(scale_shape, dtype=torch.float32, device=device))
        if scheme.act_dynamic:
            self.input_scale = None
        else:
            self.register_buffer("input_scale", torch.ones(1, dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None

    @property
    def execution(self) -> Execution:
        return self._execution

    @execution.setter
    def execution(self, value: Execution | str) -> None:
        allowed = [e.value for e in Execution]
        if value not in allowed:
            raise QuantkitError(f"execution must be one of {allowed}, got {value!r}")
        self._execution = Execution(value)

    # -- construction ------------------------------------------------------------------------------------------

    @classmethod
    def _build(
        cls,
        q: torch.Tensor,
        scale: torch.Tensor,
        scheme: QuantScheme,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        input_scale: torch.Tensor | float | None,
    ) -> W8A8Linear:
        if scheme.act_dynamic and input_scale is not None:
            raise QuantkitError("input_scale is only for static activations (scheme act_dynamic=False)")
        if not scheme.act_dynamic and input_scale is None:
            raise QuantkitError("static activations need a calibrated input_scale (see static_input_scale)")
        n, k = q.shape
        mod = cls(k, n, scheme, bias=bias is not None, dtype=dtype, device=q.device)
        mod.weight.copy_(q)
        mod.weight_scale.copy_(scale.reshape(mod.weight_scale.shape))
        if input_scale is not None:
            s = torch.as_tensor(input_scale, dtype=torch.float32).reshape(-1)
            if s.numel() != 1 or not bool(s[0] > 0):
                raise QuantkitError(f"input_scale must be one positive number, got {s.tolist()}")
            mod.input_scale.copy_(s)
        if bias is not None:
            mod.bias.copy_(bias.detach().to(dtype))
        return mod

    @classmethod
    def from_float(
        cls, linear: nn.Linear, scheme: QuantScheme, input_scale: torch.Tensor | float | None = None
    ) -> W8A8Linear:
        """Round-to-nearest, symmetric per output channel: ``weight_scale = row abs-max / QMAX`` (fp32),
        ``weight = round(W / weight_scale)`` to int8 [-127, 127] or e4m3. ``input_scale`` is required exactly when
        the scheme's activations are static."""
        _check_scheme(scheme)
        w = linear.weight.detach()
        if scheme.block_size:  # [N, K], [ceil(N/B), ceil(K/B)]
            q, scale = quantize_fp8(w, "block", scheme.block_size)
        else:
            q, scale = kernels.quantize_rows_reference(w, KERNEL_FORMAT[scheme.fmt])  # [N, K], [N]
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls._build(q, scale, scheme, bias, w.dtype, input_scale)

    @classmethod
    def from_quantized(
        cls,
        qw: QuantizedWeight,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        input_scale: torch.Tensor | float | None = None,
    ) -> W8A8Linear:
        """From an integer ``QuantizedWeight`` (e.g. GPTQ on smoothed weights): codes q in [0, 255] with zero 128
        and one scale per output channel become int8 ``q - 128``."""
        s = qw.scheme
        _check_scheme(s)
        if s.fmt != "int":
            raise QuantkitError("from_quantized takes integer weights; build fp8 layers with from_float")
        if qw.scales.shape[1] != 1 or not bool((qw.zeros == 128).all()):
            raise QuantkitError("W8A8 integer weights need one symmetric group per output channel (zero point 128)")
        q = (qw.q.to(torch.int16) - 128).to(torch.int8)
        return cls._build(q, qw.scales[:, 0].float(), s, bias, dtype, input_scale)

    @classmethod
    def concat(cls, parts: list[W8A8Linear]) -> W8A8Linear:
        """One layer whose output is the parts' outputs side by side (q/k/v or gate/up of one input): weights and
        per-channel scales concatenated, exact. Each token's activation scale depends on the input only, so the
        fused layer quantizes the shared input once where the parts did it once each. Missing biases become zeros.

        Raises ValueError when the parts differ in scheme, input width, execution or static input scale.
        """
        first = parts[0]
        for p in parts:
            if (p.scheme, p.in_features, p.execution, p.fp8_fast_accum, p.dtype) != (
                first.scheme,
                first.in_features,
                first.execution,
                first.fp8_fast_accum,
                first.dtype,
            ):
                raise ValueError("only layers with one scheme, input width, dtype and execution can be concatenated")
            if p.input_scale is not None and not torch.equal(p.input_scale, first.input_scale):
                raise ValueError("the layers' static input scales differ")
        if first.block and any(p.out_features % first.block for p in parts[:-1]):
            raise ValueError(f"block-wise layers concatenate only when each part but the last fills whole "
                             f"{first.block}-row blocks")  # fmt: skip
        n = sum(p.out_features for p in parts)
        with torch.device("meta"):  # no storage: the buffers are assigned below
            out = cls(
                first.in_features, n, first.scheme, bias=any(p.bias is not None for p in parts), dtype=first.dtype
            )
        out.weight = torch.cat([p.weight for p in parts])
        out.weight_scale = torch.cat([p.weight_scale for p in parts])
        if first.input_scale is not None:
            out.input_scale = first.input_scale.clone()
        if out.bias is not None:
            out.bias = torch.cat(
                [
                    p.bias if p.bias is not None else p.weight_scale.new_zeros(p.out_features, dtype=p.dtype)
                    for p in parts
                ]
            )
        out.execution = first.execution
        out.fp8_fast_accum = first.fp8_fast_accum
        return out

    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K] = weight * weight_scale[:, None] (block-wise: weight_scale[n // B, k // B]), computed in fp32."""
        if self.block:
            return dequantize_fp8(self.weight, self.weight_scale, dtype, block_size=self.block)
        return (self.weight.float() * self.weight_scale[:, None]).to(dtype)

    # -- forward -----------------------------------------------------------------------------------------------

    def quantize_input(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> (qa [M, K], a_scale fp32 [M] or [1]; block-wise: [M, ceil(K/B)]) with the plain PyTorch
        reference quantizer."""
        if self.block:
            return block_kernels.quantize_tiles_reference(x2, self.block)
        return kernels.quantize_activations_reference(x2, self.fmt, self.input_scale)

    def _forward_simulated(self, x2: torch.Tensor) -> torch.Tensor:
        qa, a_scale = self.quantize_input(x2)
        if self.block:  # [M, K] fake-quantized activations, fp32
            x_fq = qa.float() * a_scale.repeat_interleave(self.block, 1)[:, : self.in_features]
        else:
            x_fq = qa.float() * a_scale.reshape(-1, 1)
        y = x_fq @ self.dequantize_weight(torch.float32).t()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x2.dtype)

    def _forward_integer(self, x2: torch.Tensor) -> torch.Tensor:
        if self.block:  # CUDA: the block GEMM; elsewhere its reference (fp32 partial sums per tile, scaled, summed)
            if x2.is_cuda:
                return block_kernels.fp8_block_linear(x2, self.weight, self.weight_scale, self.block, self.bias)
            qa, a_scale = self.quantize_input(x2)
            return block_kernels.fp8_block_matmul_reference(
                qa, a_scale, self.weight, self.weight_scale, self.block, self.bias, x2.dtype
            )
        if x2.is_cuda:
            return kernels.w8a8_linear(
                x2, self.weight, self.weight_scale, self.bias, self.input_scale, fp8_fast_accum=self.fp8_fast_accum
            )
        if x2.device.type != "cpu" or self.fmt != "int8":
            where = "CUDA and CPU" if self.fmt == "int8" else "CUDA only"
            raise QuantkitError(
                f"no integer {self.fmt} W8A8 path for a {x2.device.type} input ({self.fmt} runs on {where}); "
                "set execution='simulated'"
            )
        qa, a_scale = self.quantize_input(x2)
        acc = torch._int_mm(qa, self.weight.t())  # int32 [M, N]
        return kernels.scaled_epilogue_reference(acc, a_scale, self.weight_scale, self.bias, x2.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected input [..., {self.in_features}], got {tuple(x.shape)}")
        x2 = x.reshape(-1, self.in_features)
        if self.execution is Execution.INTEGER:
            y = self._forward_integer(x2)
        else:
            y = self._forward_simulated(x2)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        fast = ", fp8_fast_accum=True" if self.fp8_fast_accum else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}, "
            f"execution={self.execution.value}{fast}"
        )


def set_execution(model: nn.Module, execution: Execution | str, fp8_fast_accum: bool | None = None) -> int:
    """Set ``execution`` (and ``fp8_fast_accum`` unless None) on every W8A8Linear in ``model``; returns how many
    modules were changed."""
    mods = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    for m in mods:
        m.execution = execution
        if fp8_fast_accum is not None:
            m.fp8_fast_accum = bool(fp8_fast_accum)
    return len(mods)
