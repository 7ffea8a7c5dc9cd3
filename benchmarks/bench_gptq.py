"""GPTQ speed and memory: a Llama-3-8B-shaped model with random weights on CUDA, or SmolLM2-135M on CPU.

    python benchmarks/bench_gptq.py                    # Llama-3-8B shapes, 32 layers, 128 x 2048 random tokens, CUDA
    python benchmarks/bench_gptq.py --layers 2         # smoke run: the first 2 decoder layers only
    python benchmarks/bench_gptq.py --cpu-smollm2      # the real SmolLM2-135M on CPU, 128 x 512 Brown windows
    python benchmarks/bench_gptq.py --layers 8 --resume-state /tmp/state   # with the resume state (--resume's)
    python benchmarks/bench_gptq.py --nproc 1,2,4      # 1, 2 and 4 GPUs in turn (quantize --nproc), speedups vs 1

GPU mode: the bf16 model is built on the meta device and materialised on the CPU (random normal weights drawn on the
GPU in bf16 and copied over, one tensor at a time: ~16 GB of host writes and no fp32 copy); the calibration ids are
uniform random. ``quantkit.quantize`` then moves one decoder layer at a time to the GPU, exactly as for a real model,
so the timing includes layer transfers, Hessian accumulation (fp32), the true-sequential forwards and GPTQ itself.
Random weights and tokens leave the arithmetic unchanged: GPTQ's cost depends on shapes, not values.

Printed and written (``--out``, default out/gptq: ``bench_gptq.json`` and ``bench_gptq.md``): wall time of the build and
of the quantization, time per layer, the GPTQ share (sum of the per-linear ``seconds`` of the report), and the peak GPU
memory (``torch.cuda.max_memory_allocated``). Needs only torch and transformers (no datasets / gguf in GPU mode).

``--nproc 1,2,4``: the same run with calibration shared by 1, 2 and 4 processes (one GPU each; CPU processes with
``--cpu-smollm2``), one after the other; every process builds the model with the same seed, and rank 0 times the
quantization. Written: each count's figures, its speedup against the first count and the peak GPU memory of every
rank.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from common import LLAMA3_8B, add_out_argument, out_folder, random_llama


def gptq_recipe(args):
    from quantkit.recipe import Recipe

    return Recipe.from_dict(
        {
            "name": "bench-gptq",
            "scheme": {"bits": args.bits, "group_size": args.group_size, "sym": not args.asym},
            "calibration": {"nsamples": args.nsamples, "seqlen": args.seqlen, "batch_size": args.batch_size},
            "stages": [
                {
                    "method": "gptq",
                    "params": {
                        "act_order": args.act_order,
                        "mse": args.mse,
                        "block_size": args.block_size,
                        "static_groups": args.static_groups,
                    },
                }
            ],
        },
        "bench recipe",
    )


def run(model, calib, args, device) -> dict:
    import quantkit

    per_layer: list[float] = []
    last = [time.perf_counter()]

    def progress(done, total, desc):
        now = time.perf_counter()
        per_layer.append(now - last[0])
        last[0] = now
        print(f"  [{done}/{total}] {desc}", flush=True)

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    if torch.distributed.is_initialized():  # --nproc: every rank has built its model before the clock starts
        torch.distributed.barrier()
    t0, cpu0 = time.perf_counter(), time.process_time()
    result = quantkit.quantize(
        model, gptq_recipe(args), calib, device=device, progress=progress, state_dir=args.resume_state
    )
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    gptq_seconds = sum(r.get("seconds", 0.0) for r in result.layers.values())
    retries = sum(r.get("retries", 0) for r in result.layers.values())
    return {
        "quantize_seconds": round(wall, 2),
        "quantize_cpu_seconds": round(cpu, 2),  # all threads; on a shared CPU, 1 thread: the uncontended time
        "gptq_seconds": round(gptq_seconds, 2),
        # progress is reported on rank 0 only (--nproc): the other ranks have no per-layer times
        "seconds_per_layer_median": round(statistics.median(per_layer), 3) if per_layer else None,
        "seconds_per_layer_max": round(max(per_layer), 3) if per_layer else None,
        "layers": len(per_layer),
        "linears": len(result.layers),
        "cholesky_retries": retries,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
        **(resume_figures(result.state) if result.state is not None else {}),
    }


def resume_figures(state) -> dict:
    """What the resume state cost: its size per layer, and the run's time inside save (copies off the GPU, and
    waits for the background writer when the disk is slower than a layer)."""
    state.clear()
    return {
        "resume_state_bytes_per_layer": state.bytes_written // max(state.saves, 1),
        "resume_state_seconds": round(state.seconds, 2),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smollm2", action="store_true", help="time SmolLM2-135M (real weights, Brown text) on CPU")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers to build (GPU mode; default 32)")
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=None, help="default 2048 (GPU mode) or 512 (--cpu-smollm2)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--asym", action="store_true", help="asymmetric grid (default symmetric)")
    ap.add_argument(
        "--act-order", action=argparse.BooleanOptionalAction, default=True, help="default: on (as the stage)"
    )
    ap.add_argument("--mse", action=argparse.BooleanOptionalAction, default=True, help="clipped grids (default: on)")
    ap.add_argument(
        "--static-groups",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="groups in natural order (quantize's default); off: act-order groups, as the table of record",
    )
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument(
        "--resume-state", default=None, help="write the resume state here after every layer (deleted after)"
    )
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave the default)")
    add_out_argument(ap, "gptq")
    ap.add_argument(
        "--nproc", default=None, help="processes sharing the calibration, e.g. 1,2,4: each count timed in turn"
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.nproc is None:
        info = measure(args, None)
    else:
        counts = [int(n) for n in args.nproc.split(",")]
        args.nproc = None  # each rank measures one run
        info = scaling(args, counts)
    report(info, args)


def measure(args: argparse.Namespace, device: torch.device | None) -> dict:
    """Build the model and time its quantization on ``device`` (None: the CPU for --cpu-smollm2, else CUDA)."""
    seed = 0
    info: dict = {
        "torch": torch.__version__,
        "host": platform.node(),
        "cpu_threads": torch.get_num_threads(),
        "scheme": {"bits": args.bits, "group_size": args.group_size, "sym": not args.asym},
        "act_order": args.act_order,
        "mse": args.mse,
        "block_size": args.block_size,
    }
    t0 = time.perf_counter()
    if args.cpu_smollm2:
        import quantkit
        from quantkit.calib.data import calibration_windows

        args.seqlen = args.seqlen or 512
        device = device or torch.device("cpu")
        model, tokenizer, _ = quantkit.load_model("smollm2-135m")
        calib, fingerprint = calibration_windows(tokenizer, "brown", args.nsamples, args.seqlen)
        info.update(mode="smollm2-135m-cpu", calibration=fingerprint)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("GPU mode needs CUDA; use --cpu-smollm2 for the CPU benchmark")
        args.seqlen = args.seqlen or 2048
        device = device or torch.device("cuda")
        layers = args.layers or LLAMA3_8B["num_hidden_layers"]
        model = random_llama({**LLAMA3_8B, "num_hidden_layers": layers}, device, seed)
        calib = torch.randint(0, LLAMA3_8B["vocab_size"], (args.nsamples, args.seqlen), generator=torch.Generator())
        info.update(mode="llama3-8b-shapes-random-cuda", gpu=torch.cuda.get_device_name(), decoder_layers=layers)
        info["calibration"] = {"source": "random ids", "nsamples": args.nsamples, "seqlen": args.seqlen}
    info["build_seconds"] = round(time.perf_counter() - t0, 2)
    print(
        f"built {info['mode']} in {info['build_seconds']} s; quantizing ({info['calibration']['nsamples']} x "
        f"{args.seqlen} tokens, w{args.bits} g{args.group_size})",
        flush=True,
    )
    info.update(run(model, calib, args, device))
    return info


def one_rank(args: argparse.Namespace, result: str) -> None:
    """A rank of an ``--nproc`` count (started by quantkit.distributed.launch): rank 0 writes the figures to
    ``result``, with the peak GPU memory of every rank."""
    from quantkit import distributed

    device = distributed.init_from_env("cpu" if args.cpu_smollm2 else "cuda")
    info = measure(args, torch.device(device))
    peaks: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(peaks, info["peak_gpu_bytes"])
    if distributed.is_main():
        Path(result).write_text(json.dumps({**info, "nproc": len(peaks), "peak_gpu_bytes_per_rank": peaks}))


def scaling(args: argparse.Namespace, counts: list[int]) -> dict:
    """The run with each process count in turn; the first count is the baseline of the speedups."""
    import tempfile

    from quantkit.distributed import launch

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            print(f"--- {n} process(es)", flush=True)
            result = Path(tmp) / f"{n}.json"
            launch(n, one_rank, {"args": args, "result": str(result)}, threads=args.threads or None)
            runs.append(json.loads(result.read_text()))
    for r in runs:
        r["speedup"] = round(runs[0]["quantize_seconds"] / r["quantize_seconds"], 2)
        print(f"nproc {r['nproc']}: quantize {r['quantize_seconds']} s, speedup {r['speedup']}x against nproc "
              f"{counts[0]}, peak GPU bytes per rank {r['peak_gpu_bytes_per_rank']}")  # fmt: skip
    return {**runs[0], "scaling": [{k: r[k] for k in SCALING_KEYS} for r in runs]}


SCALING_KEYS = ("nproc", "quantize_seconds", "speedup", "seconds_per_layer_median", "peak_gpu_bytes_per_rank")


def report(info: dict, args: argparse.Namespace) -> None:
    peak = info["peak_gpu_bytes"]
    print(
        f"quantize: {info['quantize_seconds']} s wall, {info['quantize_cpu_seconds']} s CPU "
        f"({info['gptq_seconds']} s wall inside GPTQ), "
        f"{info['seconds_per_layer_median']} s/layer median"
        + (f", peak GPU memory {peak / 2**30:.2f} GiB" if peak is not None else "")
    )
    if args.resume_state:
        print(f"resume state: {info['resume_state_bytes_per_layer'] / 2**30:.2f} GiB a layer, "
              f"{info['resume_state_seconds']} s of the run inside save")  # fmt: skip
    out = out_folder(args.out)
    (out / "bench_gptq.json").write_text(json.dumps(info, indent=1) + "\n")
    (out / "bench_gptq.md").write_text(markdown(info))
    print(f"wrote {out / 'bench_gptq.json'} and .md")


def markdown(info: dict) -> str:
    peak = info["peak_gpu_bytes"]
    rows = [
        ("mode", info["mode"]),
        ("device", info.get("gpu", f"CPU, {info['cpu_threads']} threads")),
        ("calibration", f"{info['calibration']['nsamples']} x {info['calibration']['seqlen']} tokens"),
        ("scheme", f"w{info['scheme']['bits']} g{info['scheme']['group_size']} sym={info['scheme']['sym']}"),
        ("act_order / mse", f"{info['act_order']} / {info.get('mse', False)}"),
        ("layers / linears", f"{info['layers']} / {info['linears']}"),
        ("build (s)", str(info["build_seconds"])),
        ("quantize wall (s)", str(info["quantize_seconds"])),
        ("quantize CPU time, all threads (s)", str(info["quantize_cpu_seconds"])),
        ("inside GPTQ (s)", str(info["gptq_seconds"])),
        ("per layer median / max (s)", f"{info['seconds_per_layer_median']} / {info['seconds_per_layer_max']}"),
        ("peak GPU memory", "n/a" if peak is None else f"{peak / 2**30:.2f} GiB"),
        ("torch", info["torch"]),
    ]
    text = "# GPTQ benchmark\n\n| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)
    if "scaling" in info:  # --nproc: one row per process count
        text += "\n| processes | quantize (s) | speedup | per layer median (s) | peak GPU memory per rank (GiB) |\n"
        text += "|---|---|---|---|---|\n"
        for r in info["scaling"]:
            peaks = ", ".join("n/a" if p is None else f"{p / 2**30:.2f}" for p in r["peak_gpu_bytes_per_rank"])
            text += (f"| {r['nproc']} | {r['quantize_seconds']} | {r['speedup']}x | {r['seconds_per_layer_median']} "
                     f"| {peaks} |\n")  # fmt: skip
    return text


if __name__ == "__main__":
    main()
