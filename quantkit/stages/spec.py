"""What a recipe stage is, as data: the method's name, its scheme and parameters, which modules it selects.

Shared by :mod:`quantkit.recipe` (which reads stages from YAML) and :mod:`quantkit.stages` (which runs them);
it knows neither.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.quant.scheme import QuantScheme


def check_keys(data: Any, cls, where: str) -> dict:
    """``data`` as a mapping whose keys are all fields of the dataclass ``cls`` (``None`` reads as empty); an
    unknown key is an error naming it and the allowed ones."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise QuantkitError(f"{where} must be a mapping, got {type(data).__name__}")
    allowed = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - allowed, key=str)
    if unknown:
        choices = f"allowed: {', '.join(sorted(allowed))}" if allowed else "it takes none"
        raise QuantkitError(f"unknown key {unknown[0]!r} in {where}; {choices}")
    return data


def check_selector(selector: str, where: str) -> None:
    """A ``re:`` selector's pattern must compile, so that a bad one fails when the recipe is read."""
    if selector.startswith("re:"):
        try:
            re.compile(selector[3:])
        except re.error as exc:
            raise QuantkitError(f"{where}: bad regular expression {selector!r}: {exc}") from None


def selector_matches(selector: str, name: str, module) -> bool:
    """``re:<regex>`` full-matches the module name; otherwise a class name, or an exact module name."""
    if selector.startswith("re:"):
        return re.fullmatch(selector[3:], name) is not None
    return selector == type(module).__name__ or selector == name


@dataclass(frozen=True)
class Override:
    """Scheme changes for the modules whose name matches ``match`` (same syntax as targets)."""

    match: str
    scheme: dict

    @classmethod
    def from_dict(cls, data: dict, where: str) -> Override:
        data = check_keys(data, cls, where)
        if "match" not in data or "scheme" not in data:
            raise QuantkitError(f"{where} needs both 'match' and 'scheme'")
        scheme = check_keys(data["scheme"], QuantScheme, f"{where}.scheme")
        check_selector(str(data["match"]), f"{where}.match")
        return cls(match=str(data["match"]), scheme=dict(scheme))


@dataclass(frozen=True)
class Stage:
    method: str
    scheme: QuantScheme | None = None
    params: Any = None  # the method's parameter dataclass
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()
    overrides: tuple[Override, ...] = ()

    def selects(self, name: str, module) -> bool:
        return any(selector_matches(t, name, module) for t in self.targets) and not any(
            selector_matches(i, name, module) for i in self.ignore
        )

    def scheme_for(self, name: str, module) -> QuantScheme:
        if self.scheme is None:
            raise QuantkitError(f"stage {self.method!r} has no scheme")
        scheme = self.scheme
        for o in self.overrides:
            if selector_matches(o.match, name, module):
                scheme = QuantScheme.from_dict({**scheme.to_dict(), **o.scheme}, f"override {o.match!r}")
        return scheme

    def schemes(self) -> list[QuantScheme]:
        """The stage's scheme and that scheme under each override (none without a scheme)."""
        if self.scheme is None:
            return []
        base = self.scheme.to_dict()
        return [self.scheme] + [
            QuantScheme.from_dict({**base, **o.scheme}, f"override {o.match!r}") for o in self.overrides
        ]

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"method": self.method}
        if self.scheme is not None:
            out["scheme"] = self.scheme.to_dict()
        out["params"] = params_to_dict(self.params)
        out["targets"] = list(self.targets)
        out["ignore"] = list(self.ignore)
        out["overrides"] = [{"match": o.match, "scheme": o.scheme} for o in self.overrides]
        return out


def params_to_dict(params) -> dict:
    """A stage's parameter dataclass as a plain mapping (empty for a method that takes none)."""
    return asdict(params) if params is not None else {}
