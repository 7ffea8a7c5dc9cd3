"""Speculative decoding: acceptance, tokens per verify step and end-to-end speed per proposer, and the measured cost
of draft, verify and decode steps of a Llama-3-8B-shaped model with the batch-1 speed-up they project.

  python benchmarks/bench_spec.py --model smollm2-135m --device cpu     acceptance / tau (fp32), CPU tokens/s
  python benchmarks/bench_spec.py --model FOLDER --dtype float16        the same on a GPU (fp16)
  python benchmarks/bench_spec.py --costs --acceptance out/spec/acceptance.json   8B-shaped step costs (GPU)
  python benchmarks/bench_spec.py --mtp                 MTP drafting's costs on dummy:deepseek-v3-tiny (GPU, bf16)
  TRITON_INTERPRET=1 python benchmarks/bench_spec.py --mtp --smoke       the same code, tiny config, fp32 CPU

Part 1 (a real model): for each proposer (``self-g128``: the target's weights rounded to w4a16-g128; ``self-gptq``:
a GPTQ checkpoint of the same model given by ``--gptq-draft``; ``self-half``: w4a16-g128 with the first half of the
layers; ``ngram``: prompt lookup; ``eagle`` / ``medusa``: draft heads from ``quantkit train-draft`` given by
``--eagle-heads`` / ``--medusa-heads``), each k and each temperature, generate from held-out prompts of three kinds
(``narrative``: passages of the evaluation text, which no calibration saw; ``chat``: questions through the chat
template; ``grounded``: a passage and a request to quote from it) and report the acceptance rate and tau (tokens
emitted per verify step); then tokens/s against the same target without speculation at batch 1 (one prompt at a time)
and batch 16. Every run draws k tokens every step (``adaptive=False``) except the rows marked adaptive, which start
each timed run with no step costs measured (so their figures include the probes that find where speculation pays),
and then run the prompts again with the costs the rule measured (``speedup_measured``: a server that has run a while).

Part 0 (``--train METHOD:TOKENS|all[:EPOCHS[:text|self[:UNROLL]]]``, repeatable; ``spec_train.py``): heads trained
by ``train_draft`` on the target's features over ``--train-data`` (training text only: never the evaluation text the
prompts come from), the target loaded once, at growing token budgets; each run's tokens, seconds and held-out loss
are recorded, and its heads join part 1 as proposer ``METHOD-TOKENSxEPOCHS`` (tau against training tokens);
``METHOD:TOKENS:EPOCHS:self`` trains instead on the target's own continuations of passages of that text
(``train_draft.self_distilled_ids``, ``--self-tokens``); ``UNROLL`` > 1 trains EAGLE heads on their own predicted
features for that many steps (EAGLE-3's training-time test).
``--trees N`` also measures the head proposers with draft trees of N tokens (``--tree-k`` deep; EAGLE-2's dynamic
tree, Medusa's sparse one); ``--speed-proposers`` limits the end-to-end runs (``best-eagle``: the EAGLE heads of the
highest greedy tau), and ``--speed-tree N`` adds a tree run of those heads. ``--draft-vocab N,...`` adds the EAGLE
heads with a draft vocabulary of N tokens (proposer ``eagle-v8k``); ``--head-schemes w8a16-pc,...`` adds the heads
with their weights rounded to that scheme (proposer ``eagle-w8a16-pc``: the tau of quantized heads). ``--model`` may
be a quantkit checkpoint: tau of a quantized target, with heads trained on the float model or (``--train``) on it.

Part 2 (``--costs``, random weights in the Llama-3-8B shape, so acceptance is not meaningful there): median time of a
decode step, of a verify step of k + 1 tokens per sequence and of one draft step (W4A16 self, and with half the
layers), at batch 1 and 16, each on a 512-token context; then the projected batch-1 speed-up at the acceptance
measured in part 1: speed-up = E(a, k) * t_decode / (k * t_draft + t_verify(k)), E(a, k) = (1 - a^(k+1)) / (1 - a)
(a projection: labelled so in the table).

Part 2, heads (``--head-costs``, ``spec_costs.head_costs``): on the Llama-3-8B shape (bf16 and W4A16 targets), a
decode step, EAGLE's chain and Medusa's heads, each ``--trees`` N tree and its verify step, and the EAGLE chain and
trees again with each ``--draft-vocab`` size; the batch-1 speed-up they project at the tau of ``--acceptance``.

Part 2, MTP (``--mtp``, issue 51; ``spec_costs.mtp_costs``): DeepSeek-V3's MTP drafter on ``dummy:deepseek-v3-tiny``
(random bf16 weights with one random MTP layer), at batch 1 and 8 on a 512-token context, k = 1, 2, 3: a decode
step as a plain engine runs it, the drafter's chain of k tokens (cost per draft token, and its ratio to the decode
step), a verify step of k + 1 tokens per sequence; acceptance and tau measured end to end on random prompts
(meaningless for quality with random weights: the point is the cost); the speed-up these costs project at
DeepSeek-V3's reported 85-90% second-token acceptance (labelled a projection). Writes OUT/mtp.json and OUT/mtp.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import add_out_argument, environment, kernel_device, out_folder, text_row
from spec_costs import (
    head_costs,
    head_projection,
    mtp_costs,
    mtp_table,
    project,
    rounded_heads,
    step_costs,
    vocab_suffix,
)
from spec_train import parse_train, sync, train_heads

from quantkit.errors import QuantkitError
from quantkit.runtime import LLM, SamplingParams
from quantkit.runtime.speculative.config import SpeculativeConfig, weight_scheme
from quantkit.runtime.speculative.heads import read_meta

QUESTIONS = [
    "What is the capital of France, and why is it famous?",
    "Explain in two sentences why the sky is blue.",
    "Give three tips for writing clear emails.",
    "What is the difference between a list and a tuple in Python?",
    "Why do leaves change colour in autumn?",
    "How does a bicycle stay upright when it moves?",
    "Write a short poem about the sea.",
    "What are the main causes of inflation?",
    "Describe how to make a cup of tea.",
    "What is photosynthesis?",
    "Name three famous painters and one work by each.",
    "How do vaccines train the immune system?",
    "What should I pack for a weekend hiking trip?",
    "Explain what a prime number is with examples.",
    "Why is exercise good for the brain?",
    "Summarise the plot of Romeo and Juliet in three sentences.",
]


def passages(n: int, words: int, skip: int = 0) -> list[str]:
    """``n`` passages of about ``words`` words, spread over the shipped evaluation text (Moby Dick)."""
    from quantkit.calib.data import load_text

    text = load_text("moby-dick")[0].split()
    step = len(text) // (n + skip + 1)
    return [" ".join(text[(i + 1 + skip) * step : (i + 1 + skip) * step + words]) for i in range(n)]


def prompt_sets(tokenizer, n: int) -> dict[str, list]:
    def chat(message: str) -> list[int]:
        return tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)  # fmt: skip

    grounded = [
        chat(f"Here is a passage:\n\n{p}\n\nRepeat the passage above word for word.") for p in passages(n, 60, skip=n)
    ]
    return {
        "narrative": [tokenizer(p)["input_ids"] for p in passages(n, 120)],
        "chat": [chat(q) for q in (QUESTIONS * (n // len(QUESTIONS) + 1))[:n]],
        "grounded": grounded,
    }


def proposers(args, layers: int) -> dict[str, dict]:
    out = {
        "self-g128": dict(method="self", draft_scheme="w4a16-g128"),
        "self-half": dict(method="self", draft_scheme="w4a16-g128", draft_layers=max(1, layers // 2)),
        "ngram": dict(method="ngram"),
    }
    if args.gptq_draft:
        out["self-gptq"] = dict(method="self", draft=str(args.gptq_draft))
    for method in ("eagle", "medusa"):  # draft heads made by quantkit train-draft
        if getattr(args, f"{method}_heads"):
            out[method] = dict(method=method, draft=str(getattr(args, f"{method}_heads")))
    out = {k: v for k, v in out.items() if k in args.proposers.split(",")}
    out = {**args.trained, **out}
    for name, spec in list(out.items()):  # the EAGLE heads again with each draft vocabulary
        for size in args.draft_vocab if spec["method"] == "eagle" else ():
            out[name + vocab_suffix(size)] = dict(spec, draft_vocab_size=size)
    for name, spec in list(out.items()):  # the heads again with their weights rounded to each scheme
        if spec["method"] not in ("eagle", "medusa") or "draft_vocab_size" in spec:
            continue
        for scheme in args.head_schemes:
            folder = rounded_heads(Path(spec["draft"]), scheme, args.heads_dir / f"{name}-{scheme}")
            out[f"{name}-{scheme}"] = dict(spec, draft=str(folder))
    return out


def timed(llm: LLM, prompts, params: SamplingParams, batch: int) -> tuple[float, int]:
    """Seconds and output tokens to complete ``prompts`` ``batch`` at a time."""
    sync(llm)
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        outs = llm.generate(prompts[i : i + batch], params)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    sync(llm)
    return time.perf_counter() - start, tokens


def bucket_figures(b) -> dict:
    return {
        "plain_ms": round(1e3 * b.plain_time, 3),
        "spec_ms": round(1e3 * b.spec_time, 3),
        "spec_tokens": round(b.spec_tokens, 2),
        "plain_samples": b.plain_samples,
        "spec_samples": b.spec_samples,
        "hopeless": b.hopeless,
        "probe_every": b.probe_every,
    }


def drafter(llm: LLM) -> dict:
    """What an acceptance row says of its heads beyond their name: the draft vocabulary's size and the scheme their
    weights were rounded to (``--head-schemes``), each None where it does not apply."""
    config = llm.spec.config
    rounded = read_meta(config.draft).get("weights_rounded_to") if config.method in ("eagle", "medusa") else None
    return dict(draft_vocab_size=config.draft_vocab_size, heads_rounded_to=rounded)


def measure(llm: LLM, name: str, sets: dict, args, rows: list, ks, tree: int | None = None) -> None:
    """Acceptance and tau of ``llm``'s proposer on every prompt set and temperature, at each k (the tree's depth)."""
    heads = drafter(llm)  # the same for every row of this engine
    for kind, prompts in sets.items():
        if kind not in args.sets:
            continue
        for temperature in args.temperatures:
            params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=0, ignore_eos=True)
            for k in ks:
                llm.spec.config = dataclasses.replace(llm.spec.config, num_speculative_tokens=k)
                llm.spec.totals = type(llm.spec.totals)()
                llm.generate(prompts, params)
                t = llm.spec.totals
                rows.append(dict(proposer=name, prompts=kind, temperature=temperature, k=k, tree=tree,
                                 acceptance=t.acceptance_rate, tau=t.emitted / max(t.steps, 1),
                                 **heads))  # fmt: skip
                print(text_row([name, kind, temperature, k, tree or "-", f"{t.acceptance_rate:.3f}",
                                f"{rows[-1]['tau']:.2f}"], [14, 10, 4, 2, 3, 6, 5]), flush=True)  # fmt: skip


def speed(llm: LLM, plain: LLM, name: str, sets: dict, args, out: list, modes=(False, True), tree=None) -> None:
    """End-to-end greedy tokens/s of ``llm`` against ``plain`` at the k the table favours (``args.speed_k``); modes:
    fixed k (False) and adaptive (True)."""
    for kind in args.speed_sets:
        prompts = sets[kind][: args.speed_prompts]
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        for batch in args.batches:
            for adaptive in modes:
                llm.spec.config = dataclasses.replace(
                    llm.spec.config, adaptive=adaptive, num_speculative_tokens=args.tree_k if tree else args.speed_k
                )
                timed(llm, prompts[:batch], params, batch)  # warm-up: compiles the verify shapes
                llm.spec.buckets.clear()  # the adaptive rule starts the timed run knowing no step costs
                base_s, base_n = timed(plain, prompts, params, batch)
                spec_s, spec_n = timed(llm, prompts, params, batch)
                out.append(dict(proposer=name, prompts=kind, batch=batch, k=llm.spec.config.num_speculative_tokens,
                                tree=tree, adaptive=adaptive, plain_tok_s=base_n / base_s, spec_tok_s=spec_n / spec_s,
                                speedup=(spec_n / spec_s) / (base_n / base_s)))  # fmt: skip
                r = out[-1]
                if adaptive:  # what the rule saw: per batch-size bucket, ms per step and tokens per sequence
                    r["buckets"] = {size: bucket_figures(b) for size, b in sorted(llm.spec.buckets.items())}
                    # and once it knows the step costs (a server that has run a while): the same again
                    again_s, again_n = timed(llm, prompts, params, batch)
                    r["speedup_measured"] = (again_n / again_s) / (base_n / base_s)
                mode = f"tree {tree}" if tree else "adaptive" if adaptive else "fixed"
                print(
                    f"SPEED {name} {kind} batch {batch} k {r['k']} {mode}: "
                    f"{r['plain_tok_s']:.1f} -> {r['spec_tok_s']:.1f} tok/s = {r['speedup']:.2f}x"
                    + (f"; step costs known: {r['speedup_measured']:.2f}x {r['buckets']}" if adaptive else ""),
                    flush=True,
                )


def best_eagle(rows: list[dict]) -> str | None:
    """The EAGLE proposer of the highest greedy tau with chains, averaged over the prompt sets and k."""
    taus: dict[str, list[float]] = {}
    for r in rows:
        if r["proposer"].startswith("eagle") and r["temperature"] == 0 and r["tree"] is None:
            taus.setdefault(r["proposer"], []).append(r["tau"])
    return max(taus, key=lambda n: sum(taus[n]) / len(taus[n]), default=None)


def count_tokens(args, tokenizer, vocab_size: int) -> None:
    """``--count-tokens``: the token counts of those texts for EAGLE heads that lack them (``draft_vocab``)."""
    from quantkit.runtime.speculative.draft_vocab import COUNTS_FILE, save_token_counts
    from quantkit.train_draft import token_stream

    folders = [args.eagle_heads, *(Path(s["draft"]) for s in args.trained.values() if s["method"] == "eagle")]
    missing = [f for f in folders if f is not None and not (Path(f) / COUNTS_FILE).is_file()]
    if missing and args.count_tokens:
        ids, _ = token_stream(tuple(args.count_tokens.split(",")), tokenizer)
        for folder in missing:
            save_token_counts(folder, ids, vocab_size)
            print(f"token counts of {args.count_tokens} ({ids.numel():,} tokens) written to {folder}", flush=True)


def acceptance(args, folder: str, settings: dict) -> dict:
    """Part 1."""
    plain = LLM(folder, **settings)
    if args.draft_vocab:
        count_tokens(args, plain.tokenizer, plain.model.config.vocab_size)
    sets = prompt_sets(plain.tokenizer, args.num_prompts)
    layers = plain.model.config.num_hidden_layers
    rows, speeds = [], []
    gpu = {"gpu_memory_utilization": 0.65} if "gpu_memory_utilization" in settings else {}
    wanted = args.speed_proposers.split(",") if args.speed_proposers else None

    failures = []

    def with_engine(label: str, spec: dict, work, **extra) -> None:
        """``work(llm)`` on a speculative engine of ``spec``; a failure is reported and the next one runs (a
        benchmark of many proposers keeps what the others measured)."""
        try:
            llm = LLM(folder, **{**settings, **gpu}, speculative=SpeculativeConfig(**spec, adaptive=False, **extra))
            work(llm)
        except Exception as exc:  # reported, and in the JSON
            failures.append(f"{label}: {type(exc).__name__}: {exc}")
            print(f"FAILED {failures[-1]}", flush=True)
        llm = None
        gc.collect()
        torch.cuda.empty_cache()

    chosen = proposers(args, layers)
    for name, spec in chosen.items():  # chains first, so that a run cut short keeps them and the speed of the best
        timed_here = wanted is None or name in wanted

        def chain(llm, name=name, timed_here=timed_here):
            measure(llm, name, sets, args, rows, args.ks)
            if timed_here:
                speed(llm, plain, name, sets, args, speeds)

        with_engine(name, spec, chain)
    best = best_eagle(rows) if wanted and "best-eagle" in wanted else None
    if best is not None:
        print(f"best EAGLE heads (greedy tau, chains): {best}", flush=True)
    if best is not None and best not in wanted:  # fixed k: the heads' own speed (the adaptive rule: other proposers)
        with_engine(f"{best} speed", chosen[best], lambda llm: speed(llm, plain, best, sets, args, speeds,
                                                                     modes=(False,)))  # fmt: skip
    heads = sorted((n for n, s in chosen.items() if s["method"] in ("eagle", "medusa")), key=lambda n: n != best)
    for name, n in [(name, n) for name in heads for n in args.trees]:  # a tree drafter comes with its engine
        with_engine(f"{name} tree {n}", chosen[name], lambda llm, name=name, n=n: measure(
            llm, name, sets, args, rows, [args.tree_k], tree=n), num_tree_tokens=n,
            num_speculative_tokens=args.tree_k)  # fmt: skip
    if best is not None and args.speed_tree:
        with_engine(f"{best} tree speed", chosen[best], lambda llm: speed(
            llm, plain, best, sets, args, speeds, modes=(False,), tree=args.speed_tree),
            num_tree_tokens=args.speed_tree, num_speculative_tokens=args.tree_k)  # fmt: skip
    return {"acceptance": rows, "speed": speeds, "best_eagle": best, "failures": failures}


def summary(result: dict) -> None:
    """A compact table: training runs; tau per proposer (chain or tree) and prompt set x temperature; speed."""
    for r in result.get("training", []):
        print(f"| {r['name']} | {r['tokens_seen']:,} | {r['seconds']:.1f} s | {r['after']['loss']:.3f} | "
              f"{' '.join(f'{a:.3f}' for a in r['after']['top1'])} |")  # fmt: skip
    cells: dict[tuple, dict] = {}
    for r in result["acceptance"]:
        key = (r["proposer"], r["k"], r["tree"])
        cells.setdefault(key, {})[f"{r['prompts']} t{r['temperature']:g}"] = f"{r['acceptance']:.2f} / {r['tau']:.2f}"
    columns = sorted({c for row in cells.values() for c in row})
    print("| proposer | k | tree | " + " | ".join(columns) + " |")
    for (name, k, tree), row in cells.items():
        print(f"| {name} | {k} | {tree or '-'} | " + " | ".join(row.get(c, "") for c in columns) + " |")
    for failure in result["failures"]:
        print(f"FAILED {failure}")
    for r in result["speed"]:
        mode = f"tree {r['tree']}" if r["tree"] else "adaptive" if r["adaptive"] else "fixed"
        extra = f" (costs known {r['speedup_measured']:.2f}x)" if "speedup_measured" in r else ""
        print(
            f"| {r['proposer']} | {r['prompts']} | {r['batch']} | {mode} | {r['plain_tok_s']:.0f} | "
            f"{r['spec_tok_s']:.0f} | {r['speedup']:.2f}x{extra} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="target: a float folder or built-in name (part 1)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--proposers", default="self-g128,self-gptq,self-half,ngram,eagle,medusa")
    ap.add_argument("--gptq-draft", type=Path, help="a quantkit GPTQ checkpoint of the target (proposer self-gptq)")
    ap.add_argument("--eagle-heads", type=Path, help="EAGLE heads of the target from train-draft (proposer eagle)")
    ap.add_argument("--medusa-heads", type=Path, help="Medusa heads of the target from train-draft (proposer medusa)")
    ap.add_argument("--ks", default=None, help="k of the table ('': speed only; 2,4,6; --mtp 1,2,3)")
    ap.add_argument("--temperatures", default=None, help="0,0.7 (--mtp: 0)")
    ap.add_argument("--batches", default=None, help="1,16 (--mtp: 1,8)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=None, help="64 (--mtp: 16)")
    ap.add_argument("--sets", default="narrative,chat,grounded", help="prompt sets of the acceptance table")
    ap.add_argument("--speed-k", type=int, default=4)
    ap.add_argument("--speed-sets", default="narrative,chat,grounded")
    ap.add_argument("--speed-prompts", type=int, default=None, help="prompts of each set timed end to end (all)")
    ap.add_argument("--speed-proposers", default=None, help="proposers timed end to end (all; best-eagle: see above)")
    ap.add_argument("--speed-tree", type=int, default=None, help="also time the best EAGLE heads with this tree")
    ap.add_argument("--trees", default="", help="tree sizes measured for the head proposers, --tree-k deep")
    ap.add_argument("--draft-vocab", default="", help="EAGLE heads also with these draft vocabulary sizes (8000,...)")
    ap.add_argument("--count-tokens", default=None, help="texts whose token counts EAGLE heads lacking them get "
                    "(train-draft's --data names), for --draft-vocab")  # fmt: skip
    ap.add_argument("--tree-k", type=int, default=6, help="depth of the draft trees")
    ap.add_argument("--head-schemes", default="", help="the heads also with weights rounded to these schemes "
                    "(w8a16-pc,w4a16-g128; tau only: they draft in float)")  # fmt: skip
    ap.add_argument(
        "--train", action="append", default=[], help="part 0: heads, METHOD:TOKENS|all[:EPOCHS[:text|self[:UNROLL]]]"
    )
    ap.add_argument("--train-data", default="brown", help="part 0's training text (train-draft's --data, comma-joined)")
    ap.add_argument("--train-batch-size", type=int, default=64)
    ap.add_argument("--train-seqlen", type=int, default=256)
    ap.add_argument("--train-lr", type=float, default=3e-3)
    ap.add_argument("--train-loss-positions", type=int, default=64, help="0: every position")
    ap.add_argument("--self-tokens", type=int, default=1_000_000, help="part 0: the target's own text, tokens")
    ap.add_argument("--heads-dir", type=Path, default=None, help="where part 0 puts the heads (OUT/heads)")
    ap.add_argument("--costs", action="store_true", help="part 2 on random Llama-3-8B-shaped weights (GPU)")
    ap.add_argument("--acceptance", type=Path, help="part 1's JSON, for the projection of part 2")
    ap.add_argument("--head-costs", action="store_true", help="part 2: EAGLE / Medusa chains and trees (--trees), 8B")
    ap.add_argument("--head-targets", default="bf16,w4a16", help="--head-costs: targets (bf16, w4a16)")
    ap.add_argument("--mtp", action="store_true", help="part 2: MTP drafting's costs on dummy:deepseek-v3-tiny (GPU)")
    ap.add_argument("--context", type=int, default=None, help="--mtp: tokens before the timed steps (512; smoke 32)")
    ap.add_argument("--smoke", action="store_true", help="--mtp, --head-costs on a tiny config, fp32 CPU")
    add_out_argument(ap, "spec")
    args = ap.parse_args()
    for item in args.train:  # a malformed item is refused now, not after the heads before it have trained
        try:
            parse_train(item)
        except ValueError as exc:
            ap.error(str(exc))
    if args.smoke and not (args.mtp or args.head_costs):
        ap.error("--smoke runs --mtp and --head-costs only")
    mode = {"ks": ("2,4,6", "1,2,3"), "temperatures": ("0,0.7", "0"), "batches": ("1,16", "1,8"),
            "max_tokens": (64, 16), "context": (512, 32 if args.smoke else 512)}  # fmt: skip
    for name, defaults in mode.items():
        if getattr(args, name) is None:
            setattr(args, name, defaults[args.mtp])
    args.ks = [int(k) for k in args.ks.split(",") if k]
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.mtp and not (args.ks and args.batches and min(args.ks + args.batches) > 0 and args.context > 0):
        ap.error("--mtp needs k >= 1, batch sizes >= 1 and --context >= 1")
    args.speed_sets = [s for s in args.speed_sets.split(",") if s]
    args.trees = [int(n) for n in args.trees.split(",") if n]
    args.draft_vocab = [int(n) for n in args.draft_vocab.split(",") if n]
    args.head_schemes = [s for s in args.head_schemes.split(",") if s]
    for scheme in args.head_schemes:
        try:
            weight_scheme(scheme)
        except QuantkitError as exc:
            ap.error(f"--head-schemes: {exc}")
    for folder in [f for f in (args.eagle_heads, args.medusa_heads) if f is not None] if args.head_schemes else []:
        try:  # heads to round must be heads, before the target loads
            read_meta(folder)
        except QuantkitError as exc:
            ap.error(f"--head-schemes: {exc}")
    args.head_targets = [t for t in args.head_targets.split(",") if t]
    if args.head_costs and not set(args.head_targets) <= {"bf16", "w4a16"}:
        ap.error("--head-targets takes bf16 and w4a16")
    args.sets = args.sets.split(",")
    out = out_folder(args.out)
    args.heads_dir = args.heads_dir or out / "heads"
    args.trained = {}
    settings = {k: v for k, v in dict(device=args.device, dtype=args.dtype).items() if v is not None}
    device = "cuda" if torch.cuda.is_available() and args.device in (None, "cuda") else "cpu"
    if args.mtp:  # a GPU run, or --smoke on the CPU
        device = kernel_device(args.smoke)
    if device == "cuda" and not args.costs:  # the plain target (0.3 of the card) and a speculative engine share it
        settings["gpu_memory_utilization"] = 0.3
    result = {"environment": environment(device)}
    if args.mtp:
        args.sets = ["random"]

        def tau(llm: LLM, prompts: list) -> list[dict]:
            rows: list[dict] = []
            measure(llm, "mtp", {"random": prompts}, args, rows, args.ks)
            return rows

        dtype = "float32" if args.smoke else "bfloat16"
        result["mtp"] = mtp_costs(args, dict(device=device, dtype=dtype), args.smoke, tau)
        table = "\n".join(mtp_table(result))
        print(table)
        (out / "mtp.json").write_text(json.dumps(result, indent=2))
        (out / "mtp.md").write_text(table + "\n")
        return
    if args.head_costs:  # part 2 for draft heads and trees: random weights, batch 1
        result["head_costs_s"] = costs = head_costs(args, out, smoke=args.smoke)
        accepted = json.loads(args.acceptance.read_text()).get("acceptance", []) if args.acceptance else []
        result["head_projection"] = head_projection(costs, accepted, args.speed_k, args.trees)
        for r in result["head_projection"]:
            print(f"PROJECTION {r['target']} {r['proposer']} {r['prompts']} tree {r['tree']}: tau {r['tau']:.2f}, "
                  f"step {r['step_ms']:.2f} ms -> {r['projected_speedup']:.2f}x over its plain decode"
                  + (f", {r['projected_over_bf16']:.2f}x over bf16" if "projected_over_bf16" in r else ""))  # fmt: skip
        (out / "head_costs.json").write_text(json.dumps(result, indent=2))
        return
    if args.costs:
        costs = step_costs(args, settings)
        result["costs_s"] = costs
        accepted = json.loads(args.acceptance.read_text())["acceptance"] if args.acceptance else []
        result["projection"] = project(costs, accepted, args.ks, args.batches)
        for r in result["projection"]:
            print(
                f"PROJECTION {r['proposer']} {r['prompts']} k {r['k']} batch {r['batch']}: acceptance "
                f"{r['acceptance']:.3f} -> {r['projected_speedup']:.2f}x over plain decode"
            )
        (out / "costs.json").write_text(json.dumps(result, indent=2))
        return
    from quantkit.models.loading import resolve_model

    folder = str(resolve_model(args.model))
    if args.train:
        result["training"] = train_heads(args, folder, device, settings)
        (out / "acceptance.json").write_text(json.dumps(result, indent=2))
    result.update(acceptance(args, folder, settings))
    (out / "acceptance.json").write_text(json.dumps(result, indent=2))
    summary(result)


if __name__ == "__main__":
    main()
