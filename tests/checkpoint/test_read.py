"""checkpoint/read.py: the config, headers and tensors read back equal what safetensors holds, and each check of
what is stored fails on the damage it is for, naming the tensor."""

import json

import pytest
import torch
from safetensors.torch import load_file

import quantkit
from quantkit.checkpoint.read import (
    check_quantized_tensors,
    check_shapes,
    read_quantization_config,
    read_tensors,
    tensor_headers,
)
from quantkit.errors import QuantkitError

DTYPE_NAMES = {torch.int32: "I32", torch.float16: "F16", torch.float32: "F32", torch.bfloat16: "BF16"}


def test_headers_and_tensors_are_what_safetensors_holds(rtn_checkpoint):
    folder, _ = rtn_checkpoint
    stored = load_file(folder / "model.safetensors")
    headers = tensor_headers(folder)
    assert headers == {k: (list(t.shape), DTYPE_NAMES[t.dtype]) for k, t in stored.items()}
    tensors = read_tensors(folder)
    assert tensors.keys() == stored.keys() and all(torch.equal(tensors[k], stored[k]) for k in stored)


def test_the_quantization_config_is_read_and_checked(rtn_checkpoint, tmp_path):
    folder, _ = rtn_checkpoint
    qc = read_quantization_config(folder)
    assert qc == json.loads((folder / "config.json").read_text())["quantization_config"]
    assert len(qc["modules"]) == 14 and set(qc["modules"].values()) == {"w4a16-g32-asym"}
    with pytest.raises(QuantkitError, match="is not a checkpoint folder"):
        read_quantization_config(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    for change, message in [
        (lambda c: c.pop("quantization_config"), "is not quantized"),
        (lambda c: c["quantization_config"].update(quant_method="gptq"), "not a quantkit checkpoint"),
    ]:
        edited = json.loads(json.dumps(config))
        change(edited)
        (tmp_path / "config.json").write_text(json.dumps(edited))
        with pytest.raises(QuantkitError, match=message):
            read_quantization_config(tmp_path)
    with pytest.raises(QuantkitError, match=r"has no \.safetensors files"):
        tensor_headers(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(QuantkitError, match="not a readable safetensors file"):
        read_tensors(tmp_path)


def test_stored_tensors_are_checked_against_the_layers(rtn_checkpoint):
    folder, _ = rtn_checkpoint
    model = quantkit.load_quantized(folder)
    assert model.hf_quantizer.checked_tensors  # the hook checked them once; load_quantized did not again
    stored = {k: dtype for k, (_, dtype) in tensor_headers(folder).items()}
    check_quantized_tensors(folder, model, stored)  # as saved: nothing to report
    name = "model.layers.0.mlp.up_proj"
    module = model.get_submodule(name)
    with pytest.raises(QuantkitError, match=f"{name}.qweight is stored as I64, expected I32"):
        check_quantized_tensors(folder, model, {**stored, f"{name}.qweight": "I64"})
    scales = module.scales.clone()
    module.scales[0, 0] = float("nan")
    with pytest.raises(QuantkitError, match=f"{name}.scales holds NaN or infinite scales"):
        check_quantized_tensors(folder, model, stored)
    module.scales.copy_(scales)
    module.g_idx[-1] = module.scales.shape[0]  # one past the last group
    with pytest.raises(QuantkitError, match=rf"{name}.g_idx names groups outside \[0, 2\)"):
        check_quantized_tensors(folder, model, stored)


def test_shapes_that_disagree_with_the_scheme_are_named(rtn_checkpoint):
    folder, _ = rtn_checkpoint
    model = quantkit.load_quantized(folder)
    shapes = {k: tuple(shape) for k, (shape, _) in tensor_headers(folder).items()}
    check_shapes(folder, model, shapes)
    key = "model.layers.1.self_attn.o_proj.scales"
    with pytest.raises(QuantkitError, match=rf"{key} is stored as \[4, 64\], but the scheme .*w4a16-g32-asym"):
        check_shapes(folder, model, {**shapes, key: (4, 64)})
