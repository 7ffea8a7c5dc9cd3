"""Training draft heads (Medusa, EAGLE) on the target's own hidden states: ``train_draft(model, config, out)``.

Each step the target reads its batch of token windows without gradients (its final hidden states f [B, T, H]; its
logits are the lm_head of them at the positions the loss takes, so nothing vocabulary-sized or text-sized is stored,
and the whole text can serve), and the heads are self-distilled:

- Medusa: head j at position t minimises KL(p_{t+j} || q_j(t)), p_{t+j} the target's next-token distribution at
  t + j and q_j(t) = softmax(lm_head(head_j(f_t))) (Cai et al. 2024, self-distillation).
- EAGLE: the layer reads (f_t + noise, e(x_{t+1})) and predicts g_{t+1}; the loss is SmoothL1(g_{t+1}, f_{t+1}) +
  KL(p_{t+1} || softmax(lm_head(g_{t+1}))) (Li et al. 2024; the noise, a fraction of the features' RMS, stands in
  for the error of the draft's own features, on which it drafts after its first token).

A held-out share of the windows measures the loss and each head's top-1 agreement with the target's argmax before
training and after each epoch (``record["curve"]``: tokens seen, seconds, held-out loss). ``precision`` ``bf16`` runs
the target and the heads under bfloat16 autocast (the heads' weights, the optimizer and the loss stay float32);
``auto`` takes it on a GPU and float32 on the CPU. The run saves its state every ``save_every`` steps in
``OUT/.resume.pt`` (heads, optimizer, step, and the fingerprint of what the result depends on); ``resume=True``
continues from it and refuses a state of another run. The heads folder (``runtime.speculative.heads``) is written
only when training ends.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from quantkit.checks import integer, number
from quantkit.errors import QuantkitError
from quantkit.runtime.speculative.draft_vocab import save_token_counts
from quantkit.runtime.speculative.heads import METHODS, WEIGHTS_FILE, base_fingerprint, make_heads, save_heads

RESUME_FILE = ".resume.pt"
TOPK_RECORDED = 8  # Medusa: held-out accuracy of each head's best candidates, for the runtime's sparse tree
PRECISIONS = ("auto", "fp32", "bf16")
Progress = Callable[[str, int, int, str], None]  # (stage, done, total, note)


@dataclass(frozen=True)
class TrainDraftConfig:
    """- ``method``: ``eagle`` or ``medusa``; ``num_heads``: Medusa's K (EAGLE has one layer).
    - ``data``: text sources (``calib.data.load_text``: shipped names, local files, ``hf:`` datasets), joined.
    - ``tokens``: training tokens (windows of ``seqlen``; None: all of the text after the held-out windows);
      ``val_fraction``: held-out windows, as a share of the training ones.
    - ``batch_size`` windows per step, ``epochs`` passes, AdamW at ``lr`` (20-step warm-up, cosine to lr / 10).
    - ``feature_noise``: EAGLE's input noise, as a fraction of the features' RMS.
    - ``unroll``: EAGLE's drafting steps trained in a row, each on the features the steps before it predicted
      (``EagleHead.unrolled``; 1: on the target's features alone, as EAGLE-1 and -2 train).
    - ``loss_positions``: positions per window where the loss is taken (its vocabulary-sized products are most of a
      step's cost; None: all). Validation takes every position.
    - ``precision``: ``auto`` (bf16 on a GPU, fp32 on the CPU), ``fp32`` or ``bf16`` (autocast).
    - ``self_distill``: train on about this many tokens the target writes itself from passages of ``data``
      (``self_distilled_ids``) instead of on ``data`` (None).
    - ``save_every``: steps between resume states."""

    method: str
    num_heads: int = 4
    data: tuple[str, ...] = ("brown",)
    tokens: int | None = 200_000
    val_fraction: float = 0.05
    seqlen: int = 256
    batch_size: int = 4
    epochs: int = 1
    lr: float = 1e-3
    feature_noise: float = 0.1
    unroll: int = 1
    loss_positions: int | None = 64
    precision: str = "auto"
    self_distill: int | None = None
    save_every: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise QuantkitError(f"unknown draft head method {self.method!r}; available: {', '.join(METHODS)}")
        integer("tokens", self.tokens, low=1, none=True)
        integer("self_distill", self.self_distill, low=1, none=True)
        if self.precision not in PRECISIONS:
            raise QuantkitError(f"unknown precision {self.precision!r}; available: {', '.join(PRECISIONS)}")
        for name, low in (("num_heads", 1), ("seqlen", 2), ("batch_size", 1), ("epochs", 1),
                          ("save_every", 1), ("seed", 0)):  # fmt: skip
            integer(name, getattr(self, name), low=low)
        number("val_fraction", self.val_fraction, 0.0, 0.5, low_open=True)
        number("lr", self.lr, 0.0, 1.0, low_open=True)
        number("feature_noise", self.feature_noise, 0.0, 10.0)
        integer("loss_positions", self.loss_positions, low=1, none=True)
        integer("unroll", self.unroll, low=1, high=self.seqlen - 1)
        if self.method != "eagle" and self.unroll != 1:
            raise QuantkitError(f"unroll trains EAGLE's chained drafting steps; {self.method} heads take unroll 1")
        object.__setattr__(self, "data", tuple(self.data) if not isinstance(self.data, str) else (self.data,))


def _digest(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:16]


def token_stream(data: tuple[str, ...], tokenizer) -> tuple[torch.Tensor, list[dict]]:
    """All tokens of the sources, joined, and each source's fingerprint."""
    from quantkit.calib.data import load_text, tokenize

    if tokenizer is None:
        raise QuantkitError("training draft heads on text needs the model's tokenizer")
    parts, prints = [], []
    for source in data:
        text, where = load_text(source)
        ids = tokenize(tokenizer, text)
        parts.append(ids)
        prints.append({"source": where.source, "sha256": where.sha256, "tokens": int(ids.numel())})
    return torch.cat(parts), prints


INSTRUCTIONS = (  # chat turns built on passages of the training text, for the target's own chat-style answers
    "Continue this text.",
    "Summarise this passage.",
    "Explain this passage in simple words.",
    "What happens next? Write the next paragraph.",
    "List the main points of this passage.",
    "Rewrite this passage in plain modern English.",
    "Write a question about this passage and answer it.",
    "Describe the tone and the subject of this passage.",
)


def self_distilled_ids(llm, ids: torch.Tensor, tokens: int, prompt_len: int = 64, new_tokens: int = 192,
                       seed: int = 0) -> tuple[torch.Tensor, dict]:  # fmt: skip
    """Text the target writes itself, for heads that learn what it will be asked to continue: from random passages
    of ``prompt_len`` tokens of ``ids`` (training text), ``llm`` (a ``quantkit.runtime.LLM`` of the target) writes
    ``new_tokens`` tokens each, half of them as a plain continuation and half as the answer to a chat turn (one of
    ``INSTRUCTIONS`` and the passage) where the tokenizer has a chat template; half greedy, half sampled at
    temperature 0.7; EOS ignored, as speculative decoding's measurements do. Returns (prompts and answers joined,
    about ``tokens`` of them; the fingerprint of that text)."""
    from quantkit.runtime import SamplingParams

    if ids.numel() <= prompt_len:
        raise QuantkitError(f"self-distillation takes passages of {prompt_len} tokens; the text has {ids.numel()}")
    tokenizer = llm.tokenizer
    chat = getattr(tokenizer, "chat_template", None) is not None
    n = -(-tokens // (prompt_len + new_tokens))
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - prompt_len, (n,), generator=gen).tolist()
    prompts = []
    for i, start in enumerate(starts):
        passage = ids[start : start + prompt_len].tolist()
        if chat and i % 4 in (1, 2):  # chat turns in both halves below
            message = f"{INSTRUCTIONS[i // 2 % len(INSTRUCTIONS)]}\n\n{tokenizer.decode(passage)}"
            passage = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)  # fmt: skip
        prompts.append(passage)
    out = []
    for temperature, part in ((0.0, prompts[::2]), (0.7, prompts[1::2])):  # each half: plain and chat prompts
        params = SamplingParams(max_tokens=new_tokens, temperature=temperature, seed=seed, ignore_eos=True)
        out += [p + o.outputs[0].token_ids for p, o in zip(part, llm.generate(part, params), strict=True)]
    text = torch.tensor([t for seq in out for t in seq])
    where = {"source": f"self-distilled: {n} passages of {ids.numel()} training tokens, {new_tokens} new tokens each",
             "sha256": _digest(text.numpy().tobytes()), "tokens": int(text.numel())}  # fmt: skip
    return text, where


def split_windows(ids: torch.Tensor, config: TrainDraftConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Shuffled non-overlapping windows of ``ids``: (training [n, T], held-out [m, T])."""
    n_total = ids.numel() // config.seqlen
    windows = ids[: n_total * config.seqlen].view(n_total, config.seqlen)
    if config.tokens is None:  # all of it: n_val = val_fraction * n_train, n_train + n_val = n_total
        n_val = max(1, round(n_total * config.val_fraction / (1 + config.val_fraction)))
        n_train = n_total - n_val
    else:
        n_train = -(-config.tokens // config.seqlen)
        n_val = max(1, round(n_train * config.val_fraction))
    if n_total < n_train + n_val:
        raise QuantkitError(
            f"the text has {n_total} windows of {config.seqlen} tokens; {n_train} for training and {n_val} held out "
            "need more text (or lower --tokens)"
        )
    order = torch.randperm(n_total, generator=torch.Generator().manual_seed(config.seed))
    return windows[order[n_val : n_val + n_train]], windows[order[:n_val]]


def autocast(device: torch.device, precision: str):
    """The context the target and the heads run under: bfloat16 autocast, or none (float32)."""
    import contextlib

    return torch.autocast(device.type, torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


@torch.no_grad()
def target_features(model, windows: torch.Tensor) -> torch.Tensor:
    """The target's final (normed) hidden states of windows [B, T] -> [B, T, H], float32 on the windows' device."""
    return model.get_decoder()(input_ids=windows).last_hidden_state.float()


def _kl(target_logits: torch.Tensor, head_logits: torch.Tensor) -> torch.Tensor:
    """Mean KL(p || q) over rows of logits [..., V]."""
    p_log = target_logits.float().log_softmax(-1)
    return (p_log.exp() * (p_log - head_logits.float().log_softmax(-1))).sum(-1).mean()


def _pick(n: int, count: int | None, generator) -> torch.Tensor:
    """``count`` of the positions 0 .. n - 1 at random (all, in order, when ``count`` is None or >= n)."""
    if count is None or count >= n:
        return torch.arange(n)
    device = generator.device if generator is not None else "cpu"
    return torch.randperm(n, generator=generator, device=device)[:count].sort().values


def head_losses(heads, method: str, lm_head, embed, f, ids, noise: float, positions: int | None, generator=None,
                unroll: int = 1):  # fmt: skip
    """(loss, [top-1 agreement with the target's argmax of each Medusa head, or of each of EAGLE's ``unroll``
    drafting steps]) for features f [B, T, H], tokens ids [B, T]; the vocabulary-sized products (the loss's cost) are
    taken at ``positions`` random positions per window (and step)."""
    t = f.shape[1]
    if method == "medusa":
        outs = heads(f)
        loss, agree = 0.0, []
        for j in range(1, len(outs) + 1):  # head j at position t predicts the token the target gives at t + j
            at = _pick(t - j, positions, generator).to(f.device)
            logits = lm_head(outs[j - 1][:, at])
            with torch.no_grad():
                target_logits = lm_head(f[:, at + j])  # p_{t+j}, the target's next-token logits at t + j
            loss = loss + _kl(target_logits, logits)
            agree.append((logits.argmax(-1) == target_logits.argmax(-1)).float().mean().item())
        return loss / len(outs), agree
    inputs = f[:, :-1]
    if noise > 0:
        rms = inputs.pow(2).mean().sqrt()
        inputs = inputs + noise * rms * torch.randn(inputs.shape, generator=generator, device=f.device)
    outs = heads.unrolled(inputs, embed(ids[:, 1:]), unroll)
    loss, agree = 0.0, []
    for s, g in enumerate(outs):  # step s at position m >= s predicts f_{m+1} after drafting s features itself
        at = _pick(t - 1 - s, positions, generator).to(f.device) + s
        g, target = g[:, at], f[:, at + 1]
        logits = lm_head(g)
        with torch.no_grad():
            target_logits = lm_head(target)
        loss = loss + F.smooth_l1_loss(g.float(), target.float()) + _kl(target_logits, logits)
        agree.append((logits.argmax(-1) == target_logits.argmax(-1)).float().mean().item())
    return loss / len(outs), agree


def _evaluate(model, heads, method, ids, batch_size: int, device, precision: str, unroll: int = 1) -> dict:
    """Held-out loss and top-1 agreement of the heads on windows ids [m, T] (every position, no noise)."""
    lm_head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    heads.eval()
    losses, agree = [], []
    with torch.no_grad(), autocast(device, precision):
        for i in range(0, ids.shape[0], batch_size):
            x = ids[i : i + batch_size].to(device)
            loss, a = head_losses(heads, method, lm_head, embed, target_features(model, x), x, 0.0, None,
                                  unroll=unroll)  # fmt: skip
            losses.append(float(loss))
            agree.append(a)
        out = {"loss": round(sum(losses) / len(losses), 5),
               "top1": [round(sum(col) / len(col), 4) for col in zip(*agree, strict=True)]}  # fmt: skip
        if method == "medusa":
            out["topk_accuracy"] = topk_accuracy(model, heads, ids, batch_size, device)
    heads.train()
    return out


@torch.no_grad()
def topk_accuracy(model, heads, ids, batch_size: int, device, topk: int = TOPK_RECORDED) -> list[list[float]]:
    """Medusa heads on windows ids [n, T] -> [K, topk]: entry (j, i) the fraction of positions p where head j's i-th
    best candidate is the target's own choice of token p + j + 2 (``medusa_tree``'s accuracy table)."""
    lm_head = model.get_output_embeddings()
    hits, counts = None, None
    for i in range(0, ids.shape[0], batch_size):
        f = target_features(model, ids[i : i + batch_size].to(device))
        outs, t = heads(f), f.shape[1]
        if hits is None:
            hits, counts = torch.zeros(len(outs), topk, dtype=torch.float64), [0] * len(outs)
        for j in range(1, len(outs) + 1):
            candidates = lm_head(outs[j - 1][:, : t - j]).topk(topk, dim=-1).indices  # [B, T - j, topk]
            right = lm_head(f[:, j:]).argmax(-1, keepdim=True)  # the target's token at t + j + 1
            hits[j - 1] += (candidates == right).sum(dim=(0, 1)).double().cpu()
            counts[j - 1] += candidates.shape[0] * candidates.shape[1]
    return [[round(float(h) / max(c, 1), 4) for h in row] for row, c in zip(hits, counts, strict=True)]


def train_draft(
    model, config: TrainDraftConfig, out, tokenizer=None, ids: torch.Tensor | None = None, resume: bool = False,
    device=None, progress: Progress | None = None, data_print: list[dict] | None = None,
) -> dict:  # fmt: skip
    """Train ``config.method`` heads for ``model`` (a spec ``quantkit.load_model`` takes, or a loaded HF causal LM
    with ``tokenizer``) and write them to ``out``; ``ids`` [N] (token ids) replaces the text sources, and
    ``data_print`` (``token_stream``'s, when the ids are its tokens) records where they came from. Returns the
    training record saved in the heads' config."""
    from quantkit.devices import resolve_device

    out = Path(out)
    device = resolve_device(device)
    if (out / WEIGHTS_FILE).exists() and not resume:
        raise QuantkitError(f"{out} already holds draft heads; choose another --out")
    if resume and not (out / RESUME_FILE).exists():
        raise QuantkitError(f"nothing to resume in {out} (no {RESUME_FILE})")
    spec = str(model) if isinstance(model, str | Path) else None
    if config.self_distill is not None and (spec is None or ids is not None):
        raise QuantkitError("self_distill needs the model as a path or name and the text as data sources")
    if spec is not None:
        from quantkit.checkpoint.load import load_any

        model, tokenizer = load_any(spec, torch.float32, str(device))
    model.eval().requires_grad_(False)
    if ids is None:
        ids, data_print = token_stream(config.data, tokenizer)
        if config.self_distill is not None:
            from quantkit.models.loading import resolve_model
            from quantkit.runtime import LLM

            memory = {"gpu_memory_utilization": 0.3} if device.type == "cuda" else {}  # beside the target above
            llm = LLM(str(resolve_model(spec)), device=str(device), **memory)
            ids, where = self_distilled_ids(llm, ids, config.self_distill, seed=config.seed)
            data_print = [*data_print, where]
            del llm
    elif data_print is None:
        data_print = [{"source": "token ids", "sha256": _digest(ids.cpu().numpy().tobytes()), "tokens": ids.numel()}]
    train_ids, val_ids = split_windows(ids.long(), config)
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    base = base_fingerprint(model.config, embed.weight)
    settings = {k: v for k, v in asdict(config).items() if k != "save_every"}
    fingerprint = _digest(repr((sorted(settings.items()), data_print, base)))
    torch.manual_seed(config.seed)
    heads = make_heads(config.method, model.config, config.num_heads).to(device)
    if config.method == "eagle":
        heads.set_rope(config.seqlen, device)
    heads.train()
    steps_per_epoch = -(-train_ids.shape[0] // config.batch_size)
    total = steps_per_epoch * config.epochs
    n_tokens = int(train_ids.numel())
    optim = torch.optim.AdamW(heads.parameters(), lr=config.lr, weight_decay=0.0)

    def lr_at(step: int) -> float:
        warm = min(1.0, (step + 1) / 20)
        return config.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / max(total, 1))))

    step, record = 0, {}
    if resume:
        state = torch.load(out / RESUME_FILE, weights_only=False)
        if state["fingerprint"] != fingerprint:
            raise QuantkitError(f"the resume state in {out} is of another run (model, data or settings differ)")
        heads.load_state_dict(state["heads"])
        optim.load_state_dict(state["optim"])
        step, record = state["step"], state["record"]
    precision = config.precision if config.precision != "auto" else "bf16" if device.type == "cuda" else "fp32"

    def evaluate() -> dict:
        return _evaluate(model, heads, config.method, val_ids, config.batch_size, device, precision, config.unroll)

    if "before" not in record:
        record["before"] = evaluate()
        record["curve"] = [{"epoch": 0, "tokens": 0, "seconds": 0.0, "loss": record["before"]["loss"],
                            "top1": record["before"]["top1"]}]  # fmt: skip
    t0 = time.perf_counter() - record.get("seconds", 0.0)  # training and the held-out evaluations between epochs
    while step < total:
        epoch, i = divmod(step, steps_per_epoch)
        order = torch.randperm(train_ids.shape[0], generator=torch.Generator().manual_seed(config.seed + 1 + epoch))
        rows = order[i * config.batch_size : (i + 1) * config.batch_size]
        for group in optim.param_groups:
            group["lr"] = lr_at(step)
        noise_gen = torch.Generator(device).manual_seed(config.seed * 1_000_003 + step)
        x = train_ids[rows].to(device)
        with autocast(device, precision):
            f = target_features(model, x)
            loss, agree = head_losses(heads, config.method, lm_head, embed, f, x, config.feature_noise,
                                      config.loss_positions, noise_gen, config.unroll)  # fmt: skip
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        optim.step()
        step += 1
        if progress is not None:
            progress("training", step, total, f"loss {loss.item():.3f} top-1 {' '.join(f'{a:.2f}' for a in agree)}")
        if step % steps_per_epoch == 0 and step < total:  # the held-out loss after each epoch but the last
            seen = evaluate()
            record["curve"].append({"epoch": step // steps_per_epoch, "tokens": step // steps_per_epoch * n_tokens,
                                    "seconds": round(time.perf_counter() - t0, 1), "loss": seen["loss"],
                                    "top1": seen["top1"]})  # fmt: skip
        if step % config.save_every == 0 and step < total:
            record["seconds"] = time.perf_counter() - t0
            state = {"fingerprint": fingerprint, "step": step, "heads": heads.state_dict(),
                     "optim": optim.state_dict(), "record": record}  # fmt: skip
            out.mkdir(parents=True, exist_ok=True)
            torch.save(state, out / f"{RESUME_FILE}.tmp")
            (out / f"{RESUME_FILE}.tmp").replace(out / RESUME_FILE)  # whole or not at all
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = round(time.perf_counter() - t0, 1)
    record["after"] = evaluate()
    record["curve"].append({"epoch": config.epochs, "tokens": config.epochs * n_tokens, "seconds": seconds,
                            "loss": record["after"]["loss"], "top1": record["after"]["top1"]})  # fmt: skip
    record.update(steps=total, train_tokens=n_tokens, val_tokens=int(val_ids.numel()),
                  tokens_seen=config.epochs * n_tokens, seconds=seconds, device=str(device),
                  precision=precision)  # fmt: skip
    cfg = model.config
    sizes = {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size}
    if config.method == "eagle":
        sizes.update(intermediate_size=cfg.intermediate_size, num_attention_heads=cfg.num_attention_heads,
                     num_key_value_heads=cfg.num_key_value_heads)  # fmt: skip
    meta = {"method": config.method, "num_heads": config.num_heads if config.method == "medusa" else 1,
            "sizes": sizes, "base": base, "data": data_print, "settings": settings, "training": record}  # fmt: skip
    save_heads(out, heads, meta)
    save_token_counts(out, train_ids, cfg.vocab_size)  # the draft vocabulary's frequencies (``draft_vocab``)
    (out / RESUME_FILE).unlink(missing_ok=True)
    return record
