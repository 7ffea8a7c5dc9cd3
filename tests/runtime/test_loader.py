"""runtime/loader.py: a folder's weights arrive in the runtime's model bit for bit (float and quantkit), dtypes
and EOS ids are read as documented, and a tensor of the wrong shape is named."""

import types

import pytest
import torch
from safetensors.torch import load_file

import quantkit
from quantkit.errors import QuantkitError
from quantkit.runtime.loader import assign_weights, dummy, eos_ids, float_linear, load_folder, resolve_dtype
from quantkit.runtime.model import CausalLM
from tests.tiny_models import COMMON, tiny_model, tiny_model_dir, tiny_tokenizer

CPU = torch.device("cpu")


def test_resolve_dtype():
    config = types.SimpleNamespace(dtype="float16")
    assert resolve_dtype("bfloat16", config, CPU) is torch.bfloat16
    assert resolve_dtype("auto", config, CPU) is torch.float32  # float32 off CUDA, whatever was saved
    cuda = torch.device("cuda")
    assert resolve_dtype("auto", config, cuda) is torch.float16  # the checkpoint's half dtype on CUDA
    assert resolve_dtype("auto", types.SimpleNamespace(dtype=torch.float32), cuda) is torch.bfloat16
    assert resolve_dtype("auto", types.SimpleNamespace(), cuda) is torch.bfloat16


def test_eos_ids_come_from_the_first_source_that_names_them():
    assert eos_ids(None, {"eos_token_id": [2, 7]}) == (2, 7)
    assert eos_ids(types.SimpleNamespace(eos_token_id=5), {"eos_token_id": 2}) == (5,)
    assert eos_ids(types.SimpleNamespace(eos_token_id=None), {}) == ()


def test_a_float_folder_arrives_bit_for_bit(tmp_path):
    folder = tiny_model_dir(tmp_path / "float")
    loaded = load_folder(folder, "auto", CPU)
    saved = load_file(folder / "model.safetensors")
    state = loaded.model.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    assert loaded.eos_token_ids == (COMMON["eos_token_id"],) and loaded.tokenizer is not None


def test_a_quantkit_checkpoint_arrives_bit_for_bit(tmp_path):
    model = tiny_model("llama")
    quantkit.quantize(model, {"scheme": {"bits": 4, "group_size": 32}, "stages": [{"method": "rtn"}]})
    folder = quantkit.save_quantized(model, tmp_path / "q", tokenizer=tiny_tokenizer(320))
    state = load_folder(folder, "float32", CPU).model.state_dict()
    saved = load_file(folder / "model.safetensors")
    quantized = [n for n in saved if n.endswith(".qweight")]
    assert len(quantized) == 14
    for name in [*quantized, "model.layers.0.mlp.up_proj.scales", "model.embed_tokens.weight"]:
        assert torch.equal(state[name], saved[name]), name


def test_a_tensor_of_the_wrong_shape_or_name_is_named():
    config = tiny_model("llama").config
    tensors = dict(dummy(config, "float32", CPU).model.state_dict())

    def meta_model():
        with torch.device("meta"):
            return CausalLM(config, float_linear(torch.float32), torch.float32)

    assign_weights(meta_model(), tensors, CPU)
    with pytest.raises(QuantkitError, match=r"checkpoint tensor model.norm.weight has shape \(3,\), expected \(64,\)"):
        assign_weights(meta_model(), {**tensors, "model.norm.weight": torch.ones(3)}, CPU)
    with pytest.raises(QuantkitError, match=r"missing \['model.norm.weight'\], unexpected \['model.norm.w'\]"):
        tensors["model.norm.w"] = tensors.pop("model.norm.weight")
        assign_weights(meta_model(), tensors, CPU)
    with pytest.raises(QuantkitError, match="cannot build a model from this config"):
        dummy({"model_type": "no-such-model"}, "float32", CPU)


def test_dummy_quantized_weights_are_made_directly_and_float_experts_share_one_tensor_per_layer():
    """``dummy(..., scheme=...)``: every decoder-layer linear quantized (codes random, zero points at mid-range,
    the float initialisation's spread), lm_head, embedding and router float; float MoE experts are views of one
    gate/up and one down tensor per layer (stacking then copies a layer at a time); other schemes are refused."""
    from quantkit.nn.qlinear import QuantLinear
    from quantkit.quant.scheme import QuantScheme
    from quantkit.runtime.bench import DUMMY_MODELS

    config = DUMMY_MODELS["tiny-qwen3-moe"]
    model = dummy(config, "float32", CPU, scheme=QuantScheme(bits=4, group_size=32, sym=True)).model
    linears = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear | torch.nn.Linear)}
    quantized = {n for n, m in linears.items() if isinstance(m, QuantLinear)}
    assert quantized == {n for n in linears if n.startswith("model.layers.") and not n.endswith("mlp.gate")}
    expert = model.model.layers[0].mlp.experts[3].down_proj
    w = expert.dequantize_weight()
    assert abs(w.std().item() - 0.02) < 0.002 and torch.equal(expert.g_idx, torch.arange(32) // 32)
    assert torch.equal(torch.unique(expert.qzeros), torch.tensor([-2004318072], dtype=torch.int32))  # 0x88888888
    assert len(torch.unique(w)) == 16  # every 4-bit code occurs
    again = dummy(config, "float32", CPU, scheme=QuantScheme(bits=4, group_size=32, sym=True)).model
    assert torch.equal(
        again.model.layers[1].mlp.experts[0].gate_proj.qweight, model.model.layers[1].mlp.experts[0].gate_proj.qweight
    )

    block = dummy(config, "float32", CPU).model.model.layers[1].mlp
    storages = {
        name: {getattr(e, name).weight.untyped_storage().data_ptr() for e in block.experts}
        for name in ("gate_proj", "up_proj", "down_proj")
    }
    assert storages["gate_proj"] == storages["up_proj"] and all(len(s) == 1 for s in storages.values())
    assert abs(block.experts[5].up_proj.weight.std().item() - 0.02) < 0.004
    with pytest.raises(QuantkitError, match="random quantized weights are integer weight-only"):
        dummy(config, "float32", CPU, scheme=QuantScheme(bits=8, group_size=-1, act_bits=8, act_dynamic=True))
