"""Draft trees: their shape, the rules that verify them, and the two ways of building one (Medusa and EAGLE-2).

A tree drafts several candidate continuations at once; the target scores every node in one forward pass, each node
attending to the prefix and to its own ancestors only (``DraftTree.ancestor_mask``), at position = the root's
position + its depth. Conventions:
- The root is the sequence's last token (not yet computed, at position ``num_computed``); it is not a node. Nodes
  0 .. n - 1 come in topological order (a parent before its children, siblings in the order they were drafted);
  ``parent[i]`` is the parent node's index, -1 for the root's children; ``depth`` is 1 for the root's children.
- Per-slot tensors (the target's logits or probabilities, the draft's distribution) have n + 1 rows: row 0 is the
  root, row i + 1 is node i, so that node i's own token is scored in row ``parent[i] + 1``.
- ``draft_probs`` row s is the distribution q the children of slot s were drafted from; ``draws`` says how:
  ``with_replacement`` (each child an independent draw from q), ``without_replacement`` (each child drawn from q with
  its earlier siblings removed and the rest renormalised) or ``deterministic`` (the draft's top candidates, as Medusa
  and EAGLE-2 choose them; q is not needed).

Verification is per sequence (every sequence has its own tree). Randomness comes in as tensors, as in ``rejection``:
``uniform`` [n], one draw per node for its acceptance test, and ``noise`` [V] of Exp(1) draws for the one token the
target emits (the exponential race argmax(dist / noise)).

The lossless rule (SpecInfer, Miao et al. 2024, "SpecInfer: Accelerating Generative LLM Serving with Tree-based
Speculative Inference and Verification"; EAGLE, Li et al. 2024): at the current node the residual r starts as the
target's p there; children x_1 .. x_k are tried in order, x_j accepted with probability min(1, r_j(x_j) / q_j(x_j)),
and on rejection r_j+1 = norm(max(0, r_j - q_j)). If a child is accepted the walk moves there; if none is, a token
is drawn from the last residual. q_j is the distribution x_j was drawn from given the earlier siblings: q itself
with replacement; q with x_1 .. x_j-1 removed, renormalised, without replacement; the point mass on x_j for
deterministic children (given the draft, x_j is certain), for which the rule reduces to: accept x_j with probability
r_j(x_j), else remove x_j from r and renormalise. Each try is then the chain rule of ``rejection`` with target r_j
and draft q_j, whose output, given the history so far, is r_j when the continuation after a rejection outputs
r_j+1: P(y) = min(r_j, q_j)(y) + (1 - sum min(r_j, q_j)) r_j+1(y) = r_j(y). By induction over the siblings the
emitted token at each node is distributed as p there, and by induction over depth each emitted token follows the
target's distribution given the tokens before it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError

DRAWS = ("with_replacement", "without_replacement", "deterministic")


@dataclass(frozen=True)
class DraftTree:
    """``tokens`` [n] and ``parent`` [n] (long; -1: a child of the root), nodes in topological order;
    ``draft_probs`` q [n + 1, V] or None (deterministic draws); ``draws`` one of ``DRAWS``."""

    tokens: torch.Tensor
    parent: torch.Tensor
    draft_probs: torch.Tensor | None = None
    draws: str = "deterministic"

    def __post_init__(self):
        n = self.tokens.shape[0]
        if self.parent.shape != (n,):
            raise QuantkitError(f"a draft tree needs one parent per node: {n} tokens, parent {list(self.parent.shape)}")
        if n and bool((self.parent >= torch.arange(n)).any() or (self.parent < -1).any()):
            raise QuantkitError("a draft tree's nodes must come in topological order (each parent before its children)")
        if self.draws not in DRAWS:
            raise QuantkitError(f"unknown draws {self.draws!r}; allowed: {', '.join(DRAWS)}")
        if self.draws != "deterministic" and (self.draft_probs is None or self.draft_probs.shape[0] != n + 1):
            raise QuantkitError(f"sampled draft trees need draft_probs [n + 1, V] (n = {n})")

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def depth(self) -> torch.Tensor:
        """[n] long: 1 for the root's children."""
        depth = torch.zeros(self.size, dtype=torch.long)
        for i, p in enumerate(self.parent.tolist()):
            depth[i] = 1 if p < 0 else depth[p] + 1
        return depth

    def children(self) -> list[list[int]]:
        """Children of each slot in drafting order: entry 0 the root's, entry i + 1 node i's."""
        out: list[list[int]] = [[] for _ in range(self.size + 1)]
        for i, p in enumerate(self.parent.tolist()):
            out[p + 1].append(i)
        return out

    def ancestor_mask(self) -> torch.Tensor:
        """[n, n] bool: mask[i, j] iff node j is node i or one of its ancestors (tree attention; every node also
        sees the whole prefix, root included)."""
        mask = torch.eye(self.size, dtype=torch.bool)
        for i, p in enumerate(self.parent.tolist()):
            if p >= 0:
                mask[i] |= mask[p]  # the parent's row is final: it comes earlier
        return mask

    def chunk_parents(self) -> list[int]:
        """The parent array of the verify chunk [root, nodes...] (the root -1, node i at chunk index i + 1): what
        ``quantkit.kernels.attention.tree_mask.pack_tree_masks`` takes for the prefill kernel's tree mask."""
        return [-1, *(self.parent + 1).tolist()]

    def positions(self, num_computed: int) -> torch.Tensor:
        """[n] long: each node's position when the root (the sequence's last token) sits at ``num_computed``."""
        return num_computed + self.depth

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path, as node indices from the root's child down."""
        children, out = self.children(), []
        for leaf in (i for i in range(self.size) if not children[i + 1]):
            path = [leaf]
            while (p := int(self.parent[path[-1]])) >= 0:
                path.append(p)
            out.append(path[::-1])
        return out


@dataclass(frozen=True)
class TreeVerdict:
    """``nodes``: the accepted path's node indices, the root's child first (their K/V are kept); ``tokens``
    [len(nodes) + 1]: their tokens followed by the one token the target emits."""

    nodes: list[int]
    tokens: torch.Tensor

    @property
    def num_accepted(self) -> int:
        return len(self.nodes)


def _verdict(tree: DraftTree, nodes: list[int], last: int) -> TreeVerdict:
    drafted = tree.tokens[nodes].tolist() if nodes else []
    return TreeVerdict(nodes, torch.tensor([*drafted, last], dtype=torch.long))


# -- greedy ---------------------------------------------------------------------------------------------------------


def verify_tree_greedy(
    tree: DraftTree, target_logits: torch.Tensor | None, best: list[int] | None = None
) -> TreeVerdict:
    """target_logits [n + 1, V] (or ``best``, their argmax per row) -> the deepest path whose every token is the
    target's argmax at its parent, then the argmax after it: exactly what plain greedy decoding emits (siblings with
    one token lead to the same output; the deepest of their subtrees is kept, the first in order among equals)."""
    best = target_logits.argmax(dim=-1) if best is None else torch.tensor(best)  # [n + 1]
    nodes = _deepest(tree, tree.tokens == best[tree.parent + 1])
    return _verdict(tree, nodes, int(best[nodes[-1] + 1 if nodes else 0]))


def _deepest(tree: DraftTree, ok: torch.Tensor) -> list[int]:
    """ok [n] bool per node -> the deepest node whose ancestors and itself are all ok (the first in order among
    equals), as its path of node indices from the root's child down; [] if no child of the root is ok."""
    accepted = ok.tolist()
    for i, par in enumerate(tree.parent.tolist()):
        accepted[i] = accepted[i] and (par < 0 or accepted[par])
    depth = tree.depth.tolist()
    end = max((i for i in range(tree.size) if accepted[i]), key=lambda i: (depth[i], -i), default=None)
    nodes = []
    while end is not None and end >= 0:
        nodes.append(end)
        end = int(tree.parent[end])
    return nodes[::-1]


# -- the lossless rule ----------------------------------------------------------------------------------------------


def _normalised(d: torch.Tensor) -> torch.Tensor | None:
    total = d.sum()
    return d / total if total > 0 else None


def sibling_tries(p: torch.Tensor, q: torch.Tensor | None, tokens: list[int], draws: str):
    """The recursive rejection over one node's children: p [V] the target's distribution there, q [V] the draft's
    (None for deterministic draws), ``tokens`` the children's tokens in drafting order -> (accept [k]: the
    probability that child j is accepted given that every earlier one was rejected, residual [V]: the distribution
    drawn from when all are rejected). Deterministic for a given tree: the sampler and ``tree_emission`` share it."""
    r, accept = p.double(), []
    q_j = None if q is None else q.double()
    for x in tokens:
        if draws == "deterministic":
            q_j = torch.zeros_like(r)
            q_j[x] = 1.0
        qx, rx = float(q_j[x]), float(r[x])
        accept.append(1.0 if rx >= qx else rx / qx)  # qx > 0 for any token the draft could have drawn
        nxt = _normalised((r - q_j).clamp_min(0))
        if nxt is None:  # r <= q everywhere: r == q, and this try cannot have rejected
            break
        r = nxt
        if draws == "without_replacement":
            q_j = q_j.clone()
            q_j[x] = 0.0
            q_j = _normalised(q_j)
            if q_j is None:  # the draft's support is spent: no further sibling could have been drawn
                break
    return accept, r


def verify_tree_sampled(
    tree: DraftTree, target_probs: torch.Tensor, uniform: torch.Tensor, noise: torch.Tensor
) -> TreeVerdict:
    """The lossless rule over a tree. target_probs p [n + 1, V] (filtered: temperature, top-k, top-p applied, as
    the draft's q); uniform [n] in [0, 1); noise [V] of Exp(1) draws."""
    children, tokens = tree.children(), tree.tokens.tolist()
    nodes: list[int] = []
    slot = 0
    while children[slot]:
        kids = children[slot]
        q = None if tree.draft_probs is None or tree.draws == "deterministic" else tree.draft_probs[slot]
        accept, residual = sibling_tries(target_probs[slot], q, [tokens[c] for c in kids], tree.draws)
        chosen = next((c for c, a in zip(kids, accept, strict=False) if float(uniform[c]) < a), None)
        if chosen is None:
            return _verdict(tree, nodes, int((residual / noise.double()).argmax()))
        nodes.append(chosen)
        slot = chosen + 1
    return _verdict(tree, nodes, int((target_probs[slot].double() / noise.double()).argmax()))


def tree_emission(tree: DraftTree, target_probs: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Exact probability of every token sequence the lossless rule can emit for this tree, by enumerating its
    branches (accepted children and the residual's tokens). For tests."""
    children, tokens = tree.children(), tree.tokens.tolist()
    out: dict[tuple[int, ...], float] = {}

    def walk(slot: int, prefix: tuple[int, ...], weight: float) -> None:
        kids = children[slot]
        if not kids:
            final = target_probs[slot].double()
        else:
            q = None if tree.draft_probs is None or tree.draws == "deterministic" else tree.draft_probs[slot]
            accept, final = sibling_tries(target_probs[slot], q, [tokens[c] for c in kids], tree.draws)
            for c, a in zip(kids, accept, strict=False):
                if a > 0:
                    walk(c + 1, (*prefix, tokens[c]), weight * a)
                weight *= 1.0 - a
            if weight == 0:
                return
        for y in torch.nonzero(final).flatten().tolist():
            key = (*prefix, y)
            out[key] = out.get(key, 0.0) + weight * float(final[y])

    walk(0, (), 1.0)
    return out


# -- Medusa's typical acceptance (lossy) ----------------------------------------------------------------------------


def verify_tree_typical(
    tree: DraftTree, target_probs: torch.Tensor, noise: torch.Tensor, epsilon: float = 0.09, delta: float = 0.3
) -> TreeVerdict:
    """Medusa's typical acceptance (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
    Multiple Decoding Heads", section 2.3.1): a node is accepted when the target's probability of its token at its
    parent exceeds min(epsilon, delta * exp(-H(p))), H the entropy of p there, and so are all its ancestors; the
    deepest accepted node wins (the first in order among equals), and a token is drawn from p after it.

    NOT lossless: it keeps plausible tokens rather than the target's distribution (with p one-hot, temperature 0, it
    accepts exactly the argmax and equals greedy). An explicit option for speed. target_probs p [n + 1, V] filtered;
    noise [V] of Exp(1) draws."""
    p = target_probs.double()
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)  # [n + 1], nats
    threshold = torch.clamp(delta * torch.exp(-entropy), max=epsilon)
    slot_of_parent = tree.parent + 1
    nodes = _deepest(tree, p[slot_of_parent, tree.tokens] > threshold[slot_of_parent])
    slot = nodes[-1] + 1 if nodes else 0
    return _verdict(tree, nodes, int((p[slot] / noise.double()).argmax()))


# -- building trees -------------------------------------------------------------------------------------------------


def medusa_tree(accuracies: torch.Tensor, num_nodes: int) -> list[tuple[int, ...]]:
    """Medusa's sparse tree: accuracies [K, topk], entry (k, i) the measured probability that head k's i-th
    candidate is the right token at depth k + 1 -> the ``num_nodes`` paths of candidate indices (node (i_1 .. i_d):
    head 0's i_1-th candidate, then head 1's i_2-th, ...) of the highest path probability prod_k accuracies[k, i_k].
    These maximise the expected accepted length, the sum of the nodes' path probabilities (candidates of one head
    are distinct tokens, so at most one child of a node is right): a child never beats its parent, so the best n
    paths form a tree, found by expanding best-first. Sorted by depth, then by candidate indices."""
    acc = accuracies.double().tolist()
    heads, topk = len(acc), len(acc[0]) if acc else 0
    frontier = [(-acc[0][i], (i,)) for i in range(topk)] if heads else []
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < num_nodes:
        neg, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < heads:
            for i in range(topk):
                heapq.heappush(frontier, (neg * acc[len(path)][i], (*path, i)))
    return sorted(chosen, key=lambda path: (len(path), path))


def expected_length(accuracies: torch.Tensor, paths: Sequence[tuple[int, ...]]) -> float:
    """Expected accepted draft tokens per step of a static tree: the sum of its nodes' path probabilities."""
    acc = accuracies.double()
    return sum(math.prod(float(acc[k, i]) for k, i in enumerate(path)) for path in paths)


def static_tree(paths: Sequence[tuple[int, ...]], candidates: torch.Tensor) -> DraftTree:
    """The tree of ``medusa_tree``'s paths (sorted by depth) for one step: candidates [K, topk], head k's tokens
    best first."""
    index = {path: i for i, path in enumerate(paths)}
    parent = [index[path[:-1]] if len(path) > 1 else -1 for path in paths]
    tokens = [int(candidates[len(path) - 1, path[-1]]) for path in paths]
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parent, dtype=torch.long))


DraftFn = Callable[[list[int], list[int], list[int]], torch.Tensor]


def eagle_tree(draft: DraftFn, depth: int, width: int, num_nodes: int) -> tuple[DraftTree, torch.Tensor]:
    """EAGLE-2's dynamic tree (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic Draft
    Trees"). ``draft(frontier, tokens, parent) -> q [len(frontier), V]``: the draft's distribution after each
    frontier node (-1: the root), ``tokens`` / ``parent`` the nodes drafted so far. The root gets its top ``width``
    children; then ``depth`` - 1 times, the ``width`` newest nodes of highest confidence (the product of draft
    probabilities along the path) get their top ``width`` children each. All drafted nodes are reranked by
    confidence and the best ``num_nodes`` kept, with their ancestors (a child's confidence never exceeds its
    parent's, so ranking by (confidence, depth) keeps the set closed). -> (tree, confidence [n]); the tree's draws are
    deterministic and its draft_probs hold q at every kept expanded slot (zeros elsewhere)."""
    tokens: list[int] = []
    parent: list[int] = []
    conf: list[float] = []
    dists: dict[int, torch.Tensor] = {}
    frontier = [-1]
    for _ in range(max(depth, 0)):
        q = draft(frontier, list(tokens), list(parent))
        newest = len(tokens)
        for row, node in enumerate(frontier):
            dists[node] = q[row].detach().double().cpu()
            base = 1.0 if node < 0 else conf[node]
            top = torch.topk(dists[node], min(width, q.shape[-1]))
            for value, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                tokens.append(int(token))
                parent.append(node)
                conf.append(base * value)
        layer = range(newest, len(tokens))
        frontier = sorted(layer, key=lambda i: -conf[i])[:width]
    depth_of = [0] * len(tokens)
    for i, p in enumerate(parent):
        depth_of[i] = 1 if p < 0 else depth_of[p] + 1
    kept: set[int] = set()
    for i in sorted(range(len(tokens)), key=lambda i: (-conf[i], depth_of[i], i)):
        missing = []
        node = i
        while node >= 0 and node not in kept:
            missing.append(node)
            node = parent[node]
        if len(kept) + len(missing) <= num_nodes:
            kept.update(missing)
        if len(kept) == num_nodes:
            break
    order = sorted(kept)  # drafting order is topological
    new = {old: j for j, old in enumerate(order)}
    vocab = next(iter(dists.values())).shape[0] if dists else 0
    probs = torch.zeros(len(order) + 1, vocab, dtype=torch.float64)
    for slot, old in enumerate([-1, *order]):
        if old in dists:
            probs[slot] = dists[old]
    tree = DraftTree(
        torch.tensor([tokens[i] for i in order], dtype=torch.long),
        torch.tensor([new[parent[i]] if parent[i] >= 0 else -1 for i in order], dtype=torch.long),
        probs,
    )
    return tree, torch.tensor([conf[i] for i in order], dtype=torch.float64)
