"""The comparison against other tools, its plumbing on a tiny model with a stand-in for the other tool's environment
(CI has none): the stand-in writes the folder that tool would (compressed-tensors for llm-compressor, GPTQ for
GPTQModel, through quantkit's own export; a float folder for torchao, a copy), so the driver's calibration hand-off,
child processes, import, evaluation and result file all run; the figures themselves are not tests."""

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_models import tiny_model_dir

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "versus.py"

STAND_IN = """#!/bin/sh
# called as: PYTHON versus.py --side TOOL ... --model-dir D ... --calib-file C --out O
shift
while [ $# -gt 0 ]; do
  case $1 in --model-dir) dir=$2; shift ;; --calib-file) calib=$2; shift ;; --out) out=$2; shift ;; esac
  shift
done
test -s "$calib" || exit 3
{py} -m quantkit quantize --model "$dir" --method rtn --bits 4 --group-size 32 --out "$out.rtn" || exit 4
exec {py} -m quantkit export "$out.rtn" --format {fmt} --out "$out"
"""


@pytest.mark.parametrize("tool, fmt", [("llm-compressor", "compressed-tensors"), ("gptqmodel", "gptq")])
def test_compares_two_folders_end_to_end(tmp_path, tool, fmt):
    model = tiny_model_dir(tmp_path / "tiny")
    stand_in = tmp_path / "other-python"
    stand_in.write_text(STAND_IN.format(py=sys.executable, fmt=fmt))
    stand_in.chmod(stand_in.stat().st_mode | stat.S_IXUSR)
    work = tmp_path / "work"
    flags = f"--method rtn --group-size 32 --model {model} --nsamples 4 --seqlen 32 --windows 2 --work {work}"
    cmd = [sys.executable, str(BENCH), "--against", tool, "--python", str(stand_in), *flags.split()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((work / "result.json").read_text())
    assert result["against"] == tool
    assert set(result["runs"]) == set(result["rows"]) == {tool, "quantkit"}
    assert all(run["seconds"] > 0 and run["peak_rss_gb"] > 0 for run in result["runs"].values())
    # the stand-in made the same RTN model: imported back, it evaluates like quantkit's own
    other, qk = result["rows"][tool], result["rows"]["quantkit"]
    assert abs(other["perplexity"] - qk["perplexity"]) < 1e-3 * qk["perplexity"]
    # a second run re-quantizing one tool keeps the other's folder and timing
    flags += f" --against {tool} --tools quantkit"
    done = subprocess.run([sys.executable, str(BENCH), *flags.split()], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    again = json.loads((work / "result.json").read_text())
    assert again["runs"][tool] == result["runs"][tool]
    assert again["rows"][tool] == result["rows"][tool]


FLOAT_STAND_IN = """#!/bin/sh
# torchao's side writes a float folder: the stand-in copies the float model there
shift
while [ $# -gt 0 ]; do
  case $1 in --model-dir) dir=$2; shift ;; --out) out=$2; shift ;; esac
  shift
done
exec cp -r "$dir" "$out"
"""


def test_a_float_folder_is_evaluated_as_it_is(tmp_path):
    model = tiny_model_dir(tmp_path / "tiny")
    stand_in = tmp_path / "other-python"
    stand_in.write_text(FLOAT_STAND_IN)
    stand_in.chmod(stand_in.stat().st_mode | stat.S_IXUSR)
    work = tmp_path / "work"
    flags = f"--method rtn --group-size 32 --model {model} --nsamples 4 --seqlen 32 --windows 2 --work {work}"
    cmd = [sys.executable, str(BENCH), "--against", "torchao", "--python", str(stand_in), *flags.split()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((work / "result.json").read_text())
    assert set(result["rows"]) == {"torchao", "quantkit"} and result["torchao_hqq"] is False
    assert result["rows"]["torchao"]["kl"] < 1e-6  # the float model itself, read without quantkit import
    assert not (work / "torchao-imported").exists()


def test_a_failing_child_is_one_message(tmp_path):
    model = tiny_model_dir(tmp_path / "tiny")
    flags = f"--method rtn --model {model} --nsamples 2 --seqlen 16 --work {tmp_path / 'w'}"
    cmd = [sys.executable, str(BENCH), "--python", "/bin/false", *flags.split()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1 and "failed (1)" in done.stderr and "Traceback" not in done.stderr


def test_needs_the_other_environment():
    done = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--python is required" in done.stderr
    cmd = [sys.executable, str(BENCH), "--against", "gptqmodel", "--python", "x", "--llmc-observer", "mse"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--llmc-observer is llm-compressor's option" in done.stderr
    cmd = [sys.executable, str(BENCH), "--python", "x", "--gptqmodel-mse", "2.4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--gptqmodel-mse is an option of GPTQModel's GPTQ" in done.stderr
    cmd = [sys.executable, str(BENCH), "--against", "torchao", "--python", "x", "--method", "gptq"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "torchao is compared on --method rtn" in done.stderr
    cmd = [sys.executable, str(BENCH), "--python", "x", "--torchao-hqq"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--torchao-hqq is torchao's option" in done.stderr
