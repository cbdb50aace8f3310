"""A trained run, one call away: ``load_run(workdir)`` rebuilds its model from its own record.

``train.loop.train`` writes the run's config (``config.json``, with every CLI
override applied) and its checkpoints into the workdir, so nothing else is
needed to get the model back for analysis::

    model, config = train.load_run("runs/mqar")            # the newest checkpoint
    model, config = train.load_run("runs/mqar", step=200)  # or a chosen one
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path

from train.checkpoint import Checkpointer, load_state, snapshot
from train.config import TrainConfig
from train.loop import ModelFn, init_state

__all__ = ["from_json", "load_run"]


def from_json(cls, data: dict):
    """Rebuilds a nested frozen dataclass config from ``train.config.to_json``'s dicts.

    Lists become tuples where the field is a tuple, nested dicts become the
    field's dataclass, and every config validates itself again on the way.
    """
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: expected a dict of fields, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: expected fields of {sorted(names)}, got {unknown}")
    return cls(**{name: _value(hints[name], value) for name, value in data.items()})


def _value(tp, value):
    """``value`` (JSON) as an instance of the annotation ``tp``."""
    if value is None:
        return None
    if dataclasses.is_dataclass(tp):
        return from_json(tp, value)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):  # e.g. float | tuple[float, ...] | None
        arms = [a for a in args if a is not type(None)]
        if isinstance(value, dict):
            return from_json(next(a for a in arms if dataclasses.is_dataclass(a)), value)
        if isinstance(value, list):
            return _value(next((a for a in arms if typing.get_origin(a) is tuple), tuple), value)
        return value
    if origin is tuple or tp is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_value(args[0], x) for x in value)
        if args:
            return tuple(_value(a, x) for a, x in zip(args, value, strict=True))
        return tuple(value)
    return value


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
