"""accuracy.py: the shipped job list is valid (every cell builds its recipe), a malformed one is a one-line exit,
and a run on a tiny model writes rows that a later run of other cells keeps (the figures are not tests)."""

import json
from pathlib import Path

import accuracy
import pytest

from quantkit.presets import preset_recipe
from tests.tiny_models import tiny_model_dir

JOBS = Path(accuracy.__file__).with_name("accuracy_jobs.yaml")


def test_shipped_jobs_build_their_recipes():
    jobs = accuracy.read_jobs(JOBS)
    assert [j["name"] for j in jobs][:4] == ["rtn", "calibrated", "draw-1", "draw-2"]
    for job in jobs:
        for method in job["methods"]:
            for bits in job["bits"]:
                for group in job["groups"]:
                    scheme = {"bits": bits, "group_size": group, **job.get("scheme", {})}
                    preset_recipe(method, scheme, params=job.get("params") or None)
    assert [j["name"] for j in accuracy.read_jobs(JOBS, only="draw-2,rtn")] == ["rtn", "draw-2"]


@pytest.mark.parametrize(
    "text,message",
    [
        ("- name: a", "expected one key, 'jobs'"),
        ("jobs: [{name: a, methods: rtn, bits: 4, groups: 128, seed: 1}]", "unknown key 'seed'; allowed: name,"),
        ("jobs: [{name: a, methods: rtn, bits: 4}]", "job 1: missing groups"),
        ("jobs: [{name: a, methods: rtn, bits: four, groups: 128}]", r"job 1 \(a\): invalid literal"),
        (
            "jobs: [{name: a, methods: rtn, bits: 4, groups: 1}, {name: a, methods: rtn, bits: 4, groups: 1}]",
            "job name 'a' given twice",
        ),
    ],
)
def test_a_malformed_job_list_is_one_line(tmp_path, text, message):
    path = tmp_path / "jobs.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit, match=message):
        accuracy.read_jobs(path)


def test_jobs_run_and_later_runs_keep_earlier_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    model = tiny_model_dir(tmp_path / "tiny")
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(
        "jobs:\n"
        "  - {name: plain, methods: rtn, bits: [4, 3], groups: 32}\n"
        "  - {name: sym, methods: [rtn], bits: 4, groups: 32, sym: true, label: rtn (sym)}\n"
    )
    out = tmp_path / "acc.json"
    common = ["--model", str(model), "--jobs", str(jobs), "--eval-seqlen", "32", "--windows", "2", "--out", str(out)]
    accuracy.main([*common, "--only", "plain"])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["bits"], r["sym"]) for r in rows] == [("rtn", 4, False), ("rtn", 3, False)]
    accuracy.main([*common, "--only", "sym"])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["bits"], r["sym"]) for r in rows] == [("rtn", 4, False), ("rtn", 3, False),
                                                                   ("rtn (sym)", 4, True)]  # fmt: skip
    assert "| rtn (sym) | 4 | 32 | True |" in out.with_suffix(".md").read_text()
    two = tmp_path / "two.json"
    accuracy.main([*common[:-1], str(two), "--only", "plain", "--eval", "moby-dick", "brown"])
    rows = json.loads(two.read_text())["rows"]
    assert [(r["bits"], r["eval"]) for r in rows] == [(4, "moby-dick"), (4, "brown"), (3, "moby-dick"), (3, "brown")]
