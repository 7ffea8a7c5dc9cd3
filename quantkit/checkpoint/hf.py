"""The Hugging Face hook: after ``import quantkit``, ``AutoModelForCausalLM.from_pretrained(qdir)`` builds the
quantized model.

transformers picks a quantizer by ``quantization_config.quant_method``; quantkit registers ``"quantkit"``.
Before the weights load, the quantizer swaps every linear named in the config for an empty quantized module
of its scheme (splitting fused MoE experts first when the checkpoint stores them split); the loader then fills
the buffers by name. Without ``import quantkit`` transformers would only warn and load garbage: use
:func:`quantkit.load_quantized`, which imports the hook and checks every tensor arrived.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers.quantizers.auto import register_quantization_config, register_quantizer
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from quantkit.checkpoint.config import QUANT_METHOD, module_schemes
from quantkit.checkpoint.read import check_quantized_tensors, check_stored_shapes, tensor_headers
from quantkit.errors import QuantkitError


class QuantkitConfig(QuantizationConfigMixin):
    """The checkpoint's ``quantization_config`` mapping, kept as it is (see quantkit.checkpoint.config)."""

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)
        self.quant_method = QUANT_METHOD

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def to_diff_dict(self) -> dict[str, Any]:
        return self.to_dict()


class QuantkitHfQuantizer(HfQuantizer):
    requires_calibration = True  # quantkit checkpoints are made by quantkit.quantize, not at load time

    def validate_environment(self, *args, **kwargs) -> None:
        if not self.pre_quantized:
            raise QuantkitError("quantkit quantizes through quantkit.quantize; from_pretrained only loads checkpoints")

    def _process_model_before_weight_loading(self, model, **kwargs):
        from quantkit.checkpoint.swap import swap_in_quantized_modules

        qc = self.quantization_config.to_dict()
        swap_in_quantized_modules(model, module_schemes(qc), split_experts=qc.get("split_experts", False))
        files = kwargs.get("checkpoint_files") or []
        if files:
            self._folder = Path(files[0]).parent
            check_stored_shapes(self._folder, model, files)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        """Every quantized buffer was stored (transformers leaves a missing one uninitialised, with a warning) and
        the loaded values pass ``check_quantized_tensors`` (finite scales, g_idx in range, progressive grids; the
        dtypes were checked before loading). Skipped where accelerate left buffers on the meta device (offloaded)."""
        from quantkit.nn.factory import quantized_modules

        folder = getattr(self, "_folder", None)
        if folder is None or any(b.is_meta for b in model.buffers()):
            return model
        stored = tensor_headers(folder)
        missing = [f"{name}.{key}" for name, module in quantized_modules(model).items()
                   for key, _ in module.named_buffers(recurse=False) if f"{name}.{key}" not in stored]  # fmt: skip
        if missing:
            raise QuantkitError(f"corrupt checkpoint {folder}: {len(missing)} tensors missing, e.g. {missing[0]}")
        check_quantized_tensors(folder, model, {})
        self.checked_tensors = True  # load_quantized need not check them again
        return model

    def is_serializable(self, *args, **kwargs) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False


def register() -> None:
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(QuantkitConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(QuantkitHfQuantizer)
