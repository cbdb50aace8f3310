"""A run's records: ``metrics.jsonl`` (read, and truncated to a checkpoint on resume) and
``summary.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax

from train.workdir import write_atomic

__all__ = ["is_record", "reached_target", "read_metrics", "restore_metrics", "write_summary"]


# The fields a record of each kind holds besides "step" and "kind".
FIELDS = {"train": ("loss", "accuracy"), "eval": ("test_loss", "test_accuracy")}


def is_record(x) -> bool:
    """Whether ``x`` (a parsed JSON line) is a record this loop writes."""
    return (
        isinstance(x, dict)
        and isinstance(x.get("step"), int)
        and not isinstance(x["step"], bool)
        and x.get("kind") in FIELDS
        and all(isinstance(x.get(k), int | float) for k in FIELDS[x["kind"]])
    )


def _scan(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """The records of a JSONL file, and the 1-based numbers of the lines that are not
    records (not JSON, or JSON of another shape), except a torn last line.

    A process killed while writing can leave a partial last line; everything up
    to a checkpoint was flushed before it, so such a line is never needed.
    """
    if not path.exists():
        return [], []
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    torn = bool(lines) and not text.endswith("\n")
    records, damaged = [], []
    for i, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if is_record(record):
            records.append(record)
        elif not (torn and i == len(lines)):
            damaged.append(i)
    return records, damaged


def read_metrics(workdir: str | Path) -> list[dict[str, Any]]:
    """The records of ``workdir/metrics.jsonl`` (empty if there is none); lines that are
    not records are skipped (``restore_metrics`` reports them when a run resumes)."""
    return _scan(Path(workdir) / "metrics.jsonl")[0]


def restore_metrics(path: Path, through_step: int, saved: list | None) -> str | None:
    """Makes ``path`` hold the records up to ``through_step``, the checkpoint resumed from.

    Records after it (logged after that checkpoint) are dropped, so no step
    appears twice. ``saved``, the records the checkpoint carries (every record
    up to its step), replaces what the file holds up to it: records deleted,
    cut or damaged there are rebuilt. Lines that are not records are dropped.
    Without ``saved`` (checkpoints of older versions) what the file holds is
    kept, and lost records cannot be named.

    Returns:
      A one-line report of what was damaged and what was rebuilt, or None when
      nothing was (a torn last line after the checkpoint is not damage).
    """
    records, damaged = _scan(path)
    kept = [r for r in records if r["step"] <= through_step]
    rebuilt = []
    if saved is not None:
        have = {(r["kind"], r["step"]) for r in kept}
        rebuilt = [r for r in saved if (r["kind"], r["step"]) not in have]
        kept = list(saved)
    lines = "".join(json.dumps(r) + "\n" for r in kept)
    if not path.exists() or path.read_text(errors="replace") != lines:
        write_atomic(path, lines)  # a crash here leaves the old or the new file, never half
    if not damaged and not rebuilt:
        return None
    parts = []
    if damaged:
        parts.append(f"{len(damaged)} lines that are not records dropped (lines {_few(damaged)})")
    if rebuilt:
        steps = sorted({r["step"] for r in rebuilt})
        parts.append(
            f"{len(rebuilt)} records missing up to step {through_step} rebuilt from its "
            f"checkpoint (steps {_few(steps)})"
        )
    elif saved is None:
        parts.append("the records they held are lost (checkpoints of this version keep them)")
    return f"{path}: " + "; ".join(parts)


def _few(xs: list[int], most: int = 8) -> str:
    shown = ", ".join(map(str, xs[:most]))
    return shown + (f" and {len(xs) - most} more" if len(xs) > most else "")


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
        "test_loss_se": last["eval"].get("test_loss_se"),
        "test_accuracy": last["eval"].get("test_accuracy"),
        "tokens_per_s": tokens_per_s,
        "wall_s": wall_s,
        "target_reached": reached,  # stopped at config.target_accuracy
        "partial": step < config.steps and not reached,  # stopped by stop_at: resume to finish
    }
    if (step == config.steps or reached) and jax.process_index() == 0:
        write_atomic(workdir / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary
