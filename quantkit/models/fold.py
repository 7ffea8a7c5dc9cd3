"""Fold a per-channel scale into a smoothing group: shared by SmoothQuant and AWQ.

A smoothing group (:class:`quantkit.models.arch.SmoothGroup`) has a producer whose output channels X [T, C] feed
every consumer's input columns. For any s > 0 [C],

    (X / s) @ (W * s)^T = X @ W^T

so dividing the producer's output channel j by s_j and multiplying column j of every consumer by s_j leaves the
float model unchanged (up to fp32 rounding) and costs nothing at run time. How the producer divides:

- ``nn.Linear`` (e.g. ``v_proj`` before ``o_proj``, ``up_proj`` before ``down_proj``): rows (and bias) / s; with
  ``producer_rows="second_half"`` only the second half of the rows (Phi-3's fused ``gate_up_proj``: the up half).
  A positive per-channel scale also commutes with ReLU (OPT's ``fc1 -> ReLU -> fc2``).
- norms, by the architecture table's kind: ``"rms"`` y = n(x) * w: w / s; ``"rms_plus_one"`` (Gemma)
  y = n(x) * (1 + w): w' = (1 + w) / s - 1; ``"layernorm"``: weight and bias / s.

With grouped-query attention, ``o_proj`` has more input columns than ``v_proj`` has rows: each value head is read
by several query heads. ``channel_map`` [K] names the producer channel behind each consumer column
(:func:`repeated_heads_map`); the scale must then be one per producer channel, which keeps the fold exact.

Embeddings are never producers: a tied embedding is also the output head, which the fold would change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.models.arch import ArchSpec
from quantkit.models.layers import expand_smooth_group, match

NORM_KINDS = ("rms", "rms_plus_one", "layernorm")
PRODUCER_ROWS = ("all", "second_half")


def producer_row_slice(producer: nn.Module, producer_rows: str = "all") -> slice:
    """The output rows of a linear producer that feed the consumers."""
    if producer_rows not in PRODUCER_ROWS:
        raise QuantkitError(f"producer_rows must be one of {PRODUCER_ROWS}, got {producer_rows!r}")
    n = producer.weight.shape[0]
    if producer_rows == "all":
        return slice(0, n)
    if n % 2:
        raise QuantkitError(f"producer_rows='second_half' needs an even number of rows, got {n}")
    return slice(n // 2, n)


def producer_channels(producer: nn.Module, producer_rows: str = "all") -> int:
    """C: how many output channels of the producer feed the consumers."""
    if isinstance(producer, nn.Linear):
        rows = producer_row_slice(producer, producer_rows)
        return rows.stop - rows.start
    weight = getattr(producer, "weight", None)
    if weight is None:
        raise QuantkitError(f"cannot fold scales into a {type(producer).__name__} without a weight")
    return weight.shape[-1]


def repeated_heads_map(n_channels: int, n_columns: int, head_dim: int, device=None) -> torch.Tensor:
    """int64 [n_columns]: consumer column -> producer channel when each of the producer's heads is read by
    ``n_columns // n_channels`` consecutive consumer heads (HF ``repeat_kv``): column h*d + i reads channel
    (h // n_rep) * d + i."""
    if head_dim < 1 or n_channels % head_dim or n_columns % n_channels:
        raise QuantkitError(
            f"cannot map {n_columns} consumer columns onto {n_channels} producer channels with head_dim {head_dim}"
        )
    n_rep = n_columns // n_channels
    col = torch.arange(n_columns, device=device)
    head, i = col // head_dim, col % head_dim
    return (head // n_rep) * head_dim + i


def column_scales(s: torch.Tensor, channel_map: torch.Tensor | None) -> torch.Tensor:
    """s per producer channel [C] -> per consumer column [K]."""
    return s if channel_map is None else s[channel_map.to(s.device)]


def to_channels(
    v: torch.Tensor, channel_map: torch.Tensor | None, n_channels: int, reduce: str = "amax"
) -> torch.Tensor:
    """The other way: a statistic per consumer column [K] -> per producer channel [C], reduced ("amax" or "mean")
    over the columns that read each channel."""
    if channel_map is None:
        return v
    out = torch.zeros(n_channels, dtype=v.dtype, device=v.device)
    return out.scatter_reduce(0, channel_map.to(v.device), v, reduce=reduce, include_self=False)


def _check_scales(s: torch.Tensor, n_channels: int) -> None:
    if s.dim() != 1 or s.numel() != n_channels:
        raise QuantkitError(f"expected one scale per producer channel ({n_channels}), got shape {tuple(s.shape)}")
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise QuantkitError("smoothing scales must be finite and positive")


@torch.no_grad()
def _divide_(t: torch.Tensor, s: torch.Tensor) -> None:
    t.copy_((t.float() / s.reshape(-1, *[1] * (t.dim() - 1))).to(t.dtype))


@torch.no_grad()
def fold_scales(
    producer: nn.Module,
    consumers: list[nn.Module],
    s: torch.Tensor,
    norm_kind: str,
    producer_rows: str = "all",
    channel_map: torch.Tensor | None = None,
) -> None:
    """In place: the producer's output channel j / s_j, every consumer's input columns * s (through ``channel_map``).

    ``s`` fp32 [C], C = :func:`producer_channels`; ``consumers`` are modules with a weight [N, K] (linears, and
    float modules that read the same activations, e.g. MoE routers); ``norm_kind`` is the architecture table's
    ``norm`` and applies when the producer is not a linear. Arithmetic is fp32, written back in each tensor's dtype.
    """
    if isinstance(producer, nn.Embedding):
        raise QuantkitError("never fold scales into an embedding (a tied embedding is also the output head)")
    if norm_kind not in NORM_KINDS:
        raise QuantkitError(f"norm_kind must be one of {NORM_KINDS}, got {norm_kind!r}")
    n_channels = producer_channels(producer, producer_rows)
    s = s.detach().float().to(producer.weight.device)
    _check_scales(s, n_channels)
    s_cols = column_scales(s, channel_map)
    for c in consumers:
        w = getattr(c, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1] != s_cols.numel():
            shape = tuple(w.shape) if isinstance(w, torch.Tensor) else None
            raise QuantkitError(f"consumer {type(c).__name__} weight {shape} does not have {s_cols.numel()} columns")

    if isinstance(producer, nn.Linear):
        rows = producer_row_slice(producer, producer_rows)
        _divide_(producer.weight[rows], s)
        if producer.bias is not None:
            _divide_(producer.bias[rows], s)
    elif norm_kind == "rms_plus_one":
        w = producer.weight
        w.copy_(((1.0 + w.float()) / s - 1.0).to(w.dtype))
    else:
        _divide_(producer.weight, s)
        bias = getattr(producer, "bias", None)
        if norm_kind == "layernorm" and bias is not None:
            _divide_(bias, s)

    for c in consumers:
        w = c.weight
        w.copy_((w.float() * s_cols.to(w.device)[None, :]).to(w.dtype))


@dataclass
class BoundGroup:
    """A smoothing group of one decoder layer with its wildcards bound (module names relative to the layer).

    ``readers`` are float modules that read the producer's output too but are never quantized (MoE routers,
    Qwen2-MoE's shared-expert gate): their columns are scaled with the consumers' so the model stays unchanged.
    ``channel_map`` is None when consumer column j reads producer channel j.
    """

    producer: str
    consumers: list[str]
    block: str
    producer_rows: str
    readers: list[str]
    channel_map: torch.Tensor | None

    def modules(self, layer: nn.Module) -> tuple[nn.Module, list[nn.Module], list[nn.Module]]:
        get = layer.get_submodule
        return get(self.producer), [get(c) for c in self.consumers], [get(r) for r in self.readers]


def _readers(layer: nn.Module, arch: ArchSpec, block: str) -> list[str]:
    return [n for pattern in arch.never_quantize for n, _ in match(layer, pattern) if n.startswith(f"{block}.")]


def _channel_map(layer: nn.Module, producer: str, n_channels: int, n_columns: int) -> torch.Tensor | None:
    if n_channels == n_columns:
        return None
    parent = layer.get_submodule(producer.rpartition(".")[0])  # the attention module of v_proj -> o_proj
    head_dim = getattr(parent, "head_dim", None)
    if not isinstance(head_dim, int):
        raise QuantkitError(
            f"{producer} has {n_channels} output channels but its consumers read {n_columns}, and its parent module "
            "has no head_dim to map them by"
        )
    return repeated_heads_map(n_channels, n_columns, head_dim)


def bind_smooth_groups(layer: nn.Module, arch: ArchSpec) -> list[BoundGroup]:
    """Every smoothing group of the architecture table present in ``layer``, in table order."""
    out = []
    for group in arch.smooth:
        for producer, consumers, block in expand_smooth_group(layer, group):
            n_channels = producer_channels(layer.get_submodule(producer), group.producer_rows)
            n_columns = layer.get_submodule(consumers[0]).in_features
            out.append(
                BoundGroup(
                    producer,
                    consumers,
                    block,
                    group.producer_rows,
                    _readers(layer, arch, block),
                    _channel_map(layer, producer, n_channels, n_columns),
                )
            )
    return out


def fold_group(layer: nn.Module, group: BoundGroup, s: torch.Tensor, norm_kind: str) -> None:
    """:func:`fold_scales` on the modules of ``group`` in ``layer`` (consumers and readers alike)."""
    producer, consumers, readers = group.modules(layer)
    fold_scales(producer, consumers + readers, s, norm_kind, group.producer_rows, group.channel_map)
