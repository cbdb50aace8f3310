"""A run's folder: one process at a time, checked for writing before anything starts.

``lock(workdir)`` holds ``workdir/.lock`` (an advisory ``flock``, released by the
kernel when the process ends however it ends, SIGKILL included) for as long as
a run trains: a second process on the same folder is refused in one line
naming the holder's pid, instead of both writing checkpoints and metrics.
``check_writable`` tries a real write, so a read-only folder is one line before
training, not an error (or a hang in a checkpoint writer's threads) after it.
``write_atomic`` writes a file so that a crash leaves the old or the new one.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; runs are not guarded there
    fcntl = None

__all__ = ["LOCK", "check_writable", "lock", "saved_steps", "write_atomic"]

LOCK = ".lock"


def check_writable(folder: str | Path, field: str) -> Path:
    """Creates ``folder`` if needed and writes and removes a probe file in it.

    Raises:
      ValueError: in one line naming ``field``, the folder and the reason.
    """
    folder = Path(folder)
    probe = folder / f".write-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(
            f"{field}: expected a folder this process can write, got {str(folder)!r} "
            f"({e.strerror or e})"
        ) from None
    return folder


def write_atomic(path: str | Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file and a rename.

    Raises:
      ValueError: the file cannot be written (one line naming it; a full disk
        says so), with ``path`` left as it was.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        full = " (the disk is full)" if e.errno == errno.ENOSPC else ""
        raise ValueError(f"{path}: could not be written{full}: {e.strerror or e}") from None


@contextlib.contextmanager
def lock(workdir: str | Path):
    """Holds ``workdir/.lock`` while the block runs.

    Raises:
      ValueError: another process holds it (naming its pid).
    """
    path = Path(workdir) / LOCK
    if fcntl is None:
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise ValueError(
                f"workdir: expected a folder no other process is training in, got "
                f"{str(workdir)!r} (in use by pid {holder}; wait for it to finish, or use "
                "another workdir)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def saved_steps(workdir: str | Path) -> list[int]:
    """Steps of the checkpoint folders under ``workdir/checkpoints`` (sorted), read
    from their names alone: whether a run has saved anything, without opening it."""
    folder = Path(workdir) / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit())
