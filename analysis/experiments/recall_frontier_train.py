"""The recall frontier's training: every run of a grid, in worker processes, resumed or read back
from its summary when finished."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
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

    import train.compare
    from train import interrupt, plugins

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

    args = [(train_config(scale, r), str(_common.run_dir(out, r.name)), r.name) for r in todo]
    if jobs == 1 or len(todo) <= 1:
        for run, a in zip(todo, args, strict=True):
            report(run, _train(*a))
    else:
        if interrupt.active():  # Ctrl-C stops the workers; their runs keep their checkpoints
            signal.signal(signal.SIGINT, train.compare.stop_workers)
            os.environ["PYTHONWARNINGS"] = "ignore:resource_tracker:UserWarning"
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(
            jobs,
            mp_context=context,
            initializer=train.compare.worker_init,
            initargs=(context.Value("i", 0), plugins.loaded()),
        ) as pool:
            futures = {pool.submit(_train, *a): run for run, a in zip(todo, args, strict=True)}
            for future in as_completed(futures):
                report(futures[future], future.result())
    bar.close()
    return summaries
