"""Greedy EAGLE chains for a whole batch at once, through the runtime's own layer and kernels, replayed as CUDA graphs.

``EagleProposer`` drafts sequence by sequence in eager steps of plain PyTorch (~50 small kernels per layer step,
each launched from Python): on SmolLM2 a speculative step spent more time drafting than verifying. ``EagleChains``
drafts the chains of every greedy sequence of a step together, and runs the head's decoder layer as the target runs
its own (``DecoderLayer.forward``: fused norms, q/k/v and gate/up GEMMs, the rotary kernel that also stores K/V,
the paged prefill and decode attention kernels), so the whole draft — catch-up, k readouts, k - 1 layer steps — is
one CUDA graph, captured for each batch-size bucket (1, 2, 4, 8, 16) on first use.

- The cache: the layer's K/V in a paged cache of its own whose blocks are laid out by slot (a slot per running
  sequence, at most ``MAX_SLOTS``: a sequence without one drafts nothing that step; one more slot takes the padded
  rows of a graph's batch bucket). A sequence's position p sits at index p - lo of its slot, lo the first position
  whose target feature is known (0 unless its prefix came from the prefix cache), so the kernels' causal rule over
  indices is the layer's attention over positions lo .. p (RoPE still rotates by p).
- A step's window: per sequence, the up to ``width`` = k + 1 verified positions the cache has not seen (the target's
  features and the next tokens) as one prefill chunk, padded to ``width`` (padded rows store K/V past the real
  ones, which the chain's own K/V overwrite and no real row attends to); a longer catch-up (after the prompt, or
  after steps that drafted nothing) first runs its older positions eagerly.
- The chain: the layer's output at the last real row is read out (the target's lm_head) and its argmax is the first
  draft; each further depth is a decode step of the layer on (that feature, the draft's embedding).

Sampled requests, trees and MTP layers draft through ``EagleProposer``'s eager path (each keeps its own cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.kernels.attention.paged import default_num_splits
from quantkit.kernels.attention.tree_mask import TREE_MAX_TOKENS
from quantkit.runtime.attention import AttentionMetadata
from quantkit.runtime.model import concat_projections, head_dim
from quantkit.runtime.model_runner import capture
from quantkit.runtime.sequence import Sequence
from quantkit.runtime.speculative.proposers import Draft

MAX_SLOTS = 16  # sequences drafting at once; speculation stops paying well below such batch sizes
BATCH_BUCKETS = (1, 2, 4, 8, 16)
BLOCK = 16  # the cache's page size (the paged kernels' usual one)


def room(depth: int, topk: int | None = None) -> int:
    """Cache positions a slot needs past its sequence's last one: the padded window and the chain, or a tree's
    chunk of ``topk`` nodes per level (``eagle_trees``)."""
    return max(2 * depth, 0 if topk is None else topk * (depth - 1)) + 2


def cache_shape(config, max_model_len: int, extra: int, max_seqs: int) -> tuple[int, int, int, int]:
    """[blocks, BLOCK, Hkv, D] of the K (and of the V) cache of ``EagleChains``: the blocks of each slot (up to
    ``MAX_SLOTS`` of them, plus the scratch slot), each slot long enough for a sequence and ``extra`` (``room``)
    positions past it."""
    slots = min(MAX_SLOTS, max_seqs) + 1
    pages = -(-(max_model_len + extra) // BLOCK)
    return slots * pages, BLOCK, config.num_key_value_heads, head_dim(config)


def cache_bytes(config, dtype: torch.dtype, max_model_len: int, extra: int, max_seqs: int) -> int:
    """Device bytes of that cache, K and V: the engine keeps them out of the KV blocks it sizes."""
    n = 1
    for size in cache_shape(config, max_model_len, extra, max_seqs):
        n *= size
    return 2 * n * torch.empty(0, dtype=dtype).element_size()


def batched_cache_bytes(spec, config, dtype: torch.dtype, max_model_len: int, max_seqs: int) -> int:
    """The cache bytes of the batched drafter an EAGLE ``SpeculativeConfig`` gets (chains, or ``eagle_trees`` where
    its tree fits one mask word; else none, as for other methods and without speculation)."""
    if spec is None or spec.method != "eagle":
        return 0
    k, topk = spec.num_speculative_tokens, spec.tree_topk
    if spec.num_tree_tokens is None:
        extra = room(k)
    elif topk * (k - 1) <= TREE_MAX_TOKENS:
        extra = room(k, topk)
    else:
        return 0
    return cache_bytes(config, dtype, max_model_len, extra, max_seqs)


@dataclass
class _Slot:
    index: int
    lo: int = -1  # the store's lo when the cache was started (-1: empty)
    length: int = 0  # positions lo .. lo + length - 1 hold the layer's K/V of verified positions


@dataclass
class _Row:
    seq: Sequence
    slot: int
    lo: int
    start: int  # the window: positions start .. start + count - 1
    count: int


class EagleChains:
    """Greedy chains of up to ``depth`` tokens for the ``EagleProposer`` ``proposer`` of ``runner``'s target; CUDA
    graphs where the runner uses them (else the same steps run eagerly, as on the CPU)."""

    def __init__(self, proposer, depth: int, runner, extra: int | None = None):
        head, target = proposer.head, proposer.target
        self.proposer, self.head, self.depth, self.width = proposer, head, depth, depth + 1
        self.device, self.backend, self.use_graphs = runner.device, runner.backend, runner.use_graphs
        extra = room(depth) if extra is None else extra
        shape = cache_shape(target.config, runner.max_model_len, extra, runner.config.max_num_seqs)
        self.cache = tuple(torch.zeros(shape, dtype=target.dtype, device=self.device) for _ in range(2))
        self.pages = -(-(runner.max_model_len + extra) // BLOCK)
        self.scratch = shape[0] // self.pages - 1  # the padded rows' slot
        self.tables = torch.arange(shape[0], dtype=torch.int32, device=self.device).view(-1, self.pages)
        self.slots: dict[int, _Slot] = {}  # seq_id -> its slot
        self.free = list(range(self.scratch))[::-1]
        self.cos, self.sin = (t.to(target.dtype) for t in (head.cos, head.sin))
        attn, mlp = head.layer.self_attn, head.layer.mlp
        if self.device.type == "cuda":  # one GEMM for q/k/v, one for gate/up (copies: the eager path keeps the parts)
            attn.qkv_proj = concat_projections((attn.q_proj, attn.k_proj, attn.v_proj))
            mlp.gate_up_proj = concat_projections((mlp.gate_proj, mlp.up_proj))
        self.hidden, self.num_kv_heads = target.config.hidden_size, attn.num_kv_heads
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.static: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # batch bucket -> (feats, ints) buffers
        self.vocab = None  # a DraftReadout (``draft_vocab``): read out its rows only, draft its tokens only
        self.pool = None

    # -- the layer over the chains' cache ----------------------------------------------------------------------------

    def _layer(self, feats, ids, pos, meta: AttentionMetadata) -> torch.Tensor:
        """The head's layer on rows (f, e(x)) at positions ``pos`` [N] -> the predicted features [N, H]."""
        head = self.head
        x = head.fc(torch.cat([feats, self.proposer.embed(ids)], dim=-1))
        out, residual = head.layer(x, None, self.cos[pos], self.sin[pos], meta, self.cache)
        return head.norm.add_forward(out, residual)[0]

    def _logits(self, g: torch.Tensor) -> torch.Tensor:
        """Readout logits of features g [..., H]: over the whole vocabulary, or over ``vocab``'s tokens."""
        return self.proposer.readout(g) if self.vocab is None else self.vocab(g)

    def _tokens(self, index: torch.Tensor) -> torch.Tensor:
        """Token ids of positions in ``_logits``' last dimension."""
        return index if self.vocab is None else self.vocab.tokens(index)

    def _window_meta(self, width: int, slots, ctx, cu, tables) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=slots, num_decodes=0, prefill_block_tables=tables, prefill_cu_seqlens=cu,
            prefill_context_lens=ctx, max_prefill_len=width, prefill_has_prefix=True, backend=self.backend,
        )  # fmt: skip

    def _decode_meta(self, rows: int, slots, ctx, tables) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=slots, num_decodes=rows, decode_block_tables=tables, decode_context_lens=ctx,
            decode_num_splits=default_num_splits(rows, self.num_kv_heads, self.pages * BLOCK), backend=self.backend,
        )  # fmt: skip

    def _views(self, ints: torch.Tensor, b: int):
        """The parts of a step's int32 inputs for ``b`` rows: (window ids, positions, slots [b * width]; context
        lengths [b]; cu [b + 1]; the last real row of each window, each row's slot [b]; then ``_tail_sizes``)."""
        w = self.width
        sizes = [b * w] * 3 + [b, b + 1, b, b] + self._tail_sizes(b)
        return list(ints[: sum(sizes)].split(sizes))

    def _tail_sizes(self, b: int) -> list[int]:
        return [b] * (3 * (self.depth - 1))  # per chain depth 1 .. depth - 1: positions, slots, context lengths

    def _window(self, feats: torch.Tensor, views: list, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Catch up on the windows -> (the layer's output at each one's last real row [b, H], block tables)."""
        ids, pos, slots, ctx, cu, last, slot = views[:7]
        tables = self.tables[slot.long()]
        meta = self._window_meta(self.width, slots, ctx, cu, tables)
        return self._layer(feats, ids, pos, meta)[last.long()], tables

    def _draft(self, feats: torch.Tensor, ints: torch.Tensor, b: int) -> torch.Tensor:
        """Catch up on the windows, then draft ``depth`` tokens -> [b, depth] int64."""
        views = self._views(ints, b)
        g, tables = self._window(feats, views, b)
        chain = views[7:]
        tokens = []
        for j in range(self.depth):
            token = self._tokens(self._logits(g).argmax(-1))
            tokens.append(token)
            if j + 1 < self.depth:
                p, s, c = chain[3 * j : 3 * j + 3]
                g = self._layer(g, token, p, self._decode_meta(b, s, c, tables))
        return torch.stack(tokens, dim=1)

    # -- inputs ------------------------------------------------------------------------------------------------------

    def _ints(self, rows: list[_Row], b: int) -> torch.Tensor:
        """The host's int32 inputs of a step (``_views``' layout) for ``rows``, padded to ``b`` with scratch rows."""
        window, base, end, lo = self._window_ints(rows, b)
        p = end[None, :] + torch.arange(self.depth - 1, dtype=torch.int32)[:, None]  # the chain's positions
        chain = torch.stack([p, base + p, p - lo + 1], dim=1)  # [depth - 1, 3, b]
        return torch.cat([window, chain.flatten()])

    def _window_ints(self, rows: list[_Row], b: int):
        """The window part of ``_ints``, and per row: the flat cache slot of position 0 (``base``: position p sits
        at base + p), the position after the window's last real row, and lo [b]."""
        w = self.width
        ids, pos, slots = (torch.zeros(b, w, dtype=torch.int32) for _ in range(3))
        ctx, last, slot, bases, ends, los = (torch.zeros(b, dtype=torch.int32) for _ in range(6))
        for r in range(b):
            row = rows[r] if r < len(rows) else None
            index, lo, start, count = (row.slot, row.lo, row.start, row.count) if row else (self.scratch, 0, 0, 1)
            if row is not None:
                ids[r, :count] = torch.tensor(row.seq.token_ids[start + 1 : start + count + 1])
            base = index * self.pages * BLOCK - lo  # a position's flat cache slot is base + position
            pos[r] = torch.arange(start, start + w)
            slots[r] = base + pos[r]
            ctx[r] = start - lo + w
            last[r] = r * w + count - 1
            slot[r] = index
            bases[r], ends[r], los[r] = base, start + count, lo
        cu = torch.arange(b + 1, dtype=torch.int32) * w
        return torch.cat([ids.flatten(), pos.flatten(), slots.flatten(), ctx, cu, last, slot]), bases, ends, los

    def _fill(self, feats: torch.Tensor, rows: list[torch.Tensor]) -> None:
        """Write each row's window features at the start of its ``width`` rows of ``feats`` [b * width, H]."""
        for r, f in enumerate(rows):
            feats[r * self.width : r * self.width + f.shape[0]] = f

    def _replay(self, feats_rows: list[torch.Tensor], host: torch.Tensor, b: int) -> torch.Tensor:
        if b not in self.static:
            feats = torch.zeros(b * self.width, self.hidden, dtype=self.cache[0].dtype, device=self.device)
            ints = torch.zeros_like(host, device=self.device)
            self.static[b] = (feats, ints)
        feats, ints = self.static[b]
        self._fill(feats, feats_rows)
        if self.device.type == "cuda":
            host = host.pin_memory()  # an asynchronous copy
        ints.copy_(host, non_blocking=True)
        if b not in self.graphs:
            ints.copy_(self._ints([], b))  # scratch rows only: the warm-up and the capture write nothing else

            def forward():
                return self._draft(feats, ints, b)

            forward()  # warm-up: compiles the kernels outside the capture
            self.graphs[b] = capture(forward, self.pool)
            self.pool = self.graphs[b][0].pool()
            ints.copy_(host, non_blocking=True)
        graph, out = self.graphs[b]
        graph.replay()
        return out

    # -- drafting ----------------------------------------------------------------------------------------------------

    def _row(self, seq: Sequence) -> _Row | None:
        """The window of positions the cache has not seen, or None when the sequence's recent features are missing
        or no slot is free."""
        lo, hi = self.proposer.store.span(seq)
        n = seq.num_computed_tokens
        if hi != n or hi <= lo:
            return None
        slot = self.slots.get(seq.seq_id)
        if slot is None:
            if not self.free:
                return None
            slot = self.slots[seq.seq_id] = _Slot(self.free.pop())
        if slot.lo != lo:
            slot.lo, slot.length = lo, 0
        start = lo + min(slot.length, n - lo - 1)  # at least the last position runs again: its output drafts
        if n - start > self.width:  # a long catch-up: all but the last ``width`` positions first, eagerly
            self._catch_up(seq, slot.index, lo, start, n - self.width)
            start = n - self.width
        slot.length = n - lo
        return _Row(seq, slot.index, lo, start, n - start)

    def _run(self, seqs: list[Sequence], wanted: list[bool]) -> tuple[dict[int, int], torch.Tensor | None]:
        """Catch up and draft for the ``wanted`` sequences that can -> ({index in seqs: row}, ``_draft``'s output)."""
        rows = {i: self._row(seq) for i, seq in enumerate(seqs) if wanted[i]}
        rows = {i: row for i, row in rows.items() if row is not None}
        if not rows:
            return {}, None
        store = self.proposer.store
        feats = [store.seqs[r.seq.seq_id].buf[r.start : r.start + r.count] for r in rows.values()]
        if self.use_graphs:
            b = next(size for size in BATCH_BUCKETS if size >= len(rows))
            drafted = self._replay(feats, self._ints(list(rows.values()), b), b)
        else:
            b = len(rows)
            padded = torch.zeros(b * self.width, self.hidden, dtype=self.cache[0].dtype, device=self.device)
            self._fill(padded, feats)
            drafted = self._draft(padded, self._ints(list(rows.values()), b).to(self.device), b)
        return {i: r for r, i in enumerate(rows)}, drafted

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], ks: list[int]) -> tuple[dict[int, int], torch.Tensor] | None:
        """Greedy chains for each of ``seqs`` with ``ks[i]`` > 0 that can draft, left on the device -> ({index in
        seqs: row}, tokens [rows, depth]), or None when none can."""
        rows, drafted = self._run(seqs, [k > 0 for k in ks])
        return (rows, drafted) if rows else None

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """Greedy drafts of ``ks[i]`` (<= depth) tokens for each of ``seqs``, in one batched chain."""
        out = [Draft([]) for _ in seqs]
        launched = self.launch(seqs, ks)
        if launched is not None:
            rows, drafted = launched
            tokens = drafted[: len(rows)].tolist()
            for i, r in rows.items():
                out[i] = Draft(tokens[r][: ks[i]])
        return out

    def _catch_up(self, seq: Sequence, index: int, lo: int, start: int, end: int) -> None:
        """The layer's K/V at verified positions start .. end - 1 of ``seq`` (slot ``index``), eagerly."""
        n, device = end - start, self.device
        pos = torch.arange(start, end, dtype=torch.int32)
        slots = index * self.pages * BLOCK - lo + pos
        ids = torch.tensor(seq.token_ids[start + 1 : end + 1], dtype=torch.int32)
        ints = [t.to(device) for t in (ids, pos, slots, torch.tensor([end - lo], dtype=torch.int32),
                                       torch.tensor([0, n], dtype=torch.int32))]  # fmt: skip
        meta = self._window_meta(n, ints[2], ints[3], ints[4], self.tables[index : index + 1])
        self._layer(self.proposer.store.seqs[seq.seq_id].buf[start:end], ints[0], ints[1], meta)

    def release(self, keep: set[int]) -> None:
        for seq_id in [s for s in self.slots if s not in keep]:
            self.free.append(self.slots.pop(seq_id).index)
