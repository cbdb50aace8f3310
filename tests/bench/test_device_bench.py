"""bench/device.py: its budget, its children and its report (the phases have tests of their own).

The whole dry run on the CPU is the integration test here: every phase end to
end, as the device machine will run them.
"""

import json

import pytest

from tests.bench.script import load


@pytest.fixture(scope="module")
def bench():
    yield from load("device")


def test_the_budget_is_shared_by_weight_and_phases_are_named(bench):
    assert bench.shares([1.0, 3.0], 100.0) == [25.0, 75.0]
    assert bench.shares([], 10.0) == []
    with pytest.raises(ValueError, match=r"phases: expected names from .* got 'nope'"):
        bench.phase_module("nope")
    statuses = ["ok", "failed: X", "not measured: time budget", "failed (exit 9): ..."]
    counted = bench.count_statuses([{"status": s} for s in statuses])
    assert counted == "1 ok, 2 failed, 1 not measured"
    assert bench.peak_tflops("NVIDIA H200") == 989.0 and bench.peak_tflops("cpu") is None


@pytest.mark.integration
def test_a_crash_and_an_overrun_cost_their_own_items_only(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(bench.ROOT))  # as tools/device_run.sh runs it
    phase = "tests.bench.device_phase"
    cfg = bench.Config(dry_run=True, phases=(phase,), budget_seconds=8.0, out_dir=str(tmp_path))
    bench.GRACE_SECONDS, grace = 2.0, bench.GRACE_SECONDS
    try:
        result = bench.main(cfg)
    finally:
        bench.GRACE_SECONDS = grace
    rows = {r["name"]: r["status"] for r in result["phases"][phase]["rows"]}
    assert rows["first"] == "ok"
    assert rows["crash"].startswith("failed (exit 9)")  # a fresh child took the rest
    assert rows["slow"].startswith("not measured: stopped")  # stopped after its grace
    assert rows["after"] == "not measured: time budget"
    used = result["phases"][phase]
    assert used["seconds"] < used["share_seconds"] + 2.0 + 10.0  # the grace, and a child's exit
    saved = json.loads((tmp_path / "device-dry-run.json").read_text())
    assert saved["phases"][phase]["rows"] == result["phases"][phase]["rows"]
    table = (tmp_path / "device-dry-run.md").read_text()
    assert "## A test phase" in table and "- crash: failed (exit 9)\n" in table
