"""The verification rule keeps exactly the target's distribution: by enumeration and by a fixed-seed chi-square."""

import pytest
import torch

from quantkit.runtime.speculative.rejection import emitted_distribution, verify_greedy, verify_sampled

# chi-square critical values at significance 0.001 (df -> value), from the standard table
CHI2_999 = {5: 20.515, 7: 24.322}


def _random_dist(v: int, gen: torch.Generator, zeros: int = 0) -> torch.Tensor:
    d = torch.rand(v, generator=gen, dtype=torch.float64) ** 3
    if zeros:
        d[torch.randperm(v, generator=gen)[:zeros]] = 0
    return d / d.sum()


@pytest.mark.parametrize("zeros_p,zeros_q", [(0, 0), (2, 0), (0, 2), (1, 3)])
def test_enumeration_gives_p(zeros_p, zeros_q):
    gen = torch.Generator().manual_seed(zeros_p * 10 + zeros_q)
    for _ in range(20):
        p, q = _random_dist(8, gen, zeros_p), _random_dist(8, gen, zeros_q)
        torch.testing.assert_close(emitted_distribution(p, q), p, rtol=0, atol=1e-12)


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_sampled_rule_matches_p_chi_square():
    """10^5 verifications of two drafted tokens: the first emitted token follows p_1, and the second (where the first
    draft was kept) follows p_2; q differs from p everywhere, so both branches of the rule are exercised."""
    gen = torch.Generator().manual_seed(0)
    v, k, b = 6, 2, 100_000
    p = torch.stack([_random_dist(v, gen) for _ in range(k + 1)]).float()
    q = torch.stack([_random_dist(v, gen, zeros=1) for _ in range(k)]).float()
    draft = torch.stack([torch.multinomial(q[i], b, replacement=True, generator=gen) for i in range(k)], dim=1)
    verdict = verify_sampled(
        draft,
        q.expand(b, k, v),
        p.expand(b, k + 1, v),
        torch.rand(b, k, generator=gen),
        torch.empty(b, v).exponential_(generator=gen),
    )
    first = torch.bincount(verdict.tokens[:, 0], minlength=v).double()
    assert _chi2(first, p[0].double()) < CHI2_999[v - 1]
    kept = verdict.num_accepted >= 1
    second = torch.bincount(verdict.tokens[kept, 1], minlength=v).double()
    assert _chi2(second, p[1].double()) < CHI2_999[v - 1]
    # the acceptance rate of the first draft is sum min(p, q), as the rule implies
    torch.testing.assert_close(kept.double().mean(), torch.minimum(p[0], q[0]).sum().double(), atol=0.01, rtol=0)


def test_one_hot_proposal_and_ragged_rows():
    """A deterministic proposer (n-gram lookup) passes one-hot q; rows with fewer drafts emit at their own end."""
    gen = torch.Generator().manual_seed(1)
    v, b = 8, 60_000
    p = _random_dist(v, gen).float()
    x = 3
    q = torch.nn.functional.one_hot(torch.tensor([[x, x]]), v).float().expand(b, 2, v)
    verdict = verify_sampled(
        torch.full((b, 2), x),
        q,
        p.expand(b, 3, v),
        torch.rand(b, 2, generator=gen),
        torch.empty(b, v).exponential_(generator=gen),
        num_draft=torch.ones(b, dtype=torch.long),
    )
    assert int(verdict.num_accepted.max()) <= 1  # the second slot of every row is padding
    assert (verdict.tokens[:, 2] == -1).all()
    first = torch.bincount(verdict.tokens[:, 0], minlength=v).double()
    assert _chi2(first, p.double()) < CHI2_999[v - 1]
    torch.testing.assert_close(verdict.num_accepted.double().mean(), p[x].double(), atol=0.01, rtol=0)


def test_greedy_accepts_while_draft_equals_argmax():
    logits = torch.tensor(
        [
            [[0.0, 5.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 9.0]],  # argmax 1, 0, 2
            [[0.0, 5.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 9.0]],
            [[0.0, 5.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 9.0]],
        ]
    )
    draft = torch.tensor([[1, 0], [1, 2], [0, 0]])
    verdict = verify_greedy(draft, logits, num_draft=torch.tensor([2, 2, 2]))
    assert verdict.num_accepted.tolist() == [2, 1, 0]
    assert verdict.tokens.tolist() == [[1, 0, 2], [1, 0, -1], [1, -1, -1]]
    ragged = verify_greedy(draft, logits, num_draft=torch.tensor([1, 0, 2]))
    assert ragged.tokens.tolist() == [[1, 0, -1], [1, -1, -1], [1, -1, -1]]
