"""Part 0 of ``bench_spec.py``: draft heads trained on the target's features at growing budgets (``--train``), the
target and its text loaded once; each set of heads joins part 1 as a proposer, so tau is measured against training
tokens."""

from __future__ import annotations

import gc
import time

import torch

from quantkit.runtime import LLM


def sync(llm: LLM) -> None:
    if llm.device.type == "cuda":
        torch.cuda.synchronize()


def parse_train(item: str) -> tuple[str, int | None, int, str, int]:
    """``--train METHOD:TOKENS|all[:EPOCHS[:text|self[:UNROLL]]]`` -> (method, tokens or None for all, epochs, text
    source, EAGLE's unrolled steps); ValueError naming the item otherwise."""
    from quantkit.runtime.speculative.heads import METHODS

    parts = item.split(":")
    method, tokens, epochs, source, unroll = (parts + ["", "", "1", "text", "1"][len(parts) :])[:5]
    if not (
        2 <= len(parts) <= 5
        and method in METHODS
        and (tokens == "all" or (tokens.isdigit() and int(tokens) > 0))
        and epochs.isdigit()
        and int(epochs) > 0
        and source in ("text", "self")
        and unroll.isdigit()
        and int(unroll) > 0
    ):
        raise ValueError(
            f"--train {item!r}: expected METHOD:TOKENS|all[:EPOCHS[:text|self[:UNROLL]]], METHOD one of {METHODS}"
        )
    return method, None if tokens == "all" else int(tokens), int(epochs), source, int(unroll)


def train_heads(args, folder: str, device: str, settings: dict) -> list[dict]:
    """Part 0: for each ``--train`` item, heads trained on the target's features (target and text loaded once); items
    ending in ``:self`` train on the target's own continuations of the training text (``--self-tokens`` of them)."""
    from quantkit.checkpoint.load import load_any
    from quantkit.runtime.speculative.heads import WEIGHTS_FILE, read_meta
    from quantkit.train_draft import TrainDraftConfig, self_distilled_ids, token_stream, train_draft

    model, tokenizer = load_any(folder, torch.float32, device)
    data = tuple(d for d in args.train_data.split(",") if d)
    ids, data_print = token_stream(data, tokenizer)
    parts = ", ".join(f"{d} {p['tokens']:,}" for d, p in zip(data, data_print, strict=True))
    print(f"training text: {ids.numel():,} tokens ({parts})", flush=True)
    streams = {"text": (ids, data_print)}

    def self_stream() -> None:  # the target's own text, written once when first needed (kept in --heads-dir)
        saved = args.heads_dir / f"self-distilled-{args.self_tokens}.pt"
        if saved.exists():
            state = torch.load(saved)
            if state["text"] == data_print:
                streams["self"] = (state["ids"], [*data_print, state["where"]])
                print(f"SELF-DISTILLED text: {state['ids'].numel():,} tokens, written earlier ({saved})", flush=True)
                return
        llm, t0 = LLM(folder, **settings), time.perf_counter()
        own, where = self_distilled_ids(llm, ids, args.self_tokens)
        sync(llm)
        streams["self"] = (own, [*data_print, where])
        print(f"SELF-DISTILLED text: {own.numel():,} tokens in {time.perf_counter() - t0:.1f} s", flush=True)
        saved.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"ids": own, "where": where, "text": data_print}, saved)
        del llm
        gc.collect()
        torch.cuda.empty_cache()

    rows = []
    for item in args.train:
        method, tokens, epochs, source, unroll = parse_train(item)
        name = f"{method}-{'all' if tokens is None else f'{tokens // 1000}k'}x{epochs}"
        name += ("-self" if source == "self" else "") + (f"-u{unroll}" if unroll > 1 else "")
        config = TrainDraftConfig(method=method, data=data, tokens=tokens, unroll=unroll,
                                  epochs=epochs, seqlen=args.train_seqlen, batch_size=args.train_batch_size,
                                  lr=args.train_lr, loss_positions=args.train_loss_positions or None)  # fmt: skip
        heads = args.heads_dir / name
        if (heads / WEIGHTS_FILE).exists():  # made by an earlier run: measured, not retrained
            record = read_meta(heads)["training"]
        else:
            try:  # a failed run is reported; the others still train and are measured
                if source not in streams:
                    self_stream()
                record = train_draft(model, config, heads, tokenizer, ids=streams[source][0], device=device,
                                     data_print=streams[source][1])  # fmt: skip
            except Exception as exc:
                print(f"FAILED training {name}: {type(exc).__name__}: {exc}", flush=True)
                continue
        args.trained[name] = dict(method=method, draft=str(heads))
        rows.append(
            dict(
                name=name,
                method=method,
                epochs=epochs,
                **{
                    k: record[k]
                    for k in (
                        "train_tokens",
                        "tokens_seen",
                        "steps",
                        "seconds",
                        "before",
                        "after",
                        "curve",
                        "device",
                        "precision",
                    )
                },
            )
        )
        r = rows[-1]
        top1 = " ".join(f"{a:.3f}" for a in r["after"]["top1"])
        curve = " ".join(f"{c['loss']:.3f}" for c in r["curve"][1:])
        print(f"TRAIN {name}: {r['train_tokens']:,} tokens x {epochs} = {r['tokens_seen']:,} seen, {r['steps']} steps, "
              f"{r['seconds']:.1f} s; held-out loss {r['before']['loss']:.3f} -> {r['after']['loss']:.3f} (per epoch "
              f"{curve}), top-1 {top1}", flush=True)  # fmt: skip
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows
