"""Attention over the paged KV cache for one mixed step: decodes first, then prefill chunks, packed on one axis.

The step's tokens are ``[decode_0 .. decode_{D-1}, chunk_0 tokens, chunk_1 tokens, ...]``. Every token's K/V are
written into the cache first (here, or by the caller's fused rotary kernel); decodes (one query each) then use the
flash-decoding kernel over block tables, and chunks the FlashAttention-style prefill kernel, which reads the chunk's
own K/V from the packed ``k`` / ``v`` and only the cached prefix through block tables. The ``torch`` backend runs the
plain PyTorch references of the same kernels (CPU, tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.kernels.attention import paged as decode_kernels
from quantkit.kernels.attention import prefill as prefill_kernels


@dataclass
class AttentionMetadata:
    """- ``slot_mapping`` [T]: cache slot of every token (-1: padding, not stored).
    - decodes: ``num_decodes`` rows, ``decode_block_tables`` [D, pages], ``decode_context_lens`` [D] (int32),
      ``decode_num_splits`` (fixed for CUDA graphs, else chosen from ``max_decode_context``).
    - prefills: ``prefill_block_tables`` [N, pages], ``prefill_cu_seqlens`` [N + 1], ``prefill_context_lens`` [N]
      (int32), ``max_prefill_len`` (host int), ``prefill_has_prefix`` (host bool: some chunk starts after cached
      context; False lets the prefill kernel drop its block-table loops).
    - ``prefill_tree_mask``: None (every chunk causal), or int64 [prefill tokens], one ancestor word per prefill
      row for chunks that are draft trees (``quantkit.kernels.attention.tree_mask``: ``pack_tree_masks`` builds it,
      -1 rows stay causal; no sliding window); the engine sets it for draft trees (``speculative.tree_draft``).
    """

    slot_mapping: torch.Tensor
    num_decodes: int
    decode_block_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    max_decode_context: int = 0
    decode_num_splits: int | None = None
    prefill_block_tables: torch.Tensor | None = None
    prefill_cu_seqlens: torch.Tensor | None = None
    prefill_context_lens: torch.Tensor | None = None
    max_prefill_len: int = 0
    prefill_has_prefix: bool = True
    backend: str = "torch"
    prefill_tree_mask: torch.Tensor | None = None

    @property
    def has_prefill(self) -> bool:
        return self.prefill_context_lens is not None and self.prefill_context_lens.numel() > 0


def paged_attention(
    q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int, stored: bool = False
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] -> out [T, Hq, D]; stores k/v into the caches first unless ``stored`` (the
    caller wrote them, e.g. ``fused_norm_rope.rotary_store_``)."""
    triton = meta.backend == "triton"
    if not stored:
        store = decode_kernels.store_kv if triton else decode_kernels.store_kv_reference
        store(k, v, k_cache, v_cache, meta.slot_mapping)
    nd = meta.num_decodes
    parts = []
    if nd:
        args = (q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale, window)
        if triton:
            parts.append(
                decode_kernels.paged_decode(
                    *args, num_splits=meta.decode_num_splits, max_context=meta.max_decode_context
                )
            )
        else:
            parts.append(decode_kernels.paged_decode_reference(*args))
    if meta.has_prefill:
        bt, cu, ctx = meta.prefill_block_tables, meta.prefill_cu_seqlens, meta.prefill_context_lens
        args = (q[nd:], k[nd:], v[nd:], k_cache, v_cache, bt, cu, ctx)
        if triton:
            parts.append(
                prefill_kernels.flash_prefill(
                    *args,
                    meta.max_prefill_len,
                    scale,
                    window,
                    has_prefix=meta.prefill_has_prefix,
                    tree_mask=meta.prefill_tree_mask,
                )
            )
        else:
            parts.append(prefill_kernels.flash_prefill_reference(*args, scale, window, meta.prefill_tree_mask))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
