"""runtime/config.py: EngineConfig normalises what it accepts, refuses each bad setting in one line, and
round-trips through a plain dict."""

import numpy as np
import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.runtime.config import EngineConfig


def test_settings_are_normalised():
    config = EngineConfig(block_size=np.int64(32), num_kv_blocks=torch.tensor(8), device=torch.device("cpu"))
    assert config.block_size == 32 and type(config.block_size) is int
    assert config.num_kv_blocks == 8 and type(config.num_kv_blocks) is int
    assert config.device == "cpu"
    assert EngineConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1.0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"block_size": 0}, "block_size must be in [1, 1024], got 0"),
        ({"block_size": 2048}, "block_size must be in [1, 1024], got 2048"),
        ({"max_num_seqs": "16"}, "max_num_seqs must be an integer, got '16'"),
        ({"num_kv_blocks": 0}, "num_kv_blocks must be >= 1, got 0"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization must be in (0.0, 1.0], got 0.0"),
        ({"seed": -1}, "seed must be in [0, 18446744073709551615], got -1"),
        ({"enforce_eager": "no"}, "enforce_eager must be True or False, got 'no'"),
        ({"attention_backend": "flash"}, "attention_backend must be one of ('auto', 'triton', 'torch'), got 'flash'"),
        ({"dtype": "fp16"}, "dtype must be one of ('auto', 'float32', 'float16', 'bfloat16'), got 'fp16'"),
        ({"device": 0}, "device must be a name such as 'cuda' or 'cpu', got 0"),
    ],
)
def test_each_bad_setting_is_one_line_naming_it(settings, message):
    with pytest.raises(QuantkitError) as exc:
        EngineConfig(**settings)
    assert str(exc.value) == message


def test_round_trip_through_a_dict():
    config = EngineConfig(block_size=32, max_model_len=512, attention_backend="torch", async_scheduling=False)
    data = config.to_dict()
    assert data["version"] == 1 and data["block_size"] == 32 and data["async_scheduling"] is False
    assert EngineConfig.from_dict(data) == config
    with pytest.raises(QuantkitError, match="engine config version 2 is not supported"):
        EngineConfig.from_dict({**data, "version": 2})
    with pytest.raises(QuantkitError, match="unknown engine setting 'block'; allowed: async_scheduling, "):
        EngineConfig.from_dict({"block": 16})
