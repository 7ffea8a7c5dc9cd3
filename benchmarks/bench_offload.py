"""Host memory of ``quantize`` with and without offloaded layers: a Llama-shaped model with random bf16 weights,
saved as safetensors, quantized in fp32 (what a CPU computes in) by one child process per mode.

    python benchmarks/bench_offload.py                                   # Llama-3.2-1B shapes, RTN
    python benchmarks/bench_offload.py --method gptq --nsamples 8 --seqlen 256 --layers 4

Each child loads the folder with ``quantkit.load_model(dtype=float32, offload=...)``, quantizes it on the CPU and hashes
the resulting state dict; a thread samples /proc/self/status every 10 ms. Printed and written (``--out``, default
out/offload: ``bench_offload.json`` and ``.md``): peak anonymous memory (what must fit in RAM; pages of the mapped
weights files are cache the kernel can drop), peak resident memory (both), wall time, and whether the two checkpoints
are identical. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from common import LLAMA32_1B, add_out_argument, out_folder, random_llama


def save_random_model(folder: Path, layers: int) -> None:
    """Random N(0, 0.02) bf16 weights in Llama-3.2-1B shapes (``layers`` decoder layers) and a one-word tokenizer
    (the calibration ids are random: nothing is tokenized) as a Hugging Face folder."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    random_llama({**LLAMA32_1B, "num_hidden_layers": layers}, "cpu").save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(folder)


class Sampler(threading.Thread):
    """Peak RssAnon and VmRSS of this process, sampled every 10 ms."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak = {"RssAnon": 0, "VmRSS": 0}

    def run(self):
        while True:
            with open("/proc/self/status") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key in self.peak:
                        self.peak[key] = max(self.peak[key], int(value.split()[0]) * 1024)
            time.sleep(0.01)


def child(args) -> None:
    import quantkit

    sampler = Sampler()
    sampler.start()
    t0 = time.perf_counter()
    model, _, _ = quantkit.load_model(args.folder, dtype=torch.float32, offload=args.child == "offload")
    loaded = time.perf_counter() - t0
    recipe = {"scheme": {"bits": 4, "group_size": 128}, "stages": [{"method": args.method}]}
    calib = None
    if args.method != "rtn":
        recipe["calibration"] = {"nsamples": args.nsamples, "seqlen": args.seqlen, "batch_size": args.nsamples}
        gen = torch.Generator().manual_seed(0)
        calib = torch.randint(0, model.config.vocab_size, (args.nsamples, args.seqlen), generator=gen)
    quantkit.quantize(model, recipe, calib, device="cpu")
    wall = time.perf_counter() - t0
    time.sleep(0.05)  # one more sample
    peak = dict(sampler.peak)  # before hashing
    digest = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(t.contiguous().view(torch.uint8).numpy())
    print(json.dumps({"mode": args.child, "peak_anon_bytes": peak["RssAnon"], "peak_rss_bytes": peak["VmRSS"],
                      "load_seconds": round(loaded, 2), "seconds": round(wall, 2),
                      "sha256": digest.hexdigest()}))  # fmt: skip


def markdown(info: dict) -> str:
    lines = [
        f"# quantize with and without offloaded layers ({info['method']}, {info['layers']} layers of Llama-3.2-1B, "
        f"bf16 files, fp32 compute, CPU)",
        "",
        f"Weights file {info['file_bytes'] / 1e9:.2f} GB; the model in fp32 {info['fp32_bytes'] / 1e9:.2f} GB. "
        f"Checkpoints identical: {info['identical']}.",
        "",
        "| mode | peak anonymous memory | peak resident (with file pages) | load s | total s |",
        "|---|---|---|---|---|",
    ]
    for r in info["runs"]:
        lines.append(f"| {r['mode']} | {r['peak_anon_bytes'] / 1e9:.2f} GB | {r['peak_rss_bytes'] / 1e9:.2f} GB | "
                     f"{r['load_seconds']} | {r['seconds']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=LLAMA32_1B["num_hidden_layers"])
    parser.add_argument("--method", default="rtn", choices=["rtn", "gptq"])
    parser.add_argument("--nsamples", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=256)
    add_out_argument(parser, "offload")
    parser.add_argument("--child", choices=["whole", "offload"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    with tempfile.TemporaryDirectory(prefix="bench-offload-") as tmp:
        folder = Path(tmp) / "model"
        save_random_model(folder, args.layers)
        file_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        runs = []
        for mode in ("whole", "offload"):
            cmd = [sys.executable, __file__, "--child", mode, "--folder", str(folder), "--method", args.method,
                   "--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen)]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"{mode} run failed:\n{done.stderr[-2000:]}")
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    info = {
        "method": args.method,
        "layers": args.layers,
        "file_bytes": file_bytes,
        "fp32_bytes": 2 * file_bytes,
        "identical": runs[0]["sha256"] == runs[1]["sha256"],
        "runs": runs,
        "torch": torch.__version__,
    }
    text = markdown(info)
    print(text)
    out = out_folder(args.out)
    (out / "bench_offload.json").write_text(json.dumps(info, indent=1) + "\n")
    (out / "bench_offload.md").write_text(text)


if __name__ == "__main__":
    main()
