"""Checkpoints of a training run: an orbax ``CheckpointManager`` over pure pytrees.

A checkpoint holds the model's parameters, its RNG streams (if it has any),
the optimizer state (which includes the step count the schedule reads), the
loop's step and a JSON record of the config. Modules are reduced to pure
nested dicts of arrays with ``nnx.state`` / ``nnx.to_pure_dict`` and saved with
orbax's ``StandardSave``; restoring reads them back into the same structure
(``StandardRestore`` with the freshly initialized state as the target, so
shapes and dtypes are checked) and writes them into the live modules with
``nnx.update``. The arrays come back bit for bit, which is what makes resume
exact.

orbax writes into a temporary folder and renames it when complete, so a
process killed mid-save leaves the previous checkpoint as the latest one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

__all__ = ["Checkpointer", "load_state", "snapshot"]


def _pure(state: nnx.State) -> dict:
    """``nnx.State`` as a nested dict with string keys and plain arrays.

    Keys become strings because orbax stores them that way (list indices of
    ``nnx.List`` layers included); typed PRNG keys become their raw ``uint32``
    data, which orbax can store.
    """

    def convert(tree):
        if isinstance(tree, dict):
            return {str(k): convert(v) for k, v in tree.items()}
        if jnp.issubdtype(getattr(tree, "dtype", np.float32), jax.dtypes.prng_key):
            return jax.random.key_data(tree)
        return tree

    return convert(nnx.to_pure_dict(state))


def _unpure(state: nnx.State, pure: dict) -> nnx.State:
    """``state`` with its arrays replaced by those of ``pure`` (the inverse of ``_pure``)."""

    def replace(variable, value):
        old = variable.get_value()
        if jnp.issubdtype(old.dtype, jax.dtypes.prng_key):
            value = jax.random.wrap_key_data(value, impl=jax.random.key_impl(old))
        if value.shape != old.shape or value.dtype != old.dtype:
            raise ValueError(
                f"checkpoint: expected an array of shape {old.shape} {old.dtype}, "
                f"got {value.shape} {value.dtype}"
            )
        return variable.replace(value)

    nnx.replace_by_pure_dict(state, pure, replace)
    return state


def snapshot(model: nnx.Module, optimizer: nnx.Optimizer, step: int) -> dict[str, Any]:
    """The pure pytree a checkpoint stores for ``(model, optimizer)`` after ``step`` updates.

    Returns:
      ``dict(params, rngs, opt, step)``: parameters, the model's RNG streams
      (empty when it has none), the optimizer state, and the step as an int64 scalar.
    """
    return {
        "params": _pure(nnx.state(model, nnx.Param)),
        "rngs": _pure(nnx.state(model, nnx.RngState)),
        "opt": _pure(nnx.state(optimizer, nnx.optimizer.OptState)),
        "step": np.asarray(step, np.int64),
    }


def load_state(model: nnx.Module, optimizer: nnx.Optimizer, tree: dict[str, Any]) -> int:
    """Writes a ``snapshot`` tree into ``model`` and ``optimizer``; returns its step."""
    nnx.update(model, _unpure(nnx.state(model, nnx.Param), tree["params"]))
    if tree["rngs"]:
        nnx.update(model, _unpure(nnx.state(model, nnx.RngState), tree["rngs"]))
    nnx.update(optimizer, _unpure(nnx.state(optimizer, nnx.optimizer.OptState), tree["opt"]))
    return int(tree["step"])


def _drop_empty(tree):
    """orbax does not store empty dicts; the restore target must not ask for them."""
    if isinstance(tree, dict):
        return {k: _drop_empty(v) for k, v in tree.items() if not (isinstance(v, dict) and not v)}
    return tree


class Checkpointer:
    """Saves and restores ``snapshot`` trees under ``workdir/checkpoints``, keeping the last k.

    Args:
      workdir: the run's folder.
      keep: how many of the most recent checkpoints to keep (k >= 1).
      async_save: write in a background thread (the arrays are copied to host
        memory before ``save`` returns, so training may continue at once).
    """

    def __init__(self, workdir: str | Path, *, keep: int = 2, async_save: bool = True):
        if keep < 1:
            raise ValueError(f"keep: expected an int >= 1, got {keep}")
        self.directory = Path(workdir).absolute() / "checkpoints"
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                create=True,
                enable_async_checkpointing=async_save,
                # A process killed mid-save leaves a temporary folder; drop it on restart.
                cleanup_tmp_directories=True,
            ),
        )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def refresh(self) -> None:
        """Re-reads the steps on disk (after an interrupted ``save``, the manager's own
        list can miss a checkpoint that its background write then completed)."""
        self._manager.reload()

    def all_steps(self) -> list[int]:
        """Steps of the checkpoints on disk, oldest first."""
        return sorted(self._manager.all_steps())

    def save(self, step: int, tree: dict[str, Any], meta: dict[str, Any]) -> None:
        """Saves ``tree`` (a ``snapshot``) and the JSON-able ``meta`` as checkpoint ``step``."""
        # A copy: an asynchronous save serializes ``meta`` later, in another thread, by
        # which time the caller may have changed the lists in it (the loop's window of
        # per-step losses grows with the next step).
        meta = json.loads(json.dumps(meta))
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(_drop_empty(tree)), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )

    def restore(self, step: int, target: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Reads checkpoint ``step`` into the structure of ``target`` (a fresh ``snapshot``).

        The arrays land with ``target``'s shardings, whatever the mesh they were
        saved from: a target laid out on another mesh reshards the checkpoint.

        Returns:
          ``(tree, meta)``.
        """
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _drop_empty(target))
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
        tree = {**{k: {} for k in target}, **out["state"]}
        return tree, out["meta"]

    def wait(self) -> None:
        """Blocks until background writes are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finishes pending writes and releases the manager."""
        self._manager.close()
