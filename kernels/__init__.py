"""quantkit's Triton kernels, installed as ``quantkit.kernels`` (pyproject's package-dir maps this folder there).

When a checkout's root is on ``sys.path`` (pytest with ``tests/__init__.py``, ``python -m`` from the root), this
folder is also importable as a top-level ``kernels``, the name of Hugging Face's kernels package, which transformers
>= 5.25 depends on and imports at start-up (``transformers.integrations.hub_kernels``). Imported under that name,
this module steps aside: it loads the installed ``kernels`` from the rest of ``sys.path`` and puts it in
``sys.modules`` in its place, which the import statement then returns. Without such a package, nothing changes.

The kernels by family: ``w4a16`` (weight-only GPTQ layers), ``w8a8`` (8-bit activations and weights, int8 or fp8),
``attention`` (paged decode and prefill), ``dense`` (float GEMV, norm and rotary), ``gptq`` (GPTQ's column loop),
``moe`` (routing and grouped expert GEMMs of mixture-of-experts layers); ``_device`` holds what they share.
``explain(m, n, k, scheme, device)`` names the kernel and config that serve a product; ``GPU`` describes a device to
ask it about.
"""

import importlib.machinery
import importlib.util
import os
import sys

if __name__ == "kernels":
    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
else:
    from quantkit.kernels._device import GPU
    from quantkit.kernels.explain import explain

    __all__ = ["GPU", "explain"]
