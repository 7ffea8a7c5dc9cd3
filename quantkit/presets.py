"""Named one-line recipes behind ``quantkit quantize --method NAME`` (a recipe file can say anything more).

Each preset lists its stages and its default scheme; the caller's scheme keys (CLI flags), calibration and
parameters go over them. ``awq+gptq`` reads: AWQ scaling, then GPTQ on the scaled weights. Its AWQ stage does not
clip: AWQ's clip ranges are searched for round-to-nearest, and clamping the weights to them before GPTQ throws away
what GPTQ's own clipped grids and error feedback would use (SmolLM2-135M, 3-bit g128: 96.7 perplexity with the clip,
79.1 without; results/accuracy-awq.md). It re-judges its scales under GPTQ (``quantizer: gptq``), with GPTQ fitted
on other calibration batches than those it is judged on: 51.9 at 4-bit g128 and 70.0 at 3-bit g64 (mean of three
calibration draws) against 54.9 and 72.1 for GPTQ alone (results/accuracy-h200-2026-12-02.md). Its GPTQ stage keeps
the settings those figures were measured with (act-order groups, MSE-clipped grids: ``AWQ_GPTQ``), which its AWQ
stage also judges with; plain ``gptq`` takes the stage's defaults (at 4 and 8 bits static groups and grids chosen on
held-out windows; below 4 bits act-order groups and MSE-clipped grids, the settings of earlier versions).
``w4a8`` reads: SmoothQuant migration (its alpha searched against the W4A8 numerics), then GPTQ on the smoothed
weights to 4-bit groups of 128, with int8 activations per token (``act_fmt: fp8`` for e4m3). ``w4a8-progressive``
is the same on QServe's progressive grid (``w4a8-int8-g128-progressive``: int8 per channel, then 4-bit asymmetric
groups with integer scales and zeros; int8 activations only; in a recipe: ``progressive: true`` in the scheme).
"""

from __future__ import annotations

from quantkit.errors import QuantkitError
from quantkit.recipe import Recipe

W4A16 = {"bits": 4, "group_size": 128, "sym": True}
W8A8 = {"bits": 8, "group_size": -1, "sym": True, "act_bits": 8, "act_dynamic": True}
FP8_BLOCK = {**W8A8, "fmt": "fp8", "block_size": 128}  # DeepSeek-V3's w8a8-fp8-block
W4A8 = {**W4A16, "act_bits": 8, "act_dynamic": True}  # w4a8-int8-g128-sym (act_fmt fp8: w4a8-fp8)
W4A8_PROGRESSIVE = {**W4A8, "sym": False, "progressive": True}  # w4a8-int8-g128-progressive
AWQ_GPTQ = {"static_groups": False, "mse": True}  # the GPTQ that awq+gptq's figures and its AWQ stage's judge use

PRESETS: dict[str, tuple[list, dict]] = {  # stages: a method name, or (name, its parameters)
    "rtn": (["rtn"], W4A16),
    "gptq": (["gptq"], W4A16),
    "awq": (["awq", "rtn"], W4A16),
    "awq+gptq": ([("awq", {"clip": False, "quantizer": "gptq", "refine_steps": 0}), ("gptq", AWQ_GPTQ)], W4A16),
    "w8a8": (["rtn"], W8A8),
    "fp8-block": (["rtn"], FP8_BLOCK),
    "smoothquant": (["smoothquant", "rtn"], W8A8),
    "smoothquant+gptq": (["smoothquant", "gptq"], W8A8),
    "w4a8": (["smoothquant", "gptq"], W4A8),
    "w4a8-progressive": (["smoothquant", "gptq"], W4A8_PROGRESSIVE),
}


def check_preset_bits(method: str | None, bits: int | None) -> None:
    """A preset with 8-bit activations is named by its widths (``w4a8``, ``w8a8``, ...): ``bits`` other than its
    weights' is a one-line error naming the preset that has them."""
    preset = PRESETS.get(method, ([], {}))[1]
    if preset.get("act_bits") and bits not in (None, preset["bits"]):
        other = {4: "w4a8", 8: "w8a8"}.get(bits)
        hint = f"; --method {other} has {bits}-bit weights" if other else ""
        raise QuantkitError(f"--method {method} has {preset['bits']}-bit weights and {preset['act_bits']}-bit "
                            f"activations: --bits {bits} does not apply{hint}")  # fmt: skip


def preset_recipe(method: str, scheme: dict | None = None, calibration: dict | None = None, params: dict | None = None):
    """The recipe of preset ``method`` with ``scheme`` keys over its default scheme."""
    if method not in PRESETS:
        raise QuantkitError(f"unknown method {method!r}; available: {', '.join(sorted(PRESETS))}")
    stages, default_scheme = PRESETS[method]
    data = {
        "name": method,
        "scheme": {**default_scheme, **(scheme or {})},
        "stages": [{"method": s} if isinstance(s, str) else {"method": s[0], "params": s[1]} for s in stages],
    }
    if calibration:
        data["calibration"] = calibration
    recipe = Recipe.from_dict(data, f"method {method}")
    return recipe.with_overrides(params=params) if params else recipe
