"""Evaluation: perplexity, KL divergence and top-1 agreement against a float baseline."""

from quantkit.eval.perplexity import EvalResult, evaluate, evaluate_windows, window_log_probs

__all__ = ["EvalResult", "evaluate", "evaluate_windows", "window_log_probs"]
