"""Probe: the runtime's int8 W8A8 offline throughput with the persistent large-M GEMM against the config before it.

    python benchmarks/probes/probe_serve_w8a8.py [--out DIR] [--rounds 2]

bench_serve.py's workload and model (256 requests, Llama-3-8B shape, random weights, int8 W8A8 built in process),
one engine per measurement, alternating the int8 "large" (M > 256) tile config between the committed persistent
(256, 128, 128, 8, 2, 8, 3) and the sweep's (128, 256, 128, 8, 1, 8, 3) that ran before 2026-12-02, ``--rounds``
times each, so that drift of the machine hits both alike. Prints and saves each measurement as it comes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_serve
import bench_serve as B
from quantkit.kernels import w8a8 as W

CANDIDATES = {"persistent": W.CONFIGS[("int8", "large")], "before": (128, 256, 128, 8, 1, 8, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    n_req, min_len, max_len, out_len, _, _, shape = B.MODES["full"]
    settings = argparse.Namespace(max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=16384,
                                  gpu_memory_utilization=0.9, num_kv_blocks=None, enforce_eager=False,
                                  fp8_fast_accum=False, no_async_scheduling=False)  # fmt: skip
    hf = B.build_hf_model(shape, torch.device("cuda"), torch.bfloat16, 0)
    prompts = B.random_workload(n_req, min_len, max_len, hf.config.vocab_size, 0)
    B.swap_modules(hf, B.quantize_decoder_linears(hf, B.SCHEMES["w8a8"]))
    rows = []
    for r in range(args.rounds):
        for name, values in CANDIDATES.items():
            W.CONFIGS[("int8", "large")] = values
            llm = B.engine(hf, settings)
            result, _ = B.offline_throughput(llm, prompts, out_len)
            rows.append({"round": r, "config": name, "values": values, **result.to_dict()})
            print(f"round {r} {name:<10} {values}: {result.output_tok_s:.0f} output tok/s", flush=True)
            (args.out / "probe_serve_w8a8.json").write_text(json.dumps(rows, indent=1))
            llm = None
            B.free_memory()


if __name__ == "__main__":
    main()
