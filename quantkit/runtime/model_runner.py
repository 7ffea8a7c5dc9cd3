"""Runs scheduled steps on the model: owns the KV cache, packs each step's tokens, replays CUDA graphs for decodes.

KV cache: one tensor [layers, 2, num_blocks, block_size, Hkv, D] (MLA models: [layers, 1, num_blocks, block_size, 1,
kv_lora_rank + qk_rope_head_dim], the compressed latent); on CUDA the number of blocks is what fits in
``gpu_memory_utilization`` of the device after the weights and the activations of a profiling step of
``max_num_batched_tokens`` tokens. Pure-decode steps of up to ``cuda_graph_max_bs`` sequences replay a CUDA graph
captured for the next batch-size bucket (1, 2, 4, 8, then multiples of 16), padded rows writing nowhere. A step's
integer inputs reach the device in two host-to-device copies (``runtime.inputs``); the only device-to-host copy of
a step is the engine's read of the sampled tokens.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable

import torch

from quantkit.errors import QuantkitError
from quantkit.kernels.attention.paged import default_num_splits
from quantkit.kernels.attention.tree_mask import CAUSAL_ROW
from quantkit.runtime.attention import AttentionMetadata
from quantkit.runtime.config import EngineConfig
from quantkit.runtime.inputs import StepInputs, StepLayout, packed_order
from quantkit.runtime.model import CausalLM
from quantkit.runtime.sampling_params import SamplingParams
from quantkit.runtime.scheduler import ScheduledBatch
from quantkit.runtime.sequence import Sequence

GRAPH_MEMORY_RESERVE = 1 << 30  # bytes kept free for CUDA-graph pools and allocator slack
VERIFY_GRAPH_MAX_BS = 32  # speculative verify steps of up to this many sequences replay a CUDA graph
_PROFILE_PARAMS = SamplingParams(max_tokens=1)


def kv_block_bytes(model: CausalLM, block_size: int) -> int:
    """Bytes of one KV-cache block of ``model``: K and V of ``block_size`` tokens in every layer (MLA models: the
    latent rows, ``CausalLM.kv_layout``)."""
    parts, heads, width = model.kv_layout
    per_token = parts * model.config.num_hidden_layers * heads * width
    return per_token * block_size * torch.empty(0, dtype=model.dtype).element_size()


def capture(forward: Callable[[], torch.Tensor], pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A CUDA graph of ``forward()`` (its output tensor, rewritten by every replay). Only this thread's calls can
    break the capture ("thread_local": another thread's CUDA work is left alone), and the garbage collector waits
    until the capture ends, so that it cannot free objects of earlier engines (and their CUDA state) in the middle of
    it. Both guard against a capture failure seen now and then on an H100 when several engines were built in one
    process ("operation failed due to a previous error during capture")."""
    graph = torch.cuda.CUDAGraph()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool, capture_error_mode="thread_local"):
            out = forward()
    finally:
        if collecting:
            gc.enable()
    return graph, out


class ModelRunner:
    """``extra_block_bytes``: bytes that every KV block of this runner must leave free elsewhere on the device (a
    speculative draft model's cache of as many blocks), counted when the cache is sized from free memory;
    ``reserved_bytes``: bytes to leave free besides (the EAGLE chains' cache)."""

    def __init__(
        self, model: CausalLM, config: EngineConfig, device: torch.device, max_model_len: int,
        extra_block_bytes: int = 0, reserved_bytes: int = 0,
    ):  # fmt: skip
        self.model = model
        self.config = config
        self.device = device
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        cfg = model.config
        self.kv_parts, self.num_kv_heads, self.head_dim = model.kv_layout
        self.backend = self._backend()
        model.set_rope(max_model_len, device)
        self.block_bytes = kv_block_bytes(model, self.block_size)
        self.extra_block_bytes = extra_block_bytes
        self.reserved_bytes = reserved_bytes
        self.table_width = -(-max_model_len // self.block_size)
        self.inputs = StepInputs(self.block_size, self.table_width, pin=device.type == "cuda")
        self._copied = torch.cuda.Event() if device.type == "cuda" else None  # recorded after the input copies
        self.num_blocks = config.num_kv_blocks or self._blocks_that_fit()
        self.kv = self._empty_cache(self.num_blocks)
        self.kv_caches = [tuple(self.kv[i, j] for j in range(self.kv_parts)) for i in range(cfg.num_hidden_layers)]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.verify_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.verify_width = 0
        self.verify_trees = False  # whether the verify graphs hold a tree mask (draft trees verify in them)
        self.graph_pool = None
        # a proposer that reads the target's features (draft heads) sets this: called with each step's batch and
        # the final hidden states of all its tokens [T, hidden], in packed order (decodes first, then chunks)
        self.on_hidden: Callable[[ScheduledBatch, torch.Tensor], None] | None = None
        if self.use_graphs:
            self._capture_graphs()

    @property
    def use_graphs(self) -> bool:
        """Whether steps replay CUDA graphs: on CUDA, without ``enforce_eager``, for models whose forward can be
        captured (not MoE models whose experts are not stacked: their blocks read expert counts on the host)."""
        return self.device.type == "cuda" and not self.config.enforce_eager and self.model.graph_safe

    def _backend(self) -> str:
        backend = self.config.attention_backend
        if backend == "auto":
            return "triton" if self.device.type == "cuda" else "torch"
        if backend == "triton" and self.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise QuantkitError("the triton attention backend on CPU needs TRITON_INTERPRET=1 set before start-up")
        return backend

    def _empty_cache(self, num_blocks: int) -> torch.Tensor:
        cfg = self.model.config
        shape = (cfg.num_hidden_layers, self.kv_parts, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return torch.zeros(shape, dtype=self.model.dtype, device=self.device)

    def num_splits(self, num_decodes: int) -> int:
        """Flash-decoding splits, from the batch size and ``max_model_len`` only (never the current contexts), so a
        captured graph stays valid and eager steps split the way a graph of that size does."""
        return default_num_splits(num_decodes, self.num_kv_heads, self.max_model_len)

    # -- inputs ----------------------------------------------------------------------------------------------------

    def _write(self, batch: ScheduledBatch, graph_rows: int | None = None) -> StepLayout:
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies are done reading the host buffers
        return self.inputs.write(batch, graph_rows)

    def _to_device(self, layout: StepLayout, flat_dst: torch.Tensor | None, tables_dst: torch.Tensor | None):
        """Copy the step's host buffers to the device (into the given buffers, else into new tensors)."""
        host_flat = self.inputs.flat.tensor[: layout.size]
        host_tables = self.inputs.tables.buf.tensor[: layout.num_seqs]
        if flat_dst is None:
            flat = host_flat.to(self.device, non_blocking=True)
            tables = host_tables.to(self.device, non_blocking=True)
        else:
            flat, tables = flat_dst, tables_dst
            flat[: layout.size].copy_(host_flat, non_blocking=True)
            tables[: layout.num_seqs].copy_(host_tables, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return flat, tables

    def metadata(self, layout: StepLayout, flat: torch.Tensor, tables: torch.Tensor) -> AttentionMetadata:
        def part(name):
            a, b = layout.offsets[name]
            return flat[a:b]

        nd, n = layout.num_decodes, layout.num_seqs
        ctx = part("ctx")
        meta = AttentionMetadata(slot_mapping=part("slots"), num_decodes=nd, backend=self.backend)
        if nd:
            meta.decode_block_tables = tables[:nd]
            meta.decode_context_lens = ctx[:nd]
            meta.max_decode_context = layout.max_decode_context
            meta.decode_num_splits = self.num_splits(nd)
        if n > nd:
            meta.prefill_block_tables = tables[nd:n]
            meta.prefill_context_lens = ctx[nd:n]
            meta.prefill_cu_seqlens = part("cu")
            meta.max_prefill_len = layout.max_prefill_len
            meta.prefill_has_prefix = layout.prefill_has_prefix
            if layout.tree_mask is not None:  # draft trees: eager steps only (no graph holds a mask)
                meta.prefill_tree_mask = torch.from_numpy(layout.tree_mask).to(self.device, non_blocking=True)
        return meta

    # -- running ---------------------------------------------------------------------------------------------------

    def _patch_ids(self, layout: StepLayout, flat: torch.Tensor, source: dict[int, int], tokens: torch.Tensor):
        """Write on the device the input ids the host does not know yet: the decode row of every sequence in
        ``source`` (seq_id -> index into ``tokens``, the previous step's sampled tokens, still on the device)."""
        pairs = sorted(
            (row, source[sid]) for sid, row in layout.last_rows.items() if sid in source and row < layout.num_decodes
        )
        if not pairs:
            return
        ids = flat[layout.offsets["ids"][0] :]
        rows, src = zip(*pairs, strict=True)
        if rows == src == tuple(range(len(rows))):  # the same sequences in the same order: one copy
            ids[: len(rows)].copy_(tokens[: len(rows)])
            return
        index = self._device_index([rows, src])
        ids[index[0]] = tokens[index[1]]

    def _device_index(self, values) -> torch.Tensor:
        """``values`` (a list, or a list of lists) as an int64 tensor on the device, copied asynchronously (from
        pinned memory on CUDA: a pageable copy would wait for the work queued before it)."""
        pin = self.device.type == "cuda"
        return torch.tensor(values, dtype=torch.int64, pin_memory=pin).to(self.device, non_blocking=True)

    def _patch_drafts(self, layout: StepLayout, flat: torch.Tensor, batch: ScheduledBatch, drafts) -> None:
        """Write on the device the input ids of drafted tokens the host does not know yet: ``drafts`` (tokens
        [rows, k] on the device, seq_id -> row) hold the last ``num_draft_tokens`` of those sequences' chunks."""
        drafted, rows = drafts
        depth, dst, src = drafted.shape[1], [], []
        for seq in batch.seqs:
            k, row = seq.num_draft_tokens, rows.get(seq.seq_id)
            if k and row is not None:
                last = layout.last_rows[seq.seq_id]
                dst += range(last - k + 1, last + 1)
                src += range(row * depth, row * depth + k)
        if dst:
            index = self._device_index([dst, src])
            ids = flat[layout.offsets["ids"][0] :]
            ids[index[0]] = drafted.flatten()[index[1]].to(ids.dtype)

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch, ids_from: tuple[dict[int, int], torch.Tensor] | None = None, drafts=None
    ) -> torch.Tensor:
        """Execute one step; returns fp32 logits [sum over batch.sampled of 1 + num_draft_tokens, vocab] (a sequence
        verifying k drafted tokens gets the rows of its last k + 1 positions). ``ids_from`` (seq_id -> index, tokens
        int32 on the device): the input ids of those sequences' decode rows come from ``tokens`` instead of their
        ``token_ids``, whose last entry is then a placeholder (the engine runs a step before the previous one's
        tokens reached the host). ``drafts``: drafted tokens still on the device (``_patch_drafts``)."""
        if batch.copies:
            src, dst = (torch.tensor(x, device=self.device) for x in zip(*batch.copies, strict=True))
            self.kv[:, :, dst] = self.kv[:, :, src]
        n = batch.num_tokens
        bucket = None
        if len(batch.seqs) == n:  # one token per sequence: every one is a decode
            bucket = next((b for b in self.graphs if b >= n), None)
        elif (
            ids_from is None
            and self.verify_graphs
            and self._all_verify(batch)
            and (self.verify_trees or not any(s.draft_parents is not None for s in batch.seqs))
        ):
            rows = next((b for b in self.verify_graphs if b >= len(batch.seqs)), None)
            if rows is not None:
                return self._run_verify_graph(batch, rows, drafts)
        layout = self._write(batch, graph_rows=bucket)
        graph_buffers = (self.static["flat"], self.static["tables"]) if bucket is not None else (None, None)
        flat, tables = self._to_device(layout, *graph_buffers)
        if ids_from is not None:
            self._patch_ids(layout, flat, *ids_from)
        if drafts is not None:
            self._patch_drafts(layout, flat, batch, drafts)
        if bucket is not None:
            graph, out = self.graphs[bucket]
            graph.replay()
            hidden = out[:n]
        else:
            ids, pos = (flat[a:b] for a, b in (layout.offsets["ids"], layout.offsets["pos"]))
            hidden = self.model(ids, pos, self.metadata(layout, flat, tables), self.kv_caches)
        if self.on_hidden is not None:
            self.on_hidden(batch, hidden)
        if layout.sample_rows is not None:
            a, b = layout.offsets["sample"]
            hidden = hidden[flat[a:b]]
        return self.model.logits(hidden).float()

    # -- CUDA graphs -----------------------------------------------------------------------------------------------

    def _all_verify(self, batch: ScheduledBatch) -> bool:
        """Whether every sequence of ``batch`` computes at most verify_width tokens up to its end, sampling its last
        d + 1 of them (d drafted tokens; a plain decode is a verify of none, a draft model catching up on the
        target's verified tokens samples its last one), so the step fits a verify graph."""
        return all(
            seq.num_draft_tokens + 1 <= num_new <= self.verify_width
            and seq.num_computed_tokens + num_new == seq.num_tokens
            for seq, num_new in zip(batch.seqs, batch.num_new, strict=True)
        )

    def _run_verify_graph(self, batch: ScheduledBatch, rows: int, drafts=None) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()
        layout = self.inputs.write_verify(batch, rows, self.verify_width, self.verify_trees)
        if layout.tree_mask is not None:
            n = rows * self.verify_width
            self.vstatic["mask_host"].numpy()[:n] = layout.tree_mask
            self.vstatic["mask"][:n].copy_(self.vstatic["mask_host"][:n], non_blocking=True)
        flat, _ = self._to_device(layout, self.vstatic["flat"], self.vstatic["tables"])
        if drafts is not None:
            self._patch_drafts(layout, flat, batch, drafts)
        graph, out = self.verify_graphs[rows]
        graph.replay()
        if self.on_hidden is not None:  # the real rows (sequence i's from row i * width), in the eager step's order
            width = self.verify_width
            index = [i * width + j for i in packed_order(batch) for j in range(batch.num_new[i])]
            self.on_hidden(batch, out[self._device_index(index)])
        a, b = layout.offsets["sample"]
        return self.model.logits(out[flat[a:b]]).float()

    def alloc_verify_static(self, width: int, most: int, trees: bool = False) -> None:
        """The fixed device buffers that captured verify steps of up to ``most`` sequences of ``width`` read (and,
        with ``trees``, the tree mask's words, and their pinned host copy)."""
        self.verify_width, self.verify_trees = width, trees
        self.vstatic = {
            "flat": torch.zeros(most * (4 * width + 2) + 1, dtype=torch.int32, device=self.device),
            "tables": torch.zeros(most, self.table_width, dtype=torch.int32, device=self.device),
        }
        if trees:
            pin = self.device.type == "cuda"
            self.vstatic["mask"] = torch.full((most * width,), CAUSAL_ROW, dtype=torch.int64, device=self.device)
            self.vstatic["mask_host"] = torch.full((most * width,), CAUSAL_ROW, dtype=torch.int64, pin_memory=pin)

    def static_verify_forward(self, b: int, width: int):
        """The verify step of ``b`` sequences of ``width`` tokens each over the static buffers (``write_verify``'s
        layout), as a callable; until real inputs arrive every chunk starts at position 0 and stores nothing."""
        flat, n = self.vstatic["flat"], b * width
        ids, pos, slots = flat[:n], flat[n : 2 * n], flat[2 * n : 3 * n]
        ctx, cu = flat[3 * n : 3 * n + b], flat[3 * n + b : 3 * n + 2 * b + 1]
        meta = AttentionMetadata(
            slot_mapping=slots,
            num_decodes=0,
            prefill_block_tables=self.vstatic["tables"][:b],
            prefill_cu_seqlens=cu,
            prefill_context_lens=ctx,
            max_prefill_len=width,
            prefill_has_prefix=True,
            backend=self.backend,
            prefill_tree_mask=self.vstatic["mask"][:n] if self.verify_trees else None,
        )
        ids.zero_()
        pos.zero_()
        slots.fill_(-1)
        ctx.fill_(width)
        cu.copy_(torch.arange(b + 1, dtype=torch.int32, device=self.device) * width)
        return lambda: self.model(ids, pos, meta, self.kv_caches)

    def capture_verify_graphs(self, width: int, trees: bool = False) -> None:
        """CUDA graphs of speculative verify steps: every sequence scores up to ``width`` tokens (its last token and
        up to width - 1 drafted ones, padded to width), at the decode graphs' batch sizes up to
        ``VERIFY_GRAPH_MAX_BS``; ``trees``: drafted trees too, under the prefill kernel's tree mask (``width`` <= 64).
        Eager, a verify step of an 8B model spent more time launching kernels than running them (bench_spec.py
        --costs). No-op without ``use_graphs``."""
        if not self.use_graphs:
            return
        sizes = [b for b in self.graph_sizes() if b <= VERIFY_GRAPH_MAX_BS]
        self.alloc_verify_static(width, sizes[-1], trees)
        pool = self.graph_pool
        with torch.inference_mode():
            for b in reversed(sizes):
                forward = self.static_verify_forward(b, width)
                forward()  # warm-up: compiles the prefill kernel for this width outside the capture
                graph, out = capture(forward, pool)
                pool = graph.pool()
                self.verify_graphs[b] = (graph, out)
        self.verify_graphs = dict(sorted(self.verify_graphs.items()))
        self.graph_pool = pool
        torch.cuda.synchronize()

    def graph_sizes(self) -> list[int]:
        max_bs = min(self.config.cuda_graph_max_bs, self.config.max_num_seqs)
        return sorted({b for b in (1, 2, 4, 8, *range(16, max_bs + 16, 16)) if b <= max_bs} | {max_bs})

    def alloc_static(self, max_bs: int) -> None:
        """The fixed device buffers that captured decode steps read: the flat inputs laid out for ``max_bs`` rows (a
        graph of b rows reads the layout for b rows at the start of it) and ``max_bs`` block-table rows."""
        self.static = {
            "flat": torch.zeros(5 * max_bs, dtype=torch.int32, device=self.device),
            "tables": torch.zeros(max_bs, self.table_width, dtype=torch.int32, device=self.device),
        }

    def static_forward(self, b: int):
        """The decode step of ``b`` rows over the static buffers, as a callable (what a graph captures)."""
        flat = self.static["flat"]
        meta = AttentionMetadata(
            slot_mapping=flat[2 * b : 3 * b],
            num_decodes=b,
            decode_block_tables=self.static["tables"][:b],
            decode_context_lens=flat[3 * b : 4 * b],
            decode_num_splits=self.num_splits(b),
            backend=self.backend,
        )
        flat[: 4 * b] = 0
        flat[2 * b : 3 * b] = -1  # until the first replay's inputs arrive: a warm-up or capture run writes nothing
        return lambda: self.model(flat[:b], flat[b : 2 * b], meta, self.kv_caches)

    def _capture_graphs(self) -> None:
        sizes = self.graph_sizes()
        self.alloc_static(sizes[-1])
        pool = None
        with torch.inference_mode():
            for b in reversed(sizes):  # largest first, so the smaller graphs reuse its memory pool
                forward = self.static_forward(b)
                forward()  # warm-up: compiles kernels, fills lazy kernel state outside the capture
                graph, out = capture(forward, pool)
                pool = graph.pool()
                self.graphs[b] = (graph, out)
        self.graphs = dict(sorted(self.graphs.items()))
        self.graph_pool = pool
        torch.cuda.synchronize()

    # -- sizing the cache ------------------------------------------------------------------------------------------

    def _blocks_that_fit(self) -> int:
        if self.device.type != "cuda":
            return self.config.cpu_kv_blocks
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        activations = self._profile_step()
        free, total = torch.cuda.mem_get_info()
        budget = total * self.config.gpu_memory_utilization - (total - free) - activations - GRAPH_MEMORY_RESERVE
        budget -= self.reserved_bytes
        blocks = int(budget // (self.block_bytes + self.extra_block_bytes))
        need = -(-self.max_model_len // self.block_size)
        if blocks < need:
            raise QuantkitError(
                f"only {max(blocks, 0)} KV blocks fit in gpu_memory_utilization {self.config.gpu_memory_utilization}"
                f" of {total / 2**30:.1f} GiB ({(total - free) / 2**30:.1f} GiB already in use on the device by all"
                f" processes, this model {base / 2**30:.1f} GiB, activations {activations / 2**30:.1f} GiB) but one"
                f" {self.max_model_len}-token sequence needs {need}; raise gpu_memory_utilization or lower "
                "max_model_len / max_num_batched_tokens"
            )
        return blocks

    @torch.inference_mode()
    def _profile_step(self) -> int:
        """Peak activation bytes of a prefill step of ``max_num_batched_tokens`` tokens (plus the logits of
        ``max_num_seqs`` rows), run against a throw-away cache just big enough."""
        total = self.config.max_num_batched_tokens
        seq_len = min(total, self.max_model_len)
        n_seq = -(-total // seq_len)
        pages = -(-seq_len // self.block_size)
        base = torch.cuda.memory_allocated()
        kv = self._empty_cache(n_seq * pages)
        kv_bytes = torch.cuda.memory_allocated() - base
        caches = [tuple(kv[i, j] for j in range(self.kv_parts)) for i in range(kv.shape[0])]
        batch = ScheduledBatch()
        for i in range(n_seq):
            seq = Sequence(-1 - i, -1, [0] * min(seq_len, total - i * seq_len), _PROFILE_PARAMS)
            seq.block_table = list(range(i * pages, (i + 1) * pages))
            batch.add(seq, seq.num_tokens, [])
        layout = self._write(batch)
        flat, tables = self._to_device(layout, None, None)
        ids, pos = (flat[a:b] for a, b in (layout.offsets["ids"], layout.offsets["pos"]))
        hidden = self.model(ids, pos, self.metadata(layout, flat, tables), caches)
        self.model.logits(hidden[-1:].expand(self.config.max_num_seqs, -1)).float()
        torch.cuda.synchronize()
        activations = torch.cuda.max_memory_allocated() - base - kv_bytes
        del kv, caches, hidden
        torch.cuda.empty_cache()
        return activations
