"""The recall frontier's training: every run of a grid, in worker processes, resumed or read back
from its summary when finished, and extended while it still learns where the grid allows."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

from analysis.experiments import _common
from analysis.experiments.recall_frontier_grid import NAME, Run, Scale, runs, train_config

# A run still learns while, over the second half of its updates, its test loss falls by more
# than LOSS_DROP (relative) or its test accuracy rises by more than ACC_RISE. MQAR's loss
# falls well before its accuracy jumps; at a plateau both move by less than a percent.
LOSS_DROP = 0.05
ACC_RISE = 0.02


def _train(config, workdir: str, desc: str) -> dict[str, Any]:
    """One run (in a worker or in this process); a diverged run scores 0."""
    import train.loop

    try:
        summary = train.loop.train(config, workdir, progress=False, desc=desc)
    except train.loop.NonFiniteLossError as e:
        print(f"{desc}: {e}", file=sys.stderr)
        summary = {"test_accuracy": 0.0, "step": e.step, "diverged": True}
    return summary


def _train_run(scale: Scale, out: Path, run: Run, steps: int | None = None) -> dict[str, Any]:
    """``run`` of ``scale`` under ``out/runs``, to its first cap or to ``steps`` (picklable
    for the workers)."""
    config = train_config(scale, run, steps)
    return _train(config, str(_common.run_dir(out, run.name)), run.name)


def _extend_run(scale: Scale, out: Path, item: tuple[Run, int]) -> dict[str, Any]:
    return _train_run(scale, out, *item)


def still_learning(evals: list[dict], steps: int) -> bool:
    """Whether a run's test metrics still improved over the second half of its ``steps``.

    Args:
      evals: its evaluation records (``metrics.jsonl``'s ``kind == "eval"``), by step.
      steps: the updates it took.

    Returns:
      True where its last evaluation's test loss is more than ``LOSS_DROP`` below (relative)
      the last one at or before ``steps // 2`` (its first, if none is), or its accuracy more
      than ``ACC_RISE`` above it.
    """
    if not evals:
        return False
    half = [e for e in evals if e["step"] <= steps // 2] or evals[:1]
    then, last = half[-1], evals[-1]
    return (
        last["test_loss"] < (1 - LOSS_DROP) * then["test_loss"]
        or last["test_accuracy"] > then["test_accuracy"] + ACC_RISE
    )


def learning_at_cap(out: Path, run: Run, summary: dict) -> bool:
    """Whether ``run`` ended at its cap short of the target while still learning."""
    if summary.get("target_reached") or summary.get("diverged"):
        return False
    from train.metrics import read_metrics

    steps = summary["step"]
    records = read_metrics(_common.run_dir(out, run.name))
    return still_learning([r for r in records if r["kind"] == "eval" and r["step"] <= steps], steps)


def next_cap(scale: Scale, out: Path, run: Run, summary: dict) -> int | None:
    """The cap to extend ``run`` to (its steps doubled, at most ``scale.most``), or None:
    the scale extends no run, or it reached its target, or is at the most, or stopped
    learning."""
    if scale.max_steps is None or summary["step"] >= scale.most(run.setting):
        return None
    if not learning_at_cap(out, run, summary):
        return None
    return min(2 * summary["step"], scale.most(run.setting))


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
    """Trains every unfinished run of ``scale`` under ``out/runs``, then extends those still
    learning at their caps (``next_cap``), in waves, until none is; returns every summary,
    each with ``learning_at_cap`` (whether it ended at its last cap still learning)."""
    from train.pool import Pool

    todo, summaries = [], {}
    for run in runs(scale):
        done = _finished(_common.run_dir(out, run.name))
        if done is None:
            todo.append(run)
        else:
            summaries[run] = done

    with Pool(jobs, f"{NAME} ({scale.name})", progress) as pool:

        def report(run, summary):
            summaries[run] = summary
            pool.write(
                f"{run.name}: test accuracy {summary['test_accuracy']:.3f} at step "
                f"{summary['step']}"
            )

        pool.run(functools.partial(_train_run, scale, out), todo,
                 lambda run: train_config(scale, run, None).steps, report,
                 labels=[run.name for run in todo])  # fmt: skip
        while more := [
            (run, cap) for run in runs(scale) if (cap := next_cap(scale, out, run, summaries[run]))
        ]:
            pool.write(f"extending {len(more)} runs still learning at their caps")
            extend = functools.partial(_extend_run, scale, out)
            pool.run(extend, more, lambda item: item[1], lambda item, s: report(item[0], s),
                     labels=[r.name for r, _ in more])  # fmt: skip
    for run, summary in summaries.items():
        summary["learning_at_cap"] = learning_at_cap(out, run, summary)
    return summaries
