"""quantkit.checks: what each check accepts (and returns as a plain number) and the one-line message it gives."""

import math

import numpy as np
import pytest
import torch

from quantkit import checks
from quantkit.errors import QuantkitError


def test_integer_accepts_integers_of_every_kind_and_returns_plain_ints():
    for value in (7, np.int64(7), torch.tensor(7)):
        got = checks.integer("n", value, low=1, high=8)
        assert got == 7 and type(got) is int
    assert checks.integer("n", None, none=True) is None


@pytest.mark.parametrize(
    ("value", "kwargs", "message"),
    [
        ("16", {}, "n must be an integer, got '16'"),
        (2.5, {}, "n must be an integer, got 2.5"),
        (True, {}, "n must be an integer, got True"),
        (None, {}, "n must be an integer, got None"),
        ("x", {"none": True}, "n must be an integer or None, got 'x'"),
        (0, {"low": 1}, "n must be >= 1, got 0"),
        (9, {"low": 1, "high": 8}, "n must be in [1, 8], got 9"),
        (9, {"high": 8}, "n must be <= 8, got 9"),
    ],
)
def test_integer_refuses_with_one_line_naming_the_setting(value, kwargs, message):
    with pytest.raises(QuantkitError) as exc:
        checks.integer("n", value, **kwargs)
    assert str(exc.value) == message


def test_number_returns_floats_and_handles_the_edges():
    assert checks.number("t", np.float32(0.5), 0.0, 1.0) == 0.5 and type(checks.number("t", 1, 0, 1)) is float
    assert checks.number("t", 0.0, 0.0, 1.0) == 0.0  # a closed bound is allowed
    with pytest.raises(QuantkitError, match=r"t must be in \(0.0, 1.0\], got 0.0"):
        checks.number("t", 0.0, 0.0, 1.0, low_open=True)
    with pytest.raises(QuantkitError, match=r"t must be in \[0, 1\], got nan"):
        checks.number("t", math.nan, 0, 1)
    with pytest.raises(QuantkitError, match=r"t must be in \[0, 1\], got 100000"):
        checks.number("t", 10**400, 0, 1)  # beyond float's range: out of range, not a traceback
    for bad in ("0.5", b"1", False):
        with pytest.raises(QuantkitError, match="t must be a number"):
            checks.number("t", bad, 0, 1)


def test_flag_and_tokenizer():
    assert checks.flag("f", True) is True and checks.flag("f", False) is False
    with pytest.raises(QuantkitError, match="f must be True or False, got 'no'"):
        checks.flag("f", "no")

    class Saves:
        def save_pretrained(self, path): ...

    checks.tokenizer(None)
    checks.tokenizer(Saves(), needs="save_pretrained")
    with pytest.raises(QuantkitError, match="tokenizer must be a Hugging Face tokenizer, got Saves"):
        checks.tokenizer(Saves())  # not callable: it cannot tokenize


def test_shown_keeps_a_bad_value_on_one_short_line():
    assert checks.shown("a\nb") == "'a\\nb'"
    long = checks.shown(list(range(100)))
    assert len(long) == 60 and long.endswith("...") and "\n" not in long
