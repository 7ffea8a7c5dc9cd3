"""W4A8 linear layer: 4-bit integer weights with 8-bit activations quantized per token at run time (int8 or e4m3).
QServe's progressive (two-level) 4-bit format has buffers of its own: ``quantkit.nn.progressive``.

Buffers: exactly ``QuantLinear``'s (``Layout.GPTQ_V2``), so every packing, checkpoint and export path of W4A16
weights applies (N = out_features, K = in_features, n_g = ceil(K / G)):

- ``qweight`` int32 [ceil(K/32)*4, N]: 4-bit codes packed along K
- ``qzeros``  int32 [n_g, ceil(N/32)*4]: zero points packed along N, stored as they are
- ``scales``  fp16  [n_g, N]
- ``g_idx``   int32 [K]: group of each input channel
- ``bias``    [N] in the model dtype, when the layer has one

Numerics: each row (token) of x is quantized symmetrically, ``a_scale[m] = abs-max(x[m]) / QMAX`` with QMAX = 127
(int8) or 448 (e4m3), rounding half to even (``quantkit.kernels.w8a8.quant``'s reference quantizer, the one the
W8A8 kernels reproduce); then ``y = (qa * a_scale[:, None]) @ W.T + bias`` with W = scales[g] * (q - zeros[g]).

- CPU (and any non-CUDA device): a faithful simulation: the activations are quantized with that reference
  quantizer and multiplied, in fp32, by the dequantized 4-bit weight. Same quantized operands as the kernel; only
  the fp32 summation order differs.
- CUDA: ``quantkit.kernels.w4a8.w4a8_linear`` on the W4A16 kernel layout of the buffers (``W4A16Weight``, built
  once and cached). There is no silent fallback: a missing kernel or a layer the layout cannot hold raises. The
  kernel takes fp16 / bf16 activations; fp32 ones (an fp32 model calibrated on a GPU: the next layer's inputs come
  from the quantized layer) run the simulation on the GPU, with a warning once.
- Quantized input: where ``takes_quantized_input(x)`` (x on CUDA in fp16 / bf16, int8 activations, no act-order
  permutation in the kernel), ``forward_quantized(qa, a_scale, out_dtype)`` runs the GEMM on codes a kernel before
  the layer made (the runtime's norm and SiLU kernels fused with the quantizer: ``quantkit.kernels.dense.norm_quant``).
"""

from __future__ import annotations

import warnings

import torch

from quantkit.errors import QuantkitError
from quantkit.kernels.w8a8.quant import quantize_activations_reference
from quantkit.nn.qlinear import QuantLinear
from quantkit.quant.scheme import QuantScheme

KERNEL_FORMAT = {"int": "int8", "fp8": "fp8"}  # QuantScheme.act_fmt -> the kernels' format name


def _missing_kernel(name: str, exc: ImportError) -> QuantkitError:
    return QuantkitError(
        f"W4A8 on CUDA needs the Triton kernel quantkit.kernels.w4a8.{name}, which cannot be imported "
        f"({exc}); run the model on the CPU (simulated W4A8) or install a quantkit that ships it"
    )


def cuda_w4a8_linear():
    """``quantkit.kernels.w4a8.w4a8_linear``, imported on first use on CUDA; a one-line error where it is absent."""
    try:
        from quantkit.kernels.w4a8 import w4a8_linear
    except ImportError as exc:
        raise _missing_kernel("w4a8_linear", exc) from None
    return w4a8_linear


def cuda_w4a8_matmul():
    """``quantkit.kernels.w4a8.w4a8_matmul`` (the GEMM on quantized activations), as ``cuda_w4a8_linear``."""
    try:
        from quantkit.kernels.w4a8 import w4a8_matmul
    except ImportError as exc:
        raise _missing_kernel("w4a8_matmul", exc) from None
    return w4a8_matmul


def require_half_activations(x2: torch.Tensor) -> None:
    """The W4A8 kernels take fp16 or bf16 activations; a one-line error otherwise."""
    if x2.dtype not in (torch.float16, torch.bfloat16):
        raise QuantkitError(f"the W4A8 kernel takes float16 or bfloat16 activations, got {x2.dtype}: load the "
                            "model in one of them (the CPU simulation takes any float dtype)")  # fmt: skip


FP32_ON_CUDA = ("W4A8 layers with float32 activations on CUDA run the fp32 simulation, not the kernel (which takes "
                "float16 or bfloat16): load the model in one of them for the kernel's speed")  # fmt: skip


class KernelOrSimulated:
    """``forward`` of a W4A8 layer: its Triton kernel on CUDA (``_forward_cuda``), a faithful simulation on any
    other device and for fp32 activations (the layer's ``quantize_input`` and ``dequantize_weight``, multiplied in
    fp32), both on x [M, K]."""

    def _forward_simulated(self, x2: torch.Tensor) -> torch.Tensor:
        qa, a_scale = self.quantize_input(x2)
        x_fq = qa.float() * a_scale[:, None]  # [M, K] fake-quantized activations, fp32
        y = x_fq @ self.dequantize_weight(torch.float32).t()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x2.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected input [..., {self.in_features}], got {tuple(x.shape)}")
        x2 = x.reshape(-1, self.in_features)
        if x2.is_cuda and x2.dtype == torch.float32:
            warnings.warn(FP32_ON_CUDA, stacklevel=2)  # shown once per place (Python's default filter)
        kernel = x2.is_cuda and x2.dtype != torch.float32
        y = self._forward_cuda(x2) if kernel else self._forward_simulated(x2)
        return y.reshape(*x.shape[:-1], self.out_features)

    def takes_quantized_input(self, x: torch.Tensor) -> bool:
        """Whether ``forward_quantized`` may take x's per-token int8 codes (made by a kernel that fuses the quantizer
        into the operation before this layer) in place of ``forward(x)``: x on CUDA in fp16 / bf16 (the kernel path),
        int8 activations, and a kernel weight that reads the input channels in x's own order. An act-order layer
        whose kernel permutes x's columns (``perm`` not None) keeps ``forward``, which permutes x before quantizing;
        so does any layer the kernel cannot serve (``forward`` says why)."""
        if not (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and self.act_format == "int8"):
            return False
        weight = self._w4a8_weight()
        return weight is not None and weight.perm is None

    def quantized_input_pdl(self, x2: torch.Tensor) -> bool:
        """The ``pdl`` flag ``w4a8_linear`` gives this layer's quantizer and GEMM for x [M, K]: a kernel that makes
        the codes in the quantizer's place is launched with it, and ``forward_quantized`` launches the GEMM with it.
        Progressive weights only (``ProgressiveW4A8Linear``); never here."""
        return False

    def forward_quantized(self, qa: torch.Tensor, a_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """y [M, N] in ``out_dtype`` from x's codes qa int8 [M, K] and scales a_scale fp32 [M], as
        ``quantize_activations(x, "int8")`` makes them (or a kernel with its numerics): the GEMM ``forward(x)`` runs,
        launched as ``w4a8_linear`` launches it, so the same result bit for bit. Only where
        ``takes_quantized_input``."""
        weight = self._w4a8_weight()
        if weight is None or weight.perm is not None or self.act_format != "int8":
            raise QuantkitError("this W4A8 layer does not take quantized input (see takes_quantized_input)")
        pdl = self.quantized_input_pdl(qa)
        return cuda_w4a8_matmul()(qa, a_scale, weight, self.bias, out_dtype=out_dtype, pdl=pdl)

    def extra_repr(self) -> str:
        where = "kernel on CUDA, simulated elsewhere"
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name} ({where})"


class W4A8Linear(KernelOrSimulated, QuantLinear):
    """``QuantLinear``'s 4-bit buffers, with activations quantized per token (see the module doc)."""

    @staticmethod
    def check_scheme(scheme: QuantScheme) -> None:
        if not scheme.w4a8:
            raise QuantkitError(f"W4A8Linear needs a W4A8 scheme (bits 4, act_bits 8), got {scheme.name}")

    @property
    def act_format(self) -> str:
        """The activations' format: ``"int8"`` or ``"fp8"`` (e4m3)."""
        return KERNEL_FORMAT[self.scheme.act_fmt]

    def quantize_input(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> (qa [M, K] int8 | float8_e4m3fn, a_scale fp32 [M]) with the reference quantizer."""
        return quantize_activations_reference(x2, self.act_format)

    def _w4a8_weight(self):
        """The kernel's ``W4A16Weight`` of the buffers (cached), or None where its layout cannot hold the layer."""
        from quantkit.nn.dispatch import kernel_weight

        return kernel_weight(self)

    def _forward_cuda(self, x2: torch.Tensor) -> torch.Tensor:
        from quantkit.kernels.w4a16 import unsupported_reason

        require_half_activations(x2)
        w4a8_linear = cuda_w4a8_linear()
        weight = self._w4a8_weight()
        if weight is None:
            reason = unsupported_reason(self.scheme.bits, self.scheme.group_size, self.g_idx)
            raise QuantkitError(f"the W4A8 kernel cannot serve this layer: {reason}")
        return w4a8_linear(x2, weight, bias=self.bias, fmt=self.act_format)
