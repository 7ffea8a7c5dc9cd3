"""Export to compressed-tensors and GPTQ v1, checked against independent readers: transformers loading through the
compressed-tensors package (the path vLLM's format takes in transformers), that package's own decompressor, and
a decoder of the GPTQ v1 layout written here from its published rules (AutoGPTQ's packing)."""

import importlib.util
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPTQConfig

import quantkit
from quantkit.checkpoint.export import export_checkpoint
from quantkit.cli.main import cli
from quantkit.errors import QuantkitError
from tests.tiny_models import tiny_model, tiny_tokenizer

# the independent reader is the test extra's compressed-tensors; where only the runtime's packages are installed
# (a CUDA host without it) these tests say so instead of failing on the missing import
needs_compressed_tensors = pytest.mark.skipif(
    importlib.util.find_spec("compressed_tensors") is None,
    reason="needs the compressed-tensors package (the test extra: pip install -e '.[test]')",
)
ACT_ORDER = {"act_order": True, "static_groups": False}  # groups follow the permutation: g_idx is not k // G
IDS = torch.randint(3, 320, (2, 12), generator=torch.Generator().manual_seed(0))
CALIB = torch.randint(3, 320, (4, 32), generator=torch.Generator().manual_seed(1))


def scheme(bits, group_size, sym=True, **extra):
    return {"bits": bits, "group_size": group_size, "sym": sym, **extra}


def checkpoint(tmp_path, recipe, name="q", prepare=None):
    """A quantkit checkpoint of the tiny Llama (fp32) quantized with ``recipe`` (a mapping)."""
    model = tiny_model("llama")
    if prepare is not None:
        prepare(model)
    needs_data = any(s["method"] != "rtn" for s in recipe["stages"])
    quantkit.quantize(model, recipe, calib=CALIB if needs_data else None)
    return quantkit.save_quantized(model, tmp_path / name, tokenizer=tiny_tokenizer(320))


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


def dequantized(folder):
    """name -> the quantkit checkpoint's dequantized weight [N, K] (fp32), per quantized linear."""
    model = quantkit.load_quantized(folder)
    return {n: m.dequantize_weight() for n, m in model.named_modules() if hasattr(m, "dequantize_weight")}


@needs_compressed_tensors
@pytest.mark.parametrize(
    "recipe",
    [
        {"scheme": scheme(4, 32), "stages": [{"method": "rtn"}]},
        {"scheme": scheme(8, -1), "stages": [{"method": "rtn"}]},
        {"scheme": scheme(3, 32), "stages": [{"method": "gptq", "params": {"act_order": False}}]},
        {"scheme": scheme(4, 64), "stages": [{"method": "rtn", "ignore": ["re:.*o_proj"],
                                              "overrides": [{"match": "re:.*down_proj", "scheme": scheme(8, -1)}]}]},
    ],
    ids=["w4-g32", "w8-per-channel", "w3-g32-gptq", "mixed-with-float-o_proj"],
)  # fmt: skip
def test_compressed_tensors_loads_in_transformers_to_the_same_model(tmp_path, recipe):
    q = checkpoint(tmp_path, recipe)
    done = export_checkpoint(q, tmp_path / "ct", "compressed-tensors")
    qc = json.loads((done.path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
    assert "lm_head" in qc["ignore"]
    if recipe["stages"][0].get("ignore"):
        assert {f"model.layers.{i}.self_attn.o_proj" for i in range(2)} <= set(qc["ignore"])
        assert len(qc["config_groups"]) == 2 and qc["format"] == "pack-quantized"
    assert load_file(done.path / "model.safetensors")["model.layers.0.mlp.up_proj.weight_scale"].dtype in (
        torch.float16,
        torch.float32,
    )  # as quantkit holds them; the reader casts them into its parameters (fp32 here: exact)
    exported = AutoModelForCausalLM.from_pretrained(done.path)
    assert torch.equal(logits(exported), logits(quantkit.load_quantized(q)))
    assert (done.path / "tokenizer.json").is_file() and (done.path / "recipe.yaml").is_file()


@needs_compressed_tensors
@pytest.mark.parametrize("bits, group_size", [(4, 32), (2, 32), (3, -1)])
def test_compressed_tensors_zero_points_decode_through_its_own_decompressor(tmp_path, bits, group_size):
    """Asymmetric layers, read by compressed-tensors' pack-quantized decompressor (the layout vLLM reads too;
    transformers 5.25 with compressed-tensors 0.20.1 cannot load packed zero points at all: its empty model
    allocates them unpacked)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    q = checkpoint(tmp_path, {"scheme": scheme(bits, group_size, sym=False), "stages": [{"method": "rtn"}]})
    done = export_checkpoint(q, tmp_path / "ct", "compressed-tensors")
    config = QuantizationConfig.model_validate(
        json.loads((done.path / "config.json").read_text())["quantization_config"]
    )
    (group,) = config.config_groups.values()
    stored = load_file(done.path / "model.safetensors")
    want = dequantized(q)
    for name, weight in want.items():
        local = {k.removeprefix(f"{name}."): v for k, v in stored.items() if k.startswith(f"{name}.weight")}
        local["weight_scale"] = local["weight_scale"].float()  # as a reader of an fp32 model allocates it
        assert set(local) == {"weight_packed", "weight_scale", "weight_zero_point", "weight_shape"}
        got = PackedQuantizationCompressor.decompress(local, group)["weight"]
        torch.testing.assert_close(got.float(), weight, rtol=1e-6, atol=0)


@needs_compressed_tensors
@pytest.mark.parametrize("fmt", ["int", "fp8"])
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_compressed_tensors_w8a8(tmp_path, fmt, dynamic):
    recipe = {
        "scheme": scheme(8, -1, act_bits=8, act_dynamic=dynamic, fmt=fmt),
        "stages": [{"method": "smoothquant"}, {"method": "rtn"}],
    }
    q = checkpoint(tmp_path, recipe)
    done = export_checkpoint(q, tmp_path / "ct", "compressed-tensors")
    qc = json.loads((done.path / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert qc["format"] == ("int-quantized" if fmt == "int" else "float-quantized")
    assert group["input_activations"]["strategy"] == ("token" if dynamic else "tensor")
    exported = AutoModelForCausalLM.from_pretrained(done.path)
    modules = dict(exported.named_modules())
    for name, weight in dequantized(q).items():
        m = modules[name]
        w = m.weight.float() * m.weight_scale.float() if m.weight.dtype != torch.float32 else m.weight
        torch.testing.assert_close(w, weight, rtol=1e-6, atol=0)
        if not dynamic:
            assert m.input_scale.numel() == 1
    # the weights are the same integers; compressed-tensors' simulated int8 activations use abs-max / 127.5
    # where quantkit (and vLLM's int8 kernels) use abs-max / 127, so the logits agree closely, not bit for bit
    want, got = logits(quantkit.load_quantized(q)), logits(exported)
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


def gptq_v1_weights(folder, bits):
    """The dequantized weights of a GPTQ v1 checkpoint, decoded from the format's rules alone: qweight packed
    along the input and qzeros along the output, lowest bits first, 32 codes per ``bits`` words (3-bit codes
    straddle words), stored zero = zero - 1."""
    stored = load_file(folder / "model.safetensors")

    def unpack(words, count):  # words int32 [rows, cols] packed along dim 0 -> codes [count, cols]
        w = words.to(torch.int64) & 0xFFFFFFFF
        bitstream = [(w[r] >> i) & 1 for r in range(w.shape[0]) for i in range(32)]
        bit = torch.stack(bitstream)  # [rows * 32, cols]
        weights = 2 ** torch.arange(bits).unsqueeze(1)
        return torch.stack([(bit[j * bits : (j + 1) * bits] * weights).sum(0) for j in range(count)])

    out = {}
    for key in stored:
        if key.endswith(".qweight"):
            name = key.removesuffix(".qweight")
            scales, g_idx = stored[f"{name}.scales"].float(), stored[f"{name}.g_idx"].long()
            n, k = scales.shape[1], g_idx.numel()
            q = unpack(stored[key], k)  # [K, N]
            zeros = unpack(stored[f"{name}.qzeros"].t(), n).t() + 1  # [n_g, N]
            out[name] = ((q - zeros[g_idx]) * scales[g_idx]).t()
    return out


@pytest.mark.parametrize(
    "bits, group_size, sym, act_order", [(4, 32, False, True), (3, 32, True, True), (8, -1, True, False)]
)
def test_gptq_v1_export_decodes_by_the_format_rules(tmp_path, bits, group_size, sym, act_order):
    recipe = {
        "scheme": scheme(bits, group_size, sym),
        "stages": [{"method": "gptq", "params": {"act_order": act_order, "static_groups": False}}],
    }
    q = checkpoint(tmp_path, recipe)
    done = export_checkpoint(q, tmp_path / "gptq", "gptq")
    qc = json.loads((done.path / "config.json").read_text())["quantization_config"]
    assert qc == {
        "quant_method": "gptq", "checkpoint_format": "gptq", "bits": bits, "group_size": group_size, "sym": sym,
        "desc_act": act_order, "static_groups": False, "true_sequential": True, "lm_head": False,
    }  # fmt: skip
    GPTQConfig.from_dict(qc)  # transformers' own reading of the config
    got = gptq_v1_weights(done.path, bits)
    want = dequantized(q)
    assert set(got) == set(want)
    for name, weight in want.items():
        torch.testing.assert_close(got[name].float(), weight, rtol=0, atol=0)


def test_gptq_declares_float_layers_inside_the_blocks(tmp_path):
    q = checkpoint(tmp_path, {"scheme": scheme(4, 32), "stages": [{"method": "rtn", "ignore": ["re:.*k_proj"]}]})
    qc = json.loads((export_checkpoint(q, tmp_path / "g", "gptq").path / "config.json").read_text())
    assert qc["quantization_config"]["dynamic"] == {
        r"-:^model\.layers\.0\.self_attn\.k_proj$": {},
        r"-:^model\.layers\.1\.self_attn\.k_proj$": {},
    }


def _nonnegative_down_proj(model):
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.abs_()


@pytest.mark.parametrize(
    "fmt, recipe, prepare, fragment",
    [
        ("gptq", {"scheme": scheme(4, 64, sym=False), "stages": [{"method": "rtn", "overrides": [
            {"match": "re:.*down_proj", "scheme": scheme(8, -1)}]}]}, None, "GPTQ holds one scheme"),
        ("gptq", {"scheme": scheme(8, -1, act_bits=8), "stages": [{"method": "rtn"}]}, None, "weight-only integer"),
        ("gptq", {"scheme": scheme(4, 32, sym=False), "stages": [{"method": "rtn"}]}, _nonnegative_down_proj,
         "zero points equal to 0"),
        ("gptq", {"scheme": scheme(4, 48), "stages": [{"method": "rtn"}]}, None, "no shorter last group"),
        ("awq", {"scheme": scheme(4, 128), "stages": [{"method": "rtn"}]}, None, "group size 128 does not divide"),
        ("compressed-tensors", {"scheme": scheme(4, 48), "stages": [{"method": "rtn"}]}, None,
         "no shorter last group"),
        ("compressed-tensors", {"scheme": scheme(4, 32), "stages": [{"method": "gptq", "params": ACT_ORDER}]}, None,
         "act-order groups"),
    ],
    ids=["gptq-mixed", "gptq-w8a8", "gptq-v1-zero-0", "gptq-ragged", "awq-group-above-k", "ct-ragged",
         "ct-act-order"],
)  # fmt: skip
def test_what_a_format_cannot_hold_is_refused_and_nothing_is_written(tmp_path, fmt, recipe, prepare, fragment):
    q = checkpoint(tmp_path, recipe, prepare=prepare)
    with pytest.raises(QuantkitError, match=fragment):
        export_checkpoint(q, tmp_path / "out", fmt)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_export_command(tmp_path):
    q = checkpoint(tmp_path, {"scheme": scheme(4, 32), "stages": [{"method": "rtn"}]})

    def run(*args):
        return CliRunner().invoke(cli, [str(a) for a in args])

    r = run("export", q, "--format", "compressed-tensors", "--out", tmp_path / "ct")
    assert r.exit_code == 0 and "wrote" in r.stdout and "14 quantized linears" in r.stdout, r.output
    r = run("export", q, "--format", "gptq", "--out", tmp_path / "ct")
    assert r.exit_code == 2 and "already exists" in r.stderr
    r = run("export", q, "--format", "gptq", "--out", tmp_path / "ct", "--overwrite")  # an earlier export
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]["quant_method"] == "gptq"
    float_dir = tmp_path / "float"
    tiny_model("llama").save_pretrained(float_dir)
    for args, fragment in [
        ((float_dir, "--format", "gptq", "--out", tmp_path / "x"), "not a quantized checkpoint"),
        ((tmp_path / "missing", "--format", "gptq", "--out", tmp_path / "x"), "checkpoint not found"),
        ((q, "--format", "marlin", "--out", tmp_path / "x"), "Invalid value for '--format'"),
    ]:
        r = run("export", *args)
        assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1 and fragment in r.stderr, r.output


@needs_compressed_tensors
def test_eval_reads_a_compressed_tensors_export(tmp_path):
    q = checkpoint(tmp_path, {"scheme": scheme(4, 32), "stages": [{"method": "rtn"}]})
    export_checkpoint(q, tmp_path / "ct", "compressed-tensors")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{i % 37}" for i in range(2000)))
    r = CliRunner().invoke(
        cli,
        ["eval", "--model", str(tmp_path / "ct"), "--baseline", str(q), "--data", str(text), "--seqlen", "32",
         "--windows", "2"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "0.0000" in r.stdout and "1.000" in r.stdout  # KL and top-1 agreement against quantkit's checkpoint


@needs_compressed_tensors
def test_eval_of_an_asymmetric_compressed_tensors_export_fails_in_one_line_or_matches(tmp_path):
    """transformers 5.25 with compressed-tensors 0.20.1 cannot load packed zero points (its empty model allocates
    them unpacked): eval says so in one line and names the way round it; a reader that loads them must match."""
    q = checkpoint(tmp_path, {"scheme": scheme(4, 32, sym=False), "stages": [{"method": "rtn"}]})
    export_checkpoint(q, tmp_path / "ct", "compressed-tensors")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{i % 37}" for i in range(2000)))
    args = ["--baseline", str(q), "--data", str(text), "--seqlen", "32", "--windows", "2"]
    r = CliRunner().invoke(cli, ["eval", "--model", str(tmp_path / "ct"), *args])
    if r.exit_code == 0:
        assert "0.0000" in r.stdout and "1.000" in r.stdout, r.output
    else:
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("quantkit: error:")]
        assert r.exit_code == 2 and len(lines) == 1, r.output
        assert "zero points" in lines[0] and f"quantkit import {tmp_path / 'ct'} --out DIR" in lines[0], lines[0]
    quantkit.import_checkpoint(tmp_path / "ct", tmp_path / "back")
    r = CliRunner().invoke(cli, ["eval", "--model", str(tmp_path / "back"), *args])
    assert r.exit_code == 0 and "0.0000" in r.stdout and "1.000" in r.stdout, r.output


def awq_gemm_weights(folder):
    """The dequantized weights of an AWQ GEMM checkpoint, decoded from the format's rules alone: qweight [K, N / 8]
    and qzeros packed along the output, nibble i of packed column c holding column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i],
    zero points as they are, no g_idx (group = k // group_size)."""
    stored = load_file(folder / "model.safetensors")
    group_size = json.loads((folder / "config.json").read_text())["quantization_config"]["group_size"]
    inverse = [0, 4, 1, 5, 2, 6, 3, 7]  # column j of a block of 8 sits in nibble inverse[j]

    def unpack(words):
        w = words.to(torch.int64) & 0xFFFFFFFF
        cols = [(w[:, c // 8] >> (4 * inverse[c % 8])) & 0xF for c in range(w.shape[1] * 8)]
        return torch.stack(cols, dim=1)

    out = {}
    for key in stored:
        if key.endswith(".qweight"):
            name = key.removesuffix(".qweight")
            assert f"{name}.g_idx" not in stored
            q, zeros = unpack(stored[key]), unpack(stored[f"{name}.qzeros"])
            g = torch.arange(q.shape[0]) // group_size
            out[name] = ((q - zeros[g]) * stored[f"{name}.scales"].float()[g]).t()
    return out


@pytest.mark.parametrize("sym", [False, True], ids=["asym", "sym"])
def test_awq_gemm_export_decodes_by_the_format_rules(tmp_path, sym):
    q = checkpoint(tmp_path, {"scheme": scheme(4, 32, sym), "stages": [{"method": "awq"}, {"method": "rtn"}]})
    done = export_checkpoint(q, tmp_path / "awq", "awq")
    qc = json.loads((done.path / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 32, "zero_point": True,
                  "modules_to_not_convert": None}  # fmt: skip
    got, want = awq_gemm_weights(done.path), dequantized(q)
    assert set(got) == set(want)
    for name, weight in want.items():
        torch.testing.assert_close(got[name].float(), weight, rtol=0, atol=0)


@pytest.mark.parametrize(
    "recipe, fragment",
    [
        ({"scheme": scheme(8, -1), "stages": [{"method": "rtn"}]}, "AWQ holds 4-bit weight-only groups"),
        ({"scheme": scheme(4, -1), "stages": [{"method": "rtn"}]}, "AWQ holds 4-bit weight-only groups"),
        ({"scheme": scheme(4, 48), "stages": [{"method": "rtn"}]}, "does not divide its 64 inputs"),
        ({"scheme": scheme(4, 32), "stages": [{"method": "gptq", "params": ACT_ORDER}]}, "act-order"),
    ],
    ids=["8-bit", "per-channel", "ragged", "act-order"],
)
def test_what_awq_cannot_hold_is_refused(tmp_path, recipe, fragment):
    q = checkpoint(tmp_path, recipe)
    with pytest.raises(QuantkitError, match=fragment):
        export_checkpoint(q, tmp_path / "out", "awq")
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_missing_a_tensor_is_named(tmp_path):
    from safetensors.torch import save_file

    q = checkpoint(tmp_path, {"scheme": scheme(4, 32), "stages": [{"method": "rtn"}]})
    tensors = load_file(q / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.qzeros"]
    save_file(tensors, q / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(QuantkitError, match=r"model\.layers\.1\.mlp\.up_proj lacks qzeros"):
        export_checkpoint(q, tmp_path / "out", "gptq")


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_mixture_of_experts_exports_one_linear_per_expert_and_reads_back_bit_identically(tmp_path, arch):
    """Fused experts are quantized one linear per expert projection; every format stores them under per-expert
    names (``mlp.experts.{e}.gate_proj``, as DeepSeek-V3 and llm-compressor store them), which quantkit's importer
    reads back to the same tensors and logits, and ``verify`` passes."""
    from safetensors.torch import load_file

    from quantkit.checkpoint.foreign import import_checkpoint
    from quantkit.checkpoint.verify import verify_checkpoint

    model = tiny_model(arch)
    quantkit.quantize(model, {"scheme": scheme(4, 32, sym=False), "stages": [{"method": "rtn"}]})
    q = quantkit.save_quantized(model, tmp_path / "q", tokenizer=tiny_tokenizer(320))
    assert json.loads((q / "config.json").read_text())["quantization_config"]["split_experts"]

    def tensors(folder):
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            out.update(load_file(f))
        return out

    original, reference = tensors(q), logits(quantkit.load_quantized(q))
    for fmt in ("compressed-tensors", "gptq", "awq"):
        exported = export_checkpoint(q, tmp_path / fmt, fmt)
        stored = tensors(exported.path)
        assert any(".mlp.experts.1.down_proj." in name for name in stored), fmt
        assert verify_checkpoint(exported.path).ok, fmt
        back = import_checkpoint(exported.path, tmp_path / f"{fmt}-back")
        again = tensors(back.path)
        assert set(again) == set(original) and all(torch.equal(t, again[n]) for n, t in original.items()), fmt
        assert torch.equal(logits(quantkit.load_quantized(back.path)), reference), fmt


@needs_compressed_tensors
def test_eval_of_a_per_expert_compressed_tensors_export_is_refused_in_one_line(tmp_path):
    """transformers 5 holds Mixtral's experts fused and leaves per-expert quantized layers unread: eval says so and
    names the import that reads them, instead of scoring a model with random experts."""
    model = tiny_model("mixtral")
    quantkit.quantize(model, {"scheme": scheme(4, 32), "stages": [{"method": "rtn"}]})
    q = quantkit.save_quantized(model, tmp_path / "q", tokenizer=tiny_tokenizer(320))
    exported = export_checkpoint(q, tmp_path / "ct", "compressed-tensors")
    r = CliRunner().invoke(cli, ["eval", "--model", str(exported.path), "--windows", "1", "--seqlen", "16"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert "holds this model's experts fused" in r.output and "quantkit import" in r.output
