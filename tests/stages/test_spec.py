"""stages/spec.py: which modules a stage selects, the scheme each gets after overrides, and the one-line errors of
a stage written as data."""

import pytest
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.quant import QuantScheme
from quantkit.stages.spec import Override, Stage, check_keys, check_selector, params_to_dict, selector_matches

W4 = QuantScheme(bits=4, group_size=128)
LINEAR, NORM = nn.Linear(4, 4), nn.LayerNorm(4)


def test_selectors_match_class_names_exact_names_and_full_regexes():
    assert selector_matches("Linear", "model.layers.0.mlp.up_proj", LINEAR)
    assert not selector_matches("Linear", "model.norm", NORM)
    assert selector_matches("model.norm", "model.norm", NORM)
    assert selector_matches("re:.*up_proj", "model.layers.0.mlp.up_proj", LINEAR)
    assert not selector_matches("re:up_proj", "model.layers.0.mlp.up_proj", LINEAR)  # a full match, not a search


def test_a_stage_selects_its_targets_minus_ignore_and_applies_overrides_in_order():
    stage = Stage(
        "rtn",
        W4,
        targets=("Linear",),
        ignore=("re:.*gate$",),
        overrides=(
            Override("re:.*down_proj", {"bits": 8}),
            Override("re:.*layers\\.0\\.mlp\\.down_proj", {"group_size": 32}),
        ),
    )
    assert stage.selects("model.layers.0.mlp.up_proj", LINEAR)
    assert not stage.selects("model.layers.0.mlp.gate", LINEAR) and not stage.selects("model.norm", NORM)
    assert stage.scheme_for("model.layers.1.mlp.up_proj", LINEAR) == W4
    assert stage.scheme_for("model.layers.1.mlp.down_proj", LINEAR) == W4.replace(bits=8)
    assert stage.scheme_for("model.layers.0.mlp.down_proj", LINEAR) == W4.replace(bits=8, group_size=32)
    with pytest.raises(QuantkitError, match="stage 'smoothquant' has no scheme"):
        Stage("smoothquant").scheme_for("model.layers.0.mlp.up_proj", LINEAR)
    data = stage.to_dict()
    assert data["scheme"] == W4.to_dict() and data["params"] == {} and data["ignore"] == ["re:.*gate$"]
    assert data["overrides"][0] == {"match": "re:.*down_proj", "scheme": {"bits": 8}}


def test_stage_data_is_checked_key_by_key():
    assert check_keys(None, Override, "o") == {}
    with pytest.raises(QuantkitError, match="unknown key 'matches' in o; allowed: match, scheme"):
        check_keys({"matches": "x"}, Override, "o")
    with pytest.raises(QuantkitError, match="o must be a mapping, got list"):
        check_keys(["x"], Override, "o")
    with pytest.raises(QuantkitError, match="o needs both 'match' and 'scheme'"):
        Override.from_dict({"match": "x"}, "o")
    with pytest.raises(QuantkitError, match=r"o.match: bad regular expression 're:\('"):
        Override.from_dict({"match": "re:(", "scheme": {"bits": 8}}, "o")
    check_selector("re:.*ok", "t")
    assert params_to_dict(None) == {}
