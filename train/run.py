"""A trained run, one call away: ``load_run(workdir)`` rebuilds its model from its own record.

``train.loop.train`` writes the run's config (``config.json``, with every CLI
override applied) and its checkpoints into the workdir, so nothing else is
needed to get the model back for analysis::

    model, config = train.load_run("runs/mqar")            # the newest checkpoint
    model, config = train.load_run("runs/mqar", step=200)  # or a chosen one
"""

from __future__ import annotations

import json
from pathlib import Path

from train.checkpoint import Checkpointer, load_state, snapshot
from train.config import TrainConfig, from_json
from train.loop import ModelFn, init_state

__all__ = ["from_json", "load_run"]


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
      ValueError: no run there, no checkpoint, or no checkpoint ``step``.
    """
    workdir = Path(workdir)
    record = workdir / "config.json"
    if not record.is_file():
        raise ValueError(f"workdir: expected a run folder with config.json, got {str(workdir)!r}")
    if not (workdir / "checkpoints").is_dir():
        raise ValueError(f"workdir: expected checkpoints in {str(workdir)!r}, got none")
    config = from_json(TrainConfig, json.loads(record.read_text()))
    ckpt = Checkpointer(workdir, async_save=False)
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise ValueError(f"workdir: expected checkpoints in {str(workdir)!r}, got none")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise ValueError(f"step: expected one of the saved steps {steps}, got {step!r}")
        model, optimizer = init_state(config, config.task.vocab, model_fn)
        tree, _ = ckpt.restore(step, snapshot(model, optimizer, 0))
        load_state(model, optimizer, tree)
    finally:
        ckpt.close()
    return model, config
