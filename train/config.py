"""The frozen configs of a training run; ``configs/*.py`` files return a ``TrainConfig``.

Every field can be overridden on the command line through tyro, e.g.
``python -m train --config configs/mqar.py --workdir runs/x --model.width 128 --optim.lr 3e-3``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from models.config import KINDS, LEGACY_DEFAULTS, AttentionConfig, ModelConfig
from train import plugins
from train.sharding import AXIS_TYPES, mesh_shape
from train.tasks import TaskConfig, make_task
from train.workdir import saved_steps, write_atomic

__all__ = [
    "RECORD",
    "OptimConfig",
    "Resume",
    "TrainConfig",
    "check_resume",
    "differences",
    "from_json",
    "read_record",
    "to_json",
    "write_record",
]

# The run's record in its workdir: the config's fields and the plugins it needs.
RECORD = "config.json"


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup, cosine decay and global-norm clipping.

    Attributes:
      lr: peak learning rate.
      warmup_fraction: fraction of the steps spent warming up linearly from 0
        (a fraction, so a shorter run keeps the same schedule shape).
      final_lr_fraction: the cosine decays to ``lr * final_lr_fraction``.
      decay_steps: the step at which the cosine ends (warmup is a fraction of
        it); the learning rate then stays at ``lr * final_lr_fraction``. None: the
        run's ``steps``. Extending a run's ``steps`` on resume pins it to the
        original length, so the steps already taken keep their schedule.
      weight_decay: decoupled weight decay, on matrices only (not norms or biases).
      b1, b2, eps: Adam's moments and epsilon.
      clip_norm: gradients are rescaled to at most this global norm.
    """

    lr: float = 1e-3
    warmup_fraction: float = 0.1
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-8
    clip_norm: float = 1.0
    decay_steps: int | None = None

    def __post_init__(self):
        if not self.lr > 0:
            raise ValueError(f"optim.lr: expected a float > 0, got {self.lr}")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError(
                f"optim.warmup_fraction: expected a float in [0, 1), got {self.warmup_fraction}"
            )
        if not 0 <= self.final_lr_fraction <= 1:
            raise ValueError(
                f"optim.final_lr_fraction: expected a float in [0, 1], got {self.final_lr_fraction}"
            )
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay: expected >= 0, got {self.weight_decay}")
        if not self.clip_norm > 0:
            raise ValueError(f"optim.clip_norm: expected a float > 0, got {self.clip_norm}")
        d = self.decay_steps
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"optim.decay_steps: expected None or an int >= 1, got {d!r}")

    def horizon(self, steps: int) -> int:
        """The schedule's length for a run of ``steps`` updates."""
        return steps if self.decay_steps is None else self.decay_steps


@dataclass(frozen=True)
class TrainConfig:
    """One training run: task, model, optimizer, budget and bookkeeping.

    The model's vocabulary is the task's (``task.vocab``): ``with_task_vocab()``
    sets ``model.vocab_size`` to it, and that is what a run builds and records.

    Attributes:
      task: which batches to train and test on.
      model: the decoder (attention variant, width, layers, ...).
      optim: optimizer and schedule.
      steps: optimizer updates in the run.
      batch_size: B, sequences per update.
      seed: seeds the parameters and the data streams.
      eval_every: evaluate on the test split every this many steps (and at the end).
      eval_batches: test batches per evaluation; always the same ones, so the
        curve measures the model, not the sample.
      final_eval_batches: None, or the test batches of the run's last evaluation
        (at ``steps``), at least ``eval_batches``: batches 0 to ``eval_batches - 1``
        are the curve's, the rest a larger sample where the result is read (its
        standard error shrinks as one over the root of the batches).
      ckpt_every: save a checkpoint every this many steps (and at the end).
      ckpt_seconds: also save one at the first step this many seconds after the last
        save (or the session's start), so a run killed early loses at most about that
        much; None saves by steps only. Read on one process only: processes of a job
        could disagree on the moment, so a job of several saves by steps.
      keep_checkpoints: how many recent checkpoints to keep.
      log_every: write a train record to ``metrics.jsonl`` every this many steps.
      mesh: None trains on one device (the default path). ``"data=2,fsdp=4"``
        style: train on a device mesh with these axis sizes (unnamed axes have
        size 1; the product must be the device count; ``""`` puts every device
        on ``data``); see ``train.sharding``. It does not change the result
        beyond float rounding, so a run may resume on another mesh.
      mesh_axis_types: ``"auto"`` (the default: XLA lays out every intermediate)
        or ``"explicit"`` (arrays carry their shardings in their types, as on a
        mesh from ``jax.make_mesh``); the same result, so it may change on resume.
      target_accuracy: None trains all ``steps``. A float in (0, 1]: stop at the
        first evaluation whose test accuracy reaches it (a checkpoint is saved
        there, and a resumed run that already reached it trains no further).
        It only decides where the run stops, never what a step computes, so it
        may change on resume.
    """

    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    steps: int = 1000
    batch_size: int = 64
    seed: int = 0
    eval_every: int = 200
    eval_batches: int = 4
    final_eval_batches: int | None = None
    ckpt_every: int = 200
    ckpt_seconds: float | None = 60.0
    keep_checkpoints: int = 2
    log_every: int = 10
    mesh: str | None = None
    mesh_axis_types: str = "auto"
    target_accuracy: float | None = None

    def __post_init__(self):
        for name in ("steps", "batch_size", "eval_every", "eval_batches", "ckpt_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        f = self.final_eval_batches
        if f is not None and (type(f) is not int or f < self.eval_batches):
            raise ValueError(
                f"final_eval_batches: expected None or an int >= eval_batches "
                f"({self.eval_batches}), got {f!r}"
            )
        c = self.ckpt_seconds
        if c is not None and (isinstance(c, bool) or not isinstance(c, int | float)
                              or not 0 < c < math.inf):  # fmt: skip
            raise ValueError(f"ckpt_seconds: expected None or a positive number, got {c!r}")
        for name in ("keep_checkpoints", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {getattr(self, name)}")
        if self.seed < 0:
            raise ValueError(f"seed: expected an int >= 0, got {self.seed}")
        t = self.target_accuracy
        if t is not None and (isinstance(t, bool) or not 0 < t <= 1):
            raise ValueError(f"target_accuracy: expected None or a float in (0, 1], got {t!r}")
        if self.mesh is not None:
            mesh_shape(self.mesh)  # the syntax; the device count is checked when a run starts
        if self.mesh_axis_types not in AXIS_TYPES:
            raise ValueError(
                f"mesh_axis_types: expected one of {tuple(AXIS_TYPES)}, "
                f"got {self.mesh_axis_types!r}"
            )

    def with_task_vocab(self) -> TrainConfig:
        """This config with ``model.vocab_size`` set to the task's vocabulary."""
        if self.model.vocab_size == self.task.vocab:
            return self
        model = dataclasses.replace(self.model, vocab_size=self.task.vocab)
        return dataclasses.replace(self, model=model)


# Fields that change what a run computes: a run cannot resume under a config
# that differs in any of them (the others only change logging, saving and the
# device layout: ``mesh`` may change on resume).
RESULT_FIELDS = ("task", "model", "optim", "steps", "batch_size", "seed")
# Fields of the result added after runs were recorded without them, whose
# default means "not recorded" or is what the older runs did (older records still
# read): ``task.hops`` is read only by ``variable_tracking``, which came with it.
ADDED_FIELDS = ("task.fingerprint", "task.hops")


def to_json(config) -> dict:
    """A dataclass config as JSON-able nested dicts (tuples become lists)."""
    return dataclasses.asdict(config)


def from_json(cls, data: dict):
    """Rebuilds a nested frozen dataclass config from ``train.config.to_json``'s dicts.

    Lists become tuples where the field is a tuple, nested dicts become the
    field's dataclass (a layer: its kind's config class, ``models.KINDS``), and
    every config validates itself again on the way.
    """
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: expected a dict of fields, got {type(data).__name__}")
    if issubclass(cls, AttentionConfig) and isinstance(data.get("kind"), str):
        cls = KINDS.lookup(data["kind"], "kind").config_class  # a kind's own config class
        data = _without_legacy(cls, data)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: expected fields of {sorted(names)}, got {unknown}")
    for name, value in data.items():
        if value is None and not _admits_none(hints[name]):
            raise ValueError(f"{cls.__name__}.{name}: expected a value, got null")
    return cls(**{name: _value(hints[name], value) for name, value in data.items()})


def _admits_none(tp) -> bool:
    """Whether a field annotated ``tp`` may hold None (``X | None``, ``Any``)."""
    if tp is typing.Any or tp is type(None):
        return True
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in (
        typing.get_args(tp)
    )


def _without_legacy(cls, data: dict) -> dict:
    """A layer's record without the old union config's fields its class does not hold.

    Records written before each kind had its own config class hold every
    field of the union, at its default where the kind did not read it
    (``models.config.LEGACY_DEFAULTS``); any other value stays, to be refused.
    """
    names = {f.name for f in dataclasses.fields(cls)}
    legacy = json.loads(json.dumps(LEGACY_DEFAULTS))  # as a record holds them (tuples as lists)
    return {k: v for k, v in data.items() if k in names or k not in legacy or v != legacy[k]}


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


def differences(old, new, prefix: str = "") -> list[tuple[str, object, object]]:
    """``(dotted field, old, new)`` for every leaf where two ``to_json`` trees differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [
            d
            for k in sorted(set(old) | set(new), key=list({**old, **new}).index)
            for d in differences(old.get(k), new.get(k), f"{prefix}{k}.")
        ]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [
            d
            for i, (a, b) in enumerate(zip(old, new, strict=True))
            for d in differences(a, b, f"{prefix}{i}.")
        ]
    return [] if old == new else [(prefix[:-1], old, new)]


def write_record(workdir: Path, config: TrainConfig, needs=()) -> None:
    """Writes ``workdir/config.json``: ``to_json(config)`` and ``"plugins"``, the plugins
    the run needs (``needs`` and ``plugins.needed(config.model)``), atomically."""
    names = list(dict.fromkeys((*needs, *plugins.needed(config.model))))
    # A crash leaves the old record or the new one, never half of one.
    write_atomic(
        Path(workdir) / RECORD, json.dumps({**to_json(config), "plugins": names}, indent=2) + "\n"
    )


def read_record(workdir: Path) -> tuple[TrainConfig, tuple[str, ...]]:
    """``(config, plugins)`` of the run in ``workdir``; its plugins are imported first.

    Raises:
      ValueError: in one line naming ``config.json``: not valid JSON, a recorded
        plugin that cannot be imported, a bad value, or a field of the result
        (``RESULT_FIELDS``) missing (a default would stand in for a value never
        recorded).
    """
    path = Path(workdir) / RECORD
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: expected a readable run record, got {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}: expected a JSON object of config fields, got invalid JSON ({e}); "
            "restore it from a copy, or use a new workdir"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of config fields, got {data!r}")
    needs = data.pop("plugins", [])
    if not isinstance(needs, list) or not all(isinstance(n, str) for n in needs):
        raise ValueError(f"{path}: expected 'plugins' to be a list of names, got {needs!r}")
    plugins.load(needs, field=f"{path} plugins")
    try:
        config = from_json(TrainConfig, data)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None
    missing = [m for m in _missing(to_json(config), data, RESULT_FIELDS) if m not in ADDED_FIELDS]
    if missing:
        raise ValueError(
            f"{path}: expected every field of the run's result, missing {', '.join(missing[:4])}"
            f"{' and more' if len(missing) > 4 else ''} (restore it, or use a new workdir)"
        )
    return config, tuple(needs)


def _missing(full, data, keys, prefix: str = "") -> list[str]:
    """Dotted names of the fields under ``keys`` of ``full`` (a ``to_json`` tree) ``data`` lacks."""
    out = []
    for key in keys:
        if key not in data:
            out.append(prefix + key)
            continue
        a, b = full[key], data[key]
        if isinstance(a, dict) and isinstance(b, dict):
            out += _missing(a, b, list(a), f"{prefix}{key}.")
        elif isinstance(a, list) and isinstance(b, list):
            for i, (x, y) in enumerate(zip(a, b, strict=False)):
                if isinstance(x, dict) and isinstance(y, dict):
                    out += _missing(x, y, list(x), f"{prefix}{key}.{i}.")
    return out


def _with_horizon(config: TrainConfig) -> TrainConfig:
    optim = dataclasses.replace(config.optim, decay_steps=config.optim.horizon(config.steps))
    return dataclasses.replace(config, optim=optim)


class Resume(NamedTuple):
    """What ``check_resume`` found: the config to run, whether the run grows, its plugins."""

    config: TrainConfig  # with the data's fingerprint (and a pinned horizon if it grows)
    extended_from: int | None  # the recorded steps when ``steps`` grows, else None
    plugins: tuple[str, ...]  # what the record lists: ``write_record(workdir, config, plugins)``


def check_resume(workdir: Path, config: TrainConfig, *, adopt: bool = False) -> Resume:
    """The config to resume ``workdir``'s run under, and the recorded steps if it grows.

    A run's identity is its recorded config plus the fingerprint of its data
    (``train.tasks.data_fingerprint``: the corpus's files, or the synthetic
    task's settings). It cannot resume under a config that changes its
    result, nor on other data, with one exception: ``steps`` may grow, which
    continues the run. The schedule's horizon (``optim.decay_steps``) is then
    pinned to the recorded one, so the steps already taken keep their learning
    rates and the result equals an uninterrupted run of the extended config.

    Args:
      workdir: the run's folder.
      config: the config asked for.
      adopt: resume checkpoints whose ``config.json`` is gone under ``config``
        (refused otherwise: nothing would say which config and data they are of).

    Nothing is written: the caller records the run (``write_record``) once
    its checkpoints have been read (a refused restore leaves the record as it
    was), and only process 0 does.

    Returns:
      A ``Resume``.

    Raises:
      ValueError: in one line, naming the differing fields (or the data, or the
        missing record) and the way out.
    """
    path = workdir / RECORD
    extended_from, needs = None, ()
    # make_task refuses a config pinned to other data than what is there now.
    config = _with_fingerprint(config, make_task(config.task).fingerprint)
    if path.exists():
        old, needs = read_record(workdir)
        if old.task.fingerprint not in (None, config.task.fingerprint):
            raise ValueError(
                f"workdir: {str(workdir)!r} holds a run of other data (recorded "
                f"{old.task.fingerprint[:16]}, now {config.task.fingerprint[:16]}: "
                f"{_data_name(config.task)} changed); restore the recorded data, or use a new "
                "workdir for a run on this data"
            )
        old = _with_fingerprint(old.with_task_vocab(), config.task.fingerprint)  # None: older
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
    elif saved_steps(workdir) and not adopt:
        raise ValueError(
            f"workdir: {str(workdir)!r} holds checkpoints (steps {saved_steps(workdir)}) but no "
            f"{RECORD}, so nothing says which config and data they are of; restore {RECORD}, "
            "use a new workdir, or resume them under this config with --adopt-checkpoints"
        )
    return Resume(config, extended_from, tuple(dict.fromkeys((*needs, *plugins.loaded()))))


def _with_fingerprint(config: TrainConfig, fingerprint: str) -> TrainConfig:
    return dataclasses.replace(
        config, task=dataclasses.replace(config.task, fingerprint=fingerprint)
    )


def _data_name(task: TaskConfig) -> str:
    if task.name != "bytes":
        return "the task config"
    return "the standard library's files" if task.data is None else f"the files under {task.data!r}"
