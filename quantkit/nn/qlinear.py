"""Weight-only quantized linear layer (W2/3/4/8 A16) in the GPTQ-v2 layout.

Buffers (N = out_features, K = in_features, b = bits, n_g = ceil(K / G)):

- ``qweight`` int32 [ceil(K/32)*b, N]: codes packed along K (``quantkit.quant.packing``)
- ``qzeros``  int32 [n_g, ceil(N/32)*b]: zero points packed along N, stored as they are
- ``scales``  fp16  [n_g, N]
- ``g_idx``   int32 [K]: group of each input channel
- ``bias``    [N] in the model dtype, when the layer has one

On CUDA the forward pass calls the Triton W4A16 kernel when one serves the scheme; elsewhere it dequantizes
the weight and uses a plain matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.quant.packing import Layout, packed_rows
from quantkit.quant.scheme import QuantScheme
from quantkit.quant.tensor import QuantizedWeight


def unpack_codes_fast(qweight: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """int32 [ceil(K/32)*b, N] -> int codes [K, N]; vectorised for 2/4/8 bits, generic for 3."""
    if bits == 3:
        from quantkit.quant.packing import unpack_rows

        return unpack_rows(qweight, bits, k)
    pf = 32 // bits
    shifts = torch.arange(0, 32, bits, device=qweight.device, dtype=torch.int32)
    codes = (qweight.unsqueeze(1) >> shifts.view(1, pf, 1)) & (2**bits - 1)  # [rows, pf, N]
    return codes.reshape(-1, qweight.shape[1])[:k]


class QuantLinear(nn.Module):
    layout = Layout.GPTQ_V2

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
        self.in_features = in_features
        self.out_features = out_features
        self.scheme = scheme
        b, n_g = scheme.bits, scheme.n_groups(in_features)
        self.register_buffer(
            "qweight", torch.zeros(packed_rows(in_features, b), out_features, dtype=torch.int32, device=device)
        )
        self.register_buffer("qzeros", torch.zeros(n_g, packed_rows(out_features, b), dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.zeros(n_g, out_features, dtype=torch.float16, device=device))
        self.register_buffer("g_idx", torch.zeros(in_features, dtype=torch.int32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None
        self._kernel_state = None  # filled lazily by the CUDA kernel path (re-laid-out weights)

    @staticmethod
    def check_scheme(scheme: QuantScheme) -> None:
        if not scheme.weight_only or scheme.fmt != "int":
            raise ValueError(f"QuantLinear holds integer weight-only schemes, got {scheme.name}")

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> QuantLinear:
        n, k = qw.shape
        mod = cls(k, n, qw.scheme, bias=bias is not None, dtype=dtype, device=qw.q.device)
        for name, t in qw.pack().items():
            getattr(mod, name).copy_(t)
        if bias is not None:
            mod.bias.copy_(bias.detach().to(dtype))
        return mod

    @classmethod
    def concat(cls, parts: list[QuantLinear]) -> QuantLinear:
        """One layer whose output is the parts' outputs side by side (q/k/v or gate/up of one input), made by
        concatenating the packed buffers along N: exact, nothing is re-quantized. Missing biases become zeros.

        Raises ValueError when the parts cannot share one packed weight: different schemes or inputs, different
        group maps (act-order permutations differ unless the parts shared one Hessian), or an output width that
        does not fill whole packed zero-point words.
        """
        first = parts[0]
        for p in parts:
            if p.scheme != first.scheme or p.in_features != first.in_features:
                raise ValueError("only layers with one scheme and one input width can be concatenated")
            if not torch.equal(p.g_idx, first.g_idx):
                raise ValueError("the layers map input channels to groups differently (act-order permutations)")
            if (p.out_features * p.scheme.bits) % 32:
                raise ValueError(f"{p.out_features} outputs do not fill whole packed zero-point words")
        dtype = next((p.bias.dtype for p in parts if p.bias is not None), torch.float16)
        n = sum(p.out_features for p in parts)
        with torch.device("meta"):  # no storage: the buffers are assigned below
            out = cls(first.in_features, n, first.scheme, bias=any(p.bias is not None for p in parts), dtype=dtype)
        for name in ("qweight", "qzeros", "scales"):
            setattr(out, name, torch.cat([getattr(p, name) for p in parts], dim=1))
        out.g_idx = first.g_idx.clone()
        if out.bias is not None:
            out.bias = torch.cat(
                [p.bias if p.bias is not None else p.scales.new_zeros(p.out_features, dtype=dtype) for p in parts]
            )
        return out

    def quantized_weight(self) -> QuantizedWeight:
        return QuantizedWeight.unpack(
            {"qweight": self.qweight, "qzeros": self.qzeros, "scales": self.scales, "g_idx": self.g_idx},
            self.scheme,
            self.in_features,
            self.out_features,
        )

    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K] = scales[g] * (q - zeros[g]), computed in fp32."""
        b = self.scheme.bits
        q = unpack_codes_fast(self.qweight, b, self.in_features)  # [K, N]
        zeros = unpack_codes_fast(self.qzeros.t().contiguous(), b, self.out_features).t()  # [n_g, N]
        g = self.g_idx.long()
        w = (q.float() - zeros.float()[g]) * self.scales.float()[g]  # [K, N]
        return w.t().to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from quantkit.nn.dispatch import cuda_weight_only_linear

            y = cuda_weight_only_linear(self, x)
            if y is not None:
                return y
        return F.linear(x, self.dequantize_weight(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}"
