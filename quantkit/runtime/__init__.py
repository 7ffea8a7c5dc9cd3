"""A paged, continuously batched inference runtime for float and quantized Llama-family models."""

from quantkit.runtime.config import EngineConfig
from quantkit.runtime.engine import LLM, Completion, RequestOutput, StreamEvent
from quantkit.runtime.sampling_params import SamplingParams

__all__ = ["LLM", "Completion", "EngineConfig", "RequestOutput", "SamplingParams", "StreamEvent"]
