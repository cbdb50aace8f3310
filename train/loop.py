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
  with the schedule of the steps taken kept (see ``_check_config``), and
  ``mesh`` may change (the run continues sharded as ``train.sharding`` lays it
  out on the new mesh).
- ``checkpoints/<step>/``: the last ``keep_checkpoints`` orbax checkpoints.
- ``metrics.jsonl``: one JSON record per line, ``{"step", "kind": "train", ...}``
  every ``log_every`` steps and ``{"step", "kind": "eval", ...}`` at each
  evaluation. On resume from step s, records after s (logged by the
  interrupted process after its last checkpoint) are dropped before appending,
  so no step appears twice.
- ``summary.json``: written when the run completes: all ``steps`` taken, or
  an evaluation reached ``target_accuracy`` (the run stops there).

A non-finite loss or gradient norm raises ``NonFiniteLossError`` naming the
step; nothing is saved after the last good checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from models.mesh import SEQ_AXIS
from train import plugins, sharding
from train.checkpoint import Checkpointer, load_state, snapshot
from train.config import (
    RECORD,
    RESULT_FIELDS,
    OptimConfig,
    TrainConfig,
    differences,
    read_record,
    to_json,
    write_record,
)
from train.interrupt import EXIT_INTERRUPTED
from train.tasks import Task, make_task
from train.workdir import check_writable, lock, write_atomic

__all__ = [
    "NonFiniteLossError",
    "build_model",
    "evaluate",
    "init_state",
    "make_optimizer",
    "read_metrics",
    "train",
    "weighted_metrics",
]

ModelFn = Callable[[Any, int, nnx.Rngs], nnx.Module]


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


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped the run between two steps.

    The first Ctrl-C lets the step in flight finish and saves a checkpoint of
    it, so nothing is lost and the run resumes exactly from ``last_checkpoint``;
    a second one stops at once, keeping the checkpoints already written (a write
    in progress is completed first).

    Attributes:
      step: updates completed when the interrupt arrived.
      last_checkpoint: the newest checkpoint on disk, or None.
      steps: the run's total updates.
    """

    def __init__(self, step: int, last_checkpoint: int | None, steps: int):
        self.step, self.last_checkpoint, self.steps = step, last_checkpoint, steps
        saved = "none" if last_checkpoint is None else f"step {last_checkpoint} of {steps}"
        super().__init__(f"interrupted after {step} updates; the last checkpoint is {saved}")


class _StopOnSigint:
    """Within the block, the first SIGINT only sets ``requested``; the loop reads it
    between steps, so an interrupt never lands inside a step or a checkpoint write.

    A second SIGINT stops without a new checkpoint: at once (one line, exit
    status 130) when no checkpoint is being written, else as soon as the write
    in progress is complete (``now``; the loop then raises ``TrainingInterrupted``).
    It never raises inside the step: a ``KeyboardInterrupt`` there can land in
    the middle of a compile, which crashes the process. Signal handlers can only
    be set from the main thread; elsewhere this does nothing.
    """

    def __init__(self, run: _Run):
        self.run = run
        self.requested = self.now = False
        self._previous = None

    def _handler(self, signum, frame):
        if not self.requested:
            self.requested = True
            return
        if self.run.busy():
            self.now = True
            return
        sys.stderr.write(
            f"{self.run.workdir}: interrupted twice: stopped at once; the last checkpoint is "
            f"step {self.run.ckpt.latest_step()} (run the same command to resume from it)\n"
        )
        sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        return False


# ----------------------------------------------------------------------------
# Pieces the tests and the comparison reuse


def make_schedule(optim: OptimConfig, steps: int, peak=None) -> optax.Schedule:
    """Linear warmup from 0 to the peak, then cosine decay to ``peak * final_lr_fraction``.

    The schedule spans ``optim.horizon(steps)`` updates (``optim.decay_steps``,
    default ``steps``) and holds its final value after them.

    Args:
      optim: the optimizer config.
      steps: the run's length.
      peak: the peak learning rate (a float or a traced scalar); default ``optim.lr``.
    """
    peak = optim.lr if peak is None else peak
    horizon = optim.horizon(steps)
    warmup = int(optim.warmup_fraction * horizon)
    # Shape of the schedule with peak 1; the peak multiplies it, so it may be an array.
    shape = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=1.0,
        warmup_steps=warmup,
        decay_steps=max(horizon, warmup + 1),
        end_value=optim.final_lr_fraction,
    )
    return lambda count: peak * shape(count)


@functools.lru_cache(maxsize=32)
def make_optimizer(optim: OptimConfig, steps: int) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on ``make_schedule(optim, steps)``.

    Cached: the transformation is part of the jitted step's static structure,
    so returning the same object for the same config lets a second run in the
    process (a resume, a repeat) reuse the compiled step.

    The peak learning rate lives in the optimizer state (``inject_hyperparams``)
    rather than in the compiled program, so runs that differ only in it (a
    learning-rate sweep) compile to the same program and share the persistent
    compilation cache. Weight decay applies to parameters of rank >= 2
    (matrices and embeddings): decaying norm scales toward 0 only hurts.
    """

    def chain(learning_rate):
        return optax.chain(
            optax.clip_by_global_norm(optim.clip_norm),
            optax.adamw(
                make_schedule(optim, steps, learning_rate),
                b1=optim.b1,
                b2=optim.b2,
                eps=optim.eps,
                weight_decay=optim.weight_decay,
                mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
            ),
        )

    return optax.inject_hyperparams(chain)(learning_rate=optim.lr)


def weighted_metrics(logits, batch) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Cross-entropy and accuracy over labelled positions only.

    Args:
      logits: ``[B,T,V]``.
      batch: ``labels [B,T]`` (any value where unweighted) and ``weights [B,T]``.

    Returns:
      ``(mean loss, correct predictions, labelled positions)``, float32 scalars;
      the loss is the weighted mean, 0 when nothing is labelled.
    """
    weights = batch["weights"].astype(jnp.float32)
    labels = jnp.where(weights > 0, batch["labels"], 0)  # IGNORE (-100) is not a class
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    count = weights.sum()
    loss = (ce * weights).sum() / jnp.maximum(count, 1.0)
    correct = ((logits.argmax(-1) == labels) * weights).sum()
    return loss, correct, count


def _logits(model, batch):
    """The model on a batch; a sequence-parallel batch carries its tokens' ``positions``."""
    if "positions" in batch:
        return model(batch["tokens"], positions=batch["positions"])
    return model(batch["tokens"])


def _gathered(model, gather):
    """``model``, or (with ``gather``) a copy of it computing with ``gather(state)``.

    A copy, so that the caller's state keeps its layout (and gradients flow
    through ``gather`` to it).
    """
    if gather is None:
        return model
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, gather(state))


def _train_step(model, optimizer, batch, gather=None):
    def loss_fn(model):
        logits = _logits(_gathered(model, gather), batch)
        loss, correct, count = weighted_metrics(logits, batch)
        return loss, (correct, count)

    (loss, (correct, count)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return {
        "loss": loss,
        "accuracy": correct / jnp.maximum(count, 1.0),
        "grad_norm": optax.tree.norm(grads),
    }


def _eval_step(model, batch, gather=None):
    loss, correct, count = weighted_metrics(_logits(_gathered(model, gather), batch), batch)
    return jnp.stack([loss * count, correct, count])


_jit_eval_step = nnx.jit(_eval_step)


# Updates dispatched before the loop reads their metrics, at most (see _Run.flush).
MAX_PENDING = 100


@functools.lru_cache(maxsize=16)
def _pure_steps(mesh, graphdef, treedef):
    """``(train, eval)``: ``_train_step`` and ``_eval_step`` jitted over the state's leaves.

    ``train(leaves, batch) -> (leaves, metrics)`` and ``eval(leaves, batch) ->
    [loss sum, correct, count]``, where ``leaves`` are the arrays of
    ``nnx.split((model, optimizer))``'s state (``treedef`` its structure) and
    ``graphdef`` the rest. A call costs the host one flatten of a list of
    arrays: ``nnx.cached_partial`` also writes every variable back into the
    modules after each call, and a static graphdef is hashed on each call;
    either costs a small model's step on one core several milliseconds.

    On a mesh (``train.sharding``'s layout): under Auto axes the collectives
    come from the input shardings. Under Explicit ones each step gathers the
    parameters it computes with (``sharding.gather``: FSDP's all-gather, whose
    transpose scatters the gradients back to the shards). The updated state is
    constrained back to the rules, so the layout never drifts.
    """
    gather = None
    if mesh is not None and sharding.is_explicit(mesh):
        gather = functools.partial(sharding.gather, mesh)

    def objects(leaves):
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

    @jax.jit
    def train(leaves, batch):
        model, optimizer = objects(leaves)
        out = _train_step(model, optimizer, batch, gather)
        state = nnx.split((model, optimizer))[1]
        if mesh is not None:
            state = sharding.constrain(mesh, state)
        return jax.tree.leaves(state), out

    @jax.jit
    def evaluate(leaves, batch):
        model, _ = objects(leaves)
        return _eval_step(model, batch, gather)

    return train, evaluate


class _Steps:
    """A run's jitted train and eval steps on host batches, over its model's state.

    The state lives here between steps, as a list of arrays; ``sync()`` writes
    it into the model and optimizer (before anything reads them: checkpoints,
    the summary) and ``reload()`` takes it from them (after a restore wrote
    into them).
    """

    def __init__(self, mesh, model: nnx.Module, optimizer: nnx.Optimizer):
        self.mesh, self.objects = mesh, (model, optimizer)
        self.reload()

    def reload(self) -> None:
        graphdef, state = nnx.split(self.objects)
        self.leaves, treedef = jax.tree.flatten(state)
        self.treedef = treedef
        self._train, self._eval = _pure_steps(self.mesh, graphdef, treedef)
        self.synced = True

    def sync(self) -> None:
        if not self.synced:
            nnx.update(self.objects, jax.tree.unflatten(self.treedef, self.leaves))
            self.synced = True

    def _batch(self, batch):
        return batch if self.mesh is None else sharding.shard_batch(self.mesh, batch)

    def _context(self):
        # Models read the mesh when they trace (ring attention over "seq", models.softmax).
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def train(self, batch) -> dict:
        """One update; returns its metrics (loss, accuracy, grad_norm) as device scalars."""
        with self._context():
            self.leaves, out = self._train(self.leaves, self._batch(batch))
        self.synced = False
        return out

    def eval(self, batch):
        """``[loss sum, correct, count]`` of the current state on ``batch``."""
        with self._context():
            return self._eval(self.leaves, self._batch(batch))


def _place(mesh, model: nnx.Module, optimizer: nnx.Optimizer) -> None:
    """Moves the model and optimizer state onto ``mesh`` with ``train.sharding``'s rules."""
    for obj in (model, optimizer):
        nnx.update(obj, sharding.place(mesh, nnx.state(obj)))


def evaluate(model: nnx.Module, task: Task, config: TrainConfig, *, step_fn=None) -> dict:
    """Loss and accuracy on the test split's first ``eval_batches`` batches (a fixed set).

    Args:
      model: the model.
      task: its task.
      config: the run config (seed, batch size, eval_batches).
      step_fn: ``batch -> [loss sum, correct, count]``; default a jitted step on ``model``.

    Returns:
      ``dict(test_loss, test_accuracy)``, weighted by labelled positions.
    """
    step_fn = step_fn or nnx.cached_partial(_jit_eval_step, model)
    sums = np.zeros(3)
    for i in range(config.eval_batches):
        sums += np.asarray(step_fn(task.batch(config.seed, "test", i, config.batch_size)))
    loss_sum, correct, count = sums
    return {
        "test_loss": float(loss_sum / max(count, 1.0)),
        "test_accuracy": float(correct / max(count, 1.0)),
    }


def _decoder(model_config, vocab_size: int, rngs: nnx.Rngs) -> nnx.Module:
    from models import Decoder  # the model package is only needed when it is used

    return Decoder(dataclasses.replace(model_config, vocab_size=vocab_size), rngs=rngs)


def build_model(config: TrainConfig, vocab_size: int, model_fn: ModelFn | None = None):
    """The run's model, initialized from ``config.seed`` (eagerly).

    Args:
      config: the run config.
      vocab_size: V, from the task.
      model_fn: ``(model_config, vocab_size, rngs) -> nnx.Module``; default ``models.Decoder``.
    """
    return (model_fn or _decoder)(config.model, vocab_size, nnx.Rngs(config.seed))


def init_state(config: TrainConfig, vocab_size: int, model_fn: ModelFn | None = None):
    """The run's model and optimizer at step 0, built by one jitted program.

    One compilation instead of one per initializer and shape (each eager op
    compiles on first use, which on CPU costs more than the whole program).

    Returns:
      ``(model, optimizer)``.
    """

    def init():
        model = build_model(config, vocab_size, model_fn)
        tx = make_optimizer(config.optim, config.steps)
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    return nnx.jit(init)()


def count_params(model: nnx.Module) -> int:
    """Number of trainable parameters."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


# ----------------------------------------------------------------------------
# Files in the workdir


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


def _truncate_metrics(path: Path, through_step: int) -> None:
    """Drops records after ``through_step`` (written after the checkpoint resumed from)."""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = [line for line, record in _records(path) if record["step"] <= through_step]
    if len(kept) != len(lines):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)  # atomic: a crash here leaves the old or the new file, never half


def _with_horizon(config: TrainConfig) -> TrainConfig:
    optim = dataclasses.replace(config.optim, decay_steps=config.optim.horizon(config.steps))
    return dataclasses.replace(config, optim=optim)


def _check_config(workdir: Path, config: TrainConfig) -> tuple[TrainConfig, int | None]:
    """The config to resume ``workdir``'s run under, and the recorded steps if it grows.

    A run cannot resume under a config that changes its result, with one
    exception: ``steps`` may grow, which continues the run. The schedule's
    horizon (``optim.decay_steps``) is then pinned to the recorded one, so the
    steps already taken keep their learning rates and the result equals an
    uninterrupted run of the extended config.

    Raises:
      ValueError: in one line, naming the differing fields and the way out.
    """
    path = workdir / RECORD
    extended_from, needs = None, ()
    if path.exists():
        old, needs = read_record(workdir)
        old = old.with_task_vocab()
        if config.steps > old.steps and config.optim.decay_steps is None:
            optim = dataclasses.replace(config.optim, decay_steps=old.optim.horizon(old.steps))
            config = dataclasses.replace(config, optim=optim)
        if config.steps > old.steps:
            extended_from = old.steps
        # Compared with each schedule's horizon resolved: None and the run's steps agree.
        old_json, new_json = (
            json.loads(json.dumps(to_json(_with_horizon(c)))) for c in (old, config)
        )
        changed = [
            d
            for k in RESULT_FIELDS
            for d in differences(old_json[k], new_json[k], f"{k}.")
            if not (d[0] == "steps" and extended_from is not None)
        ]
        if changed:
            shown = ", ".join(f"{name} (recorded {a!r}, got {b!r})" for name, a, b in changed[:3])
            more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
            raise ValueError(
                f"workdir: {str(workdir)!r} holds a run with a different {shown}{more}; "
                "use a new workdir for a different run, or resume with the recorded values "
                "(only --steps may grow: that extends the run)"
            )
    write_record(workdir, config, (*needs, *plugins.loaded()))
    return config, extended_from


# ----------------------------------------------------------------------------
# The loop


def train(
    config: TrainConfig,
    workdir: str | Path,
    *,
    stop_at: int | None = None,
    model_fn: ModelFn | None = None,
    progress: bool = True,
    desc: str | None = None,
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
        more ``steps`` or another ``mesh``), cannot be written, or another
        process is training in it (``train.workdir``); ``mesh`` does not fit the
        devices, or ``batch_size`` does not split over it.
    """
    t_begin = time.perf_counter()
    mesh = _mesh(config)
    workdir = Path(workdir)
    check_writable(workdir, "workdir")  # before anything is written or compiled
    if (workdir / "checkpoints").exists():
        check_writable(workdir / "checkpoints", "workdir")
    guard = lock(workdir) if jax.process_index() == 0 else contextlib.nullcontext()
    with guard:  # one process per workdir
        return _train(config, workdir, mesh, stop_at, model_fn, progress, desc, t_begin)


def _train(config, workdir, mesh, stop_at, model_fn, progress, desc, t_begin):
    """``train`` in a checked, locked workdir."""
    config, extended_from = _check_config(workdir, config.with_task_vocab())
    run = _Run(config, workdir, mesh, model_fn, t_begin)
    start = run.resume(extended_from)
    end = config.steps if stop_at is None else max(start, min(stop_at, config.steps))
    reached = start > 0 and _reached_target(read_metrics(workdir), start, config.target_accuracy)
    if reached:  # the run stopped at its target: resuming it trains no further
        end = start
    bar = tqdm(
        total=config.steps,
        initial=start,
        desc=desc or workdir.name,
        disable=not progress,
        dynamic_ncols=True,
    )
    done, stop = start, _StopOnSigint(run)
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
        run.ckpt.close()
    run.steps.sync()
    return _summary(workdir, config, run.model, end, run.tokens_per_s(), run.wall(), reached)


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


class _Run:
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
            _place(mesh, self.model, self.optimizer)
        self.steps = _Steps(mesh, self.model, self.optimizer)
        # One compile, not one per op.
        self.schedule = jax.jit(make_schedule(config.optim, config.steps))
        self.ckpt = Checkpointer(workdir, keep=config.keep_checkpoints)
        self.saving = False
        self.totals = {"wall_s": 0.0, "train_s": 0.0, "train_tokens": 0}
        self.window: list[tuple[float, float]] = []
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
        _truncate_metrics(path, start)
        return path.open("a")

    def wall(self) -> float:
        return self.totals["wall_s"] + time.perf_counter() - self.t_begin

    def tokens_per_s(self) -> float:
        return self.totals["train_tokens"] / max(self.totals["train_s"], 1e-9)

    def save(self, done: int, log) -> None:
        """A checkpoint of step ``done``, after the records up to it reached the disk."""
        log.flush()
        meta = {"totals": {**self.totals, "wall_s": self.wall()}, "window": self.window}
        self.saving = True
        self.steps.sync()
        try:
            self.ckpt.save(done, snapshot(self.model, self.optimizer, done), meta)  # verifiable
        finally:
            self.saving = False

    def busy(self) -> bool:
        """Whether a checkpoint is being written (here or in the background)."""
        return self.saving or self.ckpt.saving()

    def step(self, batch, done: int) -> None:
        """Dispatches update ``done + 1`` on ``batch`` without waiting for it (see ``flush``).

        The first of a session includes compilation: it is read at once, untimed.
        """
        self.pending.append(self.steps.train(batch))
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
        return {
            "step": done,
            "kind": "eval",
            **evaluate(self.model, self.task, self.config, step_fn=self.steps.eval),
        }


def _run_steps(run: _Run, start: int, end: int, log, stop, bar) -> tuple[int, int, bool]:
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
        record_now = done % config.log_every == 0 or done == config.steps
        eval_now = done % config.eval_every == 0 or done == config.steps
        save_now = done % config.ckpt_every == 0 or done == end
        if not (record_now or eval_now or save_now or len(run.pending) >= MAX_PENDING):
            continue
        gnorm = run.flush(done)
        if record_now:
            record = run.train_record(done, gnorm)
            log.write(json.dumps(record) + "\n")
            bar.set_postfix(
                loss=f"{record['loss']:.3f}",
                acc=f"{record['accuracy']:.3f}",
                tok_s=f"{record['tokens_per_s']:.0f}",
            )
        if eval_now:
            record = run.eval_record(done)
            log.write(json.dumps(record) + "\n")
            reached = _reached_target([record], done, config.target_accuracy)
        if save_now or reached:
            run.save(done, log)
        if reached:
            return done, done, True
        run.resume_timing()
    if run.pending:  # stopped by a second Ctrl-C: read what ran, save nothing
        run.flush(done)
    return done, end, reached


def _reached_target(records, step: int, target: float | None) -> bool:
    """Whether the evaluation at ``step`` among ``records`` reached ``target`` accuracy."""
    return target is not None and any(
        r["kind"] == "eval" and r["step"] == step and r["test_accuracy"] >= target for r in records
    )


def _summary(workdir, config, model, step, tokens_per_s, wall_s, reached) -> dict[str, Any]:
    """The run's result from its last records; written to ``summary.json`` once complete."""
    records = read_metrics(workdir)
    last = {
        kind: next((r for r in reversed(records) if r["kind"] == kind), {})
        for kind in ("train", "eval")
    }
    summary = {
        "step": step,
        "params": count_params(model),
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
