"""runtime/model_runner.py: the KV cache is the size its block arithmetic says, and the attention backend follows
the device (Triton on a CPU only under the interpreter)."""

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.runtime.config import EngineConfig
from quantkit.runtime.loader import dummy
from quantkit.runtime.model_runner import ModelRunner, kv_block_bytes
from tests.tiny_models import tiny_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    return dummy(tiny_model("llama").config, "float32", CPU).model


def test_the_cache_holds_k_and_v_of_every_layer_for_each_block(model):
    # 2 layers x (K, V) x 2 KV heads x head_dim 16 x 16 tokens x 4 bytes
    assert kv_block_bytes(model, 16) == 2 * 2 * 2 * 16 * 16 * 4
    runner = ModelRunner(model, EngineConfig(num_kv_blocks=5, block_size=16), CPU, max_model_len=100)
    assert runner.kv.numel() * runner.kv.element_size() == 5 * runner.block_bytes
    assert len(runner.kv_caches) == 2 and runner.kv_caches[1][0].shape == (5, 16, 2, 16)
    assert runner.table_width == 7  # ceil(100 / 16) pages for the longest sequence
    assert runner.backend == "torch"


def test_triton_attention_on_a_cpu_needs_the_interpreter(model, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    config = EngineConfig(num_kv_blocks=2, attention_backend="triton")
    with pytest.raises(QuantkitError, match="needs TRITON_INTERPRET=1"):
        ModelRunner(model, config, CPU, max_model_len=32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ModelRunner(model, config, CPU, max_model_len=32).backend == "triton"
