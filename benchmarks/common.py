"""What the benchmarks share: the layer shapes and model configs they measure, the GPU timing harness, the output
folder and the text tables they print.

Timing follows one rule everywhere: ``triton.testing.do_bench`` (median); calls too short to time one by one are
captured R at a time in a CUDA graph (launch overhead amortized, as in a captured decode step); their operands come
in R rotated copies spanning more than the L2 cache, so that the weights are read from device memory.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import subprocess
import time
from pathlib import Path

import torch

from quantkit.runtime.bench import DUMMY_MODELS

L2_BYTES = 60 * 2**20  # the H200's L2 (the H100 has 50 MB): rotated operands span a multiple of it

# (N, K) of a linear layer y [M, N] = x [M, K] @ W.T: Llama-3-8B's q/o, gate (or up) and down projections, then
# Llama-3-70B's
LLAMA_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (28672, 8192), (8192, 28672)]

# transformers LlamaConfig keys of the Llama-3-8B shape that `quantkit bench-serve --model dummy:llama-3-8b` serves
LLAMA3_8B = {
    k: v for k, v in DUMMY_MODELS["llama-3-8b"].items()
    if k not in ("model_type", "architectures", "bos_token_id", "eos_token_id", "dtype")
}  # fmt: skip
LLAMA32_1B = dict(LLAMA3_8B, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, tie_word_embeddings=True)


def head_dim(config: dict) -> int:
    return config["hidden_size"] // config["num_attention_heads"]


def decoder_linears(config: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of a Llama decoder's linears as the runtime fuses them (q, k, v into one; gate and up into one), and
    of the lm_head."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * head_dim(config)
    return {
        "qkv": (hidden + 2 * kv, hidden),
        "o": (hidden, hidden),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (config["vocab_size"], hidden),
    }


def random_llama(config: dict, draw_on: torch.device | str, seed: int = 0):
    """LlamaForCausalLM of ``config`` (LlamaConfig keys) in bf16 on the CPU, as a real checkpoint would sit in host
    memory: weights ~ N(0, 0.02), norms 1. Built on the meta device (no fp32 copy); the random values are drawn on
    ``draw_on`` (fast on a GPU) and copied into the CPU tensors one at a time. Random weights leave the cost of
    quantizing unchanged: it depends on shapes, not values."""
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaConfig(**config)
    with torch.device("meta"):
        model = LlamaForCausalLM(llama).to(torch.bfloat16)
    model.to_empty(device="cpu")  # uninitialised bf16 storage, nothing written yet
    model.tie_weights()  # to_empty gave a tied lm_head storage of its own
    gen = torch.Generator(device=draw_on).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # RMSNorm weights
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=draw_on, dtype=torch.bfloat16).mul_(0.02))
        model.model.rotary_emb = type(model.model.rotary_emb)(config=llama)  # inv_freq was computed on meta
    stray = [n for n, b in model.named_buffers() if b.is_meta]
    if stray:
        raise RuntimeError(f"buffers left on the meta device: {stray}")
    return model.eval()


# -- where a benchmark runs --------------------------------------------------------------------------------------


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernel_device(smoke: bool) -> str:
    """The device of a run: "cpu" for a ``--smoke`` plumbing check in Triton's interpreter, else "cuda"; a one-line
    exit where the environment does not match."""
    if smoke != interpreting():
        raise SystemExit("--smoke runs in Triton's interpreter and only there: set TRITON_INTERPRET=1 with --smoke")
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or TRITON_INTERPRET=1 --smoke for a CPU plumbing check)")
    return "cpu" if smoke else "cuda"


def environment(device: str) -> dict:
    """What a result was measured on: date, device, versions and the commit."""
    import triton

    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                         text=True, check=False)  # fmt: skip
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (timings meaningless)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": rev.stdout.strip() if rev.returncode == 0 else "unknown",
    }


# -- output --------------------------------------------------------------------------------------------------------


def add_out_argument(ap, name: str) -> None:
    """``--out DIR``: where the benchmark writes its raw JSON and markdown (default out/NAME, outside git)."""
    ap.add_argument("--out", type=Path, default=Path("out") / name, help=f"output folder (default: out/{name})")


def out_folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


# -- timing --------------------------------------------------------------------------------------------------------


def rotations(per_call_bytes: int, span: int = 2 * L2_BYTES, most: int = 32) -> int:
    """Copies of a call's operands that make one pass over them span ``span`` bytes (at most ``most``; 2 in the
    interpreter, which is slow)."""
    cap = 2 if interpreting() else most
    return max(1, min(cap, math.ceil(span / per_call_bytes)))


def seconds_per_call(calls: list, smoke: bool, warmup_ms: int, rep_ms: int) -> float:
    """Seconds per call of a list of zero-argument calls over rotated operands.

    On a GPU: warm up (and compile) off the capture stream, capture every call into one CUDA graph and take the
    median replay time of ``do_bench`` (which flushes L2 before each replay), divided by the number of calls. Under
    ``smoke`` (CPU plumbing checks): the wall clock of one pass.
    """
    if smoke:
        t0 = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t0) / len(calls)
    import triton.testing

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture stream, as torch.cuda.graphs recommends
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    ms = triton.testing.do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    del graph
    return ms * 1e-3 / len(calls)


class Timer:
    """Microseconds per call of R rotated calls (``seconds_per_call``)."""

    def __init__(self, smoke: bool, warmup_ms: int = 10, rep_ms: int = 40) -> None:
        self.smoke, self.warmup_ms, self.rep_ms = smoke, warmup_ms, rep_ms

    def per_call(self, calls: list) -> float:
        return seconds_per_call(calls, self.smoke, self.warmup_ms, self.rep_ms) * 1e6


def median_seconds(fn, graph: bool = False, smoke: bool = False, rep_ms: int | None = None) -> float:
    """Median seconds per call of one launch: ``do_bench`` (``do_bench_cudagraph`` with ``graph``) over ``rep_ms``
    milliseconds of calls (their default where None); under ``smoke`` the wall clock of the second of two calls."""
    if smoke:
        fn()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    import triton.testing

    rep = {} if rep_ms is None else {"rep": rep_ms}
    if graph:
        return triton.testing.do_bench_cudagraph(fn, return_mode="median", **rep) * 1e-3
    return triton.testing.do_bench(fn, return_mode="median", **rep) * 1e-3


def copy_bandwidth(device: str = "cuda", smoke: bool = False, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Device-to-device copy of 1 GiB (2 MiB under ``smoke``), bytes read + written per second (median)."""
    src = torch.empty((1 << 21) if smoke else (1 << 30), dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    if smoke:
        seconds = median_seconds(lambda: dst.copy_(src), smoke=True)
    else:
        import triton.testing

        ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=warmup_ms, rep=rep_ms, return_mode="median")
        seconds = ms * 1e-3
    return 2 * src.numel() / seconds


# -- tables --------------------------------------------------------------------------------------------------------


def geomean(xs) -> float:
    """Geometric mean (NaN for none)."""
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def text_row(cells: list, widths: list[int], sep: str = " ") -> str:
    """One line of a printed table: each cell right-aligned to its width (left-aligned where the width is
    negative)."""
    return sep.join(f"{c!s:<{-w}}" if w < 0 else f"{c!s:>{w}}" for c, w in zip(cells, widths, strict=True))
