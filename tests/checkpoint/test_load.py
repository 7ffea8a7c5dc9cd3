"""checkpoint/load.py and checkpoint/compressed.py: load_any opens each kind of model folder ``quantkit eval``
takes (float, quantkit, compressed-tensors) as the model saved there; what cannot load fails in one typed line."""

import importlib.util
import json

import pytest
import torch

import quantkit
from quantkit.checkpoint.compressed import load_compressed_tensors, packed_zero_points
from quantkit.checkpoint.export import export_checkpoint
from quantkit.checkpoint.load import load_any, load_quantized
from quantkit.errors import QuantkitError, UnsupportedCheckpointError
from quantkit.nn.factory import quantized_modules
from tests.tiny_models import tiny_model, tiny_model_dir, tiny_tokenizer

needs_compressed_tensors = pytest.mark.skipif(
    importlib.util.find_spec("compressed_tensors") is None, reason="needs the compressed-tensors package"
)

IDS = torch.randint(3, 320, (2, 12), generator=torch.Generator().manual_seed(0))


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


def test_load_any_opens_a_float_folder_and_a_quantkit_checkpoint(rtn_checkpoint, tmp_path):
    folder, model = rtn_checkpoint
    float_dir = tiny_model_dir(tmp_path / "float")
    m, tokenizer = load_any(str(float_dir), torch.float32, "cpu")
    assert not quantized_modules(m) and tokenizer.vocab_size == 320
    torch.testing.assert_close(logits(m), logits(tiny_model("llama")), rtol=0, atol=0)
    q, tokenizer = load_any(str(folder), torch.float32, "cpu")
    assert len(quantized_modules(q)) == 14 and tokenizer("the cat")["input_ids"]
    torch.testing.assert_close(logits(q), logits(model), rtol=0, atol=0)


def test_load_quantized_names_what_is_not_a_checkpoint(tmp_path):
    with pytest.raises(QuantkitError, match="needs a checkpoint folder's path, got int"):
        load_quantized(3)
    with pytest.raises(QuantkitError, match="checkpoint not found"):
        load_quantized(tmp_path / "missing")
    float_dir = tiny_model_dir(tmp_path / "float")
    with pytest.raises(QuantkitError, match=r"is not quantized \(config.json has no quantization_config\)"):
        load_quantized(float_dir)


def compressed_export(tmp_path, sym: bool):
    model = tiny_model("llama")
    quantkit.quantize(model, {"scheme": {"bits": 4, "group_size": 32, "sym": sym}, "stages": [{"method": "rtn"}]})
    q = quantkit.save_quantized(model, tmp_path / "q", tokenizer=tiny_tokenizer(320))
    return q, export_checkpoint(q, tmp_path / "ct", "compressed-tensors").path


@needs_compressed_tensors
def test_a_compressed_tensors_export_loads_as_the_checkpoint_it_came_from(tmp_path):
    q, ct = compressed_export(tmp_path, sym=True)
    assert not packed_zero_points(ct)
    model, _ = load_any(str(ct), torch.float32, "cpu")
    torch.testing.assert_close(logits(model), logits(load_quantized(q)), rtol=0, atol=0)


@needs_compressed_tensors
def test_packed_zero_points_the_reader_cannot_hold_are_a_typed_error(tmp_path):
    """transformers 5.25 with compressed-tensors 0.20.1 allocates packed zero points unpacked: the mismatch it
    lists is raised as UnsupportedCheckpointError naming quantkit import; a reader that loads them must match."""
    q, ct = compressed_export(tmp_path, sym=False)
    assert packed_zero_points(ct)
    try:
        model = load_compressed_tensors(ct, torch.float32, "cpu")
    except UnsupportedCheckpointError as exc:
        assert "with zero points (asymmetric)" in str(exc) and f"'quantkit import {ct} --out DIR'" in str(exc)
    else:
        torch.testing.assert_close(logits(model), logits(load_quantized(q)), rtol=0, atol=1e-5)


def test_packed_zero_points_reads_the_config_groups(tmp_path):
    def config(groups, fmt=None):
        qc = {"quant_method": "compressed-tensors", "config_groups": groups}
        if fmt:
            qc["format"] = fmt
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
        return tmp_path

    asym = {"weights": {"symmetric": False}, "format": "pack-quantized"}
    assert packed_zero_points(config({"group_0": asym}))
    assert packed_zero_points(config({"group_0": {"weights": {"symmetric": False}}}, fmt="pack-quantized"))
    assert not packed_zero_points(config({"group_0": {**asym, "weights": {"symmetric": True}}}))
    assert not packed_zero_points(config({"group_0": {**asym, "format": "int-quantized"}}))
    assert not packed_zero_points(config("not a mapping"))
