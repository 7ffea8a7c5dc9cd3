"""The calibration inputs an AWQ stage works on: the captured calls of a block, a strided token sample of a
token-wise block, per-channel statistics of a block's input, and a token sample of each linear's input."""

from __future__ import annotations

import torch
from torch import nn

from quantkit.calib.runner import LayerContext
from quantkit.errors import QuantkitError


def block_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states of one captured call of a block (the first argument, or ``hidden_states``)."""
    return args[0] if args else kwargs["hidden_states"]


def tokenwise(calls) -> bool:
    """A block called with its input alone (no positions, no mask) maps each token by itself: an MLP or MoE block
    in the architecture table (attention always receives position embeddings or a mask)."""
    return bool(calls) and all(
        len(args) == 1 and isinstance(args[0], torch.Tensor) and not _holds_tensor(kwargs) for args, kwargs in calls
    )


def _holds_tensor(v) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, dict):
        return any(_holds_tensor(x) for x in v.values())
    return isinstance(v, (tuple, list)) and any(_holds_tensor(x) for x in v)


def token_sample(calls, n_tokens: int) -> list[tuple[tuple, dict]]:
    """One call of a token-wise block on ``n_tokens`` input rows evenly strided over all ``calls`` (all rows
    when there are fewer)."""
    x = torch.cat([args[0].reshape(-1, args[0].shape[-1]) for args, _ in calls])
    if x.shape[0] > n_tokens:
        x = x[torch.linspace(0, x.shape[0] - 1, n_tokens, device=x.device).round().long()]
    return [((x.unsqueeze(0),), dict(calls[0][1]))]


def token_count(calls) -> int:
    """Tokens (input rows) over every captured call of a block."""
    inputs = [block_input(args, kwargs) for args, kwargs in calls]
    return sum(x.numel() // max(x.shape[-1], 1) for x in inputs)


def input_stats(calls, width: int, device, gram: bool):
    """Over every call of the block: mean |x| and mean x^2 per input channel [width], the Gram matrix sum x^T x
    [width, width] (fp32, only when ``gram``) and the number of tokens."""
    total = torch.zeros(width, dtype=torch.float64, device=device)
    squares = torch.zeros(width, dtype=torch.float64, device=device)
    xtx = torch.zeros(width, width, dtype=torch.float32, device=device) if gram else None
    count = 0
    for args, kwargs in calls:
        x = block_input(args, kwargs)
        if x.shape[-1] != width:
            raise QuantkitError(f"awq: the block's input has {x.shape[-1]} channels, the consumers take {width}")
        x = x.reshape(-1, width).float()
        total += x.abs().sum(dim=0).double()
        squares += x.pow(2).sum(dim=0).double()
        if xtx is not None:
            xtx.addmm_(x.t(), x)
        count += x.shape[0]
    return (total / max(count, 1)).float(), (squares / max(count, 1)).float(), xtx, count


def sample_inputs(ctx: LayerContext, modules: dict[str, nn.Linear], n_tokens: int) -> dict[str, torch.Tensor]:
    """Up to ``n_tokens`` input rows of each module, evenly strided within each calibration batch: {name: [T, K]}."""
    per_call = -(-n_tokens // max(len(ctx.hidden), 1))
    rows: dict[str, list[torch.Tensor]] = {}

    def hook(name: str):
        def fn(module, args):
            x = args[0].reshape(-1, module.in_features)
            step = max(1, x.shape[0] // per_call)
            if x.shape[0]:
                rows.setdefault(name, []).append(x[::step][:per_call].float())

        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in modules.items()]
    try:
        ctx.forward()
    finally:
        for h in handles:
            h.remove()
    return {n: torch.cat(r)[:n_tokens] for n, r in rows.items()}
