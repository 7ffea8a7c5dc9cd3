"""Draft heads on the target's own features: Medusa and EAGLE, their saved form, and the proposers that draft with them.

- Medusa (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"):
  K heads; head j is a residual block f + SiLU(W_j f + b_j) on the target's last hidden state f_t, read out by the
  target's own lm_head, and predicts the token at t + j + 1 (the lm_head itself predicts t + 1).
- EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty"): one decoder layer of
  the target's own architecture (the runtime's ``DecoderLayer`` built from the target's config) on
  fc(concat(f_t, e(x_{t+1}))), then an RMSNorm, predicts the next feature f_{t+1}; the target's lm_head gives the
  token. It drafts autoregressively on its own predicted features, with a dense KV cache per sequence.

Both read the target's post-norm hidden states: the model runner hands every step's hidden rows to
``FeatureStore.record`` (``ModelRunner.on_hidden``), which keeps them by position per sequence. Drafts are chains
(the argmax for greedy requests, a sample of the head's filtered distribution for sampled ones), verified by the
lossless rule of ``rejection``. A sequence whose recent features are missing (its prefix came from the prefix cache,
or it was forked from another) drafts from the features it has, or not at all.

A heads folder holds ``heads.safetensors`` and ``config.json``: the method, the sizes, the training data's
fingerprint and the base model's (architecture, sizes, and a probe of its embedding: the sums of 32 rows), so heads
made for another model are refused when they load.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.kernels.dense.norm_rope import add_rms_norm_reference
from quantkit.runtime.inputs import packed_order
from quantkit.runtime.model import DecoderLayer, RMSNorm, architecture, decoder_spec, rope_tables, rotate
from quantkit.runtime.sampler import filter_logits
from quantkit.runtime.scheduler import ScheduledBatch
from quantkit.runtime.sequence import Sequence
from quantkit.runtime.speculative.proposers import Draft

FORMAT, VERSION = "quantkit-draft-heads", 1
METHODS = ("eagle", "medusa")
PROBE_ROWS = 32
PROBE_RTOL = 1e-2  # probe sums may differ by this fraction of their mean size (the same weights in another dtype)
CONFIG_FILE, WEIGHTS_FILE = "config.json", "heads.safetensors"


# -- the base model's fingerprint -----------------------------------------------------------------------------------


def base_fingerprint(config, embedding: torch.Tensor) -> dict:
    """What identifies the model heads are made for: its class, sizes, and the sums of 32 rows of its embedding."""
    rows = torch.linspace(0, embedding.shape[0] - 1, PROBE_ROWS).long()
    probe = embedding.detach()[rows.to(embedding.device)].double().sum(dim=1)
    return {
        "architecture": architecture(config),
        "hidden_size": int(config.hidden_size),
        "vocab_size": int(config.vocab_size),
        "num_hidden_layers": int(config.num_hidden_layers),
        "embedding_probe": [round(float(x), 6) for x in probe],
    }


def check_base(saved: dict, actual: dict, folder) -> None:
    """A QuantkitError naming the first difference between the heads' base model and this one."""
    for key in ("architecture", "hidden_size", "vocab_size", "num_hidden_layers"):
        if saved.get(key) != actual[key]:
            raise QuantkitError(
                f"draft heads {folder} were made for another model: {key} {saved.get(key)} there, {actual[key]} here"
            )
    a, b = torch.tensor(saved["embedding_probe"]), torch.tensor(actual["embedding_probe"])
    if (a - b).abs().max() > PROBE_RTOL * a.abs().mean():
        raise QuantkitError(f"draft heads {folder} were made for another model: its embedding weights differ")


# -- the modules ----------------------------------------------------------------------------------------------------


def _norm(module: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return add_rms_norm_reference(x, module.weight, module.eps)[0]  # plain torch: differentiable on every device


class MedusaHeads(nn.Module):
    """``forward(f [..., H]) -> [K, ..., H]``: head j's feature, whose lm_head logits predict the token at t + j + 1.
    The blocks start at zero, so an untrained head repeats the target's own next-token prediction."""

    def __init__(self, hidden_size: int, num_heads: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size, dtype=dtype) for _ in range(num_heads))
        for block in self.blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return torch.stack([f + F.silu(block(f)) for block in self.blocks])


class EagleHead(nn.Module):
    """``forward(features, embeds [B, T, H], positions [T], past) -> (next features [B, T, H], (k, v))``: position t
    takes (f_t, e(x_{t+1})) and predicts f_{t+1}; ``past`` (k, v) [B, T0, Hkv, D] are the earlier positions' keys and
    values (returned extended). The decoder layer is the runtime's own class; its forward here is plain torch (dense
    causal attention), so the same module trains and drafts on any device."""

    def __init__(self, config, dtype: torch.dtype = torch.float32):
        super().__init__()
        hidden = config.hidden_size

        def linear(name, n_in, n_out, bias):
            return nn.Linear(n_in, n_out, bias=bias, dtype=dtype)

        self.config = config
        self.fc = nn.Linear(2 * hidden, hidden, bias=True, dtype=dtype)
        # one dense layer of the target's shape (an MoE target's head gets a plain MLP of its intermediate size)
        self.layer = DecoderLayer(config, dataclasses.replace(decoder_spec(config), moe=None), 0, linear, 0, dtype)
        self.norm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.cos = self.sin = None

    def set_rope(self, max_len: int, device) -> None:
        self.cos, self.sin = rope_tables(self.config, max_len, device)

    def _project(self, features, embeds, positions):
        """fc, the input norm and q / k / v with RoPE at ``positions``: (x [B, T, H], q, k, v [B, T, heads, D])."""
        x = self.fc(torch.cat([features, embeds], dim=-1))
        attn = self.layer.self_attn
        b, t, _ = x.shape
        h = _norm(self.layer.input_layernorm, x)
        q = attn.q_proj(h).view(b, t, attn.num_heads, attn.head_dim)
        k = attn.k_proj(h).view(b, t, attn.num_kv_heads, attn.head_dim)
        v = attn.v_proj(h).view(b, t, attn.num_kv_heads, attn.head_dim)
        if attn.q_norm is not None:
            q, k = _norm(attn.q_norm, q), _norm(attn.k_norm, k)
        cos, sin = self.cos[positions].to(q.dtype), self.sin[positions].to(q.dtype)
        if positions.dim() == 2:  # a position per row and step [B, T]: rotate the rows flattened
            cos, sin = cos.flatten(0, 1), sin.flatten(0, 1)
            return x, rotate(q.flatten(0, 1), cos, sin).view_as(q), rotate(k.flatten(0, 1), cos, sin).view_as(k), v
        return x, rotate(q, cos, sin), rotate(k, cos, sin), v

    def _finish(self, x, q, k, v, mask):
        """Attention of q over k / v under ``mask`` [T, Tk] or [B, 1, T, Tk] (True: attend), then the MLP and the
        final norm."""
        attn, mlp = self.layer.self_attn, self.layer.mlp
        b, t, _ = x.shape
        rep = attn.num_heads // attn.num_kv_heads
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.repeat_interleave(rep, dim=2).transpose(1, 2),
            v.repeat_interleave(rep, dim=2).transpose(1, 2),
            attn_mask=mask,
            scale=attn.scale,
        )
        x = x + attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        h = _norm(self.layer.post_attention_layernorm, x)
        x = x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
        return _norm(self.norm, x)

    def forward(self, features, embeds, positions, past=None):
        x, q, k, v = self._project(features, embeds, positions)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=1), torch.cat([past[1], v], dim=1)
        t = x.shape[1]
        t0 = k.shape[1] - t
        mask = torch.arange(t0 + t, device=x.device)[None, :] <= t0 + torch.arange(t, device=x.device)[:, None]
        return self._finish(x, q, k, v, mask), (k, v)

    def unrolled(self, features, embeds, steps: int) -> list[torch.Tensor]:
        """Training on the head's own features ("training-time test", Li et al. 2025, EAGLE-3): ``steps`` drafting
        steps over windows features, embeds [B, T, H] (position m: f_m and e(x_{m+1})) -> each step's predicted
        features [B, T, H]. Step 0 is ``forward``; step s >= 1 at position m reads step s - 1's prediction of f_m (its
        output at m - 1) and attends as a chain drafted after position m - s does: to step 0's keys up to m - s
        and to one key of each step 1 .. s (positions m - s + 1 .. m). Its output at m predicts f_{m+1}; positions
        m < s have no such chain (their outputs are not to be trained on)."""
        t, device = features.shape[1], features.device
        positions = torch.arange(t, device=device)
        outs, keys, values = [], [], []
        x_in = features
        for s in range(steps):
            x, q, k, v = self._project(x_in, embeds, positions)
            keys.append(k)
            values.append(v)
            m = positions[:, None]  # query positions [T, 1]
            j = positions[None, :]
            mask = torch.cat([j <= m - s] + [j == m - s + r for r in range(1, s + 1)], dim=1)  # [T, (s + 1) T]
            outs.append(self._finish(x, q, torch.cat(keys, dim=1), torch.cat(values, dim=1), mask))
            x_in = torch.cat([outs[-1][:, :1], outs[-1][:, :-1]], dim=1)  # position m reads the prediction of f_m
        return outs


def make_heads(method: str, config, num_heads: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    if method == "medusa":
        return MedusaHeads(config.hidden_size, num_heads, dtype)
    if method == "eagle":
        if decoder_spec(config).mla:
            raise QuantkitError("EAGLE heads need q/k/v attention; DeepSeek-V3 (latent attention) drafts with its own "
                                "MTP layers: speculative method mtp")  # fmt: skip
        return EagleHead(config, dtype)
    raise QuantkitError(f"unknown draft head method {method!r}; available: {', '.join(METHODS)}")


# -- saving and loading ---------------------------------------------------------------------------------------------


def save_heads(folder: Path, heads: nn.Module, meta: dict) -> None:
    """``meta``: method, num_heads, base (``base_fingerprint``), training ... -> config.json beside the weights."""
    save_head_state(folder, heads.state_dict(), meta)


def save_head_state(folder: Path, state: dict[str, torch.Tensor], meta: dict) -> None:
    """``save_heads`` from the tensors themselves (fp32 on the CPU); each file is written whole or not at all."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().cpu().contiguous() for k, v in state.items()}
    tmp = folder / f".{WEIGHTS_FILE}.tmp"
    save_file(state, str(tmp), metadata={"format": FORMAT})
    tmp.replace(folder / WEIGHTS_FILE)
    (folder / f".{CONFIG_FILE}.tmp").write_text(json.dumps({"format": FORMAT, "version": VERSION, **meta}, indent=2))
    (folder / f".{CONFIG_FILE}.tmp").replace(folder / CONFIG_FILE)


def read_meta(folder) -> dict:
    path = Path(folder) / CONFIG_FILE
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise QuantkitError(f"{folder} is not a draft heads folder ({CONFIG_FILE}: {exc})") from None
    if meta.get("format") != FORMAT:
        raise QuantkitError(f"{folder} is not a draft heads folder (made by quantkit train-draft)")
    if meta.get("version") != VERSION:
        raise QuantkitError(
            f"draft heads version {meta.get('version')} is not supported (this quantkit reads {VERSION})"
        )
    return meta


def load_heads(folder, method: str, config, embedding: torch.Tensor, dtype, device) -> tuple[nn.Module, dict]:
    """The heads in ``folder`` for the model of ``config`` / ``embedding``; refused if made for another model."""
    from safetensors.torch import load_file

    meta = read_meta(folder)
    if meta["method"] != method:
        raise QuantkitError(f"draft heads {folder} are {meta['method']} heads, not {method}")
    check_base(meta["base"], base_fingerprint(config, embedding), folder)
    heads = make_heads(method, config, meta.get("num_heads", 1))
    heads.load_state_dict(load_file(str(Path(folder) / WEIGHTS_FILE)))
    return heads.to(device=device, dtype=dtype).eval(), meta


# -- the target's features ------------------------------------------------------------------------------------------


@dataclass
class _Features:
    buf: torch.Tensor  # [capacity, H], indexed by position
    lo: int = 0  # positions lo .. hi - 1 hold features of the sequence's tokens (as of the step that computed them)
    hi: int = 0


class FeatureStore:
    """The target's last hidden state at each computed position of each running sequence."""

    def __init__(self) -> None:
        self.seqs: dict[int, _Features] = {}

    def record(self, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        """``hidden`` [batch tokens, H] in the runner's packed order: decodes first, then prefill chunks."""
        row = 0
        for i in packed_order(batch):
            seq, n = batch.seqs[i], batch.num_new[i]
            self._write(seq.seq_id, seq.num_computed_tokens, hidden[row : row + n])
            row += n

    def _write(self, seq_id: int, start: int, h: torch.Tensor) -> None:
        f = self.seqs.get(seq_id)
        end = start + h.shape[0]
        if f is None or f.buf.shape[0] < end:
            buf = torch.empty(max(end, 256, 2 * (f.buf.shape[0] if f else 0)), h.shape[1], dtype=h.dtype,
                              device=h.device)  # fmt: skip
            if f is not None:
                buf[: f.hi] = f.buf[: f.hi]
                f.buf = buf
            else:
                f = self.seqs[seq_id] = _Features(buf, start, start)
        if start > f.hi or start < f.lo:  # a gap (prefix-cache hit) or a recomputation from an earlier position
            f.lo = start
        f.buf[start:end] = h
        f.hi = end

    def span(self, seq: Sequence) -> tuple[int, int]:
        """Positions [lo, hi) whose features are known and verified for ``seq`` (hi <= its computed tokens)."""
        f = self.seqs.get(seq.seq_id)
        if f is None:
            return 0, 0
        return f.lo, min(f.hi, seq.num_computed_tokens)

    def release(self, keep: set[int]) -> None:
        for seq_id in [s for s in self.seqs if s not in keep]:
            del self.seqs[seq_id]

    def move(self, seq_id: int, src: list[int], dst: list[int]) -> None:
        """Copy the features at positions ``src`` to ``dst`` (a verified tree's accepted path, into consecutive
        positions)."""
        f = self.seqs.get(seq_id)
        if f is not None and src:
            f.buf[dst] = f.buf[src]


# -- the proposers --------------------------------------------------------------------------------------------------


def _choose(logits: torch.Tensor, seq: Sequence, generator) -> tuple[int, torch.Tensor | None]:
    """A drafted token from head logits [V]: the argmax (greedy), else a draw from the filtered distribution q."""
    if seq.params.greedy:
        return int(logits.argmax()), None
    q = filter_logits(logits.float(), seq.params).softmax(-1)
    noise = torch.empty_like(q).exponential_(generator=generator)
    return int((q / noise).argmax()), q


def _draft(tokens: list[int], probs: list) -> Draft:
    return Draft(tokens, torch.stack(probs) if probs and probs[0] is not None else None)


class MedusaProposer:
    """Drafts min(k, K) tokens from the K heads on the feature of the sequence's last computed position."""

    def __init__(self, target, heads: MedusaHeads, store: FeatureStore, cost_per_token: float):
        self.target, self.heads, self.store = target, heads, store
        self.cost_per_token = cost_per_token

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int], generators: list[torch.Generator | None]) -> list[Draft]:
        out = [Draft([]) for _ in seqs]
        spans = [self.store.span(s) for s in seqs]
        ready = [i for i, (s, (lo, hi)) in enumerate(zip(seqs, spans, strict=True)) if hi == s.num_computed_tokens > lo]
        if not ready:
            return out
        f = torch.stack([self.store.seqs[seqs[i].seq_id].buf[seqs[i].num_computed_tokens - 1] for i in ready])
        logits = self.target.logits(self.heads(f.to(self.target.dtype))).float()  # [K, n, V]
        for row, i in enumerate(ready):
            chosen = [_choose(logits[j, row], seqs[i], generators[i]) for j in range(min(ks[i], logits.shape[0]))]
            out[i] = _draft([t for t, _ in chosen], [q for _, q in chosen])
        return out

    def release(self, keep: set[int]) -> None:
        self.store.release(keep)


@dataclass
class _EagleCache:
    lo: int  # the first position of the cache (the feature store's lo when it was made)
    length: int = 0  # positions lo .. lo + length - 1 are in k, v
    kv: tuple[torch.Tensor, torch.Tensor] | None = None


class EagleProposer:
    """For each sequence: the EAGLE layer catches up on the verified positions (features from the target, tokens of
    the sequence) into its KV cache, then drafts k tokens on its own predicted features (those K/V are dropped)."""

    def __init__(self, target, head: EagleHead, store: FeatureStore, cost_per_token: float):
        self.target, self.head, self.store = target, head, store
        self.cost_per_token = cost_per_token
        self.caches: dict[int, _EagleCache] = {}
        self.readout = target.logits  # features -> logits (the MTP drafter reads out by its own head)
        self.embed = target.model.embed_tokens
        self._positions: torch.Tensor | None = None
        self.chains = None  # EagleChains: greedy steps draft through it (batched, CUDA graphs)
        self.trees = None  # EagleTrees: greedy sequences' trees (TreeDrafter)
        self.vocab = None  # a DraftReadout: the batched drafters' draft vocabulary (``draft_vocab``)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int], generators: list[torch.Generator | None]) -> list[Draft]:
        """Each sequence catches up and chains its layer on its own K/V; the readout of every sequence's feature at
        one depth is one product with the vocabulary matrix (read once per depth, not once per sequence: on a small
        model it is the largest weight, and a per-sequence readout was most of the drafting time). Steps of greedy
        sequences only go to ``chains`` where it is set."""
        if self.chains is not None and all(s.params.greedy for s in seqs):
            return self.chains.propose(seqs, ks)
        state = {i: self.catch_up(s) if k > 0 else None for i, (s, k) in enumerate(zip(seqs, ks, strict=True))}
        state = {i: caught for i, caught in state.items() if caught is not None}  # i -> (g [1, 1, H], kv)
        chosen: list[list] = [[] for _ in seqs]  # (token, q) per drafted position
        for j in range(max((ks[i] for i in state), default=0)):
            rows = [i for i in state if j < ks[i]]
            logits = self.readout(torch.cat([state[i][0][0] for i in rows])).float()  # [len(rows), V]
            best = logits.argmax(-1)  # greedy rows chain on it where it is: no wait for the device until the end
            for row, i in enumerate(rows):
                seq = seqs[i]
                token, q = (best[row], None) if seq.params.greedy else _choose(logits[row], seq, generators[i])
                chosen[i].append((token, q))
                if j + 1 < ks[i]:
                    g, kv = state[i]
                    ids = token.view(1, 1) if torch.is_tensor(token) else torch.tensor([[token]], device=g.device)
                    state[i] = self.head(g, self.embed(ids), self._position(seq.num_computed_tokens + j, g.device), kv)
        on_device = [t for c in chosen for t, _ in c if torch.is_tensor(t)]
        tokens = iter(torch.stack(on_device).tolist() if on_device else [])  # one transfer for every greedy token
        return [_draft([next(tokens) if torch.is_tensor(t) else t for t, _ in c], [q for _, q in c]) for c in chosen]

    def launch(self, seqs: list[Sequence], ks: list[int]):
        """Greedy chains of all of ``seqs`` through ``chains``, left on the device: ({index in seqs: row}, tokens
        [rows, k]); None where they cannot be (no chains, or a sampled request)."""
        if self.chains is None or not all(s.params.greedy for s in seqs):
            return None
        return self.chains.launch(seqs, ks)

    def _position(self, p: int, device) -> torch.Tensor:
        """[p] on ``device``, sliced from a kept range (a new tensor from the host would wait for the device)."""
        if self._positions is None or self._positions.numel() <= p:
            self._positions = torch.arange(max(2 * p, 4096), device=device)
        return self._positions[p : p + 1]

    def catch_up(self, seq: Sequence):
        """Run the layer over the sequence's verified positions not yet in its KV cache -> (the predicted feature
        after the last one [1, 1, H], the cache's (k, v)), or None when the sequence's recent features are missing."""
        lo, hi = self.store.span(seq)
        n = seq.num_computed_tokens  # the features of positions < n are the target's; token n is the newest
        if hi != n or hi <= lo:
            return None
        cache = self.caches.get(seq.seq_id)
        if cache is None or cache.lo != lo:
            cache = self.caches[seq.seq_id] = _EagleCache(lo)
        keep = min(cache.length, n - lo - 1)  # at least the last position runs again: its output drafts
        if cache.kv is not None:
            cache.kv = tuple(t[:, :keep] for t in cache.kv)
        start = lo + keep  # catch up on positions start .. n - 1: (f_t, x_{t+1})
        embed = self.embed
        device = self.store.seqs[seq.seq_id].buf.device
        feats = self.store.seqs[seq.seq_id].buf[start:n].unsqueeze(0).to(self.target.dtype)
        ids = torch.tensor(seq.token_ids[start + 1 : n + 1], device=device)
        g, cache.kv = self.head(feats, embed(ids).unsqueeze(0), torch.arange(start, n, device=device), cache.kv)
        cache.length = n - lo
        return g[:, -1:], cache.kv

    def release(self, keep: set[int]) -> None:
        self.store.release(keep)
        for seq_id in [s for s in self.caches if s not in keep]:
            del self.caches[seq_id]
        for batched in (self.chains, self.trees):
            if batched is not None:
                batched.release(keep)


def head_proposer(spec, runner):
    """The proposer of ``spec`` (method eagle or medusa, ``draft`` the heads folder) for the target of ``runner``,
    which from now on hands its hidden states to the proposer's feature store."""
    target = runner.model
    heads, _ = load_heads(spec.draft, spec.method, target.config, target.model.embed_tokens.weight, target.dtype,
                          runner.device)  # fmt: skip
    store = FeatureStore()
    runner.on_hidden = store.record

    def params(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    head_cost = target.config.vocab_size * target.config.hidden_size  # the lm_head's product, once per token
    if spec.method == "eagle":
        heads.set_rope(runner.max_model_len + spec.num_speculative_tokens + 1, runner.device)
        cost = (params(heads) + head_cost) / params(target)
        proposer = EagleProposer(target, heads, store, cost)
        if spec.draft_vocab_size is not None and spec.draft_vocab_size < target.config.vocab_size:
            from quantkit.runtime.speculative.draft_vocab import DraftReadout, draft_vocab

            ids = draft_vocab(spec.draft, spec.draft_vocab_size, target.config.vocab_size)
            proposer.vocab = DraftReadout(target, ids)
        if spec.num_tree_tokens is None:  # chains: greedy steps draft in one batched (graphed) chain
            from quantkit.runtime.speculative.eagle_chains import EagleChains

            proposer.chains = EagleChains(proposer, spec.num_speculative_tokens, runner)
            proposer.chains.vocab = proposer.vocab
        return proposer
    return MedusaProposer(target, heads, store, (params(heads) / len(heads.blocks) + head_cost) / params(target))
