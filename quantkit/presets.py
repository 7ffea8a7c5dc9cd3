"""Named one-line recipes behind ``quantkit quantize --method NAME`` (a recipe file can say anything more).

Each preset lists its stages; the scheme, calibration and parameters come from the caller (CLI flags or
defaults). ``awq+gptq`` reads: AWQ scaling, then GPTQ on the scaled weights.
"""

from __future__ import annotations

from quantkit.errors import QuantkitError
from quantkit.recipe import Recipe

DEFAULT_SCHEME = {"bits": 4, "group_size": 128, "sym": True}

PRESETS: dict[str, list[str]] = {
    "rtn": ["rtn"],
}


def preset_recipe(method: str, scheme: dict | None = None, calibration: dict | None = None, params: dict | None = None):
    """The recipe of preset ``method`` with ``scheme`` keys over the default scheme."""
    if method not in PRESETS:
        raise QuantkitError(f"unknown method {method!r}; available: {', '.join(sorted(PRESETS))}")
    data = {
        "name": method,
        "scheme": {**DEFAULT_SCHEME, **(scheme or {})},
        "stages": [{"method": m} for m in PRESETS[method]],
    }
    if calibration:
        data["calibration"] = calibration
    recipe = Recipe.from_dict(data, f"method {method}")
    return recipe.with_overrides(params=params) if params else recipe
