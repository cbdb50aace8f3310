"""The recall frontier's training: every run of a grid, in worker processes, resumed or read back
from its summary when finished."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

from analysis.experiments import _common
from analysis.experiments.recall_frontier_grid import NAME, Run, Scale, runs, train_config


def _train(config, workdir: str, desc: str) -> dict[str, Any]:
    """One run (in a worker or in this process); a diverged run scores 0."""
    import train.loop

    try:
        summary = train.loop.train(config, workdir, progress=False, desc=desc)
    except train.loop.NonFiniteLossError as e:
        print(f"{desc}: {e}", file=sys.stderr)
        summary = {"test_accuracy": 0.0, "step": e.step, "diverged": True}
    return summary


def _train_run(scale: Scale, out: Path, run: Run) -> dict[str, Any]:
    """``run`` of ``scale`` under ``out/runs`` (picklable for the workers)."""
    return _train(train_config(scale, run), str(_common.run_dir(out, run.name)), run.name)


def _finished(workdir: Path) -> dict[str, Any] | None:
    """A finished run's summary, read back (None: not finished, or unreadable)."""
    path = workdir / "summary.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # retrain: train.loop resumes from its checkpoints and rewrites it


def train_all(scale: Scale, out: Path, *, jobs: int, progress: bool) -> dict[Run, dict]:
    """Trains every unfinished run of ``scale`` under ``out/runs``; returns every summary."""
    from tqdm.auto import tqdm

    todo, summaries = [], {}
    for run in runs(scale):
        done = _finished(_common.run_dir(out, run.name))
        if done is None:
            todo.append(run)
        else:
            summaries[run] = done
    bar = tqdm(total=len(todo), desc=f"{NAME} ({scale.name})", disable=not progress)

    def report(run, summary):
        summaries[run] = summary
        bar.write(
            f"{run.name}: test accuracy {summary['test_accuracy']:.3f} at step {summary['step']}"
        )
        bar.update(1)

    _common.run_all(functools.partial(_train_run, scale, out), todo, jobs, report)
    bar.close()
    return summaries
