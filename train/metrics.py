"""A run's records: ``metrics.jsonl`` (read, and truncated to a checkpoint on resume) and
``summary.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax

from train.workdir import write_atomic

__all__ = ["reached_target", "read_metrics", "truncate_metrics", "write_summary"]


def _records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """``(line, record)`` pairs of a JSONL file, without a torn last line.

    A process killed while writing can leave a partial line; everything up to
    a checkpoint was flushed before it, so such a line is never needed.
    """
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append((line, json.loads(line)))
        except json.JSONDecodeError:
            continue
    return out


def read_metrics(workdir: str | Path) -> list[dict[str, Any]]:
    """The records of ``workdir/metrics.jsonl`` (empty if there is none)."""
    return [record for _, record in _records(Path(workdir) / "metrics.jsonl")]


def truncate_metrics(path: Path, through_step: int) -> None:
    """Drops records after ``through_step`` (written after the checkpoint resumed from)."""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = [line for line, record in _records(path) if record["step"] <= through_step]
    if len(kept) != len(lines):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)  # atomic: a crash here leaves the old or the new file, never half


def reached_target(records, step: int, target: float | None) -> bool:
    """Whether the evaluation at ``step`` among ``records`` reached ``target`` accuracy."""
    return target is not None and any(
        r["kind"] == "eval" and r["step"] == step and r["test_accuracy"] >= target for r in records
    )


def write_summary(workdir, config, params: int, step, tokens_per_s, wall_s, reached) -> dict:
    """The run's result from its last records; written to ``summary.json`` once complete.

    Args:
      workdir: the run's folder; config: its ``TrainConfig``; params: its model's
        trainable parameters; step: where it stopped; tokens_per_s, wall_s: its
        timing over all sessions; reached: whether it stopped at its target accuracy.
    """
    records = read_metrics(workdir)
    last = {
        kind: next((r for r in reversed(records) if r["kind"] == kind), {})
        for kind in ("train", "eval")
    }
    summary = {
        "step": step,
        "params": params,
        "train_loss": last["train"].get("loss"),
        "train_accuracy": last["train"].get("accuracy"),
        "test_loss": last["eval"].get("test_loss"),
        "test_accuracy": last["eval"].get("test_accuracy"),
        "tokens_per_s": tokens_per_s,
        "wall_s": wall_s,
        "target_reached": reached,  # stopped at config.target_accuracy
        "partial": step < config.steps and not reached,  # stopped by stop_at: resume to finish
    }
    if (step == config.steps or reached) and jax.process_index() == 0:
        write_atomic(workdir / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary
