"""bench_w4a16.py's table selection on the CPU: the issue's shapes by default, other layers / rows / groups on
request, and a one-line exit for a malformed list."""

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_w4a16.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH.parent))  # its sibling imports (graph_timing)
    try:
        spec = importlib.util.spec_from_file_location("bench_w4a16", BENCH)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH.parent))


def args(**kw):
    return argparse.Namespace(**{"smoke": False, "quick": False, "shapes": None, "ms": None, "groups": None, **kw})


def test_default_table_is_the_issues(bench):
    spec = bench.table_spec(args())
    assert spec == {"shapes": bench.SHAPES, "ms": bench.MS, "groups": bench.GROUPS}
    assert bench.table_spec(args(quick=True))["shapes"] == bench.QUICK["shapes"]


def test_other_layers_rows_and_groups(bench):
    spec = bench.table_spec(args(shapes="4096x11008,3584x18944", ms="1,4", groups="128"))
    assert spec == {"shapes": [(4096, 11008), (3584, 18944)], "ms": [1, 4], "groups": [128]}
    assert bench.table_spec(args(quick=True, ms="2"))["shapes"] == bench.QUICK["shapes"]  # one field replaced


@pytest.mark.parametrize("flag,text", [("shapes", "4096y11008"), ("shapes", "4096"), ("ms", "1,x"), ("groups", "")])
def test_malformed_lists_exit_with_one_line(bench, flag, text):
    with pytest.raises(SystemExit, match=f"--{flag}: expected a comma-separated list"):
        bench.table_spec(args(**{flag: text or ","}))
