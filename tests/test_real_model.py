"""The real SmolLM2-135M end to end (slow: a few minutes on 2 cores)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import quantkit
from quantkit.calib.data import evaluation_windows
from quantkit.eval import evaluate_windows
from quantkit.presets import preset_recipe

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def smollm2():
    return quantkit.load_model("smollm2-135m")


def test_rtn_8bit_per_channel_within_one_percent(smollm2, tmp_path):
    model, tokenizer, _ = smollm2
    float_model = quantkit.load_model("smollm2-135m")[0]
    quantkit.quantize(model, preset_recipe("rtn", {"bits": 8, "group_size": -1, "sym": True}))
    windows, _ = evaluation_windows(tokenizer, "moby-dick", 512, 6)
    res = evaluate_windows(model, windows, baseline=float_model)
    assert res.perplexity <= 1.01 * res.baseline_perplexity, res
    assert res.top1_agreement > 0.9

    reloaded = AutoModelForCausalLM.from_pretrained(quantkit.save_quantized(model, tmp_path / "w8", tokenizer)).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(windows[:1]).logits, model(windows[:1]).logits, rtol=0, atol=0)


def test_demo_example_runs(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--windows", "2", "--out", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "logits identical to the in-memory model: True" in proc.stdout
    assert "perplexity" in proc.stdout


def test_export_example_runs(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "export_formats.py"), "--out", str(tmp_path / "export")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("True") == 3, proc.stdout
