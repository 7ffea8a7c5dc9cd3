"""quantkit: post-training quantization for large language models.

    import quantkit
    model, tokenizer, _ = quantkit.load_model("smollm2-135m")
    quantkit.quantize(model, "gptq-w4g128", tokenizer=tokenizer)
    quantkit.save_quantized(model, "out/smollm2-w4", tokenizer=tokenizer)
    qmodel = quantkit.load_quantized("out/smollm2-w4")        # or AutoModelForCausalLM.from_pretrained
    quantkit.export_checkpoint("out/smollm2-w4", "out/smollm2-w4-ct", "compressed-tensors")  # for vLLM

Importing quantkit registers its Hugging Face quantizer, so ``from_pretrained`` understands its checkpoints.
"""

from quantkit._version import __version__ as __version__
from quantkit.checkpoint import load_quantized, save_quantized
from quantkit.checkpoint.export import export_checkpoint
from quantkit.checkpoint.foreign import import_checkpoint
from quantkit.checkpoint.hf import register as _register_hf_hook
from quantkit.errors import QuantkitError
from quantkit.models.loading import load_model
from quantkit.pipeline import quantize
from quantkit.quant.scheme import QuantScheme
from quantkit.recipe import Recipe, load_recipe

_register_hf_hook()

__all__ = [
    "QuantScheme",
    "QuantkitError",
    "Recipe",
    "export_checkpoint",
    "import_checkpoint",
    "load_model",
    "load_quantized",
    "load_recipe",
    "quantize",
    "save_quantized",
]
