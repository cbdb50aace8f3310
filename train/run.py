"""A trained run, one call away: ``load_run(workdir)`` rebuilds its model from its own record.

``train.loop.train`` writes the run's config (``config.json``, with every CLI
override applied) and its checkpoints into the workdir, so nothing else is
needed to get the model back for analysis::

    model, config = train.load_run("runs/mqar")            # the newest checkpoint
    model, config = train.load_run("runs/mqar", step=200)  # or a chosen one
    batch = train.run_batch(config, "test")                # the batches it was tested on
    logits, weights = models.capture_weights(model, batch["tokens"])

The run's plugins (layer kinds of one's own, ``train.plugins``) are imported
from its record first, so a run of a plugin's kind loads like any other.
"""

from __future__ import annotations

import sys
from pathlib import Path

from train.checkpoint import Checkpointer, load_state, snapshot
from train.config import RECORD, from_json, read_record
from train.steps import ModelFn, init_state
from train.tasks import make_task

__all__ = ["from_json", "load_run", "run_batch"]


def load_run(workdir: str | Path, step: int | None = None, *, model_fn: ModelFn | None = None):
    """The model of the run in ``workdir`` at a checkpoint, and the run's config.

    Args:
      workdir: a folder written by ``train.loop.train`` (``config.json`` and
        ``checkpoints/``).
      step: which checkpoint; default the newest.
      model_fn: as in ``train.loop.train``, for runs of a custom model.

    Returns:
      ``(model, config)``: the ``nnx.Module`` with the checkpoint's parameters,
      and the ``TrainConfig`` the run recorded.

    Raises:
      ValueError: no run there, no checkpoint, no checkpoint ``step``, data
        that is no longer the run's (a corpus file changed since it was
        recorded), or a record or checkpoint that does not read or verify
        (``CorruptCheckpoint``, naming the step; without ``step``, the newest
        that verifies is loaded).
    """
    workdir = Path(workdir)
    record = workdir / RECORD
    if not record.is_file():
        raise ValueError(f"workdir: expected a run folder with config.json, got {str(workdir)!r}")
    if not (workdir / "checkpoints").is_dir():
        raise ValueError(f"workdir: expected checkpoints in {str(workdir)!r}, got none")
    config, _ = read_record(workdir)  # imports the run's plugins first
    make_task(config.task)  # the data must still be the run's (its recorded fingerprint)
    ckpt = Checkpointer(workdir, async_save=False)
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise ValueError(f"workdir: expected checkpoints in {str(workdir)!r}, got none")
        if step is not None and step not in steps:
            raise ValueError(f"step: expected one of the saved steps {steps}, got {step!r}")
        model, optimizer = init_state(config, config.task.vocab, model_fn)
        target = snapshot(model, optimizer, 0)
        if step is None:  # the newest that verifies (a broken one is reported, moved aside)
            _, tree, _ = ckpt.restore_newest(
                target, report=lambda line: print(f"{workdir}: {line}", file=sys.stderr)
            )
        else:  # exactly this one: a CorruptCheckpoint (a ValueError) if it does not verify
            tree, _ = ckpt.restore(step, target)
        load_state(model, optimizer, tree)
    finally:
        ckpt.close()
    return model, config


def run_batch(config, split: str = "test", step: int = 0, batch_size: int | None = None) -> dict:
    """Batch ``step`` of ``split`` exactly as the run of ``config`` saw it.

    Test batches 0 to ``eval_batches - 1`` are the ones every evaluation scores;
    training batch s is the one update s trained on.

    Args:
      config: the run's ``TrainConfig`` (from ``load_run``).
      split: ``"train"`` or ``"test"``.
      step: the batch index.
      batch_size: B; default the run's ``batch_size``.

    Returns:
      ``dict(tokens [B,T] int32, labels [B,T] int32, weights [B,T] float32)``.

    Raises:
      ValueError: the data is no longer the run's (``config.task.fingerprint``,
        recorded when the run started, differs from the data's now).
    """
    B = config.batch_size if batch_size is None else batch_size
    return make_task(config.task).batch(config.seed, split, step, B)
