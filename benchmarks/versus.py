"""quantkit against another quantization tool: the same model, calibration windows, scheme and evaluation, timed in
one run.

    python benchmarks/versus.py --against llm-compressor --python V/bin/python --method gptq --group-size 64
    python benchmarks/versus.py --against gptqmodel --python G/bin/python --method gptq --group-size 128
    python benchmarks/versus.py --against gptqmodel --python G/bin/python --method awq --asym --group-size 64
    python benchmarks/versus.py --against torchao --python T/bin/python --method rtn --asym --group-size 64
    (likewise --method rtn, --bits 3)

The other tool runs in a virtual environment of its own (its pins on transformers, compressed-tensors or torch are not
quantkit's); it is never a dependency of quantkit:

    python3 -m venv V && V/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1
    python3 -m venv G && BUILD_CUDA_EXT=0 G/bin/pip install torch==2.13.0 gptqmodel==7.3.6 requests
    python3 -m venv T && T/bin/pip install torch==2.13.0 torchao==0.18.0 transformers safetensors

(llm-compressor 0.14, and GPTQModel's AWQ, refuse groups that do not divide a layer's input size, such as 128 on
SmolLM2's 576: use 64 there. GPTQModel 7.4 and later need torch 2.14.)

What happens, each tool in a child process of its own (wall time and peak RSS from ``os.wait4``: loading the
model, quantizing, saving; 2-core CPU, fp32):
1. the calibration windows quantkit would take (``--calib``, ``--nsamples`` x ``--seqlen``, ``--seed``) are written
   to ``WORK/calib.pt``, so both tools see the same tokens;
2. the other tool quantizes at its own defaults, only the scheme set (bits, group, symmetry; ``lm_head`` left float):
   llm-compressor's ``oneshot`` with its GPTQModifier, AWQModifier + QuantizationModifier, or QuantizationModifier
   alone (RTN), saved compressed; GPTQModel's ``quantize`` with GPTQConfig, AWQConfig (GEMM) or RTNConfig, saved in its
   GPTQ / AWQ format; torchao's ``quantize_`` with ``IntxWeightOnlyConfig`` (RTN only: its int4 weight-only path that
   runs on a CPU; ``Int4WeightOnlyConfig`` needs CUDA or the mslk package there; ``--torchao-hqq`` takes its
   HQQ-refined scales), whose weights are dequantized into a float folder (torchao writes no GPTQ / AWQ layout);
3. ``quantkit quantize --method METHOD`` with the same scheme and calibration (its defaults otherwise);
4. the other tool's folder goes through ``quantkit import`` (so quantkit's own modules run it, and the import is
   checked on a real third-party checkpoint; torchao's float folder loads as it is), and both models are evaluated
   by quantkit's protocol against the float model: perplexity, KL divergence and top-1 agreement over
   ``--windows`` windows of ``--eval`` text.

Written to ``WORK`` (``--work``, default ``out/vs-TOOL-METHOD-...``): the folders, the logs, ``result.json``; the
table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

METHODS = ("rtn", "gptq", "awq")
SHORT = {"llm-compressor": "llmc", "gptqmodel": "gptqmodel", "torchao": "torchao"}  # folder names under --work
FLOAT_FOLDER = {"torchao"}  # tools whose folder holds dequantized float weights (no quantkit import)


def run_child(cmd: list[str], log: Path, env: dict | None = None, cwd: Path | None = None) -> dict:
    """Run ``cmd`` with its output in ``log``; its wall seconds and peak RSS (GB); raise if it failed."""
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        tail = log.read_text().strip().splitlines()[-5:]
        raise SystemExit(f"{cmd[0]} {' '.join(cmd[1:4])} ... failed ({code}); log {log}:\n" + "\n".join(tail))
    return {"seconds": round(seconds, 1), "peak_rss_gb": round(usage.ru_maxrss / 2**20, 2)}


def llmc_side(args) -> None:
    """In llm-compressor's environment: quantize ``args.model_dir`` on the windows in ``args.calib_file``."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    windows = torch.load(args.calib_file)
    dataset = Dataset.from_dict({"input_ids": windows.tolist(), "attention_mask": torch.ones_like(windows).tolist()})
    weights = QuantizationArgs(
        num_bits=args.bits, type="int", symmetric=not args.asym, strategy="group", group_size=args.group_size,
        observer=args.llmc_observer,
    )  # fmt: skip
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
    if args.method == "gptq":
        from llmcompressor.modifiers.gptq import GPTQModifier

        recipe = GPTQModifier(config_groups=groups, ignore=["lm_head"])
    elif args.method == "awq":
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from llmcompressor.modifiers.transform.awq import AWQModifier

        if not torch.cuda.is_available():
            # 0.14's AWQ pins its cached inputs for host-to-device copies, which fails without an accelerator;
            # on the CPU nothing is copied, so not pinning changes nothing but lets it run
            from llmcompressor.pipelines.cache import IntermediatesCache

            IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
        # AWQ only rescales; the quantization modifier after it rounds on the scheme AWQ searched for
        recipe = [AWQModifier(), QuantizationModifier(config_groups=groups, ignore=["lm_head"])]
    else:
        from llmcompressor.modifiers.quantization import QuantizationModifier

        recipe = QuantizationModifier(config_groups=groups, ignore=["lm_head"])
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    oneshot(
        model=model,
        dataset=dataset,
        recipe=recipe,
        max_seq_length=windows.shape[1],
        num_calibration_samples=windows.shape[0],
    )
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)


def gptqmodel_side(args) -> None:
    """In GPTQModel's environment: quantize ``args.model_dir`` on the windows in ``args.calib_file``."""
    import types

    # 7.3 imports every model family it knows at start-up, InternVL's among them, which needs torchvision (no build
    # of it for torch 2.13's CPU wheel on PyPI); SmolLM2 is a Llama, so an empty stand-in for that one module will do
    stand_in = types.ModuleType("gptqmodel.models.definitions.internvl_chat")
    stand_in.InternVLChatQModel = type("InternVLChatQModel", (), {})
    sys.modules[stand_in.__name__] = stand_in

    import torch
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.quantization.config import AWQConfig, GPTQConfig, RTNConfig

    windows = torch.load(args.calib_file)
    calibration = [{"input_ids": w.tolist(), "attention_mask": [1] * len(w)} for w in windows]
    config = {"gptq": GPTQConfig, "awq": AWQConfig, "rtn": RTNConfig}[args.method]
    extra = {"mse": args.gptqmodel_mse} if args.gptqmodel_mse else {}
    config = config(bits=args.bits, group_size=args.group_size, sym=not args.asym, **extra)
    model = GPTQModel.load(args.model_dir, config, device="cpu")
    backend = BACKEND.AUTO
    if args.method == "awq" and not torch.cuda.is_available():
        # AWQ's automatic choice is the CUDA GEMM kernel even on a CPU-only machine ("AWQ: CUDA is not available");
        # its torch kernel writes the same GEMM format
        backend = BACKEND.AWQ_TORCH
    model.quantize(None if args.method == "rtn" else calibration, backend=backend)
    model.save(args.out)


def torchao_side(args) -> None:
    """In torchao's environment: round ``args.model_dir``'s decoder linears with ``IntxWeightOnlyConfig`` (per group,
    symmetric or asymmetric, min-max or HQQ scales; no calibration), then save them dequantized as a float folder."""
    import torch
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.quant_primitives import MappingType
    from torchao.quantization.quantize_.workflows import IntxChooseQParamsAlgorithm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    config = IntxWeightOnlyConfig(
        weight_dtype=getattr(torch, f"int{args.bits}"), granularity=PerGroup(args.group_size),
        mapping_type=MappingType.ASYMMETRIC if args.asym else MappingType.SYMMETRIC,
        intx_choose_qparams_algorithm=IntxChooseQParamsAlgorithm.HQQ_SCALE_ONLY if args.torchao_hqq
        else IntxChooseQParamsAlgorithm.AFFINE,
    )  # fmt: skip

    def decoder(module, name: str) -> bool:
        return isinstance(module, torch.nn.Linear) and name.startswith("model.layers.")

    quantize_(model, config, filter_fn=decoder)
    with torch.no_grad():
        for name, module in model.named_modules():
            if decoder(module, name):
                module.weight = torch.nn.Parameter(module.weight.dequantize().float(), requires_grad=False)
    model.save_pretrained(args.out)
    AutoTokenizer.from_pretrained(args.model_dir).save_pretrained(args.out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", choices=sorted(SHORT), default="llm-compressor", help="the other tool")
    ap.add_argument("--python", help="python of the virtual environment holding the other tool")
    ap.add_argument("--method", choices=METHODS, default="gptq")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--asym", action="store_true", help="asymmetric (integer zero points); default symmetric")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calib", default="brown")
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval", default="moby-dick")
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--llmc-observer", help="llm-compressor's weight observer (default: its own, min-max)")
    ap.add_argument("--gptqmodel-mse", type=float, help="GPTQModel's clipped-grid search, the error's exponent "
                    "(GPTQ's reference code uses 2.4; default: off, min-max grids)")  # fmt: skip
    ap.add_argument("--torchao-hqq", action="store_true", help="torchao's HQQ-refined scales (default: min-max); "
                    "its scale-only search gives the same grid with or without --asym")  # fmt: skip
    ap.add_argument("--work", help="output folder (default out/vs-TOOL-METHOD-wBITSgG[-asym][-OBSERVER|-mseX|-hqq])")
    ap.add_argument("--tools", help="which tools quantize (comma-separated; default: the other tool and quantkit); "
                    "a folder an earlier run left in --work stands in for a tool left out")  # fmt: skip
    # the other tool's side (run by the driver in the other environment)
    ap.add_argument("--side", choices=sorted(SHORT), help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--calib-file", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        {"llm-compressor": llmc_side, "gptqmodel": gptqmodel_side, "torchao": torchao_side}[args.side](args)
        return
    args.tools = [t.strip() for t in (args.tools or f"{args.against},quantkit").split(",") if t.strip()]
    if set(args.tools) - {args.against, "quantkit"}:
        ap.error(f"--tools takes {args.against} and quantkit, got {args.tools}")
    if args.llmc_observer and args.against != "llm-compressor":
        ap.error("--llmc-observer is llm-compressor's option")
    if args.gptqmodel_mse and (args.against != "gptqmodel" or args.method != "gptq"):
        ap.error("--gptqmodel-mse is an option of GPTQModel's GPTQ")
    if args.against == "torchao" and args.method != "rtn":
        ap.error("torchao is compared on --method rtn (its stable API has no GPTQ or AWQ)")
    if args.torchao_hqq and args.against != "torchao":
        ap.error("--torchao-hqq is torchao's option")
    if args.against in args.tools and not args.python:
        ap.error(f"--python is required (the python of an environment with {args.against} installed)")
    drive(args)


def drive(args) -> None:
    import torch
    from rich.console import Console
    from rich.table import Table

    import quantkit
    from quantkit.calib.data import calibration_windows, evaluation_windows
    from quantkit.eval import evaluate_windows
    from quantkit.models.loading import resolve_model

    console = Console(soft_wrap=True)
    other, short = args.against, SHORT[args.against]
    tag = f"{args.method}-w{args.bits}g{args.group_size}" + ("-asym" if args.asym else "")
    tag += f"-{args.llmc_observer}" if args.llmc_observer else ""
    tag += f"-mse{args.gptqmodel_mse:g}" if args.gptqmodel_mse else ""
    tag += "-hqq" if args.torchao_hqq else ""
    work = Path(args.work or f"out/vs-{short}-{tag}")
    work.mkdir(parents=True, exist_ok=True)
    folder = resolve_model(args.model)
    other_dir, qk_dir = work / short, work / "quantkit"
    imported = other_dir if other in FLOAT_FOLDER else work / f"{short}-imported"
    result_file = work / "result.json"
    runs = json.loads(result_file.read_text())["runs"] if result_file.is_file() else {}

    float_model, tokenizer, _ = quantkit.load_model(folder)
    windows, fingerprint = calibration_windows(tokenizer, args.calib, args.nsamples, args.seqlen, args.seed)
    console.print(f"calibration: {fingerprint}")
    if other in args.tools:
        torch.save(windows, work / "calib.pt")
        side = [args.python, str(Path(__file__).resolve()), "--side", other, "--method", args.method,
                "--bits", str(args.bits), "--group-size", str(args.group_size), "--model-dir", str(folder),
                "--calib-file", str((work / "calib.pt").resolve()), "--out", str(other_dir.resolve())]  # fmt: skip
        side += ["--asym"] if args.asym else []
        side += ["--llmc-observer", args.llmc_observer] if args.llmc_observer else []
        side += ["--gptqmodel-mse", str(args.gptqmodel_mse)] if args.gptqmodel_mse else []
        side += ["--torchao-hqq"] if args.torchao_hqq else []
        env = {**os.environ, "PYTHONPATH": ""}
        if other == "gptqmodel":
            # 7.3 sizes its CPU pool at half the cores, then asks that pool for two loader threads: on two cores
            # that is a refusal ("requests 2 workers but parent 'cpu' only has 1") unless the pool is set
            env.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, (os.cpu_count() or 1) // 2)))
        console.print(f"{other} {args.method} ... (log {work / (short + '.log')})")
        # run inside WORK: GPTQModel writes a logs/ folder into the directory it starts in
        runs[other] = run_child(side, work / f"{short}.log", env=env, cwd=work)
        console.print(f"  {runs[other]}")
        if other not in FLOAT_FOLDER:
            imp = [sys.executable, "-m", "quantkit", "import", str(other_dir), "--out", str(imported), "--overwrite"]
            run_child(imp, work / "import.log")
    if "quantkit" in args.tools:
        cli = [sys.executable, "-m", "quantkit", "quantize", "--model", str(folder), "--method", args.method,
               "--bits", str(args.bits), "--group-size", str(args.group_size), "--calib", args.calib,
               "--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen), "--seed", str(args.seed),
               "--out", str(qk_dir), "--overwrite", "--asym" if args.asym else "--sym"]  # fmt: skip
        console.print(f"quantkit {args.method} ... (log {work / 'quantkit.log'})")
        runs["quantkit"] = run_child(cli, work / "quantkit.log")
        console.print(f"  {runs['quantkit']}")

    windows, protocol = evaluation_windows(tokenizer, args.eval, 512, args.windows)
    rows = {}
    for name, path in ((other, imported), ("quantkit", qk_dir)):
        if not (path / "config.json").is_file():
            raise SystemExit(f"{path} holds no checkpoint: run with --tools {name} first")
        model = quantkit.load_model(path)[0] if name in FLOAT_FOLDER else quantkit.load_quantized(path)
        res = evaluate_windows(model, windows, baseline=float_model)
        rows[name] = {"perplexity": res.perplexity, "kl": res.kl, "top1": res.top1_agreement}
        float_ppl = res.baseline_perplexity
    title = f"{args.model} {tag}: {args.nsamples} x {args.seqlen} {args.calib} windows, "
    table = Table(title=title + f"{protocol['windows']} x 512 {args.eval} windows, float perplexity {float_ppl:.3f}")
    for col in ("tool", "perplexity", "KL vs float", "top-1", "wall s", "peak RSS GB"):
        table.add_column(col)
    for name, r in rows.items():
        run = runs.get(name, {})
        table.add_row(name, f"{r['perplexity']:.3f}", f"{r['kl']:.4f}", f"{r['top1']:.3f}",
                      str(run.get("seconds", "-")), str(run.get("peak_rss_gb", "-")))  # fmt: skip
    console.print(table)
    result_file.write_text(json.dumps({
        "against": other, "method": args.method, "bits": args.bits, "group_size": args.group_size,
        "asym": args.asym, "llmc_observer": args.llmc_observer, "gptqmodel_mse": args.gptqmodel_mse,
        "torchao_hqq": args.torchao_hqq,
        "calibration": {"source": args.calib, "nsamples": args.nsamples, "seqlen": args.seqlen, "seed": args.seed},
        "evaluation": protocol, "float_perplexity": float_ppl, "runs": runs, "rows": rows,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
