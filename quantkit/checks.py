"""Type and range checks of settings given through the Python API, each failing as a one-line QuantkitError that
names the setting: ``"16"`` for a block size or ``"no"`` for a flag would otherwise fail deep inside torch, or, for
a flag, be read as true."""

from __future__ import annotations

import math

from quantkit.errors import QuantkitError


def integer(name: str, value, low: int | None = None, high: int | None = None, none: bool = False) -> int | None:
    """``value`` if it is an int (not a bool) in [low, high]; None passes when ``none``."""
    if value is None and none:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise QuantkitError(f"{name} must be an integer{' or None' if none else ''}, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]" if low is not None else f"<= {high}"
        raise QuantkitError(f"{name} must be {span}, got {value}")
    return value


def number(name: str, value, low: float, high: float, low_open: bool = False) -> float:
    """``value`` as a float if it is a real number (not a bool) in [low, high] (or (low, high] when ``low_open``)."""
    if not isinstance(value, int | float) or isinstance(value, bool) or math.isnan(value):
        raise QuantkitError(f"{name} must be a number, got {value!r}")
    if value > high or value < low or (low_open and value == low):
        raise QuantkitError(f"{name} must be in {'(' if low_open else '['}{low}, {high}], got {value}")
    return float(value)


def flag(name: str, value) -> bool:
    """``value`` if it is True or False."""
    if not isinstance(value, bool):
        raise QuantkitError(f"{name} must be True or False, got {value!r}")
    return value
