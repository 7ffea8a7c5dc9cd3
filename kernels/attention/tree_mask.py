"""Tree masks for the prefill kernel: which earlier tokens of a chunk each query sees when the chunk is a draft tree.

A draft tree of n <= 64 tokens (speculative decoding's candidates, verified in one pass; SpecInfer, Medusa, EAGLE)
is a parent array in topological order: ``parents[i] < i`` is the chunk index of token i's parent, -1 for a root.
Token i sees the whole cached prefix and its ancestors in the tree and itself, encoded as one int64 word per query
row: bit j set when chunk token j is one of them. ``CAUSAL_ROW`` (-1, every bit set) is a plain causal row, so a
launch mixes trees with chains and single decodes; chunk keys from index 64 on follow causality alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

CAUSAL_ROW = -1  # the word of a query row that attends causally (every bit set)
TREE_MAX_TOKENS = 64  # bits in one int64 word


def tree_mask_words(parents: Sequence[int]) -> torch.Tensor:
    """Parent array of a tree -> int64 [n]: bit j of word i set for each ancestor j of token i and for i itself."""
    words: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i or i >= TREE_MAX_TOKENS:
            raise ValueError(f"tree_mask_words: token {i} has parent {p}: parents must precede their children "
                             f"(-1 for a root) and a tree holds at most {TREE_MAX_TOKENS} tokens")  # fmt: skip
        words.append((words[p] if p >= 0 else 0) | 1 << i)
    return torch.tensor([w - (1 << 64) if w >> 63 else w for w in words], dtype=torch.int64)


def pack_tree_masks(chunks: Sequence[int | Sequence[int]], device=None) -> torch.Tensor:
    """The step's ``tree_mask`` int64 [T]: per chunk, in packing order, a parent array (a tree) or a length (a
    causal chunk: ``CAUSAL_ROW`` rows)."""
    rows = [
        torch.full((c,), CAUSAL_ROW, dtype=torch.int64) if isinstance(c, int) else tree_mask_words(c) for c in chunks
    ]
    return torch.cat(rows).to(device) if rows else torch.zeros(0, dtype=torch.int64, device=device)


def tree_mask_dense(words: torch.Tensor, n_keys: int) -> torch.Tensor:
    """int64 words [M] -> bool [M, n_keys]: bit j of each word; chunk keys from index 64 on all True."""
    j = torch.arange(n_keys, device=words.device)
    return ((words[:, None] >> j.clamp(max=63)) & 1).bool() | (j >= TREE_MAX_TOKENS)
