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

import re
import sys
from pathlib import Path

from train.checkpoint import Checkpointer, load_state, snapshot
from train.config import RECORD, from_json, read_record
from train.steps import ModelFn, init_state
from train.tasks import make_task

__all__ = ["find_run", "from_json", "load_run", "run_batch"]

# A comparison's run folder: runs/<name>/<variant>/lr<lr>_seed<seed> (train.compare).
_RUN_NAME = re.compile(r"^lr(?P<lr>[^_]+)_seed(?P<seed>-?\d+)$")


def find_run(folder: str | Path, *, variant=None, lr=None, seed=None) -> Path:
    """The run folder ``folder`` names: itself if it holds a run, else the one run below it
    (at most two levels: a comparison's ``<variant>/lr<lr>_seed<seed>``) that ``variant``,
    ``lr`` and ``seed`` pick.

    Raises:
      ValueError: no run, or several, match; the message lists the runs found.
    """
    folder = Path(folder)
    if (folder / RECORD).is_file() and variant is None and lr is None and seed is None:
        return folder
    runs = sorted(
        p.parent.relative_to(folder)
        for depth in ("*", "*/*")
        for p in folder.glob(f"{depth}/{RECORD}")
    )
    picked = [r for r in runs if _matches(folder, r, variant, lr, seed)]
    if len(picked) == 1:
        return folder / picked[0]
    shown = ", ".join(str(r) for r in runs[:12]) + (" and more" if len(runs) > 12 else "")
    asked = ", ".join(f"{k}={v!r}" for k, v in dict(variant=variant, lr=lr, seed=seed).items()
                      if v is not None)  # fmt: skip
    if not runs:
        raise ValueError(f"workdir: expected a run folder with config.json, got {str(folder)!r}")
    which = (
        f"{len(picked)} runs match {asked or 'nothing given'}"
        if picked
        else f"none matches {asked}"
    )
    raise ValueError(
        f"workdir: expected one run, got {str(folder)!r}, which holds {len(runs)} runs ({shown}) "
        f"and {which}: pick one with variant=, lr=, seed= (or pass its folder)"
    )


def _matches(folder: Path, run: Path, variant, lr, seed) -> bool:
    parts = (folder.name, *run.parts)
    if variant is not None and str(variant) not in parts[:-1] and str(variant) != run.name:
        return False
    name = _RUN_NAME.match(run.name)
    if (lr is not None or seed is not None) and name is None:
        return False
    if lr is not None and float(name["lr"]) != float(lr):
        return False
    return seed is None or int(name["seed"]) == int(seed)


def load_run(
    workdir: str | Path,
    step: int | None = None,
    *,
    model_fn: ModelFn | None = None,
    variant: str | None = None,
    lr: float | None = None,
    seed: int | None = None,
):
    """The model of the run in ``workdir`` at a checkpoint, and the run's config.

    Args:
      workdir: a folder written by ``train.loop.train`` (``config.json`` and
        ``checkpoints/``), or a folder of runs (a comparison's
        ``runs/<name>`` or ``runs/<name>/<variant>``), of which ``variant``,
        ``lr`` and ``seed`` pick one (``find_run``).
      step: which checkpoint; default the newest.
      model_fn: as in ``train.loop.train``, for runs of a custom model.
      variant, lr, seed: pick a run in a folder of runs.

    Returns:
      ``(model, config)``: the ``nnx.Module`` with the checkpoint's parameters,
      and the ``TrainConfig`` the run recorded.

    Raises:
      ValueError: no run there (or not one: the runs found are listed), no
        checkpoint, no checkpoint ``step``, data
        that is no longer the run's (a corpus file changed since it was
        recorded), or a record or checkpoint that does not read or verify
        (``CorruptCheckpoint``, naming the step; without ``step``, the newest
        that verifies is loaded).
    """
    workdir = find_run(workdir, variant=variant, lr=lr, seed=seed)
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
