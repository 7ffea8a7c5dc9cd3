"""Choose the fastest available implementation of a quantized linear on CUDA.

Returns ``None`` when no kernel serves the module's scheme, so the caller uses its portable path.
"""

from __future__ import annotations

import torch


def cuda_weight_only_linear(module, x: torch.Tensor) -> torch.Tensor | None:
    """The Triton W4A16/W8A16 kernel for a ``QuantLinear`` on CUDA, or None when it does not serve the layer.

    The kernel-ready weight (act-order permuted once) is cached in ``module._kernel_state`` as
    ``(source_key, weight_or_None)`` and rebuilt when any source buffer is replaced or written in place.
    """
    from quantkit.kernels import w4a16

    if x.dtype not in w4a16.ACT_DTYPES:
        return None
    weight = kernel_weight(module)
    if weight is None:
        return None
    return w4a16.w4a16_linear(x, weight, module.bias)


def kernel_weight(module):
    """The module's ``W4A16Weight`` (GPTQ-v2 buffers in the kernel layout), or None when the W4A16 layout cannot
    hold the layer (``quantkit.kernels.w4a16.unsupported_reason``); cached as described above."""
    from quantkit.kernels import w4a16

    sources = (module.qweight, module.qzeros, module.scales, module.g_idx)
    key = tuple((t.data_ptr(), t._version) for t in sources)
    state = module._kernel_state
    if state is None or state[0] != key:
        scheme = module.scheme
        weight = None
        if w4a16.unsupported_reason(scheme.bits, scheme.group_size, module.g_idx) is None:
            weight = w4a16.prepare_gptq_weight(*sources, scheme.bits, scheme.group_size)
        state = module._kernel_state = (key, weight)
    return state[1]
