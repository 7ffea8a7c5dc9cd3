"""Recipe stages: the glue between the layer-by-layer runner and the pure algorithms.

Each method registers a class with a frozen ``Params`` dataclass (the ``params:`` mapping of a recipe stage)
and an ``apply(ctx)`` that works on one decoder layer. "weights" stages replace linears by quantized modules;
"transform" stages (smoothing, scaling) rewrite float weights and leave quantization to a later stage.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.stages.spec import Stage, check_keys, params_to_dict

__all__ = ["METHODS", "build_stage", "params_to_dict", "parse_params", "register", "replace_params", "stage_class"]


METHODS: dict[str, type] = {}


def register(name: str):
    def deco(cls):
        METHODS[name] = cls
        return cls

    return deco


BUILTIN_MODULES = ("weights", "gptq", "awq", "smoothquant")


def _load_builtin_methods() -> None:
    import importlib

    for module in BUILTIN_MODULES:  # each registers its methods on import
        importlib.import_module(f"quantkit.stages.{module}")


def stage_class(method: str) -> type:
    _load_builtin_methods()
    try:
        return METHODS[method]
    except KeyError:
        raise QuantkitError(f"unknown method {method!r}; available: {', '.join(sorted(METHODS))}") from None


def parse_params(method: str, data: Any, where: str):
    cls = stage_class(method).Params
    return cls(**check_keys(data, cls, where))


def replace_params(method: str, params, changes: dict):
    names = {f.name for f in fields(stage_class(method).Params)}
    applicable = {k: v for k, v in changes.items() if k in names}
    return replace(params, **applicable) if applicable else params


def validate_stage(stage: Stage, where: str) -> None:
    cls = stage_class(stage.method)
    if cls.kind == "weights" and stage.scheme is None:
        raise QuantkitError(f"{where}: method {stage.method!r} needs a scheme (in the stage or the recipe)")
    check = getattr(cls, "check_stage", None)
    if check is not None:
        check(stage, where)


def build_stage(stage: Stage):
    return stage_class(stage.method)(stage)
