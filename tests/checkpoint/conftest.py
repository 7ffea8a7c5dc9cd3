"""A quantkit checkpoint of the tiny Llama, shared by the checkpoint tests of one module."""

import pytest

import quantkit
from tests.tiny_models import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def rtn_checkpoint(tmp_path_factory):
    """(folder, model): the tiny Llama quantized with RTN (4-bit, groups of 32, asymmetric) and saved."""
    model = tiny_model("llama")
    quantkit.quantize(model, {"scheme": {"bits": 4, "group_size": 32, "sym": False}, "stages": [{"method": "rtn"}]})
    folder = quantkit.save_quantized(model, tmp_path_factory.mktemp("ckpt") / "q", tokenizer=tiny_tokenizer(320))
    return folder, model
