"""Import of GPTQ (v1, v2) and compressed-tensors checkpoints: what the other direction of export wrote comes back
as the same model, a layer written by compressed-tensors' own compressor comes back as that library decodes it,
and what quantkit's layouts cannot hold is refused."""

import json
import re
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import quantkit
from quantkit.checkpoint.export import export_checkpoint
from quantkit.checkpoint.foreign import import_checkpoint
from quantkit.cli.main import cli
from quantkit.errors import QuantkitError
from tests.checkpoint.test_export import checkpoint, logits, needs_compressed_tensors, scheme
from tests.tiny_models import tiny_model, tiny_tokenizer

# block 64 over the tiny Llama's 64 x 96 layers: ragged blocks along K (96 = 64 + 32) and along N (96 outputs)
FP8_BLOCK64 = scheme(8, -1, act_bits=8, fmt="fp8", block_size=64)
ROUND_TRIPS = [
    ("compressed-tensors", {"scheme": scheme(4, 32), "stages": [{"method": "rtn"}]}),
    ("compressed-tensors", {"scheme": scheme(4, 32, sym=False), "stages": [{"method": "rtn"}]}),
    ("compressed-tensors", {"scheme": scheme(3, -1, sym=False), "stages": [{"method": "rtn"}]}),
    ("compressed-tensors", {"scheme": scheme(4, 64), "stages": [{"method": "rtn", "ignore": ["re:.*o_proj"],
                                                                 "overrides": [{"match": "re:.*down_proj",
                                                                                "scheme": scheme(8, -1)}]}]}),
    ("compressed-tensors", {"scheme": scheme(8, -1, act_bits=8), "stages": [{"method": "rtn"}]}),
    ("compressed-tensors", {"scheme": scheme(8, -1, act_bits=8, act_dynamic=False, fmt="fp8"),
                            "stages": [{"method": "smoothquant"}, {"method": "rtn"}]}),
    ("gptq", {"scheme": scheme(4, 32, sym=False), "stages": [{"method": "gptq", "params": {"act_order": True,
                                                                                            "static_groups": False}}]}),
    ("gptq", {"scheme": scheme(3, 32), "stages": [{"method": "gptq"}]}),
    ("gptq", {"scheme": scheme(8, -1), "stages": [{"method": "rtn", "ignore": ["re:.*k_proj"]}]}),
    ("awq", {"scheme": scheme(4, 32, sym=False), "stages": [{"method": "awq"}, {"method": "rtn"}]}),
    ("awq", {"scheme": scheme(4, 32), "stages": [{"method": "rtn", "ignore": ["re:.*k_proj"]}]}),
    ("compressed-tensors", {"scheme": FP8_BLOCK64, "stages": [{"method": "rtn"}]}),
    ("fp8", {"scheme": FP8_BLOCK64, "stages": [{"method": "rtn", "ignore": ["re:.*k_proj"]}]}),
]  # fmt: skip


@pytest.mark.parametrize(
    "fmt, recipe",
    ROUND_TRIPS,
    ids=["ct-w4", "ct-w4-asym", "ct-w3-pc-asym", "ct-mixed", "ct-w8a8-int8", "ct-w8a8-fp8-static", "gptq-w4-act-order",
         "gptq-w3", "gptq-w8-float-k", "awq-asym", "awq-sym-float-k", "ct-fp8-block", "fp8-block-float-k"],
)  # fmt: skip
def test_an_export_imports_back_to_the_same_model(tmp_path, fmt, recipe):
    q = checkpoint(tmp_path, recipe)
    exported = export_checkpoint(q, tmp_path / "exported", fmt)
    done = import_checkpoint(exported.path, tmp_path / "back")
    assert done.method == fmt and done.scale_change == 0.0  # fp16 scales, as quantkit keeps them
    qc = json.loads((done.path / "config.json").read_text())["quantization_config"]
    original = json.loads((q / "config.json").read_text())["quantization_config"]
    assert qc["modules"] == original["modules"] and qc["schemes"] == original["schemes"]
    assert qc["recipe"]["name"] == f"imported-{fmt}" and qc["imported_from"]["quant_method"] == fmt
    assert torch.equal(logits(quantkit.load_quantized(done.path)), logits(quantkit.load_quantized(q)))


def test_fp8_block_round_trips_bit_for_bit_and_refuses_bad_scales(tmp_path):
    q = checkpoint(tmp_path, {"scheme": FP8_BLOCK64, "stages": [{"method": "rtn"}]})
    for fmt in ("fp8", "compressed-tensors"):
        exported = export_checkpoint(q, tmp_path / fmt, fmt).path
        stored = load_file(exported / "model.safetensors")
        qc = json.loads((exported / "config.json").read_text())["quantization_config"]
        if fmt == "fp8":
            assert qc["weight_block_size"] == [64, 64] and qc["activation_scheme"] == "dynamic"
            assert stored["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (1, 2)  # [64 out, 96 in]
        else:
            (group,) = qc["config_groups"].values()
            assert group["weights"]["strategy"] == "block" and group["weights"]["block_structure"] == [64, 64]
            assert group["input_activations"]["strategy"] == "group" and group["input_activations"]["group_size"] == 64
        back = import_checkpoint(exported, tmp_path / f"{fmt}-back").path
        want, got = load_file(q / "model.safetensors"), load_file(back / "model.safetensors")
        assert want.keys() == got.keys()
        for key, t in want.items():
            assert got[key].dtype == t.dtype and torch.equal(got[key].view(torch.uint8), t.view(torch.uint8)), key
    exported = tmp_path / "fp8"
    key = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    for edit, fragment in [
        ({"tensor_update": lambda t: t.pop(key)}, "o_proj: fp8 weight without its weight_scale_inv"),
        ({"tensor_update": lambda t: t.update({key: torch.ones(2, 2)})}, r"weight_scale_inv \[2, 2\] does not fit"),
        ({"qc_update": {"weight_block_size": [96, 96]}}, r"weight block \[96, 96\] is not importable"),
        ({"qc_update": {"weight_block_size": [64, 128]}}, "is not importable"),
        ({"qc_update": {"activation_scheme": "static"}}, "static e4m3 activations are not importable"),
    ]:
        broken = tmp_path / "broken"
        if broken.exists():
            shutil.rmtree(broken)
        shutil.copytree(exported, broken)
        _edit(broken, **edit)
        r = CliRunner().invoke(cli, ["import", str(broken), "--out", str(tmp_path / "x")])
        assert r.exit_code == 2 and re.search(fragment, r.stderr) and len(r.stderr.strip().splitlines()) == 1, r.output
        assert not (tmp_path / "x").exists()


def test_gptq_v2_imports_with_its_zero_points_as_stored(tmp_path):
    q = checkpoint(tmp_path, {"scheme": scheme(4, 32, sym=False), "stages": [{"method": "rtn"}]})
    config = json.loads((q / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "checkpoint_format": "gptq_v2", "bits": 4,
                                     "group_size": 32, "sym": False, "desc_act": False}  # fmt: skip
    (q / "config.json").write_text(json.dumps(config))  # quantkit's own buffers are the v2 layout
    done = import_checkpoint(q, tmp_path / "back")
    model = quantkit.load_quantized(done.path)
    again = checkpoint(tmp_path, {"scheme": scheme(4, 32, sym=False), "stages": [{"method": "rtn"}]}, name="again")
    reference = quantkit.load_quantized(again)
    assert torch.equal(logits(model), logits(reference))


@needs_compressed_tensors
def test_a_layer_written_by_compressed_tensors_decodes_as_that_library_decodes_it(tmp_path):
    """compressed-tensors' own compressor writes one asymmetric 4-bit group-16 layer (as llm-compressor would);
    the import must dequantize to what the library's decompressor gives."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    model = tiny_model("llama")
    folder = tmp_path / "llmc"
    model.save_pretrained(folder)
    tiny_tokenizer(320).save_pretrained(folder)
    name = "model.layers.1.mlp.down_proj"
    weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 16}
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": [name], "weights": weights, "input_activations": None,
                                        "format": "pack-quantized"}}, "ignore": []}  # fmt: skip
    (group,) = QuantizationConfig.model_validate(qc).config_groups.values()
    w = model.get_submodule(name).weight.detach()  # [64, 96]
    lo, hi = w.view(64, 6, 16).amin(-1).clamp(max=0), w.view(64, 6, 16).amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).half().float()  # fp16 values: quantkit keeps weight-only scales in fp16
    zero_point = (-8 - torch.round(lo / scale)).clamp(-8, 7).to(torch.int8)  # signed, as the library keeps it
    compressed = PackedQuantizationCompressor.compress(
        {"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}, group
    )
    tensors = load_file(folder / "model.safetensors")
    del tensors[f"{name}.weight"]
    tensors.update({f"{name}.{k}": v for k, v in compressed.items()})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))

    done = import_checkpoint(folder, tmp_path / "back")
    assert done.modules == 1 and done.scale_change == 0.0
    got = quantkit.load_quantized(done.path).get_submodule(name).dequantize_weight()
    want = PackedQuantizationCompressor.decompress(compressed, group)["weight"]
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)


def _edit(folder, qc_update=None, tensor_update=None):
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(qc_update or {})
    (folder / "config.json").write_text(json.dumps(config))
    if tensor_update:
        tensors = load_file(folder / "model.safetensors")
        tensor_update(tensors)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _v1_wrapped_zero(tensors):
    key = "model.layers.0.mlp.up_proj.qzeros"
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] = -1  # every code 15: stored zero 15, which v1 readers decode as 16


@pytest.mark.parametrize(
    "fmt, edit, fragment",
    [
        ("gptq", {"tensor_update": _v1_wrapped_zero}, "stored as 15 means 16"),
        ("gptq", {"qc_update": {"dynamic": {r"+:.*down_proj": {"bits": 8}}}}, "gives modules other settings"),
        ("gptq", {"qc_update": {"checkpoint_format": "marlin"}}, "checkpoint_format 'marlin'"),
        ("compressed-tensors", {"qc_update": {"kv_cache_scheme": {"num_bits": 8}}}, "a quantized KV cache"),
        ("compressed-tensors", {"qc_update": {"quant_method": "hqq"}}, "cannot import 'hqq' checkpoints"),
        ("compressed-tensors", {"qc_update": {"quantization_status": "frozen"}}, "status 'frozen'"),
    ],
    ids=["v1-wrapped-zero", "gptq-dynamic-override", "gptq-marlin", "ct-kv-cache", "hqq", "ct-frozen"],
)
def test_what_quantkit_cannot_hold_is_refused(tmp_path, fmt, edit, fragment):
    q = checkpoint(tmp_path, {"scheme": scheme(4, 32, sym=False), "stages": [{"method": "rtn"}]})
    exported = export_checkpoint(q, tmp_path / "exported", fmt).path
    _edit(exported, **edit)
    with pytest.raises(QuantkitError, match=fragment):
        import_checkpoint(exported, tmp_path / "back")
    assert not (tmp_path / "back").exists()
    with pytest.raises(QuantkitError, match="already a quantkit checkpoint"):
        import_checkpoint(q, tmp_path / "back")


def test_import_command_then_inspect_and_generate(tmp_path):
    q = checkpoint(tmp_path, {"scheme": scheme(4, 32), "stages": [{"method": "rtn"}]})
    exported = export_checkpoint(q, tmp_path / "ct", "compressed-tensors").path

    def run(*args):
        return CliRunner().invoke(cli, [str(a) for a in args])

    r = run("import", exported, "--out", tmp_path / "back")
    # rich wraps the line at the console's width (80 columns off a terminal): read it with its breaks undone
    assert r.exit_code == 0 and "from compressed-tensors, 14 quantized linears" in " ".join(r.stdout.split()), r.output
    r = run("inspect", tmp_path / "back", "--json")
    assert r.exit_code == 0, r.output
    assert {m["scheme"] for m in json.loads(r.stdout)["modules"]} == {"w4a16-g32-sym"}
    r = run("generate", "--model", tmp_path / "back", "--max-tokens", "4", "--temperature", "0", "hello")
    assert r.exit_code == 0, r.output
    r = run("import", tmp_path / "missing", "--out", tmp_path / "x")
    assert r.exit_code == 2 and "checkpoint not found" in r.stderr


def test_compressed_tensors_groups_are_matched_as_the_library_ranks_them(tmp_path):
    """An exact name beats a ``re:`` pattern (matched at the start, as re.match), which beats the class Linear:
    here the 8-bit group names the down projections by a prefix pattern and the 4-bit group claims Linear."""
    recipe = {"scheme": scheme(4, 32), "stages": [{"method": "rtn", "overrides": [
        {"match": "re:.*down_proj", "scheme": scheme(8, -1)}]}]}  # fmt: skip
    q = checkpoint(tmp_path, recipe)
    exported = export_checkpoint(q, tmp_path / "ct", "compressed-tensors").path
    config = json.loads((exported / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["targets"] = ["Linear"] if group["weights"]["num_bits"] == 4 else ["re:model.*down"]
    (exported / "config.json").write_text(json.dumps(config))
    done = import_checkpoint(exported, tmp_path / "back")
    assert torch.equal(logits(quantkit.load_quantized(done.path)), logits(quantkit.load_quantized(q)))

    for group in config["quantization_config"]["config_groups"].values():
        group["targets"] = ["Linear"]  # both groups claim every layer: the first one is wrong for some
    (exported / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantkitError, match=r"weight_packed \[96, \d+\] does not hold 96 x 64 \d-bit codes"):
        import_checkpoint(exported, tmp_path / "back2")


def _tiny_bf16_scales(tensors):
    key = "model.layers.0.mlp.up_proj.scales"
    tensors[key] = torch.full_like(tensors[key], 1e-6, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "fmt, edit, fragment",
    [
        ("gptq", {"tensor_update": _tiny_bf16_scales}, "scales change by"),
        ("gptq", {"qc_update": {"dynamic": ["-:.*k_proj"]}}, "dynamic must be a mapping"),
        ("compressed-tensors", {"qc_update": {"config_groups": ["group_0"]}}, "config_groups must map"),
        ("compressed-tensors", {"tensor_update": lambda t: t.pop("model.layers.0.mlp.up_proj.weight_shape")},
         "weight_packed without weight_shape"),
        ("awq", {"tensor_update": lambda t: t.update({"model.layers.0.mlp.up_proj.qweight": torch.zeros(96, 12)})},
         "qweight is stored as torch.float32"),
        ("awq", {"tensor_update": lambda t: t.update({"model.layers.0.mlp.up_proj.qweight": torch.zeros(
            5, 12, dtype=torch.int32)})}, "do not describe one 32-group layer"),
    ],
    ids=["gptq-tiny-scales", "gptq-dynamic-list", "ct-groups-list", "ct-no-weight-shape", "awq-float-qweight",
         "awq-short-qweight"],
)  # fmt: skip
def test_malformed_checkpoints_are_one_line_errors(tmp_path, fmt, edit, fragment):
    q = checkpoint(tmp_path, {"scheme": scheme(4, 32), "stages": [{"method": "rtn"}]})
    exported = export_checkpoint(q, tmp_path / "exported", fmt).path
    _edit(exported, **edit)
    with pytest.raises(QuantkitError, match=fragment):
        import_checkpoint(exported, tmp_path / "back")
    assert not (tmp_path / "back").exists()


def test_legacy_autogptq_folder_and_what_overwrite_may_replace(tmp_path):
    q = checkpoint(tmp_path, {"scheme": scheme(4, 32), "stages": [{"method": "rtn"}]})
    exported = export_checkpoint(q, tmp_path / "gptq", "gptq").path
    config = json.loads((exported / "config.json").read_text())
    (exported / "quantize_config.json").write_text(json.dumps(config.pop("quantization_config")))
    config.pop("quantkit_export")  # now another tool's folder, with AutoGPTQ's own settings file
    (exported / "config.json").write_text(json.dumps(config))
    done = import_checkpoint(exported, tmp_path / "back")
    assert torch.equal(logits(quantkit.load_quantized(done.path)), logits(quantkit.load_quantized(q)))
    with pytest.raises(QuantkitError, match="not a quantkit checkpoint"):
        export_checkpoint(q, exported, "gptq", overwrite=True)  # never replaces another tool's checkpoint
    with pytest.raises(QuantkitError, match=r"must lie outside .*, the folder being read"):
        import_checkpoint(exported, exported / "nested")
    for out in (q, q / "nested"):  # the source itself (it would be replaced), a folder inside it
        with pytest.raises(QuantkitError, match=r"must lie outside .*, the folder being read"):
            export_checkpoint(q, out, "awq", overwrite=True)
    assert json.loads((q / "config.json").read_text())["quantization_config"]["quant_method"] == "quantkit"
    export_checkpoint(q, tmp_path / "ct", "compressed-tensors")
    export_checkpoint(q, tmp_path / "ct", "gptq", overwrite=True)  # an earlier export may be replaced


def test_a_config_that_disagrees_with_the_tensors_is_named_before_anything_loads(tmp_path):
    q = checkpoint(tmp_path, {"scheme": scheme(4, 32), "stages": [{"method": "rtn"}]})
    exported = export_checkpoint(q, tmp_path / "gptq", "gptq").path
    config = json.loads((exported / "config.json").read_text())
    config["quantization_config"]["group_size"] = 64  # the tensors hold groups of 32
    (exported / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantkitError, match=r"corrupt checkpoint .* is stored as \[2, \d+\], but .* expects \[1, "):
        import_checkpoint(exported, tmp_path / "back")
    assert not (tmp_path / "back").exists()

    config = json.loads((q / "config.json").read_text())
    for s in config["quantization_config"]["schemes"].values():
        s["group_size"] = 64
    (q / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantkitError, match=r"corrupt checkpoint .* is stored as .* \(w4a16-g64"):
        quantkit.load_quantized(q)
    with pytest.raises(QuantkitError, match=r"corrupt checkpoint .* is stored as"):
        AutoModelForCausalLM.from_pretrained(q)  # the hook, too


def deepseek_fp8_folder(path, block=16):
    """A DeepSeek-V3-layout fp8 folder made from the tiny random config: one linear per expert as DeepSeek stores
    them, every linear but the head in e4m3 with ``weight_scale_inv``, by the report's definition written out here
    (one scale per block = its abs-max / 448, codes = round-to-nearest-even of w / scale), and an MTP layer
    ``model.layers.2`` (after the dense layer 0 and the MoE layer 1) that transformers has no module for."""
    model = tiny_model("deepseek_v3")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for key in [k for k in state if k.endswith("mlp.experts.gate_up_proj")]:
        base = key.removesuffix("gate_up_proj")
        gate_up, down = state.pop(key), state.pop(base + "down_proj")
        for e in range(gate_up.shape[0]):
            gate, up = gate_up[e].chunk(2, dim=0)
            state.update({f"{base}{e}.gate_proj.weight": gate, f"{base}{e}.up_proj.weight": up,
                          f"{base}{e}.down_proj.weight": down[e]})  # fmt: skip
    g = torch.Generator().manual_seed(7)
    mtp = {"model.layers.2.eh_proj.weight": torch.randn(64, 128, generator=g), "model.layers.2.enorm.weight":
           torch.rand(64, generator=g), "model.layers.2.self_attn.q_a_proj.weight": torch.randn(48, 64, generator=g),
           "model.layers.2.shared_head.head.weight": torch.randn(320, 64, generator=g)}  # fmt: skip
    state.update(mtp)
    floats = {}
    for key in sorted(state):
        w = state[key]
        if not key.endswith("proj.weight") or w.dim() != 2:
            continue
        n, k = w.shape
        q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
        s = torch.empty(-(-n // block), -(-k // block))
        for i in range(0, n, block):
            for j in range(0, k, block):
                tile = w[i : i + block, j : j + block]
                s[i // block, j // block] = tile.abs().max() / 448
                q[i : i + block, j : j + block] = (tile / s[i // block, j // block]).to(torch.float8_e4m3fn)
        state[key], state[key.replace(".weight", ".weight_scale_inv")] = q, s
        floats[key.removesuffix(".weight")] = (q, s)
    path.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config["num_nextn_predict_layers"] = 1
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return floats, {k: state[k] for k in state if k.startswith("model.layers.2.")}


def test_a_deepseek_v3_fp8_folder_imports_to_its_reference_weights_with_its_mtp_layer(tmp_path):
    from quantkit.checkpoint.verify import verify_checkpoint

    blocks, mtp = deepseek_fp8_folder(tmp_path / "ds")
    assert verify_checkpoint(tmp_path / "ds").ok  # its MTP layer past the last decoder layer is accounted for
    done = import_checkpoint(tmp_path / "ds", tmp_path / "back")
    qc = json.loads((done.path / "config.json").read_text())["quantization_config"]
    assert qc["split_experts"] and qc["mtp"] == {"layers": ["model.layers.2"], "mode": "keep", "tensors": len(mtp)}
    assert set(qc["modules"]) == {n for n in blocks if not n.startswith("model.layers.2.")}
    model = quantkit.load_quantized(done.path)
    for name, (q, s) in blocks.items():
        if name.startswith("model.layers.2."):
            continue
        want = q.float() * s.repeat_interleave(16, 0).repeat_interleave(16, 1)[: q.shape[0], : q.shape[1]]
        assert torch.equal(model.get_submodule(name).dequantize_weight(), want), name
    stored = load_file(done.path / "model.safetensors")
    for key, t in mtp.items():  # the MTP layer as it was stored, fp8 codes and scales included
        assert torch.equal(stored[key].view(torch.uint8), t.contiguous().view(torch.uint8)), key
    assert model(torch.tensor([[5, 6, 7]])).logits.isfinite().all()
    r = CliRunner().invoke(cli, ["inspect", str(done.path)])
    assert r.exit_code == 0 and f"MTP layers model.layers.2: {len(mtp)} tensors, keep" in " ".join(r.stdout.split())
