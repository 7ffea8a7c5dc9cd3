"""Named one-line recipes behind ``quantkit quantize --method NAME`` (a recipe file can say anything more).

Each preset lists its stages and its default scheme; the caller's scheme keys (CLI flags), calibration and
parameters go over them. ``awq+gptq`` reads: AWQ scaling, then GPTQ on the scaled weights.
"""

from __future__ import annotations

from quantkit.errors import QuantkitError
from quantkit.recipe import Recipe

W4A16 = {"bits": 4, "group_size": 128, "sym": True}
W8A8 = {"bits": 8, "group_size": -1, "sym": True, "act_bits": 8, "act_dynamic": True}

PRESETS: dict[str, tuple[list[str], dict]] = {
    "rtn": (["rtn"], W4A16),
    "gptq": (["gptq"], W4A16),
    "awq": (["awq", "rtn"], W4A16),
    "awq+gptq": (["awq", "gptq"], W4A16),
    "w8a8": (["rtn"], W8A8),
    "smoothquant": (["smoothquant", "rtn"], W8A8),
    "smoothquant+gptq": (["smoothquant", "gptq"], W8A8),
}


def preset_recipe(method: str, scheme: dict | None = None, calibration: dict | None = None, params: dict | None = None):
    """The recipe of preset ``method`` with ``scheme`` keys over its default scheme."""
    if method not in PRESETS:
        raise QuantkitError(f"unknown method {method!r}; available: {', '.join(sorted(PRESETS))}")
    stages, default_scheme = PRESETS[method]
    data = {"name": method, "scheme": {**default_scheme, **(scheme or {})}, "stages": [{"method": m} for m in stages]}
    if calibration:
        data["calibration"] = calibration
    recipe = Recipe.from_dict(data, f"method {method}")
    return recipe.with_overrides(params=params) if params else recipe
