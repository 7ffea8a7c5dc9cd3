"""quantkit.eval.perplexity against the protocol computed here by hand in float64: perplexity = exp(mean NLL of
position t predicting token t + 1), KL(baseline || model) and top-1 agreement averaged over every prediction."""

import math

import pytest
import torch

from quantkit.eval import evaluate_windows as exported
from quantkit.eval.perplexity import EvalResult, evaluate_windows, window_log_probs
from tests.tiny_models import tiny_model

WINDOWS = torch.randint(3, 320, (3, 17), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def models():
    return tiny_model("llama", seed=0), tiny_model("llama", seed=1)


def reference_log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    """log-softmax in float64 of the next-token logits of one window: [L] -> [L-1, V]."""
    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1]
    return torch.log_softmax(logits.double(), dim=-1)


def test_window_log_probs_are_the_next_token_log_softmax(models):
    lp = window_log_probs(models[0], WINDOWS[0])
    assert lp.shape == (16, 320) and lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), reference_log_probs(models[0], WINDOWS[0]), rtol=0, atol=1e-5)


def test_perplexity_kl_and_agreement_match_the_protocol(models):
    model, baseline = models
    nll = kl = agree = base_nll = 0.0
    for ids in WINDOWS:
        lp, base = reference_log_probs(model, ids), reference_log_probs(baseline, ids)
        target = ids[1:, None]
        nll -= lp.gather(1, target).sum().item()
        base_nll -= base.gather(1, target).sum().item()
        kl += (base.exp() * (base - lp)).sum().item()
        agree += (base.argmax(-1) == lp.argmax(-1)).sum().item()
    n = WINDOWS.shape[0] * (WINDOWS.shape[1] - 1)
    seen = []
    result = evaluate_windows(model, WINDOWS, baseline, progress=lambda done, total: seen.append((done, total)))
    assert isinstance(result, EvalResult) and result.tokens == n == 48
    assert result.perplexity == pytest.approx(math.exp(nll / n), rel=1e-5)
    assert result.baseline_perplexity == pytest.approx(math.exp(base_nll / n), rel=1e-5)
    assert result.kl == pytest.approx(kl / n, rel=1e-4) and result.kl > 0
    assert result.top1_agreement == agree / n
    assert seen == [(1, 3), (2, 3), (3, 3)]
    assert exported is evaluate_windows


def test_a_model_against_itself_has_no_divergence(models):
    model = models[0]
    result = evaluate_windows(model, WINDOWS, model)
    assert result.kl == pytest.approx(0.0, abs=1e-9) and result.top1_agreement == 1.0
    assert result.baseline_perplexity == result.perplexity
    alone = evaluate_windows(model, WINDOWS)
    assert alone.perplexity == result.perplexity and alone.kl is None and alone.top1_agreement is None


def test_baseline_log_probs_can_be_given_and_reused_for_the_model(models):
    """A baseline given as per-window log-probs scores the same as the baseline model; ``float_from_baseline``
    scores those log-probs as the model's own without a forward pass (the float row of a comparison table)."""
    model, baseline = models
    cached = [window_log_probs(baseline, ids) for ids in WINDOWS]
    from_model = evaluate_windows(model, WINDOWS, baseline)
    from_cache = evaluate_windows(model, WINDOWS, cached)
    assert from_cache.to_dict() == pytest.approx(from_model.to_dict())
    own = evaluate_windows(None, WINDOWS, cached, float_from_baseline=True)
    assert own.perplexity == pytest.approx(evaluate_windows(baseline, WINDOWS).perplexity, rel=1e-6)
    assert own.kl == pytest.approx(0.0, abs=1e-9) and own.top1_agreement == 1.0
