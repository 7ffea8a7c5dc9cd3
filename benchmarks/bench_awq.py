"""AWQ search speed and memory on a Llama-3-8B-shaped model with random bf16 weights on CUDA.

    python benchmarks/bench_awq.py                 # 8 decoder layers, 128 x 512 random-id calibration, w4 g128 asym
    python benchmarks/bench_awq.py --layers 32     # the whole 8B stack (about 4 s per layer expected on an H200)
    python benchmarks/bench_awq.py --smoke         # CPU plumbing check: tiny shapes, numbers meaningless
    python benchmarks/bench_awq.py --cpu-smollm2 --threads 1   # the real SmolLM2-135M (fp32) on CPU, Brown windows
    python benchmarks/bench_awq.py --cpu-smollm2 --layers 1 --search-samples 0 --search-tokens 8192   # old defaults

The model is built on the meta device and materialised on the CPU in bf16 (``common.random_llama``: weights ~ N(0, 0.02)
drawn on the GPU, one tensor at a time; norms 1), as a real checkpoint would sit in host memory. ``quantkit.quantize``
with a recipe holding only the awq stage then moves one decoder layer at a time to the GPU: the timing covers the layer
transfers, the captures, the scale search of every smoothing group (block re-runs with fake-quantized weights) and the
clip search. Random weights and ids leave the cost unchanged: it depends on shapes, not values.

Printed and written (``--out``, default out/awq: ``bench_awq.json``): wall time, time per layer (median, max) and the
extrapolation to 32 layers, and the peak GPU memory (``torch.cuda.max_memory_allocated``). Needs only torch and
transformers: no ``datasets``, no ``gguf``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from common import LLAMA3_8B, add_out_argument, out_folder, random_llama

SMOKE = dict(LLAMA3_8B, hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)
SMOKE["vocab_size"] = 512


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--layers", type=int, default=None, help="decoder layers (the 8B model has 32; default 8, SmolLM2: all 30)"
    )
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--sym", action="store_true", help="symmetric grid (default asymmetric, as AWQ checkpoints)")
    ap.add_argument("--grid", type=int, default=20)
    ap.add_argument("--no-clip", dest="clip", action="store_false")
    ap.add_argument("--search-samples", type=int, default=16, help="windows the scale objective runs on (0: all)")
    ap.add_argument("--search-tokens", type=int, default=4096, help="tokens a token-wise block is judged on")
    ap.add_argument(
        "--refine-steps",
        type=int,
        default=None,
        help="scale refinement steps (default: the stage's 50; with --then-gptq 0, as the awq+gptq preset)",
    )
    ap.add_argument(
        "--then-gptq",
        action="store_true",
        help="time the awq+gptq composition: AWQ (no clip) with its scales re-judged under GPTQ, then GPTQ",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script, not speed")
    ap.add_argument("--cpu-smollm2", action="store_true", help="time SmolLM2-135M (real weights, Brown text) on CPU")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave the default)")
    add_out_argument(ap, "awq")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.refine_steps is None and args.then_gptq:
        args.refine_steps = 0  # the awq+gptq preset: scales from the grid, re-judged under GPTQ

    import transformers

    import quantkit
    from quantkit.recipe import Recipe

    if args.smoke:
        device, shapes = torch.device("cpu"), SMOKE
        args.nsamples, args.seqlen = min(args.nsamples, 8), min(args.seqlen, 64)
    elif args.cpu_smollm2:
        device, shapes = torch.device("cpu"), None
    elif torch.cuda.is_available():
        device, shapes = torch.device("cuda"), LLAMA3_8B
    else:
        raise SystemExit("needs a CUDA device (or --smoke for a CPU plumbing check)")
    scheme = {"bits": args.bits, "group_size": args.group_size, "sym": args.sym}
    recipe = Recipe.from_dict(
        {
            "name": "bench-awq",
            "scheme": scheme,
            "calibration": {"nsamples": args.nsamples, "seqlen": args.seqlen, "batch_size": args.batch_size},
            "stages": [
                {
                    "method": "awq",
                    "params": {
                        "grid": args.grid,
                        "clip": args.clip and not args.then_gptq,
                        "search_samples": args.search_samples or None,
                        "search_tokens": args.search_tokens,
                        "quantizer": "gptq" if args.then_gptq else "rtn",
                        **({} if args.refine_steps is None else {"refine_steps": args.refine_steps}),
                    },
                },
                *([{"method": "gptq"}] if args.then_gptq else []),
            ],
        },
        "bench recipe",
    )
    t0 = time.perf_counter()
    if args.cpu_smollm2:
        from quantkit.calib.data import calibration_windows

        model, tokenizer, _ = quantkit.load_model("smollm2-135m")
        n = model.config.num_hidden_layers
        if args.layers is not None and not 1 <= args.layers <= n:
            raise SystemExit(f"--layers must be 1 to {n} for SmolLM2-135M")
        args.layers = args.layers or n
        model.model.layers = model.model.layers[: args.layers]  # the first layers alone: a per-layer timing
        model.config.num_hidden_layers = args.layers
        calib, calibration = calibration_windows(tokenizer, "brown", args.nsamples, args.seqlen)
    else:
        args.layers = args.layers or 8
        model = random_llama({**shapes, "num_hidden_layers": args.layers}, device)
        calib = torch.randint(0, shapes["vocab_size"], (args.nsamples, args.seqlen), generator=torch.Generator())
        calibration = {"source": "random ids", "nsamples": args.nsamples, "seqlen": args.seqlen}
    build_seconds = time.perf_counter() - t0
    print(f"built {args.layers} layers in {build_seconds:.1f} s; AWQ search on {args.nsamples} x {args.seqlen} tokens")

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
    t0 = last[0] = time.perf_counter()
    result = quantkit.quantize(model, recipe, calib, device=device, progress=progress)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    report = result.layers.values()
    median = statistics.median(per_layer)
    info = {
        "model": "smollm2-135m (fp32)"
        if args.cpu_smollm2
        else ("smoke: tiny Llama shapes" if args.smoke else "Llama-3-8B shapes, random bf16 weights"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads",
        "decoder_layers": args.layers,
        "calibration": calibration,
        "search_samples": args.search_samples or "all",
        "search_tokens": args.search_tokens,
        "scheme": scheme,
        "grid": args.grid,
        "clip": args.clip and not args.then_gptq,
        "refine_steps": recipe.stages[0].params.refine_steps,
        "stages": "awq (scales re-judged under GPTQ) + gptq" if args.then_gptq else "awq",
        "build_seconds": round(build_seconds, 2),
        "search_seconds": round(wall, 2),
        "seconds_per_layer_median": round(median, 3),
        "seconds_per_layer_max": round(max(per_layer), 3),
        "extrapolated_32_layers_seconds": None
        if args.cpu_smollm2
        else round(wall + max(32 - args.layers, 0) * median, 1),
        "linears_scaled_per_layer": sum(r.get("awq_ratio") is not None for r in report) / args.layers,
        "linears_clipped_per_layer": sum("awq_clip_mean_ratio" in r for r in report) / args.layers,
        "peak_gpu_bytes": peak,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    extrapolated = info["extrapolated_32_layers_seconds"]
    print(
        f"AWQ search: {wall:.1f} s for {args.layers} layers ({median:.2f} s/layer median"
        + (f", ~{extrapolated:.0f} s for 32 layers)" if extrapolated is not None else ")")
        + (f", peak GPU memory {peak / 2**30:.2f} GiB" if peak is not None else "")
    )
    out = out_folder(args.out)
    (out / "bench_awq.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"wrote {out / 'bench_awq.json'}")


if __name__ == "__main__":
    main()
