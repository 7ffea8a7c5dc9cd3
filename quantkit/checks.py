"""Type and range checks of settings given through the Python API, each failing as a one-line QuantkitError that
names the setting: ``"16"`` for a block size or ``"no"`` for a flag would otherwise fail deep inside torch, or, for
a flag, be read as true. NumPy and 0-d torch numbers are accepted and returned as plain ``int`` / ``float``."""

from __future__ import annotations

import math
import operator

from quantkit.errors import QuantkitError


def shown(value) -> str:
    """A bad value for a one-line message: its repr on one line, cut at 60 characters."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


def integer(name: str, value, low: int | None = None, high: int | None = None, none: bool = False) -> int | None:
    """``value`` as an int if it is an integer (not a bool) in [low, high]; None passes when ``none``."""
    if value is None and none:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)  # int, numpy integers, integer tensors of one element; never a float
    except TypeError:
        raise QuantkitError(f"{name} must be an integer{' or None' if none else ''}, got {shown(value)}") from None
    if (low is not None and value < low) or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]" if low is not None else f"<= {high}"
        raise QuantkitError(f"{name} must be {span}, got {value}")
    return value


def number(name: str, value, low: float, high: float, low_open: bool = False) -> float:
    """``value`` as a float if it is a real number (not a bool or a string) in [low, high] (or (low, high] when
    ``low_open``)."""
    try:
        if isinstance(value, bool | str | bytes):
            raise TypeError
        x = float(value)
    except OverflowError:  # an int beyond float's range: out of range, not of the wrong type
        x = math.inf if value > 0 else -math.inf
    except (TypeError, ValueError):
        raise QuantkitError(f"{name} must be a number, got {shown(value)}") from None
    if math.isnan(x) or x > high or x < low or (low_open and x == low):
        raise QuantkitError(f"{name} must be in {'(' if low_open else '['}{low}, {high}], got {shown(value)}")
    return x


def tokenizer(value, needs: str = "__call__") -> None:
    """A tokenizer given in place of a Hugging Face one must have the method that will be used (``needs``)."""
    if value is not None and not callable(getattr(value, needs, None)):
        raise QuantkitError(f"tokenizer must be a Hugging Face tokenizer, got {type(value).__name__}")


def flag(name: str, value) -> bool:
    """``value`` if it is True or False."""
    if not isinstance(value, bool):
        raise QuantkitError(f"{name} must be True or False, got {shown(value)}")
    return value
