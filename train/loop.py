"""The training loop: AdamW, ``nnx.jit`` steps, evaluation, checkpoints and exact resume.

``train(config, workdir)`` trains a model for ``config.steps`` updates and
returns a summary. Running it again with the same workdir resumes from the
newest checkpoint, and the final parameters are bit-identical to those of an
uninterrupted run: batches are a function of ``(seed, step)``, the checkpoint
holds everything else (parameters, RNG streams, optimizer state with its step
count), and the restored arrays are the saved bits.

Files in the workdir:

- ``config.json``: the run's config, as the model is built (``model.vocab_size``
  is the task's), and the plugins it needs (``"plugins"``, ``train.plugins``).
  Resuming under a config that changes the result (task, model,
  optimizer, batch, seed) is refused; ``steps`` may grow, which extends the run
  with the schedule of the steps taken kept (``train.config.check_resume``), and
  ``mesh`` may change (the run continues sharded as ``train.sharding`` lays it
  out on the new mesh).
- ``checkpoints/<step>/``: the last ``keep_checkpoints`` orbax checkpoints.
- ``metrics.jsonl``: one JSON record per line, ``{"step", "kind": "train", ...}``
  every ``log_every`` steps and ``{"step", "kind": "eval", ...}`` at each
  evaluation. Every checkpoint carries the records up to its step too: on
  resume from step s, the file is made to hold exactly those (records after s,
  logged by the interrupted process after its last checkpoint, are dropped,
  so no step appears twice; records deleted, cut or damaged up to s are
  rebuilt, and the damage is reported in one line).
- ``summary.json``: written when the run completes: all ``steps`` taken, or
  an evaluation reached ``target_accuracy`` (the run stops there).

A non-finite loss or gradient norm raises ``NonFiniteLossError`` naming the
step; nothing is saved after the last good checkpoint.

The pieces the loop runs have their own modules: ``train.steps`` (the
state, the loss and the jitted steps), ``train.optimizer`` (AdamW and its
schedule), ``train.metrics`` (``metrics.jsonl`` and ``summary.json``),
``train.config`` (the record and the resume check), ``train.checkpoint``,
``train.workdir`` (the lock, atomic writes) and ``train.interrupt`` (Ctrl-C).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from models.mesh import SEQ_AXIS
from train import optimizer, pool, sharding
from train.checkpoint import Checkpointer, load_state, snapshot
from train.config import TrainConfig, check_resume, to_json, write_record
from train.interrupt import StopOnSigint, TrainingInterrupted
from train.metrics import reached_target, read_metrics, restore_metrics, write_summary
from train.steps import ModelFn, Steps, count_params, evaluate, init_state, place
from train.tasks import make_task
from train.workdir import check_writable, lock

__all__ = ["NonFiniteLossError", "TrainingInterrupted", "train"]

# Updates dispatched before the loop reads their metrics, at most (see Session.flush).
MAX_PENDING = 100


class NonFiniteLossError(FloatingPointError):
    """The loss (or gradient norm) became NaN or infinite; the run stopped.

    Attributes:
      step: the update whose loss was not finite (1-based, as in ``metrics.jsonl``).
      last_checkpoint: the newest checkpoint on disk, untouched, or None.
    """

    def __init__(self, step: int, loss: float, grad_norm: float, last_checkpoint: int | None):
        self.step, self.last_checkpoint = step, last_checkpoint
        saved = "none" if last_checkpoint is None else f"step {last_checkpoint}"
        super().__init__(
            f"non-finite loss or gradient at step {step} (loss {loss}, grad norm {grad_norm}); "
            f"stopped without saving; the last checkpoint is {saved}"
        )


def train(
    config: TrainConfig,
    workdir: str | Path,
    *,
    stop_at: int | None = None,
    model_fn: ModelFn | None = None,
    progress: bool = True,
    desc: str | None = None,
    adopt_checkpoints: bool = False,
) -> dict[str, Any]:
    """Trains (or resumes) the run in ``workdir`` up to ``config.steps`` updates.

    A finished or interrupted run resumes under a larger ``config.steps``: the
    run continues, with ``optim.decay_steps`` pinned to the recorded length.

    Args:
      config: the run.
      workdir: its folder; created if missing, resumed from if it holds checkpoints.
      stop_at: stop after this many updates (saving a checkpoint there), as an
        interruption would; a later call continues the same run.
      model_fn: builds the model, ``(model_config, vocab_size, rngs) -> nnx.Module``;
        default ``models.Decoder``.
      progress: show a tqdm bar.
      desc: the bar's label.
      adopt_checkpoints: resume checkpoints whose ``config.json`` is gone under
        ``config`` (refused otherwise; checkpoints of other shapes are refused
        either way, and never moved aside).

    Returns:
      ``dict(step, params, train_loss, train_accuracy, test_loss, test_accuracy,
      tokens_per_s, wall_s, target_reached, partial)``; ``step`` is where the run
      stopped (before ``config.steps`` when an evaluation reached
      ``config.target_accuracy``); the test metrics are those of the last evaluation,
      ``tokens_per_s`` counts training steps only (not compilation, evaluation
      or saving) over all sessions of the run, and ``wall_s`` is the total time.

    Raises:
      NonFiniteLossError: the loss or gradient norm became NaN or infinite.
      ValueError: the workdir holds a run with a different config (other than
        more ``steps`` or another ``mesh``) or data, checkpoints without a
        record (unless ``adopt_checkpoints``), cannot be written, or another
        process is training in it (``train.workdir``); ``mesh`` does not fit the
        devices, or ``batch_size`` does not split over it.
    """
    t_begin = time.perf_counter()
    workdir = Path(workdir)
    _check_same_run(config, workdir, stop_at, adopt_checkpoints)
    mesh = _mesh(config)
    check_writable(workdir, "workdir")  # before anything is written or compiled
    if (workdir / "checkpoints").exists():
        check_writable(workdir / "checkpoints", "workdir")
    guard = lock(workdir) if jax.process_index() == 0 else contextlib.nullcontext()
    with guard:  # one process per workdir
        return _train_locked(
            config, workdir, mesh, stop_at, model_fn, progress, desc, t_begin, adopt_checkpoints
        )


def _train_locked(config, workdir, mesh, stop_at, model_fn, progress, desc, t_begin, adopt):
    """``train`` in a checked, locked workdir."""
    config, extended_from, needs = check_resume(workdir, config.with_task_vocab(), adopt=adopt)
    run = Session(config, workdir, mesh, model_fn, t_begin)
    start = run.resume(extended_from)
    if jax.process_index() == 0:  # after the checkpoints read: a refused restore records nothing
        write_record(workdir, config, needs)
    end = config.steps if stop_at is None else max(start, min(stop_at, config.steps))
    reached = start > 0 and reached_target(read_metrics(workdir), start, config.target_accuracy)
    if reached:  # the run stopped at its target: resuming it trains no further
        end = start
    bar = tqdm(
        total=config.steps,
        initial=start,
        desc=desc or workdir.name,
        disable=not progress,
        dynamic_ncols=True,
    )
    done, stop = start, StopOnSigint(workdir, run.busy, run.ckpt.latest_step)
    pool.report(start, start, end)  # a pool's bar: this run's work is end - start
    try:
        with run.metrics_log(start) as log, stop:
            done, end, reached_now = _run_steps(run, start, end, log, stop, bar)
            reached = reached or reached_now
            run.ckpt.wait()  # inside: a Ctrl-C here lets the write finish
        if stop.requested and done < end:
            raise TrainingInterrupted(done, run.ckpt.latest_step(), config.steps)
    except KeyboardInterrupt as e:
        if isinstance(e, TrainingInterrupted):
            raise
        # A second Ctrl-C (or one outside the main thread's handler): no new checkpoint,
        # but one being written is completed, never left half-way.
        run.ckpt.wait()
        run.ckpt.refresh()
        raise TrainingInterrupted(done, run.ckpt.latest_step(), config.steps) from e
    finally:
        bar.close()
        late = run.ckpt.close()  # a write that failed after the loop (else: already raised)
    if late is not None:
        raise late
    run.steps.sync()
    params = count_params(run.model)
    return write_summary(workdir, config, params, end, run.tokens_per_s(), run.wall(), reached)


def _check_same_run(config: TrainConfig, workdir: Path, *args) -> None:
    """On several processes: refuses, before anything is written, processes that were
    given different runs (config, workdir, stop and adopt settings), which would
    otherwise train different programs and end in an abort inside a collective."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    text = json.dumps([to_json(config), str(workdir), *args], sort_keys=True, default=str)
    mine = np.frombuffer(hashlib.sha256(text.encode()).digest()[:8], np.uint32)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), -1)
    differ = [i for i in range(len(every)) if not np.array_equal(every[i], every[0])]
    if differ:
        raise ValueError(
            f"processes: expected every process to run the same config and workdir, got "
            f"{len(differ)} whose arguments differ from process 0's (process {differ[0]}); "
            "start them all with the same command"
        )


def _mesh(config: TrainConfig):
    """The run's mesh (None without ``config.mesh``), checked against the batch and model."""
    if config.mesh is None:
        return None
    mesh = sharding.make_mesh(config.mesh, axis_types=config.mesh_axis_types)
    sharding.check_batch_size(mesh, config.batch_size)
    if mesh.shape[SEQ_AXIS] > 1:  # sequence parallelism: see train.sharding
        sharding.check_seq_len(mesh, config.task.seq_len)
        sharding.check_sequence_parallel(config.model)
    return mesh


class Session:
    """One session of a run: its state, its steps, and what it saves, logs and evaluates.

    ``totals`` are the wall time, training time and tokens over all sessions of
    the run, carried in the checkpoints' metadata; ``window`` holds the (loss,
    accuracy) of the steps since the last train record (a record averages its
    interval, so an interrupted interval's steps travel in the checkpoint).
    """

    def __init__(self, config: TrainConfig, workdir: Path, mesh, model_fn, t_begin: float):
        self.config, self.workdir, self.t_begin = config, workdir, t_begin
        self.task = make_task(config.task)
        self.model, self.optimizer = init_state(config, self.task.vocab_size, model_fn)
        if mesh is not None:  # the restore target then carries the mesh's shardings
            place(mesh, self.model, self.optimizer)
        ordered = sharding.in_order(config.model)
        self.steps = Steps(mesh, self.model, self.optimizer, ordered)
        # One compile, not one per op.
        self.schedule = jax.jit(optimizer.make_schedule(config.optim, config.steps))
        self.ckpt = Checkpointer(workdir, keep=config.keep_checkpoints)
        self.saving = False
        self.saved_at = time.perf_counter()  # the last save, or the session's start
        self.totals = {"wall_s": 0.0, "train_s": 0.0, "train_tokens": 0}
        self.window: list[tuple[float, float]] = []
        # Every record written, carried by each checkpoint so a damaged metrics.jsonl
        # is rebuilt on resume (None: resumed from a checkpoint of an older version).
        self.records: list[dict] | None = []
        self.pending: list[dict] = []  # device metrics of the updates not yet read
        self.span: float | None = None  # when the training time being counted began
        self.gnorm = math.nan  # the gradient norm of the last update read

    def resume(self, extended_from: int | None) -> int:
        """Restores the newest checkpoint that verifies, if any; returns its step (0 without).

        A newer one that does not read or verify is reported and moved aside
        (``Checkpointer.restore_newest``); the records logged after the step
        resumed from are dropped from the metrics, so the run continues exactly.
        """
        found = self.ckpt.restore_newest(
            snapshot(self.model, self.optimizer, 0),
            report=lambda line: tqdm.write(f"{self.workdir}: {line}", file=sys.stderr),
        )
        if found is None:
            return 0
        _, tree, meta = found
        start = load_state(self.model, self.optimizer, tree)
        self.steps.reload()
        self.totals.update(meta["totals"])
        self.window = [tuple(x) for x in meta["window"]]
        self.records = meta.get("records")
        note = ""
        if extended_from is not None:
            horizon = self.config.optim.horizon(self.config.steps)
            note = (
                f" (extended from {extended_from} steps; the learning rate holds its final "
                f"value after step {horizon})"
            )
        tqdm.write(
            f"{self.workdir}: resuming from step {start} of {self.config.steps}{note}",
            file=sys.stderr,
        )
        return start

    def metrics_log(self, start: int):
        """The metrics file, opened for appending after dropping the records past ``start``.

        On several hosts every process runs the loop and one writes the shared
        files; the others write to the null device.
        """
        if jax.process_index() != 0:
            return open(os.devnull, "w")
        path = self.workdir / "metrics.jsonl"
        report = restore_metrics(path, start, self.records)
        if report is not None:
            tqdm.write(report, file=sys.stderr)
        return path.open("a")

    def log(self, log, record: dict[str, Any]) -> None:
        """Writes a record to ``metrics.jsonl``; the next checkpoint carries it too."""
        log.write(json.dumps(record) + "\n")
        if self.records is not None:
            self.records.append(record)

    def wall(self) -> float:
        return self.totals["wall_s"] + time.perf_counter() - self.t_begin

    def tokens_per_s(self) -> float:
        return self.totals["train_tokens"] / max(self.totals["train_s"], 1e-9)

    def save(self, done: int, log) -> None:
        """A checkpoint of step ``done``, after the records up to it reached the disk."""
        log.flush()
        meta = {"totals": {**self.totals, "wall_s": self.wall()}, "window": self.window}
        if self.records is not None:
            meta["records"] = self.records
        self.saving = True
        self.steps.sync()
        try:
            self.ckpt.save(done, snapshot(self.model, self.optimizer, done), meta)  # verifiable
        finally:
            self.saving = False
            self.saved_at = time.perf_counter()

    def save_due(self) -> bool:
        """Whether ``ckpt_seconds`` have passed since the last save (one process only)."""
        seconds = self.config.ckpt_seconds
        if seconds is None or jax.process_count() > 1:
            return False
        return time.perf_counter() - self.saved_at >= seconds

    def busy(self) -> bool:
        """Whether a checkpoint is being written (here or in the background)."""
        return self.saving or self.ckpt.saving()

    def step(self, batch, done: int) -> None:
        """Dispatches update ``done + 1`` on ``batch`` without waiting for it (see ``flush``).

        The first of a session includes compilation: it is read at once, untimed.
        """
        self.pending.append(self.steps.update(batch))
        if self.span is None:
            self.flush(done + 1)
            self.resume_timing()

    def flush(self, done: int) -> float:
        """Reads the metrics of the updates dispatched since the last flush, up to ``done``.

        Waiting on every step would cost a small model's step on one core a
        fifth of its time (the host and XLA's thread take turns instead of
        overlapping), so the loop reads them in one transfer at each record,
        evaluation, checkpoint or stop. Their time counts as training time.

        Returns:
          the last update's gradient norm.

        Raises:
          NonFiniteLossError: one of them had a non-finite loss or gradient norm,
            naming the first (nothing is saved).
        """
        metrics = jax.device_get(self.pending)
        first = done - len(metrics) + 1
        now = time.perf_counter()
        if self.span is not None:  # (None: the session's first step, which compiled)
            self.totals["train_s"] += now - self.span
            self.totals["train_tokens"] += (
                len(metrics) * self.config.batch_size * self.config.task.seq_len
            )
        self.pending.clear()
        for i, out in enumerate(metrics):
            loss, acc, gnorm = (float(out[k]) for k in ("loss", "accuracy", "grad_norm"))
            if not (math.isfinite(loss) and math.isfinite(gnorm)):
                self.ckpt.wait()
                raise NonFiniteLossError(first + i, loss, gnorm, self.ckpt.latest_step())
            self.window.append((loss, acc))
            self.gnorm = gnorm
        return self.gnorm

    def resume_timing(self) -> None:
        """Training time counts again from here (after an evaluation, a save or a flush)."""
        self.span = time.perf_counter()

    def train_record(self, done: int, gnorm: float) -> dict[str, Any]:
        """The mean of the steps since the last record, as a ``metrics.jsonl`` record."""
        mean_loss, mean_acc = (float(x) for x in np.mean(self.window, axis=0))
        self.window.clear()
        return {
            "step": done,
            "kind": "train",
            "loss": mean_loss,
            "accuracy": mean_acc,
            "grad_norm": gnorm,
            "lr": float(self.schedule(done - 1)),
            "tokens_per_s": self.tokens_per_s(),
            "wall_s": self.wall(),
        }

    def eval_record(self, done: int) -> dict[str, Any]:
        c = self.config
        batches = c.final_eval_batches if done == c.steps else None
        result = evaluate(self.model, self.task, c, step_fn=self.steps.eval, batches=batches)
        return {"step": done, "kind": "eval", **result}


def _run_steps(run: Session, start: int, end: int, log, stop, bar) -> tuple[int, int, bool]:
    """The updates ``start`` to ``end``, with their records, evaluations and checkpoints.

    Returns ``(done, end, reached)``: the updates completed, where the run ends
    (earlier than ``end`` when an evaluation reached the target accuracy) and
    whether it did.

    Raises:
      NonFiniteLossError: a loss or gradient norm was not finite (nothing is saved).
    """
    config, done, reached = run.config, start, False

    def batch_at(step: int):
        return run.task.batch(config.seed, "train", step, config.batch_size)

    for step in range(start, end):
        if stop.now:  # Ctrl-C twice during a write: stop once it is done, saving nothing new
            break
        if stop.requested:  # Ctrl-C: stop between steps, with a checkpoint of the last
            if run.pending:
                run.flush(done)
            if run.ckpt.latest_step() != done:
                run.save(done, log)
            break
        run.step(batch_at(step), done)
        done = step + 1
        bar.update(1)
        pool.report(start, done, end)
        record_now = done % config.log_every == 0 or done == config.steps
        eval_now = done % config.eval_every == 0 or done == config.steps
        save_now = done % config.ckpt_every == 0 or done == end or run.save_due()
        if not (record_now or eval_now or save_now or len(run.pending) >= MAX_PENDING):
            continue
        gnorm = run.flush(done)
        if record_now:
            record = run.train_record(done, gnorm)
            run.log(log, record)
            bar.set_postfix(
                loss=f"{record['loss']:.3f}",
                acc=f"{record['accuracy']:.3f}",
                tok_s=f"{record['tokens_per_s']:.0f}",
            )
        if eval_now:
            record = run.eval_record(done)
            run.log(log, record)
            reached = reached_target([record], done, config.target_accuracy)
        if save_now or reached:
            run.save(done, log)
        if reached:
            return done, done, True
        run.resume_timing()
    if run.pending:  # stopped by a second Ctrl-C: read what ran, save nothing
        run.flush(done)
    return done, end, reached
