"""Recipes: what to do to a model, as frozen dataclasses that map one to one onto YAML.

    version: 1
    name: w4a16-gptq
    scheme: {bits: 4, group_size: 128, sym: true}      # default scheme of every stage
    calibration: {source: brown, nsamples: 128, seqlen: 512, seed: 0}
    stages:
      - method: gptq
        params: {damp: 0.01, block_size: 128, act_order: true}
        targets: [Linear]                                # module class names, or "re:<regex>" on module names
        ignore: ["re:.*\\.mlp\\.gate$"]
        overrides:
          - {match: "re:.*down_proj", scheme: {bits: 8}}

Every mapping is checked: an unknown key is an error naming the key and the allowed ones. Stages run in order
on each decoder layer (e.g. smoothing, then weight quantization). Methods and their parameter classes live in
:mod:`quantkit.stages`; what a stage is (:class:`Stage`, :class:`Override`) in :mod:`quantkit.stages.spec`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from quantkit.errors import QuantkitError
from quantkit.models.experts import ExpertCalibration
from quantkit.quant.scheme import QuantScheme
from quantkit.stages import parse_params, replace_params, stage_class, validate_stage
from quantkit.stages.spec import Override, Stage, check_keys, check_selector, selector_matches

__all__ = [
    "RECIPE_VERSION",
    "CalibrationConfig",
    "Gate",
    "Override",
    "Recipe",
    "Stage",
    "check_keys",
    "load_recipe",
    "selector_matches",
    "shipped_recipes",
]

RECIPE_VERSION = 1


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML keeps the last one
    silently, so a recipe could say one thing on the page and do another). "<<" merge keys still override."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._checked: set[int] = set()

    def flatten_mapping(self, node) -> None:
        # each mapping is checked once, as written: merging rewrites a merged mapping in place (its merged keys
        # first), which a second look would take for repeats
        if id(node) not in self._checked:
            self._checked.add(id(node))
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} given twice in one mapping", key_node.start_mark
                    )
                seen.add(key)
        super().flatten_mapping(node)


@dataclass(frozen=True)
class CalibrationConfig:
    source: str = "brown"
    nsamples: int = 128
    seqlen: int = 512
    seed: int = 0
    batch_size: int = 8
    bos: bool | str = "auto"  # BOS at the start of every window: "auto" follows the tokenizer (quantkit.calib.data)
    chat_template: bool = False  # render each window through the tokenizer's chat template (instruct models)

    def __post_init__(self) -> None:
        if not isinstance(self.source, str):
            raise QuantkitError(f"calibration source must be a string, got {self.source!r}")
        if not isinstance(self.bos, bool) and self.bos != "auto":
            raise QuantkitError(f"calibration bos must be auto, true or false, got {self.bos!r}")
        if not isinstance(self.chat_template, bool):
            raise QuantkitError(f"calibration chat_template must be true or false, got {self.chat_template!r}")
        for name in ("nsamples", "seqlen", "seed", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise QuantkitError(f"calibration {name} must be an integer, got {value!r}")
        if self.nsamples < 1 or self.seqlen < 2 or self.batch_size < 1:
            raise QuantkitError("calibration needs nsamples >= 1, seqlen >= 2 and batch_size >= 1")

    @classmethod
    def from_dict(cls, data: dict | None, where: str = "calibration") -> CalibrationConfig:
        return cls(**check_keys(data, cls, where))

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Gate:
    """A quality gate checked at the end of ``quantize``: the quantized model against the float model on the first
    ``windows`` windows of ``seqlen`` tokens of ``source`` (held out: use a text other than the calibration's).
    ``max_kl``: largest mean KL (nats per token); ``max_ppl_increase``: largest relative rise of perplexity (0.05:
    5%); ``min_top1``: least top-1 agreement. A bound left out is not checked; at least one is needed."""

    max_kl: float | None = None
    max_ppl_increase: float | None = None
    min_top1: float | None = None
    source: str = "moby-dick"
    windows: int = 4
    seqlen: int = 256

    def __post_init__(self) -> None:
        bounds = ("max_kl", "max_ppl_increase", "min_top1")
        for name in bounds:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value < 0):
                raise QuantkitError(f"gate {name} must be a number >= 0, got {value!r}")
        if all(getattr(self, name) is None for name in bounds):
            raise QuantkitError(f"a gate needs at least one of {', '.join(bounds)}")
        if not isinstance(self.source, str):
            raise QuantkitError(f"gate source must be a string, got {self.source!r}")
        for name, low in (("windows", 1), ("seqlen", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise QuantkitError(f"gate {name} must be an integer >= {low}, got {value!r}")

    @classmethod
    def from_dict(cls, data: dict | None, where: str = "gate") -> Gate:
        return cls(**check_keys(data, cls, where))

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def failures(self, figures: dict) -> list[str]:
        """What ``figures`` (kl, top1_agreement, ppl_increase) break, one phrase each."""
        out = []
        if self.max_kl is not None and figures["kl"] > self.max_kl:
            out.append(f"KL {figures['kl']:.4g} > {self.max_kl}")
        if self.max_ppl_increase is not None and figures["ppl_increase"] > self.max_ppl_increase:
            out.append(f"perplexity +{figures['ppl_increase']:.2%} > +{self.max_ppl_increase:.2%}")
        if self.min_top1 is not None and figures["top1_agreement"] < self.min_top1:
            out.append(f"top-1 agreement {figures['top1_agreement']:.3f} < {self.min_top1}")
        return out


@dataclass(frozen=True)
class Recipe:
    stages: tuple[Stage, ...]
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    name: str = ""
    description: str = ""
    version: int = RECIPE_VERSION
    scheme: dict | None = None  # the default stage scheme as written (kept for round trips)
    gate: Gate | None = None  # checked at the end of quantize
    experts: ExpertCalibration = field(default_factory=ExpertCalibration)  # MoE experts' calibration tokens
    mtp: str = "keep"  # multi-token-prediction layers of the source checkpoint: keep (bit for bit) or quantize (RTN)

    def __post_init__(self) -> None:
        if not isinstance(self.stages, tuple | list) or not all(isinstance(s, Stage) for s in self.stages):
            raise QuantkitError(
                "Recipe(stages=...) takes Stage objects; for a recipe written as data use Recipe.from_dict or "
                f"load_recipe (got {self.stages!r:.60})"
            )
        if not self.stages:
            raise QuantkitError("a recipe needs at least one stage")
        if not isinstance(self.calibration, CalibrationConfig):
            got = type(self.calibration).__name__
            raise QuantkitError(f"Recipe(calibration=...) takes a CalibrationConfig, got {got}")
        if self.gate is not None and not isinstance(self.gate, Gate):
            raise QuantkitError(f"Recipe(gate=...) takes a Gate, got {type(self.gate).__name__}")
        if self.mtp not in ("keep", "quantize"):
            raise QuantkitError(f"recipe mtp must be keep or quantize, got {self.mtp!r}")
        if not isinstance(self.experts, ExpertCalibration):
            raise QuantkitError(f"Recipe(experts=...) takes an ExpertCalibration, got {type(self.experts).__name__}")
        object.__setattr__(self, "stages", tuple(self.stages))

    @property
    def needs_calibration(self) -> bool:
        return any(stage_class(s.method).needs_calibration(s) for s in self.stages)

    @classmethod
    def from_dict(cls, data: Any, where: str = "recipe") -> Recipe:
        data = check_keys(data, cls, where)
        version = data.get("version", RECIPE_VERSION)
        if version != RECIPE_VERSION:
            raise QuantkitError(
                f"{where}: recipe version {version} is not supported (this quantkit reads {RECIPE_VERSION})"
            )
        default_scheme = data.get("scheme")
        if default_scheme is not None:
            QuantScheme.from_dict(check_keys(default_scheme, QuantScheme, f"{where}.scheme"), f"{where}.scheme")
        raw_stages = data.get("stages")
        if not isinstance(raw_stages, list) or not raw_stages:
            raise QuantkitError(f"{where}: 'stages' must be a non-empty list")
        stages = []
        for i, raw in enumerate(raw_stages):
            at = f"{where}.stages[{i}]"
            raw = check_keys(raw, Stage, at)
            if "method" not in raw:
                raise QuantkitError(f"{at}: missing 'method'")
            method = str(raw["method"])
            scheme_data = raw.get("scheme", default_scheme)
            scheme = None
            if scheme_data is not None:
                merged = {**(default_scheme or {}), **check_keys(scheme_data, QuantScheme, f"{at}.scheme")}
                scheme = QuantScheme.from_dict(merged, f"{at}.scheme")
            stage = Stage(
                method=method,
                scheme=scheme,
                params=parse_params(method, raw.get("params"), f"{at}.params"),
                targets=tuple(_str_list(raw.get("targets", ["Linear"]), f"{at}.targets")),
                ignore=tuple(_str_list(raw.get("ignore", []), f"{at}.ignore")),
                overrides=tuple(
                    Override.from_dict(o, f"{at}.overrides[{j}]") for j, o in enumerate(raw.get("overrides") or [])
                ),
            )
            for j, o in enumerate(stage.overrides):  # an override's scheme fails here, not at its first module
                if stage.scheme is not None:
                    try:
                        QuantScheme.from_dict({**stage.scheme.to_dict(), **o.scheme}, f"{at}.overrides[{j}].scheme")
                    except QuantkitError as exc:
                        raise QuantkitError(f"{at}.overrides[{j}].scheme: {exc}") from None
            validate_stage(stage, at)
            stages.append(stage)
        return cls(
            stages=tuple(stages),
            calibration=CalibrationConfig.from_dict(data.get("calibration"), f"{where}.calibration"),
            name=str(data.get("name", "")),
            description=str(data.get("description", "")),
            version=version,
            scheme=default_scheme,
            gate=Gate.from_dict(data["gate"], f"{where}.gate") if data.get("gate") is not None else None,
            experts=ExpertCalibration(**check_keys(data.get("experts") or {}, ExpertCalibration, f"{where}.experts")),
            mtp=data.get("mtp", "keep"),
        )

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"version": self.version, "name": self.name}
        if self.description:
            out["description"] = self.description
        out["calibration"] = self.calibration.to_dict()
        out["stages"] = [s.to_dict() for s in self.stages]
        if self.gate is not None:
            out["gate"] = self.gate.to_dict()
        if self.experts != ExpertCalibration():
            out["experts"] = self.experts.to_dict()
        if self.mtp != "keep":
            out["mtp"] = self.mtp
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def with_overrides(self, scheme: dict | None = None, calibration: dict | None = None, params: dict | None = None):
        """A copy with CLI-level changes: scheme keys for every stage that has a scheme, calibration keys, and
        parameters for every stage whose parameter class has them (unknown ones are errors)."""
        stages = []
        for s in self.stages:
            new_scheme = s.scheme
            if scheme and s.scheme is not None:
                new_scheme = QuantScheme.from_dict({**s.scheme.to_dict(), **scheme}, "command-line scheme")
            new_params = replace_params(s.method, s.params, params or {})
            stages.append(Stage(s.method, new_scheme, new_params, s.targets, s.ignore, s.overrides))
        calib = self.calibration
        if calibration:
            calib = CalibrationConfig.from_dict({**calib.to_dict(), **calibration})
        return Recipe(
            tuple(stages),
            calib,
            self.name,
            self.description,
            self.version,
            self.scheme,
            self.gate,
            self.experts,
            self.mtp,
        )


def _str_list(value: Any, where: str) -> list[str]:
    """Selectors (``targets``, ``ignore``): a string or a list of strings, each ``re:`` pattern compiled here so
    that a bad one fails when the recipe is read."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise QuantkitError(f"{where} must be a string or a list of strings")
    for selector in value:
        check_selector(selector, where)
    return value


def shipped_recipes() -> list[str]:
    return sorted(
        p.name.removesuffix(".yaml") for p in resources.files("quantkit.recipes").iterdir() if p.name.endswith(".yaml")
    )


def load_recipe(spec: str | Path) -> Recipe:
    """A recipe from a YAML file path or a shipped recipe name."""
    if not isinstance(spec, str | Path):
        raise QuantkitError(f"a recipe is a YAML file or a shipped recipe's name, got {type(spec).__name__}")
    path = Path(spec)
    if path.is_file():
        where = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise QuantkitError(f"{where}: not a UTF-8 text file (byte {exc.start}); a recipe is YAML") from None
    elif str(spec) in shipped_recipes():
        text = resources.files("quantkit.recipes").joinpath(f"{spec}.yaml").read_text()
        where = f"recipe {spec}"
    else:
        raise QuantkitError(f"recipe not found: {spec} (a YAML file, or one of: {', '.join(shipped_recipes())})")
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise QuantkitError(f"{where}: malformed YAML{at}: {getattr(exc, 'problem', exc)}") from None
    return Recipe.from_dict(data, where)
