"""A draft vocabulary: EAGLE's batched drafters read out only the most frequent tokens of the heads' training text.

Each drafted token costs a readout, the product of the head's feature with the target's vocabulary matrix; on the
Llama-3-8B shape (128,256 x 4096, 1.05 GB in bf16) four readouts are most of a chain's cost. EAGLE-3 (Li et al.
2025) gives its draft a vocabulary of its own (32k of 128k tokens), and FR-Spec (Zhao et al. 2025, "FR-Spec:
Accelerating Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling") restricts the draft's
candidates to the most frequent tokens of a corpus. Here the heads' own training text gives the frequencies
(``train_draft`` writes its token counts beside the heads, ``COUNTS_FILE``), and ``SpeculativeConfig.
draft_vocab_size`` N keeps the N most frequent: the drafters read out those rows of the lm_head only and draft only
those tokens. Verification is unchanged, so the output is the target's; a token outside the draft vocabulary is
simply never drafted (it still comes from the target). Greedy chains and trees use it; sampled requests draft from
the full vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import torch

from quantkit.errors import QuantkitError

COUNTS_FILE = "token_counts.safetensors"


def save_token_counts(folder, ids: torch.Tensor, vocab_size: int) -> None:
    """Count each token id of ``ids`` (the heads' training text) and write the counts [vocab_size] beside the heads."""
    from safetensors.torch import save_file

    counts = torch.bincount(ids.flatten().long().cpu(), minlength=vocab_size)[:vocab_size]
    tmp = Path(folder) / f".{COUNTS_FILE}.tmp"
    save_file({"counts": counts.contiguous()}, str(tmp))
    tmp.replace(Path(folder) / COUNTS_FILE)


def draft_vocab(folder, size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids of the heads' training text (ties: the lower id), most frequent first."""
    from safetensors.torch import load_file

    path = Path(folder) / COUNTS_FILE
    if not path.is_file():
        raise QuantkitError(f"draft_vocab_size needs the token counts of the heads' training text ({path} is "
                            "missing: heads trained before quantkit wrote them; write them with "
                            "quantkit.runtime.speculative.draft_vocab.save_token_counts)")  # fmt: skip
    counts = load_file(str(path))["counts"]
    if counts.shape != (vocab_size,):
        raise QuantkitError(f"{path} counts {counts.shape[0]} tokens, the model has {vocab_size}")
    order = torch.sort(counts, descending=True, stable=True).indices  # stable: equal counts keep the lower id first
    return order[:size].clone()


class DraftReadout:
    """Logits over the draft vocabulary ``ids`` [N] for features g [..., H] (``__call__``), and the token ids of
    positions in it (``tokens``). ``target``: the runtime model whose lm_head (or tied embedding) reads out."""

    def __init__(self, target, ids: torch.Tensor):
        head = target.lm_head
        weight = target.model.embed_tokens.weight if head is None else getattr(head, "weight", None)
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 2:
            raise QuantkitError("draft_vocab_size needs a float lm_head (this model's is quantized)")
        self.ids = ids.to(weight.device)
        self.weight = weight.detach()[self.ids].contiguous()  # [N, H]: the rows read out

    def __call__(self, g: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(g, self.weight)

    def tokens(self, index: torch.Tensor) -> torch.Tensor:
        return self.ids[index]
