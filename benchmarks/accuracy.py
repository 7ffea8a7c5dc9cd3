"""Accuracy tables on a real model: methods x bits x group sizes, perplexity and KL against float.

    python benchmarks/accuracy.py --methods rtn,gptq --bits 8,4,3 --groups -1,128,64 --out out/accuracy/acc.json
    python benchmarks/accuracy.py --jobs benchmarks/accuracy_jobs.yaml [--only rtn,calibrated] --device cuda

The float model is loaded once; its next-token log-probabilities on the evaluation windows are computed once
and kept in memory (fp16), so each cell costs one quantization and one forward pass over the windows. The
calibration windows are the same for every cell of a calibration draw. Protocol: see quantkit.eval.perplexity.

``--jobs FILE``: the cells come from a YAML list of jobs (see accuracy_jobs.yaml), each with the per-cell options
below (methods, bits, groups, params, label, nsamples, calib_seed, sym, act_static, scheme: more scheme keys, e.g.
{act_bits: 8} to run a weight-only preset with 8-bit activations); the command line gives the
rest. Rows accumulate in ``--out``: a later run replaces the rows of the cells it ran and keeps the others.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import time
from pathlib import Path

import torch
import yaml
from rich.console import Console
from rich.table import Table

import quantkit
from quantkit.calib.data import calibration_windows, evaluation_windows
from quantkit.eval import evaluate_windows, window_log_probs
from quantkit.models.loading import cache_dir, resolve_model
from quantkit.presets import preset_recipe

JOB_KEYS = ("name", "methods", "bits", "groups", "params", "label", "nsamples", "calib_seed", "sym", "act_static",
            "scheme")  # fmt: skip
JOB_REQUIRED = ("name", "methods", "bits", "groups")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default="rtn", help="comma-separated presets (quantkit.presets)")
    ap.add_argument("--bits", default="4")
    ap.add_argument("--groups", default="128")
    ap.add_argument("--sym", action="store_true", help="symmetric (default: asymmetric)")
    ap.add_argument("--params", default="{}", help="JSON of stage parameters applied to every method")
    ap.add_argument(
        "--label",
        default=None,
        help="name for the method column instead of the preset name, to tell runs with different --params apart "
        "(one method only)",
    )
    ap.add_argument(
        "--act-static",
        action="store_true",
        help="W8A8 presets: one calibrated per-tensor activation scale instead of per-token scales",
    )
    ap.add_argument("--jobs", type=Path, help="YAML list of jobs, each a set of cells (replaces the options above)")
    ap.add_argument("--only", help="with --jobs: comma-separated names of the jobs to run (default: all)")
    ap.add_argument("--calib", default="brown")
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--calib-seed", type=int, default=0, help="which random calibration windows (run-to-run spread)")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--eval", nargs="+", default=["moby-dick"], help="evaluation text(s): a row per text")
    ap.add_argument("--eval-seqlen", type=int, default=512)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    ap.add_argument(
        "--device",
        default="cpu",
        help="where layers are quantized and windows evaluated (cpu, cuda); fp32 on either, TF32 off",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=Path("out/accuracy/accuracy.json"),
        help="JSON results; a .md table is written beside it (default: out/accuracy/accuracy.json)",
    )
    args = ap.parse_args(argv)
    if args.only and not args.jobs:
        ap.error("--only selects jobs of a --jobs file")
    jobs = read_jobs(args.jobs, args.only) if args.jobs else [job_from_args(args)]
    for job in jobs:
        if job.get("label") and len(job["methods"]) > 1:
            ap.error(f"job {job['name']}: a label names a single method; run one method per label")
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console()
    device = torch.device(args.device)
    if device.type == "cuda":  # fp32 products as on the CPU: no TF32 rounding
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    float_model, tokenizer, _ = quantkit.load_model(args.model)
    float_model.to(device)
    evals = []  # (text, windows, protocol, baseline log-probs, float result)
    for text in args.eval:
        windows, protocol = evaluation_windows(tokenizer, text, args.eval_seqlen, args.windows)
        t0 = time.perf_counter()
        baseline = cached_baseline(float_model, args.model, windows, protocol)
        float_result = evaluate_windows(float_model, windows, baseline, float_from_baseline=True)
        evals.append((text, windows, protocol, baseline, float_result))
        console.print(
            f"float on {text}: ppl {float_result.perplexity:.3f} on {float_result.tokens} tokens "
            f"({time.perf_counter() - t0:.0f}s)"
        )
    draws: dict[tuple[int, int], tuple] = {}  # (nsamples, seed) -> (windows, fingerprint)
    rows = []
    previous = json.loads(args.out.read_text()) if args.out.exists() else None
    for job in jobs:
        nsamples, seed = job.get("nsamples", args.nsamples), job.get("calib_seed", args.calib_seed)
        params = job.get("params") or {}
        for method in job["methods"]:
            for bits in job["bits"]:
                for group in job["groups"]:
                    scheme = {
                        "bits": bits,
                        "group_size": group,
                        "sym": job.get("sym", args.sym),
                        **job.get("scheme", {}),
                    }
                    if job.get("act_static", args.act_static):
                        scheme["act_dynamic"] = False
                    recipe = preset_recipe(method, scheme, params=params or None)
                    calib = None
                    if recipe.needs_calibration:
                        if (nsamples, seed) not in draws:
                            draws[nsamples, seed] = calibration_windows(
                                tokenizer, args.calib, nsamples, args.seqlen, seed
                            )
                        calib = draws[nsamples, seed][0]
                    model = copy.deepcopy(float_model)
                    t0 = time.perf_counter()
                    quantkit.quantize(model, recipe, calib, device=device)
                    q_seconds = time.perf_counter() - t0
                    for text, windows, _, baseline, float_result in evals:
                        res = evaluate_windows(model, windows, baseline)
                        row = {
                            "method": job.get("label") or method,
                            **scheme,
                            "eval": text,
                            "float_perplexity": float_result.perplexity,
                            "perplexity": res.perplexity,
                            "kl": res.kl,
                            "top1": res.top1_agreement,
                            "quantize_seconds": round(q_seconds, 1),
                            "params": params,
                            "calibration": (
                                f"{args.calib} {nsamples}x{args.seqlen}" + (f" seed {seed}" if seed else "")
                                if recipe.needs_calibration
                                else None
                            ),
                            "device": device.type,
                        }
                        rows.append(row)
                        console.print(row)
                    del model
    report = {
        "model": args.model,
        "baseline_note": "float baseline = the model as loaded (for the built-in SmolLM2: dequantized Q4_1 GGUF "
        "weights, see docs/evaluation.md)",
        "float_perplexity": {text: float_result.perplexity for text, *_, float_result in evals},
        "eval": [protocol for _, _, protocol, *_ in evals],
        "calibration": next(iter(draws.values()))[1] if draws else None,  # rows name their own draw
        "params": json.loads(args.params),
        "rows": rows,
        "torch_threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
    }
    if previous and previous.get("eval") == report["eval"]:  # append to an earlier run of other cells
        keep = [r for r in previous["rows"] if not any(row_key(r) == row_key(n) for n in rows)]
        report["rows"] = keep + rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    table = Table(title=f"{args.model}")
    for col in ("method", "bits", "group", "sym", "eval", "ppl", "Δppl", "KL", "top-1", "quantize s"):
        table.add_column(col)
    for r in report["rows"]:
        table.add_row(
            method_cell(r),
            str(r["bits"]),
            str(r["group_size"]),
            str(r["sym"]),
            r["eval"],
            f"{r['perplexity']:.3f}",
            f"{r['perplexity'] - r['float_perplexity']:+.3f}",
            f"{r['kl']:.4f}",
            f"{r['top1']:.3f}",
            str(r["quantize_seconds"]),
        )
    console.print(table)


def _list(value, cast) -> list:
    """A job's methods / bits / groups: a YAML list, one value, or a comma-separated string."""
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else [value]
    return [cast(v.strip() if isinstance(v, str) else v) for v in items]


def job_from_args(args) -> dict:
    """The one job the command-line options describe."""
    job = {"name": "cli", "methods": _list(args.methods, str), "bits": _list(args.bits, int)}
    job["groups"] = _list(args.groups, int)
    job["params"] = json.loads(args.params)
    if args.label:
        job["label"] = args.label
    return job


def read_jobs(path: Path, only: str | None = None) -> list[dict]:
    """The jobs of a YAML file (``jobs:`` a list of mappings with JOB_KEYS), those named in ``only`` if given; a
    one-line exit naming what is wrong otherwise."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"{path}: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict) or set(data) != {"jobs"} or not isinstance(data["jobs"], list) or not data["jobs"]:
        raise SystemExit(f"{path}: expected one key, 'jobs', holding a list of jobs")
    jobs = []
    for i, raw in enumerate(data["jobs"]):
        where = f"{path}: job {i + 1}"
        if not isinstance(raw, dict):
            raise SystemExit(f"{where}: expected a mapping, got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(JOB_KEYS))
        if unknown:
            raise SystemExit(f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(JOB_KEYS)}")
        missing = [k for k in JOB_REQUIRED if k not in raw]
        if missing:
            raise SystemExit(f"{where}: missing {', '.join(missing)}")
        try:
            job = {**raw, "methods": _list(raw["methods"], str), "bits": _list(raw["bits"], int)}
            job["groups"] = _list(raw["groups"], int)
        except (TypeError, ValueError) as exc:
            raise SystemExit(f"{where} ({raw['name']}): {exc}") from None
        if not isinstance(job.get("params", {}), dict):
            raise SystemExit(f"{where} ({raw['name']}): params must be a mapping of stage parameters")
        if not isinstance(job.get("scheme", {}), dict):
            raise SystemExit(f"{where} ({raw['name']}): scheme must be a mapping of scheme keys")
        jobs.append(job)
    names = [j["name"] for j in jobs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SystemExit(f"{path}: job name {twice[0]!r} given twice")
    if only:
        wanted = [n.strip() for n in only.split(",")]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            raise SystemExit(f"--only: no job {unknown[0]!r} in {path}; jobs: {', '.join(names)}")
        jobs = [j for j in jobs if j["name"] in wanted]
    return jobs


def row_key(row: dict) -> tuple:
    """A later run replaces an earlier row of the same cell: same method, scheme, calibration draw and device."""
    return (
        row["method"],
        row["bits"],
        row["group_size"],
        row["sym"],
        row.get("act_dynamic", True),
        row.get("calibration"),
        row.get("device", "cpu"),
        row.get("eval"),
    )


def method_cell(row: dict) -> str:
    return row["method"] + (" (static act.)" if row.get("act_dynamic") is False else "")


def cached_baseline(model, model_spec: str, windows: torch.Tensor, protocol: dict) -> list[torch.Tensor]:
    """The float model's next-token log-probs (fp16) on the windows, cached on disk and memory-mapped, so that
    concurrent table runs share one copy in the page cache instead of each computing and holding ~2 GB."""
    folder = str(resolve_model(model_spec))
    key = hashlib.sha256(json.dumps([folder, protocol], sort_keys=True).encode()).hexdigest()[:20]
    path = cache_dir() / "baselines" / f"{key}.pt"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        stacked = torch.stack([window_log_probs(model, ids).half().cpu() for ids in windows])  # [n, L-1, V]
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        torch.save(stacked, tmp)
        os.replace(tmp, path)
    return list(torch.load(path, mmap=True))


def markdown(report: dict) -> str:
    floats = ", ".join(f"{text} {ppl:.3f}" for text, ppl in report["float_perplexity"].items())
    texts = "; ".join(f"{e['source']}, {e['windows']} windows x {e['seqlen']} tokens" for e in report["eval"])
    lines = [
        f"# Accuracy on {report['model']} ({report['date']})",
        "",
        f"Float baseline perplexity {floats} ({report['baseline_note']}). Evaluation: {texts}. Calibration: per row.",
        "",
        "| method | bits | group | sym | eval | ppl | Δppl | KL | top-1 | calibration | quantize s | device |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {method_cell(r)} | {r['bits']} | {r['group_size']} | {r['sym']} | {r['eval']} | "
            f"{r['perplexity']:.3f} | {r['perplexity'] - r['float_perplexity']:+.3f} | {r['kl']:.4f} | "
            f"{r['top1']:.3f} | {r.get('calibration') or '-'} | "
            f"{r['quantize_seconds']} | {r.get('device', 'cpu')} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
