"""The runtime's settings: cache geometry, batch limits and execution choices, checked once here."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

import torch

from quantkit.checks import flag, integer, number
from quantkit.errors import QuantkitError

BACKENDS = ("auto", "triton", "torch")
DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    """- ``block_size``: tokens per KV-cache block (page).
    - ``num_kv_blocks``: blocks in the cache; ``None`` sizes the cache from free GPU memory x
      ``gpu_memory_utilization`` on CUDA, and gives ``cpu_kv_blocks`` on CPU.
    - ``max_num_seqs`` / ``max_num_batched_tokens``: per-step limits on running sequences and scheduled tokens
      (a longer prompt is prefilled in chunks of at most ``max_num_batched_tokens``).
    - ``max_model_len``: longest sequence (prompt + output); ``None`` takes the model's ``max_position_embeddings``
      capped at 32768.
    - ``enable_prefix_caching``: share full KV blocks between sequences whose token prefixes are equal.
    - ``enforce_eager``: no CUDA graphs; ``cuda_graph_max_bs``: largest decode batch that replays a graph.
    - ``attention_backend``: ``triton`` kernels, the ``torch`` reference, or ``auto`` (Triton on CUDA).
    - ``dtype``: activations and float weights; ``auto`` is the checkpoint's dtype on CUDA and float32 on CPU.
    - ``seed``: seeds sampling for requests that give no seed of their own.
    - ``fp8_fast_accum``: fp8 W8A8 layers on CUDA accumulate in the tensor cores' reduced precision instead of
      promoting to fp32 every 128 products (``quantkit.nn.w8a8``): faster at large batches, less exact. No effect on
      int8, W4A16 or float layers, nor on CPU (where W8A8 layers run the fp32 simulation).
    - ``async_scheduling``: schedule and launch each step before the previous step's tokens reach the host, so the
      device does not wait for the host's work between steps (``quantkit.runtime.engine``); the outputs are the
      same either way.
    """

    version: ClassVar[int] = 1

    block_size: int = 16
    num_kv_blocks: int | None = None
    cpu_kv_blocks: int = 1024
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    cuda_graph_max_bs: int = 256
    attention_backend: str = "auto"
    dtype: str = "auto"
    device: str | None = None  # a torch.device is accepted and kept as its name
    seed: int = 0
    fp8_fast_accum: bool = False
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        checked = {
            name: integer(name, getattr(self, name), low=1)
            for name in ("cpu_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "cuda_graph_max_bs")
        }
        checked["block_size"] = integer("block_size", self.block_size, low=1, high=1024)  # else no longer a page
        checked["num_kv_blocks"] = integer("num_kv_blocks", self.num_kv_blocks, low=1, none=True)
        checked["max_model_len"] = integer("max_model_len", self.max_model_len, low=1, none=True)
        checked["gpu_memory_utilization"] = number(
            "gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True
        )
        checked["seed"] = integer("seed", self.seed, low=0, high=2**64 - 1)
        for name in ("enable_prefix_caching", "enforce_eager", "fp8_fast_accum", "async_scheduling"):
            flag(name, getattr(self, name))
        if self.attention_backend not in BACKENDS:
            raise QuantkitError(f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")
        if self.dtype not in DTYPES:
            raise QuantkitError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device is not None and not isinstance(self.device, str | torch.device):
            raise QuantkitError(f"device must be a name such as 'cuda' or 'cpu', got {self.device!r}")
        if isinstance(self.device, torch.device):
            checked["device"] = str(self.device)  # kept as text, as to_dict's JSON needs
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        data = dict(data)
        version = data.pop("version", cls.version)
        if version != cls.version:
            raise QuantkitError(f"engine config version {version} is not supported (this quantkit reads {cls.version})")
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise QuantkitError(f"unknown engine setting {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}")
        return cls(**data)
