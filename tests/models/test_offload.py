"""Decoder layers left on disk until the runner reaches them (quantkit.models.offload): the same checkpoint as a
model loaded whole, with every layer read in only at its turn."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import quantkit
from quantkit.errors import QuantkitError
from quantkit.models.arch import arch_for
from quantkit.models.loading import load_model
from tests.tiny_models import tiny_model_dir

RECIPE = {"scheme": {"bits": 4, "group_size": 32}, "stages": [{"method": "gptq"}]}


def calib(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (4, 24), generator=torch.Generator().manual_seed(0))


def quantized_state(model) -> dict[str, torch.Tensor]:
    quantkit.quantize(model, RECIPE, calib(model.config.vocab_size), device="cpu")
    return model.state_dict()


@pytest.mark.parametrize("arch", ["llama", "gemma2", "opt", "mixtral", "qwen2_moe"])
def test_offloaded_layers_quantize_to_the_same_checkpoint(tmp_path, arch):
    folder = tiny_model_dir(tmp_path / arch, arch)
    whole = quantized_state(load_model(folder)[0])

    model = load_model(folder, offload=True)[0]
    layers = model.get_submodule(arch_for(model).layers)
    assert all(p.is_meta for p in layers.parameters())  # nothing of the layers read yet
    assert not model.get_input_embeddings().weight.is_meta
    seen = []
    for layer in layers:  # each layer is read in at its turn, not before
        layer.register_forward_pre_hook(lambda m, a: seen.append(sum(p.is_meta for p in layers.parameters())))
    offloaded = quantized_state(model)

    assert seen and seen[0] > 0  # layer 0 ran while the later layers were still on disk
    assert not any(p.is_meta for p in model.parameters())
    assert not any(hasattr(m, "_hf_hook") for m in model.modules())
    assert offloaded.keys() == whole.keys()
    assert all(torch.equal(offloaded[k], whole[k]) for k in whole)


def test_a_model_dispatched_by_the_user_quantizes_too(tmp_path):
    """quantize takes any accelerate dispatch: here layer 0 in memory, layer 1 on disk."""
    folder = tiny_model_dir(tmp_path / "llama")
    whole = quantized_state(load_model(folder)[0])
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, device_map=device_map, offload_folder=tmp_path / "offload"
    )
    assert model.model.layers[1].mlp.up_proj.weight.is_meta
    offloaded = quantized_state(model)
    assert all(torch.equal(offloaded[k], whole[k]) for k in whole)


def test_offload_reads_weights_in_the_requested_dtype(tmp_path):
    folder = tiny_model_dir(tmp_path / "llama")
    model = load_model(folder, dtype=torch.bfloat16, offload=True)[0]
    quantkit.quantize(model, {**RECIPE, "stages": [{"method": "rtn"}]}, device="cpu")
    assert model.model.layers[1].input_layernorm.weight.dtype == torch.bfloat16


def test_offload_needs_safetensors(tmp_path):
    folder = tiny_model_dir(tmp_path / "llama")
    state = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    for f in folder.glob("*.safetensors"):
        f.unlink()
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(QuantkitError, match="safetensors"):
        load_model(folder, offload=True)


def test_converted_weights_wait_in_a_scratch_folder_deleted_at_the_end(tmp_path):
    """Fused experts are converted while loading, so accelerate cannot read them in place: they wait on disk."""
    folder = tiny_model_dir(tmp_path / "mixtral", "mixtral")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    model = load_model(folder, offload=True, scratch_dir=scratch)[0]
    assert any(scratch.iterdir())
    quantized_state(model)
    assert not any(scratch.iterdir())


def test_offload_stays_on_the_host(tmp_path):
    with pytest.raises(QuantkitError, match="host"):
        load_model(tiny_model_dir(tmp_path / "llama"), offload=True, device="cuda")


def test_replaced_float_linears_are_freed_without_the_garbage_collector(tmp_path):
    """accelerate's hooks leave each module's bound forward in its __dict__ (a reference cycle): take_over removes
    it, so a float linear dies as soon as its quantized replacement takes its place."""
    import gc
    import weakref

    model = load_model(tiny_model_dir(tmp_path / "llama"), offload=True)[0]
    gc.collect()
    gc.disable()
    try:
        from quantkit.models.offload import take_over

        take_over(model, model.model.layers)
        assert not any("forward" in m.__dict__ for m in model.modules())
        float_linear = weakref.ref(model.model.layers[0].mlp.down_proj)
        quantkit.quantize(model, RECIPE, calib(model.config.vocab_size), device="cpu")
        assert float_linear() is None
    finally:
        gc.enable()


def test_a_model_that_offloads_nothing_keeps_its_hooks(tmp_path):
    from quantkit.models.offload import take_over

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(tmp_path / "llama"), device_map="cpu")
    hooked = {n for n, m in model.named_modules() if hasattr(m, "_hf_hook")}
    assert take_over(model, model.model.layers) == 0
    assert hooked == {n for n, m in model.named_modules() if hasattr(m, "_hf_hook")}
