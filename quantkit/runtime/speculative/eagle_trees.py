"""EAGLE-2's dynamic draft trees for greedy sequences, built on the device in fixed shapes and replayed as CUDA graphs.

``tree.eagle_tree`` builds the tree on the host, one expansion at a time (``TreeDrafter._eagle``), which on SmolLM2
and on the Llama-3-8B shape cost tens of milliseconds a tree. ``EagleTrees`` builds the same tree — EAGLE-2's rule,
as ``eagle_tree`` states it — for every greedy sequence of a step at once, in tensors of fixed shapes, so that the
catch-up, every expansion and the final rerank are one CUDA graph per batch-size bucket:

- the root: the window's last real row (``EagleChains``) is read out; its ``topk`` most probable tokens are depth 1;
- expansion e (1 .. depth - 1): the layer runs over one prefill chunk holding every frontier node drafted so far
  (``topk`` per depth, depth-major; node d, i at chunk index (d - 1) * topk + i and position n + d - 1), with the
  prefill kernel's tree mask (each node sees the verified prefix, its ancestors and itself), so each newest node
  gets its predicted feature; the ``topk`` best tokens of each give topk^2 candidates of confidence (the product of
  draft probabilities along the path), whose ``topk`` most confident (stable order) are the next frontier;
- the rerank: every candidate (depth 1's and each expansion's topk^2), ranked by confidence (a stable sort keeps
  the creation order on ties, so a parent, never less confident than its child, ranks first and the best
  ``num_nodes`` are a closed tree), the best ``num_nodes`` kept in creation order (topological). A sequence whose
  step has room for fewer nodes, or whose ``max_tokens`` allows fewer levels, keeps the best of them that fit.

The chunk is recomputed at each expansion (at most topk * (depth - 1) rows, <= 64 for the tree mask's words): its
earlier nodes' outputs do not change, and the layer on 64 rows costs what it costs on one. Sampled requests draft
through ``TreeDrafter``'s eager path.
"""

from __future__ import annotations

import torch

from quantkit.kernels.attention.tree_mask import TREE_MAX_TOKENS
from quantkit.runtime.sequence import Sequence
from quantkit.runtime.speculative.eagle_chains import EagleChains, room
from quantkit.runtime.speculative.tree import DraftTree


def fits(depth: int, topk: int) -> bool:
    """Whether the largest chunk (``topk`` nodes of each depth but the last) fits one tree-mask word (as
    ``eagle_chains.batched_cache_bytes`` counts)."""
    return topk * (depth - 1) <= TREE_MAX_TOKENS


class EagleTrees(EagleChains):
    """Trees of ``num_nodes`` tokens, ``depth`` deep, ``topk`` children per expanded node."""

    def __init__(self, proposer, depth: int, runner, topk: int, num_nodes: int):
        super().__init__(proposer, depth, runner, room(depth, topk))
        self.topk = topk
        self.num_nodes = min(num_nodes, topk + (depth - 1) * topk * topk)

    def _tail_sizes(self, b: int) -> list[int]:
        return [b, b, b]  # per row: the flat slot of position n, n (the first position after the window), n - lo

    def _ints(self, rows, b: int) -> torch.Tensor:
        window, base, end, lo = self._window_ints(rows, b)
        return torch.cat([window, base + end, end, end - lo])

    def _draft(self, feats: torch.Tensor, ints: torch.Tensor, b: int) -> torch.Tensor:
        """-> [b, 2, num_nodes] int64: each tree's tokens and parents (-1: a child of the root)."""
        views = self._views(ints, b)
        g, tables = self._window(feats, views, b)
        slot_n, n, span = (t.long() for t in views[7:])
        k, dev = self.topk, self.device
        probs, tokens = self._logits(g).float().softmax(-1).topk(k, dim=-1)  # depth 1: [b, k]
        tokens = self._tokens(tokens)
        conf = probs.double()
        ids = torch.arange(k, device=dev).expand(b, k)  # candidate ids, in creation order
        cand_conf, cand_tokens, cand_parent = [conf], [tokens], [torch.full_like(ids, -1)]
        # the frontier (depth-major, every depth's nodes kept for the chunk): inputs, tokens, mask words
        f_feats, f_tokens, f_words = [g[:, None].expand(b, k, g.shape[-1])], [tokens], [1 << ids]
        f_conf, f_ids = conf, ids
        for e in range(1, self.depth):
            rows = k * e
            chunk = torch.arange(rows, device=dev)
            pos = (n[:, None] + chunk // k).flatten()
            slots = (slot_n[:, None] + chunk).flatten().int()
            cu = (torch.arange(b + 1, device=dev) * rows).int()
            meta = self._window_meta(rows, slots, (span + rows).int(), cu, tables)
            meta.prefill_tree_mask = torch.cat(f_words, dim=1).flatten()
            x = torch.cat(f_feats, dim=1).flatten(0, 1)
            out = self._layer(x, torch.cat(f_tokens, dim=1).flatten(), pos, meta).view(b, rows, -1)[:, -k:]
            p, t = self._logits(out.flatten(0, 1)).float().softmax(-1).topk(k, dim=-1)  # [b * k, k]
            t = self._tokens(t)
            conf = (f_conf[:, :, None] * p.view(b, k, k).double()).flatten(1)  # [b, k * k], frontier-major
            tokens = t.view(b, k * k)
            new_ids = sum(c.shape[1] for c in cand_conf) + torch.arange(k * k, device=dev)
            cand_conf.append(conf)
            cand_tokens.append(tokens)
            cand_parent.append(f_ids.repeat_interleave(k, dim=1))
            if e + 1 < self.depth:  # the next frontier: the k most confident of these candidates
                best = conf.sort(dim=1, descending=True, stable=True).indices[:, :k]
                parent_row = best // k
                f_conf, f_ids = conf.gather(1, best), new_ids.expand(b, -1).gather(1, best)
                f_feats.append(out.gather(1, parent_row[..., None].expand(b, k, out.shape[-1])))
                f_tokens.append(tokens.gather(1, best))
                f_words.append(f_words[-1].gather(1, parent_row) | (1 << (e * k + ids)))
        conf, tokens, parent = (torch.cat(c, dim=1) for c in (cand_conf, cand_tokens, cand_parent))
        ranked = conf.sort(dim=1, descending=True, stable=True).indices[:, : self.num_nodes]
        kept, rank = ranked.sort(dim=1)  # creation order, and each kept node's rank
        parent = parent.gather(1, kept)
        index = torch.searchsorted(kept, parent.clamp(min=0))  # a parent's place among the kept nodes
        parent = torch.where(parent < 0, parent, index)
        return torch.stack([tokens.gather(1, kept), parent, rank], dim=1)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], sizes: list[int], depths: list[int]) -> list[DraftTree | None]:
        """The tree of each of ``seqs`` (None where its features are missing or no slot is free), cut to its
        ``sizes[i]`` best nodes and ``depths[i]`` levels (both keep it closed: a parent ranks before its children)."""
        rows, drafted = self._run(seqs, [True] * len(seqs))
        out: list[DraftTree | None] = [None] * len(seqs)
        if rows:
            host = drafted[: len(rows)].cpu()
            for i, r in rows.items():
                tree = DraftTree(host[r, 0], host[r, 1])
                keep = (host[r, 2] < sizes[i]) & (tree.depth <= depths[i])
                if not bool(keep.all()):
                    index = torch.cumsum(keep, 0) - 1  # a kept node's place among the kept ones
                    parent = tree.parent[keep]
                    tree = DraftTree(tree.tokens[keep], torch.where(parent < 0, parent, index[parent.clamp(min=0)]))
                out[i] = tree if tree.size else None
        return out
