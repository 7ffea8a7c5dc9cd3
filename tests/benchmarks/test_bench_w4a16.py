"""bench_w4a16.py's table selection on the CPU: the issue's shapes by default, other layers / rows / groups on
request, and a one-line exit for a malformed list."""

import argparse

import bench_w4a16 as bench
import pytest


def args(**kw):
    return argparse.Namespace(**{"smoke": False, "quick": False, "shapes": None, "ms": None, "groups": None, **kw})


def test_default_table_is_the_issues():
    spec = bench.table_spec(args())
    assert spec == {"shapes": bench.SHAPES, "ms": bench.MS, "groups": bench.GROUPS}
    assert bench.table_spec(args(quick=True))["shapes"] == bench.QUICK["shapes"]


def test_other_layers_rows_and_groups():
    spec = bench.table_spec(args(shapes="4096x11008,3584x18944", ms="1,4", groups="128"))
    assert spec == {"shapes": [(4096, 11008), (3584, 18944)], "ms": [1, 4], "groups": [128]}
    assert bench.table_spec(args(quick=True, ms="2"))["shapes"] == bench.QUICK["shapes"]  # one field replaced


@pytest.mark.parametrize("flag,text", [("shapes", "4096y11008"), ("shapes", "4096"), ("ms", "1,x"), ("groups", "")])
def test_malformed_lists_exit_with_one_line(flag, text):
    with pytest.raises(SystemExit, match=f"--{flag}: expected a comma-separated list"):
        bench.table_spec(args(**{flag: text or ","}))


def test_short_table_marks_the_targets_and_prints_geomeans(capsys):
    def row(n, k, group, m, speedup):
        return {"n": n, "k": k, "group": group, "m": m, "speedup": speedup}

    result = {
        "table": "committed CONFIG_TABLE",
        "rows": [
            row(4096, 4096, 128, 1, 2.0),
            row(4096, 4096, 128, 16, 2.0),
            row(14336, 4096, 64, 1, 2.0),
            row(14336, 4096, 64, 16, 8.0),
        ],
        "checks": [{"ok": True}, {"ok": False}],
    }
    bench.print_short_table(result)
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "       N x K    G      1     16"
    assert lines[3] == "   4096x4096  128  2.00   2.00*"  # M = 16 is below 2.5x; M = 1 has no target on this shape
    assert lines[4] == "  14336x4096   64  2.00*  8.00 "  # M = 1's target (3x) holds on the larger shapes
    assert lines[5] == "          geomean  2.00   4.00 "
    assert lines[6] == "     geomean g128  2.00   2.00 "
    assert lines[7] == "correctness: 1/2 checks within 2x cuBLAS error"
