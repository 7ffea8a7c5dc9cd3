"""The CLI: a happy path on a tiny model, and every kind of bad input -> one line, exit 2, nothing written."""

import json
import re
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from transformers import GPT2Config, GPT2LMHeadModel

from quantkit.cli.main import cli
from tests.tiny_models import tiny_model_dir, tiny_tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "llama")


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def assert_clean_failure(result, fragment, out=None):
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("quantkit: error:") and fragment in lines[0], lines[0]
    assert "Traceback" not in result.output
    if out is not None:
        assert not out.exists()
        assert not list(out.parent.glob(f".{out.name}.tmp-*"))


def test_quantize_eval_inspect_happy_path(tiny_dir, tmp_path):
    out = tmp_path / "q"
    r = run("quantize", "--model", tiny_dir, "--out", out, "--bits", "4", "--group-size", "32", "--asym")
    assert r.exit_code == 0, r.output
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    # stderr is not a terminal here: progress comes as plain lines, the last one always printed
    steps = [ln for ln in r.stderr.splitlines() if ln.startswith("quantizing ")]
    assert steps and re.fullmatch(r"quantizing 2/2 \d\d:\d\d:\d\d layer 1 \(\d+\.\ds\)", steps[-1]), r.stderr
    assert "━" not in r.stderr
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "quantkit" and qc["schemes"] == {
        "w4a16-g32-asym": {
            "bits": 4,
            "group_size": 32,
            "sym": False,
            "fmt": "int",
            "act_bits": None,
            "act_dynamic": True,
        }
    }
    assert qc["layouts"] == {"gptq_v2": 1}
    assert set(qc["versions"]) == {"quantkit", "torch", "transformers"}
    assert qc["source_model"] == str(tiny_dir)

    r = run("inspect", out, "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert len(info["modules"]) == 14 and info["totals"]["ratio"] > 2.5

    r = run("eval", "--model", out, "--baseline", tiny_dir, "--windows", "2", "--seqlen", "32", "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["perplexity"] > 1 and res["kl"] >= 0 and 0 <= res["top1_agreement"] <= 1


def test_cli_flag_overrides_recipe(tiny_dir, tmp_path):
    out = tmp_path / "q"
    r = run("quantize", "--model", tiny_dir, "--out", out, "--recipe", "w4a16-rtn-mixed", "--bits", "8")
    assert r.exit_code == 0, r.output
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    # --bits 8 applies to the stage scheme; the recipe's per-layer override still wins for down_proj
    assert set(qc["schemes"]) == {"w8a16-g64-asym", "w8a16-pc-sym"}
    assert qc["modules"]["model.layers.0.mlp.down_proj"] == "w8a16-pc-sym"


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--model", "/nonexistent/model"], "model not found"),
        (["--bits", "5"], "bits must be one of 2, 3, 4, 8, got 5"),
        (["--group-size", "0"], "group_size must be a positive integer or -1"),
        (["--recipe", "/nonexistent.yaml"], "recipe not found"),
        (["--method", "nope"], "unknown method 'nope'"),
        (["--method", "rtn", "--damp", "0.1"], "--damp does not apply"),
        (["--method", "rtn", "--recipe", "default"], "either --method or --recipe"),
        (["--device", "cuda:0"] if not torch.cuda.is_available() else ["--device", "tpu"], "device"),
    ],
)
def test_bad_quantize_arguments(tiny_dir, tmp_path, args, fragment):
    out = tmp_path / "q"
    args = ["--model", tiny_dir, *args] if "--model" not in args else args
    assert_clean_failure(run("quantize", "--out", out, *args), fragment, out)


def test_malformed_yaml_and_unknown_key(tiny_dir, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: [method: rtn\n  - oops: {")
    assert_clean_failure(
        run("quantize", "--model", tiny_dir, "--out", tmp_path / "q", "--recipe", bad), "malformed YAML", tmp_path / "q"
    )
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("scheme: {bits: 4}\nstages:\n  - method: rtn\n    tagrets: [Linear]\n")
    assert_clean_failure(
        run("quantize", "--model", tiny_dir, "--out", tmp_path / "q", "--recipe", unknown),
        "unknown key 'tagrets'",
        tmp_path / "q",
    )
    unknown_scheme = tmp_path / "unknown_scheme.yaml"
    unknown_scheme.write_text("scheme: {bits: 4, groupsize: 32}\nstages: [{method: rtn}]\n")
    assert_clean_failure(
        run("quantize", "--model", tiny_dir, "--out", tmp_path / "q", "--recipe", unknown_scheme),
        "unknown key 'groupsize'",
        tmp_path / "q",
    )


def test_too_little_calibration_text(tiny_dir, tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("Only a few words here.\n")
    out = tmp_path / "q"
    r = run(
        "quantize",
        "--model",
        tiny_dir,
        "--out",
        out,
        "--method",
        "w8a8",
        "--act-static",
        "--calib",
        text,
        "--nsamples",
        "4",
        "--seqlen",
        "64",
    )
    assert_clean_failure(r, "tokens", out)


def test_missing_calibration_file(tiny_dir, tmp_path):
    out = tmp_path / "q"
    r = run(
        "quantize",
        "--model",
        tiny_dir,
        "--out",
        out,
        "--method",
        "w8a8",
        "--act-static",
        "--calib",
        tmp_path / "missing.txt",
    )
    assert_clean_failure(r, "text source not found", out)


@pytest.mark.parametrize(("method", "bits", "hint"), [("w4a8-progressive", 8, "w8a8"), ("w8a8", 4, "w4a8")])
def test_a_preset_named_by_its_widths_refuses_other_bits(tiny_dir, tmp_path, method, bits, hint):
    out = tmp_path / "q"
    r = run("quantize", "--model", tiny_dir, "--out", out, "--method", method, "--bits", bits)
    assert_clean_failure(r, f"--bits {bits} does not apply; --method {hint}", out)
    assert not out.with_name(".q.resume").exists()


def test_existing_output_is_refused_and_kept(tiny_dir, tmp_path):
    out = tmp_path / "q"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_clean_failure(run("quantize", "--model", tiny_dir, "--out", out), "already exists")
    assert (out / "keep.txt").read_text() == "mine"


def test_overwrite_replaces_only_checkpoints(tiny_dir, tmp_path, monkeypatch):
    """--overwrite replaces an earlier checkpoint; a folder of other files, a plain file, the working directory
    (or one above it) are refused before any work, and kept."""
    out = tmp_path / "q"
    assert run("quantize", "--model", tiny_dir, "--out", out).exit_code == 0
    r = run("quantize", "--model", tiny_dir, "--out", out, "--overwrite", "--bits", "8")
    assert r.exit_code == 0, r.output
    assert json.loads((out / "config.json").read_text())["quantization_config"]["schemes"].popitem()[1]["bits"] == 8
    assert not list(tmp_path.glob(".q.*"))  # neither the temporary nor the replaced folder is left

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    assert_clean_failure(run("quantize", "--model", tiny_dir, "--out", mine, "--overwrite"), "not a quantkit")
    assert (mine / "notes.txt").read_text() == "keep"
    monkeypatch.chdir(mine)
    assert_clean_failure(run("quantize", "--model", tiny_dir, "--out", ".", "--overwrite"), "working directory")
    assert_clean_failure(run("quantize", "--model", tiny_dir, "--out", tmp_path, "--overwrite"), "working directory")
    assert (mine / "notes.txt").read_text() == "keep"
    plain = tmp_path / "plain"
    plain.write_text("keep")
    assert_clean_failure(run("quantize", "--model", tiny_dir, "--out", plain, "--overwrite"), "is not a folder")
    assert plain.read_text() == "keep"


def test_unwritable_output_fails_before_any_work(tiny_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = run("quantize", "--model", tiny_dir, "--out", blocker / "sub" / "q")
    assert_clean_failure(r, "is not a writable folder")
    assert "quantizing" not in r.output and blocker.read_text() == "x"


def test_checkpoint_gets_the_umask_modes(tiny_dir, tmp_path):
    """The folder and its files get the modes the umask allows, as files written in place would (not the private
    0700 / 0600 of a temporary folder)."""
    import os

    umask = os.umask(0o022)
    try:
        out = tmp_path / "q"
        assert run("quantize", "--model", tiny_dir, "--out", out).exit_code == 0
    finally:
        os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o755
    assert all(f.stat().st_mode & 0o777 == 0o644 for f in out.iterdir())


def test_a_failed_save_leaves_no_folders(tiny_dir, tmp_path, monkeypatch):
    """A write error while saving is one line, and neither the temporary folder nor the parents it created stay."""
    from quantkit.checkpoint import save

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(save, "write_shards", broken)
    out = tmp_path / "new" / "deeper" / "q"
    r = run("quantize", "--model", tiny_dir, "--out", out, "--no-resume-state")  # resume state stays beside --out
    assert r.exit_code == 2 and "Traceback" not in r.output  # the progress bar, then the one-line error
    assert r.stderr.strip().splitlines()[-1].endswith(f"cannot write checkpoint {out}: No space left on device")
    assert not (tmp_path / "new").exists()


def test_the_cli_turns_sigterm_into_system_exit(monkeypatch):
    """main() installs a SIGTERM handler that raises SystemExit, so the save's cleanup (``except BaseException``)
    removes a half-written folder as it does on Ctrl-C."""
    import signal

    from quantkit.cli import main as cli_main

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(cli_main, "cli", lambda **kwargs: None)
    try:
        cli_main.main()
        assert signal.getsignal(signal.SIGTERM) is cli_main._terminate
    finally:
        signal.signal(signal.SIGTERM, before)
    with pytest.raises(SystemExit) as exc:
        cli_main._terminate(signal.SIGTERM, None)
    assert exc.value.code == 128 + signal.SIGTERM


def test_unsupported_architecture(tmp_path):
    model_dir = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=320)).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    r = run("quantize", "--model", model_dir, "--out", tmp_path / "q")
    assert_clean_failure(r, "unsupported model architecture GPT2LMHeadModel; supported: ", tmp_path / "q")
    assert "LlamaForCausalLM" in r.stderr


def test_corrupt_checkpoint(tiny_dir, tmp_path):
    out = tmp_path / "q"
    assert run("quantize", "--model", tiny_dir, "--out", out).exit_code == 0
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert_clean_failure(run("eval", "--model", out, "--windows", "1", "--seqlen", "16"), "cannot load")
    assert_clean_failure(run("inspect", out), "not a readable safetensors file")
    (out / "config.json").write_text("{ not json")
    assert_clean_failure(run("inspect", out), "corrupt")


def test_entry_point_exit_code_and_single_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "quantkit", "quantize", "--out", tmp_path / "q", "--bits", "5"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["quantkit: error: bits must be one of 2, 3, 4, 8, got 5"]


def test_smoothquant_command_and_inspect_show_w8a8(tiny_dir, tmp_path):
    out = tmp_path / "sq"
    r = run(
        "quantize", "--model", tiny_dir, "--out", out, "--method", "smoothquant", "--alpha", "0.6", "--act-static",
        "--nsamples", "4", "--seqlen", "32", "--calib", "brown",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "smoothing: median activation outlier ratio" in r.stdout
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    (name,) = qc["schemes"]
    assert qc["schemes"][name]["act_bits"] == 8 and qc["schemes"][name]["act_dynamic"] is False
    r = run("inspect", out, "--json")
    assert r.exit_code == 0, r.output
    assert {m["scheme"] for m in json.loads(r.stdout)["modules"]} == {name}
    r = run("inspect", out)
    assert r.exit_code == 0 and "w8a8" in r.stdout  # the table (narrow terminal: names may wrap)
    assert "| producer |" in (out / "smoothing.md").read_text()


def test_awq_clip_flags_land_in_the_recipe(tiny_dir, tmp_path):
    out = tmp_path / "a"
    r = run(
        "quantize", "--model", tiny_dir, "--out", out, "--method", "awq", "--group-size", "32", "--asym",
        "--clip-qk", "--clip-separate-ends", "--scale-grouped-values", "--refine-steps", "7", "--nsamples", "4",
        "--seqlen", "32",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    awq = json.loads((out / "config.json").read_text())["quantization_config"]["recipe"]["stages"][0]
    assert awq["method"] == "awq"
    assert awq["params"]["clip_skip"] == [] and awq["params"]["clip_separate_ends"] is True
    assert awq["params"]["scale_grouped_values"] is True and awq["params"]["refine_steps"] == 7
    r = run("quantize", "--model", tiny_dir, "--out", tmp_path / "b", "--method", "awq", "--refine-steps", "-1")
    assert r.exit_code != 0 and "refine_steps must be a non-negative integer" in r.output
    assert not (tmp_path / "b").exists()


def test_gptq_command_with_its_flags(tiny_dir, tmp_path):
    """Each flag lands in the saved recipe; --no-act-order / --no-mse turn the stage's defaults off."""
    out = tmp_path / "g"
    r = run(
        "quantize", "--model", tiny_dir, "--out", out, "--method", "gptq", "--bits", "3", "--group-size", "32",
        "--damp", "0.02", "--block-size", "16", "--no-act-order", "--no-mse", "--static-groups", "--nsamples", "4",
        "--seqlen", "32",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    (stage,) = json.loads((out / "config.json").read_text())["quantization_config"]["recipe"]["stages"]
    assert stage["params"] == {
        "damp": 0.02, "block_size": 16, "act_order": False, "static_groups": True, "true_sequential": True,
        "mse": False,
    }  # fmt: skip


@pytest.mark.parametrize("args", [("--seqlen", "1"), ("--seqlen", "0"), ("--windows", "-1")])
def test_eval_window_arguments_are_checked(tiny_dir, args):
    assert_clean_failure(run("eval", "--model", tiny_dir, *args), args[0])


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("quantize", "--bogus"), "No such option '--bogus'"),
        (("quantiz",), "No such command 'quantiz'"),
        (("quantize", "--bits"), "Option '--bits' requires an argument"),
        (("eval", "--seqlen", "abc"), "'abc' is not a valid integer"),
        (("inspect",), "Missing argument 'FOLDER'"),
    ],
)
def test_usage_errors_are_one_line(args, fragment):
    """Click's own errors (unknown option or command, missing or malformed value) read like every other bad input:
    one line naming the help to read, status 2."""
    r = run(*args)
    assert_clean_failure(r, fragment)
    assert r.stderr.rstrip().endswith("--help')")


def test_help_version_and_bare_command_still_work():
    assert run("--help").exit_code == 0 and "quantize" in run("--help").stdout
    assert run("--version").exit_code == 0
    r = run()
    assert r.exit_code == 2 and "COMMAND [ARGS]" in r.output  # bare quantkit: click's help, as before


def test_damaged_folders_are_one_line_errors(tiny_dir, tmp_path):
    """config.json that is not a JSON object, a folder without weights, a .gguf that is not one, a checkpoint
    missing a tensor (inspect), generate on garbage weights: each a one-line error, never a traceback."""
    import shutil

    listed = tmp_path / "listed"
    shutil.copytree(tiny_dir, listed)
    (listed / "config.json").write_text("[1]")
    for args in (("quantize", "--model", listed, "--out", tmp_path / "q1"), ("eval", "--model", listed),
                 ("inspect", listed)):  # fmt: skip
        assert_clean_failure(run(*args), "is corrupt")

    no_weights = tmp_path / "no_weights"
    shutil.copytree(tiny_dir, no_weights)
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    assert_clean_failure(run("quantize", "--model", no_weights, "--out", tmp_path / "q2"), "cannot load")

    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(tiny_dir, no_tokenizer)
    for f in no_tokenizer.iterdir():
        if "token" in f.name:
            f.unlink()
    assert_clean_failure(run("quantize", "--model", no_tokenizer, "--out", tmp_path / "q4"), "has no tokenizer")

    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file at all")
    assert_clean_failure(run("quantize", "--model", fake, "--out", tmp_path / "q3"), "cannot load")

    ck = tmp_path / "ck"
    assert run("quantize", "--model", tiny_dir, "--out", ck).exit_code == 0
    garbled = tmp_path / "garbled"
    shutil.copytree(ck, garbled)
    (garbled / "config.json").write_text("{ not json")
    assert_clean_failure(run("eval", "--model", garbled, "--windows", "1", "--seqlen", "16"), "is corrupt")
    assert_clean_failure(run("generate", "--model", garbled, "--device", "cpu", "hi"), "is corrupt")

    renamed = tmp_path / "renamed"
    shutil.copytree(ck, renamed)
    config = json.loads((renamed / "config.json").read_text())
    modules = config["quantization_config"]["modules"]
    modules["model.layers.0.mlp.no_such_proj"] = next(iter(modules.values()))
    (renamed / "config.json").write_text(json.dumps(config))
    assert_clean_failure(run("generate", "--model", renamed, "--device", "cpu", "hi"), "is not in the model")

    junk = tmp_path / "junk"
    shutil.copytree(ck, junk)
    (junk / "model.safetensors").write_bytes(b"\x00" * 64)
    assert_clean_failure(run("generate", "--model", junk, "--device", "cpu", "hi"), "cannot load")

    from safetensors.torch import load_file, save_file

    tensors = load_file(ck / "model.safetensors")
    name = next(k for k in tensors if k.endswith(".scales"))
    del tensors[name]
    partial = tmp_path / "partial"
    shutil.copytree(ck, partial)
    save_file(tensors, partial / "model.safetensors", metadata={"format": "pt"})
    assert_clean_failure(run("inspect", partial), f"{name} is missing")


def test_eval_refuses_a_baseline_with_another_vocabulary(tiny_dir, tmp_path):
    from tests.tiny_models import tiny_model, tiny_tokenizer

    other = tmp_path / "other"
    model = tiny_model("llama", 1)
    model.resize_token_embeddings(model.config.vocab_size + 64)
    model.save_pretrained(other)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(other)
    r = run("eval", "--model", tiny_dir, "--baseline", other, "--windows", "1", "--seqlen", "16")
    assert_clean_failure(r, "need the same tokenizer")


def test_checkpoint_tensors_of_the_wrong_kind_are_refused(tiny_dir, tmp_path):
    """An integer tensor stored as float (the loader would cast it and run on wrong codes) and a g_idx naming a
    group the layer does not have: eval and generate refuse both."""
    import shutil

    from safetensors.torch import load_file, save_file

    ck = tmp_path / "ck"
    assert run("quantize", "--model", tiny_dir, "--out", ck).exit_code == 0
    tensors = load_file(ck / "model.safetensors")
    qweight = next(k for k in tensors if k.endswith(".qweight"))
    g_idx = qweight.removesuffix("qweight") + "g_idx"
    for label, change, fragment in [
        ("float", {qweight: tensors[qweight].float()}, "is stored as F32, expected I32"),
        ("groups", {g_idx: tensors[g_idx] + 1000}, "names groups outside"),
        (
            "nan",
            {
                qweight.removesuffix("qweight") + "scales": tensors[qweight.removesuffix("qweight") + "scales"]
                * float("nan")
            },
            "NaN or infinite scales",
        ),
    ]:
        bad = tmp_path / label
        shutil.copytree(ck, bad)
        save_file({**tensors, **change}, bad / "model.safetensors", metadata={"format": "pt"})
        assert_clean_failure(run("eval", "--model", bad, "--windows", "1", "--seqlen", "16"), fragment)
        assert_clean_failure(run("generate", "--model", bad, "--device", "cpu", "hi"), fragment)


def test_eval_seqlen_beyond_the_model_is_refused(tiny_dir, tmp_path):
    assert_clean_failure(run("eval", "--model", tiny_dir, "--seqlen", "100000"), "longer than the model's")
    r = run("quantize", "--model", tiny_dir, "--method", "gptq", "--seqlen", "100000", "--out", tmp_path / "q")
    assert_clean_failure(r, "calibration windows of 100000 tokens are longer than the model's", tmp_path / "q")


def test_recipe_files_that_are_not_what_they_say(tiny_dir, tmp_path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00bad")
    assert_clean_failure(run("quantize", "--model", tiny_dir, "--recipe", binary, "--out", tmp_path / "q"),
                         "not a UTF-8 text file", tmp_path / "q")  # fmt: skip
    twice = tmp_path / "twice.yaml"
    twice.write_text("name: a\nname: b\nscheme: {bits: 4, group_size: 32}\nstages: [{method: rtn}]\n")
    assert_clean_failure(run("quantize", "--model", tiny_dir, "--recipe", twice, "--out", tmp_path / "q"),
                         "line 2, column 1: key 'name' given twice", tmp_path / "q")  # fmt: skip
    no_params = tmp_path / "no_params.yaml"
    no_params.write_text("scheme: {bits: 4, group_size: 32}\nstages: [{method: rtn, params: {damp: 0.1}}]\n")
    assert_clean_failure(run("quantize", "--model", tiny_dir, "--recipe", no_params, "--out", tmp_path / "q"),
                         "unknown key 'damp' in", tmp_path / "q")  # fmt: skip


def test_outputs_never_land_on_or_inside_their_input(tiny_dir, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    assert_clean_failure(run("quantize", "--model", model, "--out", model / "q"), "must lie outside", model / "q")
    ck = tmp_path / "ck"
    assert run("quantize", "--model", model, "--method", "rtn", "--group-size", "32", "--out", ck).exit_code == 0
    before = (ck / "config.json").read_text()
    for out in (ck, ck / "awq"):
        assert_clean_failure(run("export", ck, "--format", "awq", "--out", out, "--overwrite"), "must lie outside")
    assert (ck / "config.json").read_text() == before and not (ck / "awq").exists()


def test_library_messages_of_several_lines_stay_whole_on_one_line(tiny_dir, tmp_path):
    import shutil

    ck = tmp_path / "ck"
    assert run("quantize", "--model", tiny_dir, "--method", "rtn", "--group-size", "32", "--out", ck).exit_code == 0
    (ck / "tokenizer.json").unlink()  # tokenizer_config.json stays: transformers explains over five lines
    result = run("eval", "--model", ck, "--windows", "1", "--seqlen", "16")
    assert_clean_failure(result, "cannot load the tokenizer of")
    assert "from one of: (1) a `tokenizers` library serialization file" in result.stderr
    shutil.rmtree(ck)


def test_unreadable_calibration_file_is_one_line(tiny_dir, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"text": "abc"\n')
    r = run("quantize", "--model", tiny_dir, "--method", "gptq", "--calib", bad, "--out", tmp_path / "q")
    assert_clean_failure(r, "JSON parse error", tmp_path / "q")


def test_eval_chat_template_needs_a_tokenizer_with_one(tiny_dir):
    assert_clean_failure(run("eval", "--model", tiny_dir, "--chat-template", "--windows", "1", "--seqlen", "16"),
                         "needs a tokenizer with a chat template")  # fmt: skip
