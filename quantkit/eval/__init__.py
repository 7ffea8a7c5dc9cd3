"""Evaluation: perplexity, KL divergence and top-1 agreement against a float baseline."""
