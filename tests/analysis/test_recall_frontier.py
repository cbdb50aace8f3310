"""The recall frontier (``analysis.experiments.recall_frontier*``): its quick run end to end
(extended while "learning"), the extension rule, merging families into a run, the dry run
of Zoology's grid, the Pareto frontier and the refusals."""

import dataclasses
import json

import pytest

from analysis.experiments import (
    recall_frontier,
    recall_frontier_grid,
    recall_frontier_report,
    recall_frontier_train,
)
from models import LAYOUTS
from tests.analysis.test_experiments import check_common


@pytest.mark.integration
def test_recall_frontier_quick(tmp_path, capsys, monkeypatch):
    # Two runs end to end through the command line (one job), extended from 6 updates to
    # 12 while "still learning" (made so here), then again: read back.
    quick = dataclasses.replace(recall_frontier_grid.SCALES["quick"], max_steps=(12,))
    monkeypatch.setitem(recall_frontier_grid.SCALES, "quick", quick)
    monkeypatch.setattr(recall_frontier_train, "still_learning", lambda evals, steps: True)
    out = tmp_path / "frontier"
    argv = ["--quick", "--jobs", "1", "--out", str(out), "--no-progress"]
    assert recall_frontier.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    check_common(results, out, "recall_frontier")
    for r in results["runs"]:
        assert r["summary"]["step"] == 12 and r["summary"]["learning_at_cap"]
        record = json.loads((out / "runs" / r["name"] / "config.json").read_text())
        assert record["optim"]["decay_steps"] == 12  # one schedule throughout
    assert all(p["learning_at_cap"] and p["steps"] == [12] for p in results["points"])
    assert "still learning at the cap: mha 16 at T=16, 2 pairs" in results["claim"]["measured"]
    assert {(p["family"], p["knob"]) for p in results["points"]} == {("mha", 16), ("linear", 16)}
    for p in results["points"]:
        assert 0 <= p["accuracy"] <= 1 and p["state_elements"] * 4 == p["state_bytes"]
    mha, linear = sorted(results["points"], key=lambda p: p["family"] != "mha")
    # 2 layers: K/V of width 16 over T = 16, or 4 heads' 16 x 16 state and normalizer;
    # and each layer's short conv keeps its last 3 inputs.
    assert mha["state_elements"] == 2 * (2 * 16 * 16 + 3 * 16)
    assert linear["state_elements"] == 2 * (4 * 16 * 16 + 4 * 16 + 3 * 64)
    summaries = {r["name"]: r["summary"] for r in results["runs"]}
    capsys.readouterr()
    assert recall_frontier.main(argv) == 0  # finished runs are read back, not retrained
    again = json.loads((out / "results.json").read_text())
    assert {r["name"]: r["summary"] for r in again["runs"]} == summaries


def _frontier_results(scale, families, runtime):
    """A results file's fields for hand-made runs of ``families`` (name -> knob)."""
    grid = [
        {**dataclasses.asdict(run), "name": run.name,
         "summary": {"test_accuracy": 0.5 + run.knob / 100, "step": 6, "target_reached": False,
                     "learning_at_cap": run.family == "linear"}}
        for run in recall_frontier_grid.runs(scale) if families.get(run.family) == run.knob
    ]  # fmt: skip
    return {"scale": dataclasses.asdict(scale), "runs": grid, "runtime_s": runtime}


def test_recall_frontier_add_to_merges_a_family_into_a_run(tmp_path):
    """``--add-to``: a run of some families joins a committed run, its points drawn again
    from every run; refuses another grid."""
    quick = recall_frontier_grid.SCALES["quick"]
    old = _frontier_results(quick, {"mha": 16, "linear": 16}, 10.0)
    rows = recall_frontier_report.points(quick, {recall_frontier._run_of(r): r["summary"]
                                                  for r in old["runs"]})  # fmt: skip
    recall_frontier._write(quick, rows, old["runs"], 10.0, tmp_path)
    knobs = (("mamba2", (8,)), ("linear", (32,)))
    new_scale = dataclasses.replace(quick, name="more", knobs=knobs)
    new = _frontier_results(new_scale, {"mamba2": 8, "linear": 32}, 5.0)
    merged = recall_frontier.add_to(tmp_path, new)
    assert [k for k, _ in merged["scale"]["knobs"]] == ["mha", "mamba2", "linear"]
    assert merged["scale"]["name"] == "more"  # the added run's
    points = {(p["family"], p["knob"]): p for p in merged["points"]}
    assert set(points) == {("mha", 16), ("mamba2", 8), ("linear", 32)}  # linear 32 replaced 16
    assert points[("linear", 32)]["accuracy"] == 0.5 + 32 / 100
    assert points[("linear", 32)]["learning_at_cap"]
    assert not points[("mha", 16)]["learning_at_cap"]
    assert [r["family"] for r in merged["runs"]] == ["mha", "mamba2", "linear"]
    assert merged["runtime_s"] == 15.0 and (tmp_path / "frontier.png").is_file()
    assert json.loads((tmp_path / "results.json").read_text()) == merged
    other = {**new, "scale": dataclasses.asdict(dataclasses.replace(new_scale, lrs=(1e-2,)))}
    with pytest.raises(ValueError, match=r"^add_to: expected a run with the same lrs"):
        recall_frontier.add_to(tmp_path, other)
    with pytest.raises(ValueError, match=r"^add_to: expected a folder"):
        recall_frontier.add_to(tmp_path / "none", new)


@pytest.mark.integration  # the fast tier's 4 minutes are full
def test_recall_frontier_dry_run_builds_zoologys_grid(capsys):
    result = recall_frontier_grid.dry_run(recall_frontier_grid.SCALES["zoology"])
    scale = recall_frontier_grid.SCALES["zoology"]
    assert result["runs"] == 22 * 4 * 4 * 4 == len(recall_frontier_grid.runs(scale))
    assert len(result["points"]) == 22 * 4 * 4
    by = {(tuple(p["setting"]), p["family"], p["knob"]): p for p in result["points"]}
    # Zoology's count for a softmax layer: 2 x d x T per layer (plus the short convs' W-1
    # inputs of width d, which Zoology's count leaves out).
    mha = by[((64, 4), "mha", 64)]
    assert mha["state_elements"] == 2 * (2 * 64 * 64 + 3 * 64)
    # Fixed states do not grow with T; caches do.
    fixed = (("linear", 16), ("gated_deltanet", 32), ("window", 32), ("mamba2", 32), ("rwkv7", 32),
             ("ttt_mlp", 16), ("titans", 8), ("mesanet", 32))  # fmt: skip
    for family, knob in fixed:
        assert (
            by[((64, 4), family, knob)]["state_elements"]
            == by[((512, 64), family, knob)]["state_elements"]
        )
    assert by[((512, 64), "mha", 64)]["state_elements"] > mha["state_elements"]
    for name in LAYOUTS:  # the production hybrids: their attention layer's cache grows with T
        state = {s: by[(s, name, 64)]["state_elements"] for s in ((64, 4), (512, 64))}
        assert state[(512, 64)] > state[(64, 4)], name
    for family, knobs in scale.knobs:  # every knob sweep grows the state
        states = [by[((128, 8), family, k)]["state_elements"] for k in knobs]
        assert states == sorted(states) and len(set(states)) == len(states), family
    assert recall_frontier.main(["--dry-run", "--scale", "zoology", "--only", "mha,linear"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "128 runs, 32 points (zoology scale)"


def test_recall_frontier_pareto_and_reach():
    rows = [
        {"family": "a", "knob": 1, "state_elements": 10, "accuracy": 0.5},
        {"family": "a", "knob": 2, "state_elements": 100, "accuracy": 0.95},
        {"family": "b", "knob": 1, "state_elements": 50, "accuracy": 0.4},
        {"family": "b", "knob": 2, "state_elements": 100, "accuracy": 0.97},
    ]
    front = recall_frontier_report.pareto(rows)
    assert [(r["family"], r["knob"]) for r in front] == [("a", 1), ("b", 2)]
    families = dict(recall_frontier_grid.FAMILIES, a=recall_frontier_grid.FAMILIES["mha"])
    families["b"] = recall_frontier_grid.FAMILIES["linear"]
    import unittest.mock

    with unittest.mock.patch.object(recall_frontier_report, "FAMILIES", families):
        assert recall_frontier_report.reach(rows, "a").startswith("100 (width 2)")
        assert recall_frontier_report.reach(rows, "b", level=0.99) == "not reached at 100"


def test_recall_frontier_still_learning_reads_the_second_half(tmp_path):
    def evals(*points):
        return [{"step": s, "test_loss": x, "test_accuracy": a} for s, x, a in points]

    still = recall_frontier_train.still_learning
    flat = evals((50, 3.0, 0.25), (100, 2.95, 0.26), (150, 2.9, 0.26), (200, 2.89, 0.27))
    assert not still(flat, 200)  # 2% lower, 0.01 higher than at step 100
    assert still(evals((100, 3.0, 0.25), (200, 2.8, 0.25)), 200)  # the loss, 7% down
    assert still(evals((100, 3.0, 0.25), (200, 3.0, 0.30)), 200)  # the accuracy, 0.05 up
    assert not still(evals((100, 3.0, 0.25), (200, 1.0, 0.99)), 400)  # the same at the half
    assert not still([], 200)
    scale = dataclasses.replace(recall_frontier_grid.SCALES["quick"], max_steps=(20,))
    run = recall_frontier_grid.runs(scale)[0]
    workdir = tmp_path / "runs" / run.name
    workdir.mkdir(parents=True)
    rising = [{"kind": "eval", **e} for e in evals((3, 3.0, 0.2), (6, 2.0, 0.5), (9, 1.0, 0.9))]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rising))
    cap = recall_frontier_train.next_cap
    assert cap(scale, tmp_path, run, {"step": 6}) == 12  # doubled; the record past 6 unread
    assert cap(scale, tmp_path, run, {"step": 12}) == 20  # at most max_steps
    assert cap(scale, tmp_path, run, {"step": 20}) is None
    assert cap(scale, tmp_path, run, {"step": 6, "target_reached": True}) is None
    assert cap(recall_frontier_grid.SCALES["quick"], tmp_path, run, {"step": 6}) is None
    with pytest.raises(ValueError, match=r"max_steps: expected one per setting, each >= its"):
        dataclasses.replace(scale, max_steps=(5,))


def test_recall_frontier_bad_input_names_the_argument(tmp_path, capsys):
    assert recall_frontier.main(["--only", "mha,nope", "--dry-run"]) == 2
    assert "only: expected family names" in capsys.readouterr().err
    with pytest.raises(ValueError, match="jobs: expected an int >= 1"):
        recall_frontier.run(recall_frontier_grid.SCALES["quick"], tmp_path, jobs=0)
    with pytest.raises(ValueError, match="steps: expected one cap per setting"):
        dataclasses.replace(recall_frontier_grid.SCALES["quick"], steps=(1, 2))
