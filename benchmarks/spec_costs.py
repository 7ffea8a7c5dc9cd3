"""Part 2 of ``bench_spec.py``: what speculative steps cost, on random weights (acceptance means nothing there).

- ``step_costs`` (``--costs``, GPU): decode, verify (k + 1 tokens per sequence) and W4A16 self-draft steps of the
  Llama-3-8B shape; ``project``: the batch-1 speed-up they give at the acceptance measured on a real model.
- ``mtp_costs`` (``--mtp``): DeepSeek-V3's MTP drafter (``speculative.mtp``) on ``dummy:deepseek-v3-tiny`` (bf16, its
  one random MTP layer), at each batch size on a ``--context``-token context: a decode step as a plain engine runs it,
  the drafter's chain of k tokens (its catch-up on the newest verified position, k layer passes less one, k
  readouts: ``MTPProposer.propose`` as the engine calls it) and the verify step of k + 1 tokens per sequence with
  the drafter's feature store attached, as an MTP engine runs it; then the draft cost per token against the decode
  step, the acceptance and tau measured end to end (random weights: meaningless for quality), and the speed-up
  these costs PROJECT at DeepSeek-V3's reported second-token acceptance. ``--smoke``: the same code on a tiny
  DeepSeek-V3 config in fp32 on the CPU (timings meaningless).

Times are ``common.median_seconds`` (``do_bench`` medians on a GPU; under ``--smoke`` the wall clock of a second
call); the step costs of ``step_costs`` are medians of 20 synchronised steps.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from pathlib import Path

import torch
from common import median_seconds, text_row

from quantkit.runtime import LLM, SamplingParams
from quantkit.runtime.bench import DUMMY_MODELS
from quantkit.runtime.scheduler import ScheduledBatch
from quantkit.runtime.sequence import Sequence
from quantkit.runtime.speculative.config import SpeculativeConfig
from quantkit.runtime.speculative.decoder import expected_tokens

# DeepSeek-V3's report (arXiv 2412.19437, section 5.4.3): its MTP module's second token is accepted 85-90% of the time
REPORTED_ACCEPTANCE = (0.85, 0.90)
MEDUSA_HEADS = 4  # the random Medusa heads --head-costs times
REP_MS = 400  # do_bench's time per measurement: eager DeepSeek-V3 steps take milliseconds, so 100 ms is a few calls
HEAD_SMOKE = dict(DUMMY_MODELS["llama-3-8b"], vocab_size=512, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, dtype="float32")  # fmt: skip
# the --smoke shape: DeepSeek-V3's layout (dense first layer, grouped router, shared expert, MLA, one MTP layer) tiny
MTP_SMOKE = dict(
    DUMMY_MODELS["deepseek-v3-tiny"], vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
    topk_group=2, max_position_embeddings=1024, dtype="float32",
)  # fmt: skip


def step_costs(args, settings: dict) -> dict:
    """Part 2: median seconds of decode, verify and draft steps on random Llama-3-8B-shaped weights."""
    config = DUMMY_MODELS["llama-3-8b"]
    context = 512
    out = {}

    def batch_of(llm_runner, bm, b: int, new: int, seed: int) -> ScheduledBatch:
        gen = torch.Generator().manual_seed(seed)
        batch = ScheduledBatch()
        params = SamplingParams(max_tokens=64)
        for i in range(b):
            ids = torch.randint(3, 1000, (context + new,), generator=gen).tolist()
            seq = Sequence(10_000 + seed * 1000 + i, i, ids, params)
            bm.admit(seq, [], context + new)
            seq.num_computed_tokens = context
            seq.num_draft_tokens = new - 1  # the step scores new tokens and returns the logits of all of them
            batch.add(seq, new, [])
        return batch

    def median_step(runner, batch, reps: int = 20) -> float:
        for _ in range(3):
            runner.run(batch)
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            runner.run(batch)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    for name, spec in (("self-g128", dict(method="self", draft_scheme="w4a16-g128")),
                       ("self-half", dict(method="self", draft_scheme="w4a16-g128", draft_layers=16))):  # fmt: skip
        llm = LLM(config, **settings, max_model_len=2048, speculative=SpeculativeConfig(**spec, adaptive=False))
        draft = llm.spec.proposer
        for b in args.batches:
            if name == "self-g128":
                out[f"decode b{b}"] = median_step(llm.runner, batch_of(llm.runner, llm.block_manager, b, 1, 1))
                for k in args.ks:
                    out[f"verify k{k} b{b}"] = median_step(
                        llm.runner, batch_of(llm.runner, llm.block_manager, b, k + 1, 2 + k)
                    )
            out[f"draft {name} b{b}"] = median_step(draft.runner, batch_of(draft.runner, draft.bm, b, 1, 50 + b))
            for key in [k for k in out if k.endswith(f"b{b}")]:
                print(f"{key}: {1e3 * out[key]:.3f} ms", flush=True)
        del llm, draft
        torch.cuda.empty_cache()
    return out


def project(costs: dict, accepted: list[dict], ks, batches) -> list[dict]:
    """Projected speed-up per proposer, k and batch from measured costs and measured acceptance (greedy)."""
    rows = []
    for name in ("self-g128", "self-half"):
        rates = [r["acceptance"] for r in accepted if r["proposer"] == name and r["temperature"] == 0]
        if not rates:
            continue
        for kind in sorted({r["prompts"] for r in accepted}):
            for k in ks:
                a = next((r["acceptance"] for r in accepted if (r["proposer"], r["prompts"], r["k"], r["temperature"])
                          == (name, kind, k, 0)), None)  # fmt: skip
                if a is None:
                    continue
                for b in batches:
                    spec_s = k * costs[f"draft {name} b{b}"] + costs[f"verify k{k} b{b}"]
                    speedup = expected_tokens(a, k) * costs[f"decode b{b}"] / spec_s
                    rows.append(
                        dict(proposer=name, prompts=kind, k=k, batch=b, acceptance=a, projected_speedup=speedup)
                    )
    return rows


# -- MTP drafting on DeepSeek-V3-tiny ------------------------------------------------------------------------------


def prefilled(llm: LLM, b: int, context: int, room: int, seed: int) -> list[Sequence]:
    """``b`` sequences of ``context`` random tokens prefilled in one step (their K/V in the cache, the target's
    features in the MTP drafter's store), then one sampled token each, as the engine leaves them before a decode;
    their blocks hold ``room`` more tokens (a verify step's drafts)."""
    gen = torch.Generator().manual_seed(seed)
    batch, seqs = ScheduledBatch(), []
    for i in range(b):
        ids = torch.randint(3, llm.model.config.vocab_size, (context,), generator=gen).tolist()
        seq = Sequence(1_000_000 + 1000 * seed + i, i, ids, SamplingParams(max_tokens=64))
        llm.block_manager.admit(seq, [], context + room + 1)
        batch.add(seq, context, [])
        seqs.append(seq)
    logits = llm.runner.run(batch)  # [b, V]
    for seq, token in zip(seqs, logits.argmax(-1).tolist(), strict=True):
        seq.num_computed_tokens = context
        seq.token_ids.append(token)
    return seqs


def of(seqs: list[Sequence], num_new: int) -> ScheduledBatch:
    batch = ScheduledBatch()
    for seq in seqs:
        batch.add(seq, num_new, [])
    return batch


def mtp_costs(args, settings: dict, smoke: bool, measure) -> dict:
    """``--mtp``: seconds of a decode step, of the MTP drafter's chain of k tokens and of a verify step of k + 1
    tokens per sequence at each ``args.batches`` and ``args.ks``; ``measure(llm, prompts)`` the acceptance rows."""
    config = MTP_SMOKE if smoke else DUMMY_MODELS["deepseek-v3-tiny"]
    context, most, widest = args.context, max(args.ks), max(args.batches)
    prompt_len = min(64, context)
    length = max(context, prompt_len + args.max_tokens) + most + 16
    llm = LLM(config, **settings, max_model_len=length, max_num_seqs=widest, cuda_graph_max_bs=widest,
              num_kv_blocks=widest * (-(-length // 16) + 1) + 8,
              speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=most, adaptive=False))  # fmt: skip
    runner, drafter = llm.runner, llm.spec.proposer
    record = runner.on_hidden  # the drafter's feature store, fed by every target step
    head = drafter.head
    out = {
        "model": "tiny DeepSeek-V3 (smoke)" if smoke else "dummy:deepseek-v3-tiny",
        "dtype": str(llm.model.dtype).removeprefix("torch."),
        "context": context,
        "decode_graphs": runner.use_graphs,  # the runner captures no graphs for MLA models (host-side lengths)
        "mtp_moe": "fused" if getattr(head.mlp, "fused", None) is not None else "looped over experts",
        "mtp_cost_per_token_estimate": drafter.cost_per_token,  # parameter ratio the adaptive rule starts from
        "costs_s": {},
    }
    costs = out["costs_s"]
    gen = torch.Generator().manual_seed(7)
    for b in args.batches:
        seqs = prefilled(llm, b, context, most, seed=b)
        runner.on_hidden = None  # a plain engine's decode step (no features recorded)
        decode = of(seqs, 1)
        costs[f"decode b{b}"] = median_seconds(lambda batch=decode: runner.run(batch), smoke=smoke, rep_ms=REP_MS)
        runner.on_hidden = record
        for k in args.ks:
            drafts = drafter.propose(seqs, [k] * b, [None] * b)  # the first catches up on the whole context
            if any(len(d.tokens) != k for d in drafts):  # a drafter that drafted nothing would time as free
                raise RuntimeError(f"the MTP drafter drafted {[len(d.tokens) for d in drafts]} tokens, not {k} each")
            costs[f"draft k{k} b{b}"] = median_seconds(
                lambda k=k, seqs=seqs: drafter.propose(seqs, [k] * len(seqs), [None] * len(seqs)),
                smoke=smoke,
                rep_ms=REP_MS,
            )
            for seq in seqs:
                seq.add_draft(torch.randint(3, llm.model.config.vocab_size, (k,), generator=gen).tolist(), None)
            verify = of(seqs, k + 1)
            costs[f"verify k{k} b{b}"] = median_seconds(
                lambda batch=verify: runner.run(batch), smoke=smoke, rep_ms=REP_MS
            )
            for seq in seqs:
                seq.drop_draft()
        drafter.release(set())
        for seq in seqs:
            llm.block_manager.free_seq(seq)
        print(", ".join(f"{key} {1e3 * s:.3f} ms" for key, s in costs.items() if key.endswith(f" b{b}")), flush=True)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, config["vocab_size"], (prompt_len,), generator=gen).tolist() for _ in range(widest)]
    t0 = time.perf_counter()
    out["acceptance"] = measure(llm, prompts)
    out["acceptance_seconds"] = time.perf_counter() - t0
    out["rows"] = mtp_rows(costs, args.batches, args.ks)
    return out


def mtp_rows(costs: dict, batches, ks) -> list[dict]:
    """Per batch and k: the draft cost per token against a decode step, and the speed-up PROJECTED at DeepSeek-V3's
    reported acceptance a: E(a, k) * t_decode / (t_chain(k) + t_verify(k)), every drafted token accepted with
    probability a (for k > 1 an assumption: the report gives the second token's rate only)."""
    rows = []
    for b in batches:
        decode = costs[f"decode b{b}"]
        for k in ks:
            chain, verify = costs[f"draft k{k} b{b}"], costs[f"verify k{k} b{b}"]
            row = dict(batch=b, k=k, decode_ms=1e3 * decode, chain_ms=1e3 * chain, draft_token_ms=1e3 * chain / k,
                       draft_token_over_decode=chain / k / decode, verify_ms=1e3 * verify,
                       verify_over_decode=verify / decode)  # fmt: skip
            for a in REPORTED_ACCEPTANCE:
                row[f"projected_speedup_a{a:.2f}"] = expected_tokens(a, k) * decode / (chain + verify)
            rows.append(row)
    return rows


def mtp_table(result: dict) -> list[str]:
    """The printed table (markdown) of ``mtp_costs``'s result."""
    m = result["mtp"]
    graphs = "CUDA graph" if m["decode_graphs"] else "eager: the runner captures no graphs for MLA"
    a0, a1 = REPORTED_ACCEPTANCE
    lines = [
        f"MTP drafting, {m['model']} ({m['dtype']}, random weights), {m['context']}-token context, "
        f"{result['environment']['device']}; decode steps {graphs}; the MTP layer's MoE {m['mtp_moe']}",
        "",
        f"| batch | k | decode ms | chain of k ms | ms per draft token | draft token / decode | verify k + 1 ms | "
        f"verify / decode | projected speed-up, a = {a0:.2f} | projected, a = {a1:.2f} |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in m["rows"]:
        lines.append(
            "| " + text_row([r["batch"], r["k"], f"{r['decode_ms']:.3f}", f"{r['chain_ms']:.3f}",
                             f"{r['draft_token_ms']:.3f}", f"{r['draft_token_over_decode']:.3f}",
                             f"{r['verify_ms']:.3f}", f"{r['verify_over_decode']:.2f}",
                             f"{r[f'projected_speedup_a{a0:.2f}']:.2f}x (projection)",
                             f"{r[f'projected_speedup_a{a1:.2f}']:.2f}x (projection)"], [0] * 10, " | ") + " |"
        )  # fmt: skip
    lines += ["", "Measured end to end (random weights: acceptance MEANINGLESS for quality, the point is cost):", ""]
    lines += ["| k | temperature | acceptance | tau |", "|---|---|---|---|"]
    lines += [f"| {r['k']} | {r['temperature']} | {r['acceptance']:.3f} | {r['tau']:.2f} |" for r in m["acceptance"]]
    return lines


# -- draft heads (EAGLE, Medusa) and draft trees on the Llama-3-8B shape ----------------------------------------------


def vocab_suffix(size: int) -> str:
    """The suffix a draft vocabulary of ``size`` tokens adds to a proposer's name: ``-v8k`` (8000), ``-v300``."""
    return f"-v{size // 1000}k" if size % 1000 == 0 else f"-v{size}"


def rounded_heads(folder: Path, scheme: str, out: Path) -> Path:
    """``--head-schemes``: a copy of the heads in ``folder`` with every weight matrix rounded to ``scheme``'s grid
    (RTN, ``weight_scheme`` names: ``w8a16-pc``, ``w4a16-g128``) and stored dequantized in its dtype, so that tau
    measures what quantized heads would draft. The runtime drafts with these weights in float: their speed is not
    that of quantized heads."""
    from safetensors.torch import load_file

    from quantkit.algorithms.rtn import rtn
    from quantkit.runtime.speculative.config import weight_scheme
    from quantkit.runtime.speculative.draft_vocab import COUNTS_FILE
    from quantkit.runtime.speculative.heads import WEIGHTS_FILE, read_meta, save_head_state

    grid = weight_scheme(scheme)
    meta = read_meta(folder)
    tensors = load_file(str(folder / WEIGHTS_FILE))
    rounded = {k: rtn(v, grid).dequantize(v.dtype) if v.dim() == 2 else v for k, v in tensors.items()}
    save_head_state(out, rounded, {**meta, "weights_rounded_to": scheme})
    if (folder / COUNTS_FILE).is_file():
        (out / COUNTS_FILE).write_bytes((folder / COUNTS_FILE).read_bytes())
    err = max((rounded[k].float() - v.float()).abs().max().item() for k, v in tensors.items() if v.dim() == 2)
    print(f"heads {folder} rounded to {scheme} -> {out} (largest weight change {err:.4f})", flush=True)
    return out


def random_heads(llm: LLM, method: str, folder, num_heads: int = MEDUSA_HEADS):
    """Untrained heads of ``method`` for ``llm``'s model saved in ``folder`` (random weights: their cost is the
    trained heads' cost), so the engine's own loader takes them."""
    from quantkit.runtime.speculative.heads import base_fingerprint, make_heads, save_heads

    torch.manual_seed(0)
    model = llm.model
    count = num_heads if method == "medusa" else 1
    heads = make_heads(method, model.config, count)
    if method == "medusa":  # non-zero blocks: the product runs as it would trained
        for block in heads.blocks:
            torch.nn.init.normal_(block.weight, std=0.02)
    base = base_fingerprint(model.config, model.model.embed_tokens.weight)
    save_heads(folder, heads, {"method": method, "num_heads": count, "base": base})
    return folder


def head_costs(args, folder, smoke: bool = False) -> dict:
    """``--head-costs``: on random Llama-3-8B-shaped weights (bf16, and each of ``args.head_targets``: ``w4a16`` is
    RTN g128 codes), batch 1 on an ``args.context``-token context, the median seconds of: a decode step (CUDA
    graph); a verify step of k + 1 tokens (CUDA graph, with the heads' feature store attached); EAGLE's chain of k
    draft tokens (catch-up on the newest position, k - 1 layer steps, k readouts: ``EagleChains``, one CUDA graph);
    Medusa's K = 4 heads on the newest feature (4 readouts); each ``args.trees`` N: the EAGLE-2 tree of N tokens
    (``args.tree_k`` deep; ``EagleTrees``, one CUDA graph) or Medusa's, and the verify step of that tree (a CUDA
    graph of N + 1 tokens under the tree mask). The heads are random: their cost is a trained head's. ``smoke``: a
    tiny Llama on the CPU (timings meaningless)."""
    from quantkit.quant.scheme import QuantScheme
    from quantkit.runtime import loader
    from quantkit.runtime.speculative.draft_vocab import save_token_counts
    from quantkit.runtime.speculative.heads import head_proposer
    from quantkit.runtime.speculative.tree_draft import tree_drafter

    config = HEAD_SMOKE if smoke else DUMMY_MODELS["llama-3-8b"]
    context, k, depth = args.context, args.speed_k, args.tree_k
    room = max([k, *args.trees]) + 1
    schemes = {"bf16": None, "w4a16": QuantScheme(bits=4, group_size=128 if not smoke else 32, sym=True)}
    device = torch.device("cpu" if smoke else "cuda")
    out: dict = {}

    def time_of(fn) -> float:
        return median_seconds(fn, smoke=smoke, rep_ms=REP_MS)

    def target_costs(target: str) -> dict:  # one engine; it and everything holding it go when this returns
        model = loader.dummy(config, "float32" if smoke else "bfloat16", device, scheme=schemes[target])
        llm = LLM(model, max_model_len=context + room + 32, max_num_seqs=1, cuda_graph_max_bs=1)
        runner, costs, seed = llm.runner, {}, 1
        runner.capture_verify_graphs(k + 1)
        seqs = prefilled(llm, 1, context, room, seed)
        costs["decode"] = time_of(lambda: runner.run(of(seqs, 1)))
        llm.block_manager.free_seq(seqs[0])
        variants = [("eagle", None), *(("eagle", n) for n in args.draft_vocab), ("medusa", None)]
        for method, vocab in variants:
            label = method + ("" if vocab is None else vocab_suffix(vocab))
            heads = random_heads(llm, method, Path(folder) / f"{target}-{label}")
            if vocab is not None:  # every token counted once (the N lowest ids): which rows are read costs the same
                vocab_size = llm.model.config.vocab_size
                save_token_counts(heads, torch.randperm(vocab_size), vocab_size)
            spec = SpeculativeConfig(method=method, draft=str(heads), num_speculative_tokens=k, adaptive=False,
                                     draft_vocab_size=vocab)  # fmt: skip
            proposer = head_proposer(spec, runner)  # the runner hands it the features of every step from now on
            seed += 1
            seqs = prefilled(llm, 1, context, room, seed)
            chain = proposer.propose(seqs, [k], [None])[0]  # the first catches up on the whole context
            wanted = min(k, MEDUSA_HEADS) if method == "medusa" else k
            if len(chain.tokens) != wanted:  # a proposer that drafted nothing would time as free
                raise RuntimeError(f"{label} drafted {len(chain.tokens)} tokens, not {wanted}")
            costs[f"{label} chain"] = time_of(lambda p=proposer, seqs=seqs: p.propose(seqs, [k], [None]))
            if label == "eagle":
                seqs[0].add_draft(chain.tokens, None)
                costs["verify chain"] = time_of(lambda seqs=seqs: runner.run(of(seqs, k + 1)))
                seqs[0].drop_draft()
            for n in args.trees:
                tree_spec = dataclasses.replace(spec, num_speculative_tokens=depth, num_tree_tokens=n)
                drafter = tree_drafter(tree_spec, proposer, runner)
                tree = drafter.propose(seqs, [n], [depth])[0]
                costs[f"{label} tree {n}"] = time_of(lambda d=drafter, n=n, seqs=seqs: d.propose(seqs, [n], [depth]))
                if vocab is None:  # the verify step does not depend on the draft vocabulary
                    seqs[0].add_draft(tree.tokens.tolist(), None, tree.parent.tolist())
                    runner.capture_verify_graphs(n + 1, trees=True)  # as an engine drafting such trees verifies them
                    costs[f"verify {method} tree {n}"] = time_of(
                        lambda t=tree, seqs=seqs: runner.run(of(seqs, t.size + 1))
                    )
                    runner.capture_verify_graphs(k + 1)
                    seqs[0].drop_draft()
                costs[f"{label} tree {n} tokens"] = tree.size  # a count, not seconds
            proposer.release(set())
            runner.on_hidden = None
            llm.block_manager.free_seq(seqs[0])
        return costs

    for target in args.head_targets:
        out[target] = costs = target_costs(target)
        print(f"{target}: " + ", ".join(f"{key} {v if 'tokens' in key else f'{1e3 * v:.3f} ms'}"
                                        for key, v in costs.items()), flush=True)  # fmt: skip
        gc.collect()  # the engine's reference cycles (runner <-> proposer), then its memory
        if not smoke:
            torch.cuda.empty_cache()
    return out


def head_projection(costs: dict, accepted: list[dict], k: int, trees: list[int]) -> list[dict]:
    """The batch-1 speed-up PROJECTED for each target of ``head_costs`` at the tau part 1 measured (greedy; chains at
    k, trees of N tokens): tau * t_decode / (t_draft + t_verify), over the same target without speculation and over
    the bf16 target without speculation."""
    rows = []
    bf16 = costs.get("bf16", {}).get("decode")
    for target, c in costs.items():
        for r in accepted:
            if r["temperature"] != 0 or not r["proposer"].startswith(("eagle", "medusa")):
                continue
            if r.get("heads_rounded_to"):  # rounded heads (--head-schemes) draft in float: their cost is not timed
                continue
            method = "eagle" if r["proposer"].startswith("eagle") else "medusa"
            vocab = r.get("draft_vocab_size")  # heads run with a draft vocabulary: that vocabulary's costs
            label = method + ("" if vocab is None else vocab_suffix(vocab))
            if f"{label} chain" not in c:
                print(f"NOT PROJECTED {r['proposer']} ({target}): --head-costs did not time a draft vocabulary of "
                      f"{vocab} (--draft-vocab)", flush=True)  # fmt: skip
                continue
            if r["tree"] is None and r["k"] == k:
                draft, verify = c[f"{label} chain"], c["verify chain"]
            elif r["tree"] in trees:  # timed with the chain of the same heads
                draft, verify = c[f"{label} tree {r['tree']}"], c[f"verify {method} tree {r['tree']}"]
            else:
                continue
            step = draft + verify
            row = dict(target=target, proposer=r["proposer"], prompts=r["prompts"], tree=r["tree"], tau=r["tau"],
                       step_ms=1e3 * step, projected_speedup=r["tau"] * c["decode"] / step)  # fmt: skip
            if bf16 is not None:
                row["projected_over_bf16"] = r["tau"] * bf16 / step
            rows.append(row)
    return rows
