"""Draft trees in the engine's speculative step (``SpeculativeConfig.num_tree_tokens``), drafted by the heads.

Each decoding sequence drafts a tree of up to ``num_tree_tokens`` tokens, at most ``num_speculative_tokens`` deep:
- Medusa: the static sparse tree of ``tree.medusa_tree`` over the heads' top-``tree_topk`` accuracies (the heads'
  config's ``training.after.topk_accuracy`` [K, topk] where training recorded it, else ``default_accuracies``), its
  nodes filled with each head's best candidates on the feature of the sequence's last computed position.
- EAGLE: EAGLE-2's dynamic tree (``tree.eagle_tree``, ``tree_topk`` children per expanded node). The layer catches up
  on the verified positions into its KV cache as for chains; the frontier nodes of one depth are then drafted in one
  call that runs the layer over each node's whole path (its ancestors' predicted features and tokens) after that
  cache. The tree's own K/V are not kept in the layer: a tree of depth d costs the layer O(d^2) rows per path,
  which keeps it simple and exact.

The tree's tokens are appended to the sequence as its drafted tokens, with their parents (``Sequence.draft_parents``);
the runner gives tree token i the position of the last verified token + its depth and the prefill kernel's tree mask,
and writes its K/V to the step's slot of chunk index i + 1 (``inputs.tree_chunk``). ``verify`` applies
``tree.verify_tree_greedy`` to greedy requests and the lossless ``tree.verify_tree_sampled`` to sampled ones (the
children are the draft's top candidates: deterministic draws), then copies the accepted nodes' K/V and target
features to consecutive positions; the engine's rollback (``Scheduler.commit`` with the kept tokens) releases the
rest. Every copy lands in a block appended for this step, or made private by copy-on-write when the step was
scheduled, so no block that another sequence shares is written.
"""

from __future__ import annotations

import torch

from quantkit.errors import QuantkitError
from quantkit.runtime.model import layer_windows
from quantkit.runtime.sampler import filter_logits
from quantkit.runtime.sequence import Sequence
from quantkit.runtime.speculative.eagle_trees import EagleTrees, fits
from quantkit.runtime.speculative.heads import MedusaProposer, read_meta
from quantkit.runtime.speculative.tree import (
    DraftTree,
    eagle_tree,
    medusa_tree,
    static_tree,
    verify_tree_greedy,
    verify_tree_sampled,
    verify_tree_typical,
)

# an assumed shape when training recorded no top-k accuracies: head k's i-th candidate is right with probability
# DEFAULT_TOP1 * HEAD_DECAY^k * RANK_DECAY^i (later heads guess further ahead; lower-ranked candidates rarely win)
DEFAULT_TOP1, HEAD_DECAY, RANK_DECAY = 0.6, 0.75, 0.3


def default_accuracies(num_heads: int, topk: int) -> torch.Tensor:
    """[num_heads, topk] float64: the assumed accuracy table (module constants)."""
    k = torch.arange(num_heads, dtype=torch.float64)[:, None]
    i = torch.arange(topk, dtype=torch.float64)[None, :]
    return DEFAULT_TOP1 * HEAD_DECAY**k * RANK_DECAY**i


def head_accuracies(meta: dict, num_heads: int, topk: int) -> torch.Tensor:
    """The Medusa heads' measured top-k accuracies [num_heads, <= topk] from their config, else the default table."""
    recorded = meta.get("training", {}).get("after", {}).get("topk_accuracy")
    if recorded:
        acc = torch.tensor(recorded, dtype=torch.float64)
        if acc.ndim == 2 and acc.shape[0] >= num_heads and acc.shape[1] >= 1:
            return acc[:num_heads, :topk]
    return default_accuracies(num_heads, topk)


class TreeDrafter:
    """Drafts trees with a Medusa or EAGLE proposer, verifies them, and moves the accepted path's K/V in ``runner``'s
    cache. ``accuracies`` [K, topk]: Medusa's table (None for EAGLE). ``typical``: (posterior_threshold,
    posterior_alpha) of Medusa's lossy typical acceptance for sampled requests; None: the lossless rule."""

    def __init__(self, proposer, runner, topk: int, accuracies: torch.Tensor | None = None,
                 typical: tuple[float, float] | None = None):  # fmt: skip
        self.proposer, self.runner, self.topk = proposer, runner, topk
        self.accuracies = accuracies
        self.typical = typical
        self._paths: dict[tuple[int, int], list[tuple[int, ...]]] = {}

    # -- drafting --------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], sizes: list[int], depths: list[int]) -> list[DraftTree | None]:
        """A tree of at most ``sizes[i]`` tokens and ``depths[i]`` levels for each sequence (None: no features).
        EAGLE: greedy sequences draft together through ``EagleTrees`` where the proposer has it."""
        if isinstance(self.proposer, MedusaProposer):
            return self._medusa(seqs, sizes, depths)
        out: list[DraftTree | None] = [None] * len(seqs)
        batched = self.proposer.trees
        on_device = [batched is not None and s.params.greedy for s in seqs]
        if any(on_device):
            index = [i for i, w in enumerate(on_device) if w]
            trees = batched.propose([seqs[i] for i in index], [sizes[i] for i in index], [depths[i] for i in index])
            for i, tree in zip(index, trees, strict=True):
                out[i] = tree
        for i, (s, n, d) in enumerate(zip(seqs, sizes, depths, strict=True)):
            if not on_device[i]:
                out[i] = self._eagle(s, n, d)
        return out

    def _medusa(self, seqs, sizes, depths) -> list[DraftTree | None]:
        p = self.proposer
        out: list[DraftTree | None] = [None] * len(seqs)
        ready = [i for i, s in enumerate(seqs) if p.store.span(s)[1] == s.num_computed_tokens > p.store.span(s)[0]]
        if not ready:
            return out
        f = torch.stack([p.store.seqs[seqs[i].seq_id].buf[seqs[i].num_computed_tokens - 1] for i in ready])
        logits = p.target.logits(p.heads(f.to(p.target.dtype))).float()  # [K, n, V]
        topk = min(self.accuracies.shape[1], logits.shape[-1])
        candidates = logits.topk(topk, dim=-1).indices.cpu()  # [K, n, topk], best first
        for row, i in enumerate(ready):
            depth = min(depths[i], logits.shape[0])
            key = (depth, sizes[i])
            if key not in self._paths:
                self._paths[key] = medusa_tree(self.accuracies[:depth, :topk], sizes[i])
            out[i] = static_tree(self._paths[key], candidates[:, row])
        return out

    def _eagle(self, seq: Sequence, size: int, depth: int) -> DraftTree | None:
        p = self.proposer
        caught = p.catch_up(seq)
        if caught is None:
            return None
        g_root, kv = caught  # [1, 1, H], the layer's K/V over the verified positions
        c, device, embed = seq.num_computed_tokens, g_root.device, p.target.model.embed_tokens
        feats = {-1: g_root[0, 0]}  # node -> the layer's predicted feature after the node's token

        def dist(g: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, V]: the distribution candidates are ranked by
            logits = p.target.logits(g).float()
            if not seq.params.greedy:
                logits = torch.stack([filter_logits(row, seq.params) for row in logits])
            return logits.softmax(-1)

        def draft(frontier: list[int], tokens: list[int], parent: list[int]) -> torch.Tensor:
            if frontier == [-1]:
                return dist(g_root[0])
            paths = []
            for node in frontier:  # every frontier node has the same depth
                path = [node]
                while parent[path[-1]] >= 0:
                    path.append(parent[path[-1]])
                paths.append(path[::-1])
            b, d = len(paths), len(paths[0])
            inputs = torch.stack([torch.stack([feats[-1], *(feats[a] for a in path[:-1])]) for path in paths])
            ids = torch.tensor([[tokens[a] for a in path] for path in paths], device=device)  # [B, d]
            past = (kv[0].expand(b, -1, -1, -1), kv[1].expand(b, -1, -1, -1))
            g, _ = p.head(inputs, embed(ids), torch.arange(c, c + d, device=device), past)
            for row, node in enumerate(frontier):
                feats[node] = g[row, -1]
            return dist(g[:, -1])

        tree, _ = eagle_tree(draft, depth, self.topk, size)
        return tree if tree.size else None

    # -- verifying -------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def verify(
        self, seq: Sequence, logits: torch.Tensor, generator: torch.Generator | None, best: list[int] | None = None
    ) -> tuple[list[int], int]:
        """``logits`` [n + 1, V] of the target at the sequence's last token and its n tree tokens (``best``: their
        argmax, already on the host, for a greedy request) -> (the tokens to emit, the tree's depth). Moves the
        accepted path's K/V and features into consecutive positions and drops the tree from ``seq.token_ids``."""
        n = seq.num_draft_tokens
        tree = DraftTree(torch.tensor(seq.token_ids[-n:]), torch.tensor(seq.draft_parents))
        if seq.params.greedy:
            verdict = verify_tree_greedy(tree, None if best is not None else logits.float().cpu(), best)
        else:
            logits = logits.float().cpu()
            probs = torch.stack([filter_logits(row, seq.params).softmax(-1) for row in logits])
            device = generator.device if generator is not None else logits.device
            uniform = torch.rand(n, generator=generator, device=device).cpu()
            noise = torch.empty(logits.shape[-1], device=device).exponential_(generator=generator).cpu()
            if self.typical is not None:  # lossy, asked for by name
                verdict = verify_tree_typical(tree, probs, noise, *self.typical)
            else:
                verdict = verify_tree_sampled(tree, probs, uniform, noise)
        self._move(seq, verdict.nodes)
        seq.drop_draft()
        return verdict.tokens.tolist(), int(tree.depth.max())

    def _move(self, seq: Sequence, nodes: list[int]) -> None:
        """Accepted node i at depth d was written at position c + 1 + i (chunk order) and belongs at c + d, c the
        position of the last verified token (i + 1 >= d along a path); every source is read before any is written."""
        c, bs = seq.num_computed_tokens, self.runner.block_size
        moves = [(c + 1 + i, c + d) for d, i in enumerate(nodes, 1) if i + 1 != d]
        if not moves:
            return
        src, dst = (list(x) for x in zip(*moves, strict=True))

        def slots(positions):
            return torch.tensor([seq.block_table[q // bs] * bs + q % bs for q in positions], device=self.runner.device)

        cache = self.runner.kv.flatten(2, 3)  # [layers, 2, blocks * block_size, Hkv, D], a view
        cache[:, :, slots(dst)] = cache[:, :, slots(src)]
        self.proposer.store.move(seq.seq_id, src, dst)


def tree_drafter(spec, proposer, runner) -> TreeDrafter:
    """The tree drafter of ``spec`` (num_tree_tokens set) around a head proposer of ``runner``'s model."""
    if any(layer_windows(runner.model.config)):
        raise QuantkitError("tree drafting (num_tree_tokens) does not support models with sliding-window attention")
    accuracies = None
    if spec.method == "medusa":
        accuracies = head_accuracies(read_meta(spec.draft), len(proposer.heads.blocks), spec.tree_topk)
    typical = None
    if spec.acceptance_method == "typical_acceptance_sampler":
        typical = (spec.posterior_threshold, spec.posterior_alpha)
    if spec.method == "eagle" and fits(spec.num_speculative_tokens, spec.tree_topk):
        k = spec.num_speculative_tokens
        proposer.trees = EagleTrees(proposer, k, runner, spec.tree_topk, spec.num_tree_tokens)
        proposer.trees.vocab = proposer.vocab
    return TreeDrafter(proposer, runner, spec.tree_topk, accuracies, typical)
