"""Runs scheduled steps on the model: owns the KV cache, packs each step's tokens, replays CUDA graphs for decodes.

KV cache: one tensor [layers, 2, num_blocks, block_size, Hkv, D]; on CUDA the number of blocks is what fits in
``gpu_memory_utilization`` of the device after the weights and the activations of a profiling step of
``max_num_batched_tokens`` tokens. Pure-decode steps of up to ``cuda_graph_max_bs`` sequences replay a CUDA graph
captured for the next batch-size bucket (1, 2, 4, 8, then multiples of 16), padded rows writing nowhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from quantkit.errors import QuantkitError
from quantkit.kernels.paged_attention import default_num_splits
from quantkit.runtime.attention import AttentionMetadata
from quantkit.runtime.config import EngineConfig
from quantkit.runtime.model import CausalLM
from quantkit.runtime.scheduler import ScheduledBatch

GRAPH_MEMORY_RESERVE = 1 << 30  # bytes kept free for CUDA-graph pools and allocator slack


@dataclass
class HostBatch:
    """A step's inputs on the host, decodes first (``num_decodes`` of them), then prefill chunks."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    num_decodes: int
    tables: list[list[int]]  # block table of each scheduled sequence, in packed order
    context_lens: list[int]
    cu_seqlens: list[int]  # over the prefill chunks
    sample_rows: list[int]  # packed row of the last token of each ``batch.sampled`` sequence


def pad_tables(tables: list[list[int]], width: int | None = None) -> np.ndarray:
    out = np.zeros((len(tables), width or max(map(len, tables), default=1)), dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return out


class ModelRunner:
    def __init__(self, model: CausalLM, config: EngineConfig, device: torch.device, max_model_len: int):
        self.model = model
        self.config = config
        self.device = device
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        cfg = model.config
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = model.model.layers[0].self_attn.head_dim
        self.backend = self._backend()
        model.set_rope(max_model_len, device)
        block_bytes = 2 * cfg.num_hidden_layers * self.block_size * self.num_kv_heads * self.head_dim
        block_bytes *= torch.empty(0, dtype=model.dtype).element_size()
        self.block_bytes = block_bytes
        self.num_blocks = config.num_kv_blocks or self._blocks_that_fit()
        self.kv = self._empty_cache(self.num_blocks)
        self.kv_caches = [(self.kv[i, 0], self.kv[i, 1]) for i in range(cfg.num_hidden_layers)]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if device.type == "cuda" and not config.enforce_eager:
            self._capture_graphs()

    def _backend(self) -> str:
        backend = self.config.attention_backend
        if backend == "auto":
            return "triton" if self.device.type == "cuda" else "torch"
        if backend == "triton" and self.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise QuantkitError("the triton attention backend on CPU needs TRITON_INTERPRET=1 set before start-up")
        return backend

    def _empty_cache(self, num_blocks: int) -> torch.Tensor:
        cfg = self.model.config
        shape = (cfg.num_hidden_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return torch.zeros(shape, dtype=self.model.dtype, device=self.device)

    def num_splits(self, num_decodes: int) -> int:
        """Flash-decoding splits, from the batch size and ``max_model_len`` only (never the current contexts), so a
        captured graph stays valid and eager steps split the way a graph of that size does."""
        return default_num_splits(num_decodes, self.num_kv_heads, self.max_model_len)

    # -- packing -------------------------------------------------------------------------------------------------

    def pack(self, batch: ScheduledBatch) -> HostBatch:
        bs = self.block_size
        order = sorted(range(len(batch.seqs)), key=lambda i: batch.num_new[i] != 1)  # decodes first, stable
        ids, pos, slots, tables, ctx, cu, last_row = [], [], [], [], [], [0], {}
        num_decodes = 0
        for i in order:
            seq, n = batch.seqs[i], batch.num_new[i]
            start, table = seq.num_computed_tokens, seq.block_table
            ids += seq.token_ids[start : start + n]
            pos += range(start, start + n)
            if n == 1:
                num_decodes += 1
                slots.append(table[start // bs] * bs + start % bs)
            else:
                p = np.arange(start, start + n)
                slots += (np.asarray(table)[p // bs] * bs + p % bs).tolist()
                cu.append(cu[-1] + n)
            tables.append(table)
            ctx.append(start + n)
            last_row[seq.seq_id] = len(ids) - 1
        rows = [last_row[s.seq_id] for s in batch.sampled]
        return HostBatch(ids, pos, slots, num_decodes, tables, ctx, cu, rows)

    def _tensor(self, data, dtype) -> torch.Tensor:
        return torch.as_tensor(np.asarray(data), dtype=dtype).to(self.device, non_blocking=True)

    def metadata(self, hb: HostBatch) -> AttentionMetadata:
        nd = hb.num_decodes
        meta = AttentionMetadata(slot_mapping=self._tensor(hb.slots, torch.int64), num_decodes=nd, backend=self.backend)
        if nd:
            meta.decode_block_tables = self._tensor(pad_tables(hb.tables[:nd]), torch.int32)
            meta.decode_context_lens = self._tensor(hb.context_lens[:nd], torch.int32)
            meta.max_decode_context = max(hb.context_lens[:nd])
            meta.decode_num_splits = self.num_splits(nd)
        if len(hb.tables) > nd:
            meta.prefill_block_tables = self._tensor(pad_tables(hb.tables[nd:]), torch.int32)
            meta.prefill_context_lens = self._tensor(hb.context_lens[nd:], torch.int32)
            meta.prefill_cu_seqlens = self._tensor(hb.cu_seqlens, torch.int32)
            meta.max_prefill_len = max(b - a for a, b in zip(hb.cu_seqlens, hb.cu_seqlens[1:], strict=False))
        return meta

    # -- running ---------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Execute one step; returns fp32 logits [len(batch.sampled), vocab]."""
        if batch.copies:
            src, dst = (self._tensor(x, torch.int64) for x in zip(*batch.copies, strict=True))
            self.kv[:, :, dst] = self.kv[:, :, src]
        hb = self.pack(batch)
        n = len(hb.input_ids)
        bucket = next((b for b in self.graphs if b >= n), None) if hb.num_decodes == n else None
        if bucket is not None:
            hidden = self._replay(hb, bucket)
        else:
            ids, pos = self._tensor(hb.input_ids, torch.int64), self._tensor(hb.positions, torch.int64)
            hidden = self.model(ids, pos, self.metadata(hb), self.kv_caches)
        if hb.sample_rows != list(range(n)):  # a pure decode step samples every row: no gather needed
            hidden = hidden[self._tensor(hb.sample_rows, torch.int64)]
        return self.model.logits(hidden).float()

    # -- CUDA graphs -----------------------------------------------------------------------------------------------

    def graph_sizes(self) -> list[int]:
        max_bs = min(self.config.cuda_graph_max_bs, self.config.max_num_seqs)
        return sorted({b for b in (1, 2, 4, 8, *range(16, max_bs + 16, 16)) if b <= max_bs} | {max_bs})

    def alloc_static(self, max_bs: int) -> None:
        """The fixed input buffers that captured decode steps read (padding rows: slot -1, context 0)."""
        width, dev = -(-self.max_model_len // self.block_size), self.device
        self.static = {
            "ids": torch.zeros(max_bs, dtype=torch.int64, device=dev),
            "pos": torch.zeros(max_bs, dtype=torch.int64, device=dev),
            "slots": torch.full((max_bs,), -1, dtype=torch.int64, device=dev),
            "ctx": torch.zeros(max_bs, dtype=torch.int32, device=dev),
            "tables": torch.zeros(max_bs, width, dtype=torch.int32, device=dev),
        }

    def static_forward(self, b: int):
        """The decode step of ``b`` rows over the static buffers, as a callable (what a graph captures)."""
        s = self.static
        meta = AttentionMetadata(
            slot_mapping=s["slots"][:b],
            num_decodes=b,
            decode_block_tables=s["tables"][:b],
            decode_context_lens=s["ctx"][:b],
            decode_num_splits=self.num_splits(b),
            backend=self.backend,
        )
        return lambda: self.model(s["ids"][:b], s["pos"][:b], meta, self.kv_caches)

    def _capture_graphs(self) -> None:
        sizes = self.graph_sizes()
        self.alloc_static(sizes[-1])
        pool = None
        with torch.inference_mode():
            for b in reversed(sizes):  # largest first, so the smaller graphs reuse its memory pool
                forward = self.static_forward(b)
                forward()  # warm-up: compiles kernels, fills lazy kernel state outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    out = forward()
                pool = graph.pool()
                self.graphs[b] = (graph, out)
        self.graphs = dict(sorted(self.graphs.items()))
        torch.cuda.synchronize()

    def _replay(self, hb: HostBatch, bucket: int) -> torch.Tensor:
        n, s = len(hb.input_ids), self.static
        tables = pad_tables(hb.tables)
        host = np.concatenate([hb.input_ids, hb.positions, hb.slots, hb.context_lens, tables.ravel()])
        dev = self._tensor(host, torch.int64)  # one host-to-device copy per step
        s["ids"][:n] = dev[:n]
        s["pos"][:n] = dev[n : 2 * n]
        s["slots"][:n] = dev[2 * n : 3 * n]
        s["slots"][n:bucket] = -1
        s["ctx"][:n] = dev[3 * n : 4 * n]
        s["ctx"][n:bucket] = 0
        s["tables"][:n, : tables.shape[1]] = dev[4 * n :].view(n, tables.shape[1])
        graph, out = self.graphs[bucket]
        graph.replay()
        return out[:n]

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
        blocks = int(budget // self.block_bytes)
        need = -(-self.max_model_len // self.block_size)
        if blocks < need:
            raise QuantkitError(
                f"only {max(blocks, 0)} KV blocks fit in memory (base {base / 2**30:.1f} GiB, activations "
                f"{activations / 2**30:.1f} GiB) but one {self.max_model_len}-token sequence needs {need}; raise "
                "gpu_memory_utilization or lower max_model_len / max_num_batched_tokens"
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
        caches = [(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])]
        lens = [min(seq_len, total - i * seq_len) for i in range(n_seq)]
        tables = [list(range(i * pages, (i + 1) * pages)) for i in range(n_seq)]
        positions = [p for n in lens for p in range(n)]
        slots = [i * pages * self.block_size + p for i, n in enumerate(lens) for p in range(n)]  # tables are contiguous
        cu = [0, *np.cumsum(lens).tolist()]
        hb = HostBatch([0] * len(positions), positions, slots, 0, tables, lens, cu, [])
        ids, pos = self._tensor(hb.input_ids, torch.int64), self._tensor(hb.positions, torch.int64)
        hidden = self.model(ids, pos, self.metadata(hb), caches)
        self.model.logits(hidden[-1:].expand(self.config.max_num_seqs, -1)).float()
        torch.cuda.synchronize()
        activations = torch.cuda.max_memory_allocated() - base - kv_bytes
        del kv, caches, hidden
        torch.cuda.empty_cache()
        return activations
