"""Resolve the name patterns of an architecture table against the modules of one decoder layer."""

from __future__ import annotations

import re
from functools import lru_cache

from torch import nn

from quantkit.models.arch import SmoothGroup


@lru_cache(maxsize=256)
def _pattern_regex(pattern: str) -> re.Pattern:
    return re.compile(re.escape(pattern).replace(r"\*", r"(\d+)") + "$")


def match(layer: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    """Modules of ``layer`` whose name matches ``pattern`` (``*`` = an expert index), in index order."""
    if "*" not in pattern:
        try:
            return [(pattern, layer.get_submodule(pattern))]
        except AttributeError:
            return []
    rx = _pattern_regex(pattern)
    found = [(name, mod) for name, mod in layer.named_modules() if rx.match(name)]
    return sorted(found, key=lambda nm: [int(i) for i in rx.match(nm[0]).groups()])


def linears(layer: nn.Module, patterns: tuple[str, ...], skip: tuple[str, ...] = ()) -> list[tuple[str, nn.Linear]]:
    """All ``nn.Linear`` modules named by ``patterns`` (in pattern order), minus the names in ``skip``."""
    out = []
    for pattern in patterns:
        out += [(n, m) for n, m in match(layer, pattern) if isinstance(m, nn.Linear) and n not in skip]
    return out


def expand_smooth_group(layer: nn.Module, group: SmoothGroup) -> list[tuple[str, list[str], str]]:
    """Bind the expert wildcard of a smoothing group: [(producer, consumers, block)], one per expert index
    when the producer itself is per-expert, else one with all matching consumers."""
    if "*" in group.producer:
        out = []
        for name, _ in match(layer, group.producer):
            idx = _pattern_regex(group.producer).match(name).group(1)
            consumers = [c.replace("*", idx) for c in group.consumers]
            consumers = [c for c in consumers if match(layer, c)]
            if consumers:
                out.append((name, consumers, group.block.replace("*", idx)))
        return out
    if not match(layer, group.producer):
        return []
    consumers = [n for c in group.consumers for n, _ in match(layer, c)]
    return [(group.producer, consumers, group.block)] if consumers else []
