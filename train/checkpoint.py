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

Every checkpoint is verifiable: ``save`` records a fingerprint of each array
in the checkpoint's metadata (two sums of its bits as 32-bit words, one
weighted by position, computed where the array lives), and ``restore``
recomputes them on the arrays it read and raises ``CorruptCheckpoint`` naming
the step and the array on any difference: a flipped byte changes one word,
hence both sums. ``restore_newest`` falls back to the newest checkpoint that
reads and verifies, moving the broken ones aside (``corrupt/``) and saying so.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from train.fingerprints import fingerprints

__all__ = [
    "CheckpointMismatch",
    "CheckpointWriteError",
    "Checkpointer",
    "CorruptCheckpoint",
    "fingerprints",
    "load_state",
    "snapshot",
]


class CorruptCheckpoint(ValueError):
    """A checkpoint that cannot be read, or whose arrays differ from what was saved."""

    def __init__(self, step: int, where: str, reason: str):
        self.step, self.where, self.reason = step, where, reason
        super().__init__(f"checkpoint {step} ({where}): {reason}")


# Free space a save leaves beside the checkpoint's estimated size (orbax's own files).
MARGIN_BYTES = 1 << 20
# Below this many times a save's size free, saves are written synchronously.
TIGHT = 4


class CheckpointMismatch(ValueError):
    """A checkpoint that reads, of other arrays than the config builds: another run's.

    Never moved aside (it is intact): the caller's config is what is wrong.
    """


class CheckpointWriteError(ValueError):
    """A checkpoint that could not be written (a full disk, a read-only folder)."""


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
        """Saves ``tree`` (a ``snapshot``) and the JSON-able ``meta`` as checkpoint ``step``.

        The previous write is finished first, and the folder's free space is
        checked against the checkpoint's size: a write that would fill the
        disk is refused before it starts (orbax's writer threads meeting a full
        disk half way print hundreds of lines, and fail a later call).

        Raises:
          CheckpointWriteError: this write, or the previous one, failed or would
            not fit (one line naming the folder, the step and the newest saved step).
        """
        # A copy: an asynchronous save serializes ``meta`` later, in another thread, by
        # which time the caller may have changed the lists in it (the loop's window of
        # per-step losses grows with the next step).
        meta = json.loads(json.dumps(meta))
        meta["fingerprints"] = fingerprints(_drop_empty(tree))
        self.wait()
        tight = self._check_space(step, tree, meta)
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(_drop_empty(tree)), meta=ocp.args.JsonSave(meta)
        )
        # Where space is tight, the write is finished here with stderr held back, so a
        # disk that fills meanwhile is one line rather than the writer threads' reports.
        quiet = _stderr_kept_unless_failed() if tight else contextlib.nullcontext([])
        with quiet as failed:
            try:
                self._manager.save(step, args=args, force=True)
                if tight:
                    self._manager.wait_until_finished()
            except Exception as e:
                if not _is_write_failure(e):
                    raise
                failed.append(e)
        if failed:
            self.refresh()
            raise self._write_error(step, failed[0]) from None

    def _check_space(self, step: int, tree, meta) -> bool:
        """Refuses a save the folder's free space cannot hold (with a margin); returns
        whether space is tight (less than ``TIGHT`` times what the save needs)."""
        newest = self.latest_step()
        if newest is not None:  # its arrays, orbax's files and a shorter meta than this one's
            size = _folder_bytes(self.directory / str(newest))
        else:  # the first: its arrays (orbax's own files are in the margin)
            size = sum(int(np.asarray(x).nbytes) for x in jax.tree.leaves(_drop_empty(tree)))
        need = int((size + len(json.dumps(meta))) * 1.1) + MARGIN_BYTES
        free = shutil.disk_usage(self.directory).free
        if free < need:
            raise self._write_error(
                step, OSError(errno.ENOSPC, f"{free} bytes free, a checkpoint needs about {need}")
            )
        return free < TIGHT * need

    def _write_error(self, step: int, e: Exception) -> CheckpointWriteError:
        full = " (the disk is full)" if _disk_full(e) else ""
        reason = e.strerror if isinstance(e, OSError) and e.strerror else _first_line(e)
        return CheckpointWriteError(
            f"checkpoints: could not save step {step} in {str(self.directory)!r}{full}: "
            f"{reason}; the newest saved step is {_step_or_none(self.latest_step())}: free space "
            "or fix the folder, then run the same command to resume from it"
        )

    def restore(self, step: int, target: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Reads checkpoint ``step`` into the structure of ``target`` (a fresh ``snapshot``).

        The arrays land with ``target``'s shardings, whatever the mesh they were
        saved from: a target laid out on another mesh reshards the checkpoint.

        Returns:
          ``(tree, meta)``.

        Raises:
          CorruptCheckpoint: the checkpoint cannot be read (a missing or truncated
            file, invalid metadata), or an array's fingerprint differs from the
            one recorded at save time.
          CheckpointMismatch: it reads, but holds other arrays than ``target``
            (another config's run; never moved aside).
        """
        where = str(self.directory / str(step))
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _drop_empty(target))
        # The metadata read is inside the hold too: on a broken checkpoint its abandoned
        # reads print tracebacks as they finish.
        with _stderr_kept_unless_failed() as failed:
            try:
                mismatch = self._shape_mismatch(step, where, abstract)
                if mismatch is not None:
                    raise mismatch
                out = self._manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
                    ),
                )
                meta, state = out["meta"], out["state"]
                if not isinstance(meta, dict):
                    raise ValueError(f"metadata: expected a JSON object, got {type(meta).__name__}")
            except (KeyboardInterrupt, SystemExit, CheckpointMismatch):
                raise
            except Exception as e:  # orbax and tensorstore raise many kinds: all mean unreadable
                failed.append(e)
        if failed:
            raise CorruptCheckpoint(step, where, f"unreadable: {_first_line(failed[0])}")
        recorded = meta.get("fingerprints")
        if recorded is not None:  # checkpoints of older versions carry none
            now = fingerprints(state)
            bad = [name for name in recorded if now.get(name) != recorded[name]]
            bad += [name for name in now if name not in recorded]
            if bad:
                raise CorruptCheckpoint(
                    step, where, f"array {bad[0]} differs from what was saved ({len(bad)} in all)"
                )
        tree = {**{k: {} for k in target}, **state}
        return tree, {k: v for k, v in meta.items() if k != "fingerprints"}

    def _shape_mismatch(self, step: int, where: str, abstract) -> CheckpointMismatch | None:
        """A ``CheckpointMismatch`` if the checkpoint's recorded arrays are not the
        target's (names, shapes, dtypes), else None. Unreadable metadata gives None: the
        restore then reports the checkpoint as corrupt."""
        try:
            state = self.directory / str(step) / "state"
            saved = _shapes(ocp.StandardCheckpointHandler().metadata(state))
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception:
            return None
        wanted = _shapes(abstract)
        if saved == wanted:
            return None
        names = [n for n in {**wanted, **saved} if saved.get(n) != wanted.get(n)]
        got = lambda n, d: "none" if n not in d else f"{d[n][1]}{list(d[n][0])}"  # noqa: E731
        return CheckpointMismatch(
            f"checkpoint {step} in {where!r} holds other arrays than this config builds "
            f"({names[0]}: saved {got(names[0], saved)}, config gives {got(names[0], wanted)}; "
            f"{len(names)} differ): it is another config's run, resume it with that config"
        )

    def restore_newest(
        self, target: dict[str, Any], report: Callable[[str], None]
    ) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
        """The newest checkpoint that reads and verifies: ``(step, tree, meta)``, or None
        when there is no checkpoint at all.

        Each broken one on the way is reported (``report``) and moved aside to
        ``<workdir>/corrupt/<step>-<time>``, so the run resumes from the intact
        one before it and never meets the broken one again.

        Raises:
          CorruptCheckpoint: checkpoints exist and none verifies (one line
            saying what to delete).
        """
        steps = self.all_steps()
        problems = []
        for step in reversed(steps):
            try:
                tree, meta = self.restore(step, target)
            except CorruptCheckpoint as e:
                problems.append(e)
                moved = self._move_aside(step)
                report(f"{e}; moved aside to {moved}" if moved else str(e))
                continue
            if problems:
                report(f"resuming from checkpoint {step}, the newest that reads and verifies")
            return step, tree, meta
        if problems:
            raise CorruptCheckpoint(
                problems[0].step,
                problems[0].where,
                f"{problems[0].reason}, and no older checkpoint verifies either; delete "
                f"{self.directory} (and metrics.jsonl) to start the run over",
            )
        return None

    def _move_aside(self, step: int) -> str | None:
        if jax.process_index() != 0:  # one process moves the shared folder; the others skip it
            return None
        source = self.directory / str(step)
        target = self.directory.parent / "corrupt" / f"{step}-{int(time.time())}"
        try:
            target.parent.mkdir(exist_ok=True)
            shutil.move(source, target)
        except OSError:
            return None
        self.refresh()
        return str(target)

    def saving(self) -> bool:
        """Whether a background write is in progress."""
        return self._manager.is_saving_in_progress()

    def wait(self) -> None:
        """Blocks until background writes are on disk.

        Raises:
          CheckpointWriteError: a background write failed (one line naming the folder).
        """
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            if not _is_write_failure(e):
                raise
            self.refresh()
            raise self._write_error(self._pending_step(), e) from None

    def _pending_step(self) -> int | str:
        """The step of the write that failed: the newest folder still temporary."""
        tmp = [p.name.split(".")[0] for p in self.directory.glob("*.orbax-checkpoint-tmp*")]
        steps = [int(n) for n in tmp if n.isdigit()]
        return max(steps) if steps else "in progress"

    def close(self) -> CheckpointWriteError | None:
        """Finishes pending writes and releases the manager.

        Returns (never raises) the ``CheckpointWriteError`` of a pending write
        that failed, so a caller closing in a ``finally`` does not replace the
        error that brought it there; None when every write is on disk.
        """
        failed = None
        try:
            self.wait()
        except CheckpointWriteError as e:
            failed = e
        try:
            self._manager.close()
        except Exception as e:
            if not _is_write_failure(e):
                raise
            failed = failed or self._write_error(self._pending_step(), e)
        return failed


@contextlib.contextmanager
def _stderr_kept_unless_failed(grace_s: float = 0.3):
    """Holds back what is written to the process's stderr (file descriptor 2) in the block.

    The block appends an exception to the yielded list if it failed. Then the
    held text is dropped: when one read of a checkpoint fails, orbax abandons
    the others, and their threads and coroutines print tracebacks of the same
    error as they finish (a closed event loop, "Exception ignored in" reports),
    for up to ``grace_s`` seconds, which the caller reports in one line. If the
    block succeeded, the held text is written out as it was.
    """
    failed: list[BaseException] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield failed
            if failed:
                time.sleep(grace_s)  # the abandoned reads finish and print here
                gc.collect()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if not failed:
                held.seek(0)
                os.write(2, held.read())


def _shapes(tree) -> dict[str, tuple[tuple, str]]:
    """``{path: (shape, dtype)}`` of a tree of arrays or of orbax's array metadata."""
    return {
        jax.tree_util.keystr(path, simple=True, separator="."): (
            tuple(x.shape),
            str(np.dtype(x.dtype)),
        )
        for path, x in jax.tree_util.tree_leaves_with_path(tree)
    }


def _is_write_failure(e: BaseException) -> bool:
    """Whether an error from orbax's writers is the file system's (tensorstore reports an
    OS error as a ``ValueError`` naming its code)."""
    return isinstance(e, OSError) or "os_error_code" in str(e) or _disk_full(e)


def _disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return True
    text = str(e)
    return "No space left on device" in text or f"os_error_code='{errno.ENOSPC}'" in text


def _step_or_none(step: int | None) -> str:
    return "none" if step is None else str(step)


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _first_line(e: BaseException) -> str:
    """The first line of an error's message (tensorstore's run to a hundred), at most 300 chars."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = text.split(" See full TensorStore details")[0]  # a repr of the whole spec follows
    return f"{type(e).__name__}: {text[:300]}"
