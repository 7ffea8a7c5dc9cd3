"""Self-describing quantized checkpoints: save, load, and the Hugging Face ``from_pretrained`` hook."""

from quantkit.checkpoint.load import load_quantized
from quantkit.checkpoint.save import save_quantized

__all__ = ["load_quantized", "save_quantized"]
