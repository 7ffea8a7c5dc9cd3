"""Probe: batch-1 decode with weights prefetched into L2 on a side stream (``decode_l2_prefetch``), against without.

    python benchmarks/probes/probe_decode_prefetch.py [--out DIR] [--variants bf16,w4a16] [--rounds 2]
        [--points ",attention,attention+down"] [--programs 132] [--tokens 256]

bench_serve.py's model (Llama-3-8B shape, random bf16 weights; W4A16 = RTN 4-bit, group 128, symmetric, built in
process). For each variant, one engine per (prefetch points, programs) setting, the settings in turn and reversed
in odd rounds; each times bench_serve's batch-1 decode (a 128-token prompt, ``--tokens`` new tokens; step = graph +
lm_head + host) and one replay of the batch-1 graph under the PyTorch profiler (span on the GPU, kernels summed,
the kernels with the most time). The greedy tokens of every engine must equal those of the first (prefetching
changes no value). Prints and saves each measurement as it comes (``decode_prefetch.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_serve
import bench_serve as B

import quantkit.runtime.prefetch as P
from quantkit.runtime import LLM, SamplingParams


def graph_profile(llm: LLM, replays: int = 3) -> dict:
    """One batch-1 graph replay's kernels as the profiler (Kineto) sees them: the median replay of ``replays``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    graph, _ = llm.runner.graphs[1]
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    kernels = sorted(
        ((e.start_ns() / 1e3, e.duration_ns() / 1e3, e.name()) for e in prof.profiler.kineto_results.events()
         if e.device_type() == DeviceType.CUDA),
    )  # fmt: skip
    per = len(kernels) // replays
    replay_rows = []
    for i in range(replays):
        chunk = kernels[i * per : (i + 1) * per]
        span = max(start + dur for start, dur, _ in chunk) - chunk[0][0]
        replay_rows.append((span, sum(dur for _, dur, _ in chunk), chunk))
    replay_rows.sort(key=lambda row: row[0])
    span, busy, chunk = replay_rows[len(replay_rows) // 2]
    by_name = defaultdict(lambda: [0, 0.0])
    for _, dur, name in chunk:
        by_name[name][0] += 1
        by_name[name][1] += dur
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:14]
    gemvs = [dur for _, dur, name in chunk if "gemv" in name]  # qkv, o, gate_up, down per layer, in order
    per_proj = {p: round(sum(gemvs[i::4]), 1) for i, p in enumerate(("qkv", "o", "gate_up", "down"))}
    return {"span_us": span, "kernel_us": busy, "kernels": len(chunk), "events": len(kernels), "gemv_us": per_proj,
            "top": [(name[:90], n, round(us, 1)) for name, (n, us) in top]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--variants", default="bf16,w4a16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--points", default=",attention,attention+down", help="settings, comma-separated; + joins points")
    ap.add_argument("--programs", default="132", help="CTAs per prefetch launch, comma-separated; 0: plain loads")
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    settings = [(pts.replace("+", ","), int(pr)) for pts in args.points.split(",") for pr in args.programs.split(",")]
    settings = list(dict.fromkeys((pts, pr if pts else -1) for pts, pr in settings))
    hf = B.build_hf_model("llama-3-8b", torch.device("cuda"), torch.bfloat16, 0)
    prompt = B.random_workload(1, 128, 128, hf.config.vocab_size, 0)[0]
    rows = []
    for variant in args.variants.split(","):
        swapped = None
        if variant != "bf16":
            swapped = B.swap_modules(hf, B.quantize_decoder_linears(hf, B.SCHEMES[variant]))
        reference = None
        for r in range(args.rounds):
            for points, programs in settings if r % 2 == 0 else settings[::-1]:
                P.PROGRAMS = programs if programs > 0 else 132
                P.MODE = "load" if programs == 0 else "prefetch"
                llm = LLM(hf, max_model_len=2048, num_kv_blocks=512, cuda_graph_max_bs=1, decode_l2_prefetch=points)
                params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
                tokens = llm.generate([prompt], params)[0].completions[0].token_ids  # warm-up, and the tokens
                reference = reference or tokens
                b1 = B.batch1_decode(llm, prompt, args.tokens)
                row = {"variant": variant, "points": points, "programs": programs, "round": r, **b1,
                       "same_tokens": tokens == reference}  # fmt: skip
                try:
                    row["profile"] = graph_profile(llm)
                except Exception as exc:  # the timings above stand without it
                    row["profile_error"] = f"{type(exc).__name__}: {exc}"
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
                if "profile" in row:
                    p = row["profile"]
                    print(f"  graph span {p['span_us']:.0f} us, kernels {p['kernel_us']:.0f} us x {p['kernels']},"
                          f" gemv us per projection {p['gemv_us']}", flush=True)  # fmt: skip
                (args.out / "decode_prefetch.json").write_text(json.dumps(rows, indent=1))
                del llm
                B.free_memory()
        if swapped is not None:
            B.swap_modules(hf, swapped)
            B.free_memory()
    print("\nvariant  points          programs  tok/s per round  graph ms  graph span us  kernels  same tokens")
    for variant in args.variants.split(","):
        for points, programs in settings:
            rs = [r for r in rows if r["variant"] == variant and r["points"] == points and r["programs"] == programs]
            profiles = [r.get("profile", {}) for r in rs]
            cols = [
                " / ".join(f"{r['tok_s']:.1f}" for r in rs),
                " / ".join(f"{r['graph_ms']:.3f}" for r in rs),
                " / ".join(f"{p.get('span_us', float('nan')):.0f}" for p in profiles),
                str(profiles[0].get("kernels")),
                str(all(r["same_tokens"] for r in rs)),
            ]
            print(f"{variant:7}  {points or '-':14}  {programs:8}  " + "  ".join(cols))
    for r in rows:  # the first round's kernel tables
        if r["round"] == 0 and "profile" in r:
            print(f"\n{r['variant']} points={r['points'] or '-'} programs={r['programs']}")
            for name, n, us in r["profile"]["top"]:
                print(f"  {us:8.1f} us  {n:4}x  {name}")


if __name__ == "__main__":
    main()
