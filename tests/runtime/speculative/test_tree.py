"""Draft trees: shape helpers, the verification rules (greedy equals plain greedy; the sampled rule keeps exactly the
target's distribution, by enumeration over every drafted tree and by a fixed-seed chi-square; Medusa's typical
acceptance is lossy), and the Medusa and EAGLE-2 tree builders."""

import itertools
import math

import pytest
import torch
from quantkit.kernels.attention.tree_mask import tree_mask_dense, tree_mask_words

from quantkit.errors import QuantkitError
from quantkit.runtime.speculative.tree import (
    DraftTree,
    eagle_tree,
    expected_length,
    medusa_tree,
    static_tree,
    tree_emission,
    verify_tree_greedy,
    verify_tree_sampled,
    verify_tree_typical,
)


def _random_dist(v: int, gen: torch.Generator, zeros: int = 0) -> torch.Tensor:
    d = torch.rand(v, generator=gen, dtype=torch.float64) ** 3 + 1e-3
    if zeros:
        d[torch.randperm(v, generator=gen)[:zeros]] = 0
    return d / d.sum()


def _chi2_critical(df: int) -> float:
    """The chi-square quantile at 0.999 (Wilson-Hilferty; within 1% of the table for df >= 3)."""
    z = 3.0902
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Statistic and degrees of freedom; cells expected under 5 are pooled into one."""
    expected = probs.double() * counts.sum()
    assert counts[expected == 0].sum() == 0, "an outcome of probability 0 occurred"
    small = expected < 5
    obs = torch.cat([counts[~small & (expected > 0)], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small & (expected > 0)], expected[small].sum().view(1)])
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def _tree(parent, tokens, q=None, draws="deterministic") -> DraftTree:
    return DraftTree(torch.tensor(tokens), torch.tensor(parent), q, draws)


def test_shape_helpers():
    tree = _tree([-1, -1, 0, 0, 2], [5, 6, 7, 8, 9])
    assert tree.depth.tolist() == [1, 1, 2, 2, 3]
    assert tree.positions(10).tolist() == [11, 11, 12, 12, 13]
    assert tree.paths() == [[1], [0, 3], [0, 2, 4]]
    assert tree.children() == [[0, 1], [2, 3], [], [4], [], []]
    want = torch.tensor(
        [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 0, 1, 0], [1, 0, 1, 0, 1]], dtype=torch.bool
    )
    assert torch.equal(tree.ancestor_mask(), want)
    # the verify chunk (root first) as the prefill kernel's tree mask sees it: the root, then each node's ancestors
    chunk = tree_mask_dense(tree_mask_words(tree.chunk_parents()), tree.size + 1)
    assert chunk[:, 0].all() and torch.equal(chunk[1:, 1:], want) and not chunk[0, 1:].any()
    with pytest.raises(QuantkitError, match="topological"):
        _tree([-1, 2, 0], [1, 2, 3])
    with pytest.raises(QuantkitError, match="draft_probs"):
        _tree([-1], [1], draws="with_replacement")


# -- greedy ---------------------------------------------------------------------------------------------------------


def _next_token(context: tuple[int, ...], v: int) -> int:
    """A fake target: a deterministic next token for each context."""
    return (sum((i + 3) * t for i, t in enumerate(context)) * 7 + 3 * len(context) + 1) % v


def test_greedy_tree_equals_plain_greedy():
    """Random trees (some nodes on the target's greedy path, most not) with logits whose argmax is the fake target's
    next token: the tree rule emits exactly plain greedy's tokens, along the deepest matching path."""
    gen = torch.Generator().manual_seed(0)
    v, prompt = 11, (4, 2)
    for _ in range(60):
        n = int(torch.randint(1, 16, (1,), generator=gen))
        parent, tokens, ctx = [], [], []
        for i in range(n):
            par = int(torch.randint(-1, i, (1,), generator=gen))
            before = prompt if par < 0 else ctx[par]
            on_path = float(torch.rand(1, generator=gen)) < 0.6
            tok = _next_token(before, v) if on_path else int(torch.randint(0, v, (1,), generator=gen))
            parent.append(par)
            tokens.append(tok)
            ctx.append((*before, tok))
        tree = _tree(parent, tokens)
        logits = torch.randn(n + 1, v, generator=gen)
        for slot, c in enumerate([prompt, *ctx]):
            logits[slot, _next_token(c, v)] = 10.0
        verdict = verify_tree_greedy(tree, logits)
        plain, c = [], prompt
        for _ in range(n + 1):
            plain.append(_next_token(c, v))
            c = (*c, plain[-1])
        assert verdict.tokens.tolist() == plain[: verdict.tokens.shape[0]]
        # the longest run of plain greedy's tokens from the root along any path
        deepest = max(
            next((d for d, i in enumerate(path) if tokens[i] != plain[d]), len(path)) for path in tree.paths()
        )
        assert verdict.num_accepted == deepest
        assert [tokens[i] for i in verdict.nodes] == plain[: verdict.num_accepted]


# -- the lossless rule by enumeration -------------------------------------------------------------------------------


def _draws(q: torch.Tensor, k: int, draws: str):
    """Every ordered tuple of k children the draft can produce, with its probability."""
    v = q.shape[0]
    if draws == "deterministic":
        yield tuple(torch.topk(q, k).indices.tolist()), 1.0
        return
    for tup in itertools.product(range(v), repeat=k):
        if draws == "with_replacement":
            prob = math.prod(float(q[x]) for x in tup)
        else:
            if len(set(tup)) < k:
                continue
            prob, left = 1.0, 1.0
            for x in tup:
                prob *= float(q[x]) / left if left > 0 else 0.0
                left -= float(q[x])
        if prob > 0:
            yield tup, prob


@pytest.mark.parametrize(
    "draws,zeros", [("with_replacement", 0), ("without_replacement", 0), ("deterministic", 0), ("with_replacement", 1),
                    ("without_replacement", 1)],
)  # fmt: skip
def test_enumeration_gives_p_depth_two(draws, zeros):
    """Root with two drafted children, each with two drafted children; target p and draft q depend on the context.
    Summed over every tree the draft can produce, weighted by its probability: the first emitted token follows
    p(root), the second given the first follows p(first), the third given the first two follows p(first, second)."""
    v = 4
    gen = torch.Generator().manual_seed(7 + zeros)
    ctxs = [(), *((a,) for a in range(v)), *itertools.product(range(v), repeat=2)]
    p = {c: _random_dist(v, gen, zeros) for c in ctxs}
    q = {c: _random_dist(v, gen, zeros) for c in ctxs if len(c) < 2}
    total: dict[tuple[int, ...], float] = {}
    for root_kids, w0 in _draws(q[()], 2, draws):
        grand = [list(_draws(q[(a,)], 2, draws)) for a in root_kids]
        for (s0, w1), (s1, w2) in itertools.product(grand[0], grand[1]):
            tokens = [*root_kids, *s0, *s1]
            parent = [-1, -1, 0, 0, 1, 1]
            ctx = [(root_kids[0],), (root_kids[1],)] + [(root_kids[0], t) for t in s0] + [(root_kids[1], t) for t in s1]
            slots = [(), *ctx]
            probs = torch.stack([p[c] for c in slots])
            qs = torch.stack([q[c] if len(c) < 2 else torch.zeros(v, dtype=torch.float64) for c in slots])
            tree = _tree(parent, tokens, None if draws == "deterministic" else qs, draws)
            for out, prob in tree_emission(tree, probs).items():
                total[out] = total.get(out, 0.0) + w0 * w1 * w2 * prob
    assert sum(total.values()) == pytest.approx(1.0, abs=1e-12)
    for prefix_len in range(3):
        marg: dict[tuple[int, ...], torch.Tensor] = {}
        for out, prob in total.items():
            if len(out) > prefix_len:
                marg.setdefault(out[:prefix_len], torch.zeros(v, dtype=torch.float64))[out[prefix_len]] += prob
        assert marg, f"no emission reaches token {prefix_len + 1}"
        for prefix, dist in marg.items():
            torch.testing.assert_close(dist / dist.sum(), p[prefix], rtol=0, atol=1e-12)


# -- the lossless rule by sampling ----------------------------------------------------------------------------------


@pytest.mark.parametrize("draws", ["with_replacement", "without_replacement"])
def test_sampled_tree_matches_p_chi_square(draws):
    """6000 draws of a tree (three children of the root, two under each) verified with fresh randomness: the first
    emitted token follows p(root), and the second, after the most frequent accepted first token y, follows p(y)."""
    gen = torch.Generator().manual_seed(3)
    v, n_trials, k1, k2 = 6, 6000, 3, 2
    p = {(): _random_dist(v, gen), **{(a,): _random_dist(v, gen) for a in range(v)}}
    q = {c: (0.5 * p[c] + 0.5 * _random_dist(v, gen)) for c in p}  # near p: many acceptances
    replace = draws == "with_replacement"
    root = torch.multinomial(q[()].expand(n_trials, v), k1, replacement=replace, generator=gen)
    below = torch.stack([torch.multinomial(q[(a,)].expand(n_trials * k1, v), k2, replacement=replace, generator=gen)
                         for a in range(v)]).view(v, n_trials, k1, k2)  # fmt: skip
    uniform = torch.rand(n_trials, k1 + k1 * k2, generator=gen)
    noise = torch.empty(n_trials, v).exponential_(generator=gen)
    parent = torch.tensor([-1] * k1 + [j for j in range(k1) for _ in range(k2)])
    zero = torch.zeros(v, dtype=torch.float64)
    first = torch.zeros(v)
    second = torch.zeros(v, v)
    for t in range(n_trials):
        kids = root[t].tolist()
        grand = [below[a, t, j].tolist() for j, a in enumerate(kids)]
        tokens = torch.tensor(kids + [x for g in grand for x in g])
        slots = [(), *((a,) for a in kids)]
        probs = torch.stack([p[c] for c in slots] + [zero] * (k1 * k2))  # leaves' rows: a bonus token, not counted
        probs[k1 + 1 :] = p[()]
        qs = torch.stack([q[c] for c in slots] + [zero] * (k1 * k2))
        verdict = verify_tree_sampled(DraftTree(tokens, parent, qs, draws), probs, uniform[t], noise[t])
        out = verdict.tokens.tolist()
        first[out[0]] += 1
        if len(out) > 1:
            second[out[0], out[1]] += 1
    stat, df = _chi2(first, p[()])
    assert stat < _chi2_critical(df)
    y = int(second.sum(1).argmax())
    stat, df = _chi2(second[y], p[(y,)])
    assert second[y].sum() > 500 and stat < _chi2_critical(df)


def test_sampler_agrees_with_enumeration_on_a_fixed_tree():
    """One EAGLE-style tree (deterministic top-k children): the verifier's outcomes over 8000 draws follow
    ``tree_emission``'s exact distribution, and the first token's exact marginal is p."""
    gen = torch.Generator().manual_seed(5)
    v = 5
    tree = _tree([-1, -1, 0, 0, 1], [0, 3, 1, 4, 2])
    probs = torch.stack([_random_dist(v, gen) for _ in range(6)])
    exact = tree_emission(tree, probs)
    first = torch.zeros(v, dtype=torch.float64)
    for out, prob in exact.items():
        first[out[0]] += prob
    torch.testing.assert_close(first, probs[0], rtol=0, atol=1e-12)
    outcomes = sorted(exact)
    index = {o: i for i, o in enumerate(outcomes)}
    counts = torch.zeros(len(outcomes))
    n = 8000
    uniform, noise = torch.rand(n, 5, generator=gen), torch.empty(n, v).exponential_(generator=gen)
    for t in range(n):
        counts[index[tuple(verify_tree_sampled(tree, probs, uniform[t], noise[t]).tokens.tolist())]] += 1
    stat, df = _chi2(counts, torch.tensor([exact[o] for o in outcomes]))
    assert stat < _chi2_critical(df)


# -- Medusa's typical acceptance ------------------------------------------------------------------------------------


def test_typical_acceptance_is_greedy_at_temperature_zero_and_lossy_otherwise():
    gen = torch.Generator().manual_seed(2)
    v = 7
    tree = _tree([-1, -1, 0, 0, 2, 1], [3, 1, 4, 2, 6, 0])
    logits = torch.randn(7, v, generator=gen)
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), v).double()
    noise = torch.empty(v).exponential_(generator=gen)
    greedy = verify_tree_greedy(tree, logits)
    typical = verify_tree_typical(tree, one_hot, noise)
    assert typical.tokens.tolist() == greedy.tokens.tolist() and typical.nodes == greedy.nodes
    # p = (0.5, 0.5, 0, ...) at the root: threshold min(0.09, 0.3 / 2) = 0.09, so the child 0 is always accepted:
    # the first token is 0 with probability 1 instead of 1/2 (not lossless)
    flat = torch.zeros(2, v, dtype=torch.float64)
    flat[:, :2] = 0.5
    tree = _tree([-1], [0])
    assert verify_tree_typical(tree, flat, torch.ones(v)).tokens[0] == 0
    # the deepest path whose every node passes wins: node 2 fails (p 0.05 < 0.09), so node 3 (depth 2) is taken
    probs = torch.full((5, v), 0.05, dtype=torch.float64)
    probs[:, 0] = 0.7
    probs[1, 5] = 0.2  # node 0's children: token 5 passes, token 6 does not
    tree = _tree([-1, 0, 0, 1], [0, 6, 5, 0])
    verdict = verify_tree_typical(tree, probs, torch.ones(v))
    assert verdict.nodes == [0, 2] and verdict.tokens.tolist() == [0, 5, 0]


# -- building trees -------------------------------------------------------------------------------------------------


def test_medusa_tree_picks_the_obvious_nodes_and_is_optimal():
    acc = torch.tensor([[0.6, 0.25, 0.1], [0.5, 0.2, 0.05], [0.4, 0.15, 0.1]])
    assert medusa_tree(acc, 1) == [(0,)]
    assert medusa_tree(acc, 2) == [(0,), (0, 0)]  # 0.3 beats 0.25
    assert medusa_tree(acc, 3) == [(0,), (1,), (0, 0)]
    assert medusa_tree(acc, 4) == [(0,), (1,), (0, 0), (1, 0)]  # 0.25 * 0.5 = 0.125 beats (0, 1) and (0, 0, 0): 0.12
    lengths = [expected_length(acc, medusa_tree(acc, n)) for n in range(1, 40)]
    assert all(b >= a for a, b in itertools.pairwise(lengths))
    assert len(medusa_tree(acc, 100)) == 3 + 9 + 27  # the full tree: nothing more to add
    # best over every ancestor-closed set of the full K = 2, topk = 3 tree
    small = torch.tensor([[0.5, 0.3, 0.1], [0.6, 0.35, 0.02]])
    nodes = [(i,) for i in range(3)] + [(i, j) for i in range(3) for j in range(3)]
    for n in range(1, 8):
        best = max(
            expected_length(small, subset)
            for subset in itertools.combinations(nodes, n)
            if all(len(path) == 1 or path[:1] in subset for path in subset)
        )
        assert expected_length(small, medusa_tree(small, n)) == pytest.approx(best, abs=1e-12)


def test_static_tree_from_paths():
    paths = medusa_tree(torch.tensor([[0.6, 0.3], [0.5, 0.4]]), 4)
    assert paths == [(0,), (1,), (0, 0), (0, 1)]
    candidates = torch.tensor([[11, 12], [21, 22]])
    tree = static_tree(paths, candidates)
    assert tree.tokens.tolist() == [11, 12, 21, 22] and tree.parent.tolist() == [-1, -1, 0, 0]


def _fake_draft(v: int, log: list):
    """A draft whose distribution is a fixed random function of the token path; logs (frontier paths, q)."""

    def path_of(node: int, tokens: list[int], parent: list[int]) -> tuple[int, ...]:
        out = []
        while node >= 0:
            out.append(tokens[node])
            node = parent[node]
        return tuple(out[::-1])

    def dist(path: tuple[int, ...]) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1 + sum((i + 1) * 31**i * (t + 1) for i, t in enumerate(path)) % 2**31)
        return torch.softmax(2.0 * torch.randn(v, generator=gen, dtype=torch.float64), -1)

    def draft(frontier, tokens, parent):
        paths = [path_of(node, tokens, parent) for node in frontier]
        q = torch.stack([dist(path) for path in paths])
        log.append((paths, q))
        return q

    return draft


@pytest.mark.parametrize("depth,width,m", [(4, 3, 10), (3, 2, 6), (5, 4, 25), (2, 3, 12)])
def test_eagle_tree_keeps_the_most_confident_closed_set(depth, width, m):
    v = 9
    log: list = []
    tree, conf = eagle_tree(_fake_draft(v, log), depth, width, m)
    assert len(log) == depth and tree.size == m and tree.draws == "deterministic"
    # every drafted node, from the calls: the top `width` children of each frontier path
    drafted: dict[tuple[int, ...], float] = {}
    base = {(): 1.0}
    for step, (paths, q) in enumerate(log):
        layer = {}
        for path, row in zip(paths, q, strict=True):
            for token in torch.topk(row, width).indices.tolist():
                layer[(*path, token)] = base[path] * float(row[token])
        if step + 1 < len(log):  # the next frontier: the `width` most confident of this layer
            nxt = log[step + 1][0]
            assert len(nxt) == width and min(layer[x] for x in nxt) >= max(
                (c for x, c in layer.items() if x not in nxt), default=0.0
            )
        drafted.update(layer)
        base.update(layer)
    kept = [tuple(_path(tree, i)) for i in range(tree.size)]
    assert len(set(kept)) == m
    assert all(len(path) == 1 or path[:-1] in kept for path in kept)  # ancestor-closed
    torch.testing.assert_close(conf, torch.tensor([drafted[path] for path in kept], dtype=torch.float64))
    cutoff = sorted(drafted.values(), reverse=True)[m - 1]
    assert all(drafted[path] >= cutoff for path in kept)  # the m most confident
    # draft_probs row of an expanded kept slot is the draft's q there; the tree verifies losslessly
    for paths, q in log:
        for path, row in zip(paths, q, strict=True):
            if path in kept:
                torch.testing.assert_close(tree.draft_probs[kept.index(path) + 1], row)
    torch.testing.assert_close(tree.draft_probs[0], log[0][1][0])
    probs = torch.softmax(torch.randn(m + 1, v, generator=torch.Generator().manual_seed(m), dtype=torch.float64), -1)
    first = torch.zeros(v, dtype=torch.float64)
    for out, prob in tree_emission(tree, probs).items():
        first[out[0]] += prob
    torch.testing.assert_close(first, probs[0], rtol=0, atol=1e-12)


def _path(tree: DraftTree, node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(int(tree.tokens[node]))
        node = int(tree.parent[node])
    return out[::-1]
