"""BOS through the whole path: a tokenizer that adds BOS gets it in every calibration and evaluation window, one
that does not, does not; the checkpoint's calibration fingerprint and eval's protocol say which; the CLI flags
override it. Also what ``quantize`` says about export formats."""

import json

import pytest
import torch
from click.testing import CliRunner

import quantkit
from quantkit.cli.main import cli
from quantkit.eval.perplexity import evaluate
from tests.tiny_models import WORDS, tiny_model, word_tokenizer

BOS = 1


@pytest.fixture
def words_file(tmp_path):
    path = tmp_path / "words.txt"
    path.write_text(" ".join(WORDS[i % len(WORDS)] for i in range(2000)))
    return str(path)


def model_dir(path, adds_bos: bool):
    tiny_model("llama").save_pretrained(path)
    word_tokenizer(adds_bos).save_pretrained(path)
    return path


def gptq_recipe(source: str, **calibration) -> dict:
    return {
        "scheme": {"bits": 4, "group_size": 32, "sym": False},
        "calibration": {"source": source, "nsamples": 8, "seqlen": 32, **calibration},
        "stages": [{"method": "gptq"}],
    }


@pytest.mark.parametrize("adds_bos", [True, False])
def test_calibration_windows_and_fingerprint_follow_the_tokenizer(tmp_path, words_file, adds_bos):
    model, tokenizer = tiny_model("llama"), word_tokenizer(adds_bos)
    seen = []
    hook = model.model.embed_tokens.register_forward_pre_hook(lambda m, a: seen.append(a[0].clone()))
    result = quantkit.quantize(model, gptq_recipe(words_file), tokenizer=tokenizer)
    hook.remove()
    windows = torch.cat(seen)
    assert windows.shape == (8, 32) and bool((windows[:, 0] == BOS).all()) is adds_bos
    assert not bool((windows[:, 1:] == BOS).any())
    assert result.calibration["bos"] is adds_bos
    saved = quantkit.save_quantized(model, tmp_path / "q", tokenizer=tokenizer)
    config = json.loads((saved / "config.json").read_text())["quantization_config"]
    assert config["calibration"]["bos"] is adds_bos


def test_recipe_bos_overrides_and_is_checked(words_file):
    result = quantkit.quantize(tiny_model("llama"), gptq_recipe(words_file, bos=False), tokenizer=word_tokenizer(True))
    assert result.calibration["bos"] is False
    with pytest.raises(quantkit.QuantkitError, match="calibration bos must be auto, true or false, got 'yes'"):
        quantkit.quantize(tiny_model("llama"), gptq_recipe(words_file, bos="yes"), tokenizer=word_tokenizer(True))
    with pytest.raises(quantkit.QuantkitError, match="chat_template must be true or false"):
        quantkit.quantize(tiny_model("llama"), gptq_recipe(words_file, chat_template=1), tokenizer=word_tokenizer(True))


@pytest.mark.parametrize("adds_bos", [True, False])
def test_evaluation_protocol_records_bos(words_file, adds_bos):
    model = tiny_model("llama")
    result, protocol = evaluate(model, word_tokenizer(adds_bos), source=words_file, seqlen=32, max_windows=3)
    assert protocol["bos"] is adds_bos and result.tokens == 3 * 31  # seqlen - 1 predictions either way
    _, forced = evaluate(model, word_tokenizer(adds_bos), source=words_file, seqlen=32, max_windows=3, bos=not adds_bos)
    assert forced["bos"] is (not adds_bos)


def test_cli_flags_override_bos_and_quantize_names_the_export_formats(tmp_path, words_file):
    folder = model_dir(tmp_path / "m", adds_bos=True)
    out = tmp_path / "q"
    common = ["--calib", words_file, "--nsamples", "8", "--seqlen", "32", "--bits", "4", "--group-size", "32"]
    r = CliRunner().invoke(cli, ["quantize", "--model", str(folder), "--out", str(out), "--method", "gptq", *common])
    assert r.exit_code == 0, r.output
    assert "BOS where the tokenizer adds it" in r.output
    exports = next(line for line in r.output.splitlines() if line.startswith("exports to:"))
    assert "compressed-tensors" in exports.split("(")[0]
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["calibration"]["bos"] is True

    r = CliRunner().invoke(
        cli,
        ["quantize", "--model", str(folder), "--out", str(tmp_path / "q2"), "--method", "gptq", "--no-bos", *common],
    )
    assert r.exit_code == 0, r.output
    assert (
        json.loads((tmp_path / "q2" / "config.json").read_text())["quantization_config"]["calibration"]["bos"] is False
    )

    for flags, bos in (([], True), (["--no-bos"], False)):
        r = CliRunner().invoke(
            cli,
            ["eval", "--model", str(out), "--data", words_file, "--seqlen", "32", "--windows", "2", "--json", *flags],
        )
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["protocol"]["bos"] is bos
