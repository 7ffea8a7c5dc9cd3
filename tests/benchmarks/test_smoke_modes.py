"""The GPU benchmarks' CPU plumbing modes (``--smoke``, Triton's interpreter): the GPU runs cannot be tested here,
but a script that fails on import or on its own bookkeeping would otherwise only be found on a CUDA host."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import triton

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


# Triton 3.6's interpreter converts one-element arrays to Python scalars, which NumPy 2.5 refuses ("only
# 0-dimensional arrays can be converted to Python scalars"): a CUDA host may have both, CI's newer Triton has not.
OLD_INTERPRETER = _version(triton.__version__) < (3, 7) and _version(numpy.__version__) >= (2, 5)


interpreted = pytest.mark.skipif(OLD_INTERPRETER, reason="Triton < 3.7's interpreter fails under NumPy >= 2.5")


def smoke(script: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, str(BENCHMARKS / script), *args, "--out", str(out)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    return run


@pytest.mark.parametrize(
    "script,written",
    [
        pytest.param("bench_w8a8.py", "w8a8_results.json", marks=interpreted),
        pytest.param("bench_w4a8.py", "w4a8_results.json", marks=interpreted),
        pytest.param("bench_quantizer.py", "quantizer.json", marks=interpreted),
        pytest.param("bench_gemv.py", "gemv.json", marks=interpreted),
        pytest.param("bench_attention.py", "bench_attention_smoke.json", marks=interpreted),
        pytest.param("bench_moe.py", "moe.json", marks=interpreted),
    ],
)
def test_smoke_mode_runs_and_writes_its_results(script, written, tmp_path):
    run = smoke(script, tmp_path, "--smoke")
    assert "WRONG" not in run.stdout
    assert (tmp_path / written).is_file() and (tmp_path / written.replace(".json", ".md")).is_file()


@interpreted
def test_w4a16_smoke_and_its_summary_print_the_same_table(tmp_path):
    """``--summary`` re-prints a table from the JSON the benchmark wrote, as the run itself printed it."""
    run = smoke("bench_w4a16.py", tmp_path, "--smoke")
    assert "CORRECTNESS FAILURE" not in run.stdout
    table = run.stdout[run.stdout.index("\nspeedup over cuBLAS fp16") :]
    again = subprocess.run([sys.executable, str(BENCHMARKS / "bench_w4a16.py"), "--summary",
                            str(tmp_path / "w4a16_smoke.json")], capture_output=True, text=True)  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout == table
    assert "geomean g128" in table and "checks within 2x cuBLAS error" in table


def test_serve_smoke_agrees_with_hf(tmp_path):
    smoke("bench_serve.py", tmp_path, "--smoke")
    agree = json.loads((tmp_path / "bench_serve_smoke.json").read_text())["results"]["agreement_bf16"]
    # on the CPU in fp32 the runtime's greedy tokens are HF's, also teacher forced
    assert agree["positionwise"] == 1.0 and agree["teacher_forced"] == 1.0 and agree["gap_max"] == 0.0
    assert agree["fp32_ours"]["teacher_forced"] == agree["fp32_hf"]["teacher_forced"] == 1.0  # fp32 is the model
    assert "tokens" not in agree


def test_serve_moe_smoke_agrees_with_hf_and_counts_active_parameters(tmp_path):
    """``--model tiny-qwen3-moe``: bf16 (fp32 on the CPU) and W4A16 random weights, HF's model of the engine's own
    tensors agrees token for token, and the roofline reads k of the E experts per layer."""
    from quantkit.runtime.bench import DUMMY_MODELS

    run = smoke("bench_serve.py", tmp_path, "--smoke", "--model", "tiny-qwen3-moe")
    assert "FAILED" not in run.stdout
    data = json.loads((tmp_path / "bench_serve_smoke_tiny-qwen3-moe.json").read_text())
    assert data["meta"]["moe"] and not data["errors"]
    agree = data["results"]["agreement_bf16"]
    assert agree["positionwise"] == 1.0 and agree["teacher_forced"] == 1.0
    c = DUMMY_MODELS["tiny-qwen3-moe"]
    h, hd, kv = c["hidden_size"], c["head_dim"], c["num_key_value_heads"]
    attention = 2 * h * c["num_attention_heads"] * hd + 2 * h * kv * hd
    experts = c["num_experts_per_tok"] * 3 * h * c["moe_intermediate_size"]  # the active ones only
    per_layer = attention + c["num_experts"] * h + experts  # router included
    params = c["num_hidden_layers"] * per_layer + c["vocab_size"] * h  # lm_head; the embedding is a gather
    assert data["results"]["bf16"]["batch1"]["weight_bytes"] == 4 * params  # fp32
    assert data["results"]["w4a16"]["batch1"]["weight_bytes"] < 4 * params
    assert "throughput_hf_subset" in data["results"]["bf16"]
    refused = subprocess.run([sys.executable, str(BENCHMARKS / "bench_serve.py"), "--smoke", "--model",
                              "tiny-qwen3-moe", "--variants", "w8a8"], capture_output=True, text=True)  # fmt: skip
    assert refused.returncode == 2 and "choose from bf16,w4a16" in refused.stderr


@pytest.mark.parametrize(
    "item",
    [
        "eagle",
        "eagle:abc",
        "eagle:all:0",
        "eagle:all:3:slef",
        "medusa:1:2:self:x",
        "eagle:1:2:self:0",
        "eagle:1:2:self:3:4",
    ],
)
def test_spec_refuses_a_malformed_train_item_before_loading_anything(item, tmp_path):
    cmd = [sys.executable, str(BENCHMARKS / "bench_spec.py"), "--train", "eagle:all:2:self", "--train", item,
           "--model", str(tmp_path / "absent"), "--out", str(tmp_path)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert (
        run.returncode == 2
        and "expected METHOD:TOKENS|all[:EPOCHS[:text|self[:UNROLL]]]" in run.stderr.splitlines()[-1]
    )


def test_spec_mtp_smoke_times_every_step_and_projects_from_them(tmp_path):
    """``bench_spec.py --mtp --smoke``: the GPU mode's code on a tiny DeepSeek-V3 in fp32 on the CPU; every batch
    and k has a decode, a draft chain (k tokens drafted per sequence, else the run fails) and a verify time, and
    the projected speed-up is E(a, k) * t_decode / (t_chain + t_verify) of those times."""
    from quantkit.runtime.speculative.decoder import expected_tokens

    run = smoke("bench_spec.py", tmp_path, "--mtp", "--smoke")
    data = json.loads((tmp_path / "mtp.json").read_text())["mtp"]
    assert [(r["batch"], r["k"]) for r in data["rows"]] == [(b, k) for b in (1, 8) for k in (1, 2, 3)]
    assert [r["k"] for r in data["acceptance"]] == [1, 2, 3] and data["dtype"] == "float32"
    for r in data["rows"]:
        chain, verify, decode = (
            data["costs_s"][f"{s} b{r['batch']}"] for s in (f"draft k{r['k']}", f"verify k{r['k']}", "decode")
        )
        assert min(chain, verify, decode) > 0 and r["draft_token_over_decode"] == chain / r["k"] / decode
        assert r["projected_speedup_a0.85"] == expected_tokens(0.85, r["k"]) * decode / (chain + verify)
    assert "projection" in run.stdout and "MEANINGLESS" in (tmp_path / "mtp.md").read_text()
    refused = subprocess.run([sys.executable, str(BENCHMARKS / "bench_spec.py"), "--smoke", "--out", str(tmp_path)],
                             capture_output=True, text=True)  # fmt: skip
    assert refused.returncode == 2 and "--smoke runs --mtp and --head-costs only" in refused.stderr


@pytest.mark.parametrize("ms", ["0", "1,-2", "x"])
def test_moe_refuses_bad_token_counts_in_one_line(ms, tmp_path):
    """``bench_moe.py --ms 0`` ran an empty layer into a traceback; every bad --ms is argparse's one-line exit 2."""
    run = subprocess.run([sys.executable, str(BENCHMARKS / "bench_moe.py"), "--ms", ms, "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 2 and "--ms takes comma-separated token counts from 1" in run.stderr.splitlines()[-1]


def test_spec_head_costs_smoke_times_chains_and_trees_and_projects_from_them(tmp_path):
    """``bench_spec.py --head-costs --smoke``: the GPU mode's code on a tiny Llama in fp32 on the CPU, for a bf16 and
    a W4A16 target; each has decode, chain, tree and verify times, and the projection is tau * t_decode / (t_draft
    + t_verify) of those times at the tau of the acceptance JSON given."""
    rows = [dict(proposer="eagle-x", prompts="narrative", temperature=0, k=4, tree=None, tau=2.0),
            dict(proposer="eagle-x", prompts="narrative", temperature=0, k=4, tree=8, tau=2.5),
            dict(proposer="medusa-x", prompts="chat", temperature=0, k=4, tree=None, tau=1.5),
            dict(proposer="eagle-x", prompts="chat", temperature=0.7, k=4, tree=None, tau=9.0),
            dict(proposer="eagle-x-v256", prompts="narrative", temperature=0, k=4, tree=None, tau=1.8,
                 draft_vocab_size=256),
            dict(proposer="eagle-x-v256", prompts="narrative", temperature=0, k=4, tree=8, tau=2.2,
                 draft_vocab_size=256),
            dict(proposer="eagle-r", prompts="narrative", temperature=0, k=4, tree=None, tau=1,
                 heads_rounded_to="w4a16-g128"),
            dict(proposer="eagle-x-v9k", prompts="narrative", temperature=0, k=4, tree=None, tau=1.7,
                 draft_vocab_size=9000)]  # fmt: skip
    (tmp_path / "a.json").write_text(json.dumps({"acceptance": rows}))
    run = smoke("bench_spec.py", tmp_path, "--head-costs", "--smoke", "--trees", "8", "--tree-k", "3", "--draft-vocab",
                "256", "--acceptance", str(tmp_path / "a.json"))  # fmt: skip
    assert "NOT PROJECTED eagle-x-v9k (bf16): --head-costs did not time a draft vocabulary of 9000" in run.stdout
    data = json.loads((tmp_path / "head_costs.json").read_text())
    costs = data["head_costs_s"]
    assert set(costs) == {"bf16", "w4a16"}
    for c in costs.values():
        assert c["eagle tree 8 tokens"] == c["medusa tree 8 tokens"] == 8
        assert all(c[key] > 0 for key in ("decode", "eagle chain", "verify chain", "medusa chain", "eagle tree 8",
                                          "verify eagle tree 8", "medusa tree 8", "verify medusa tree 8",
                                          "eagle-v256 chain", "eagle-v256 tree 8"))  # fmt: skip
        assert c["eagle-v256 tree 8 tokens"] == 8
    projection = data["head_projection"]
    # five greedy rows x two targets; the sampled row, the rounded heads (float heads' cost) and a draft vocabulary
    # --head-costs did not time are not projected
    assert len(projection) == 10
    for r in projection:
        c = costs[r["target"]]
        method = r["proposer"].split("-")[0]
        label = method + ("-v256" if r["proposer"].endswith("-v256") else "")
        draft, verify = (c[f"{label} chain"], c["verify chain"]) if r["tree"] is None else (
            c[f"{label} tree 8"], c[f"verify {method} tree 8"])  # fmt: skip
        assert abs(r["projected_speedup"] - r["tau"] * c["decode"] / (draft + verify)) < 1e-9
        assert abs(r["projected_over_bf16"] - r["tau"] * costs["bf16"]["decode"] / (draft + verify)) < 1e-9


def test_spec_rounded_heads_sit_on_the_scheme_grid_and_keep_the_rest(tmp_path, monkeypatch):
    """``bench_spec.py --head-schemes``: every weight matrix of the copy is its RTN rounding to the scheme (at most
    2^bits values per row and group), vectors are kept bit for bit, the config names the scheme; a bad scheme, or
    heads that are not heads, is argparse's one-line exit 2."""
    import importlib

    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    from quantkit.algorithms.rtn import rtn
    from quantkit.runtime.speculative.config import weight_scheme
    from quantkit.runtime.speculative.heads import WEIGHTS_FILE, base_fingerprint, make_heads, read_meta, save_heads

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec_costs = importlib.import_module("spec_costs")
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    heads = make_heads("eagle", config, 1)
    base = base_fingerprint(config, torch.randn(64, 64))
    save_heads(tmp_path / "h", heads, {"method": "eagle", "num_heads": 1, "base": base})
    out = spec_costs.rounded_heads(tmp_path / "h", "w4a16-g32", tmp_path / "r")
    before, after = load_file(str(tmp_path / "h" / WEIGHTS_FILE)), load_file(str(out / WEIGHTS_FILE))
    assert before.keys() == after.keys() and read_meta(out)["weights_rounded_to"] == "w4a16-g32"
    for key, w in before.items():
        if w.dim() == 1:
            assert torch.equal(after[key], w)
            continue
        assert torch.equal(after[key], rtn(w, weight_scheme("w4a16-g32")).dequantize(w.dtype))
        groups = after[key].reshape(w.shape[0], -1, 32)
        assert max(len(g.unique()) for row in groups for g in row) <= 16 and not torch.equal(after[key], w)
    for args, message in [
        (["--head-schemes", "int3"], "--head-schemes: draft scheme must look like"),
        (["--head-schemes", "w8a16-pc", "--eagle-heads", str(tmp_path)], "is not a draft heads"),
    ]:
        refused = subprocess.run([sys.executable, str(BENCHMARKS / "bench_spec.py"), *args, "--out", str(tmp_path)],
                                 capture_output=True, text=True)  # fmt: skip
        assert refused.returncode == 2 and message in refused.stderr.splitlines()[-1]
