"""Ctrl-C before, around and inside the training loop: one line, exit status 130, never a crash.

Python turns SIGINT into ``KeyboardInterrupt`` wherever the main thread is,
including inside callbacks that JAX and XLA run while importing or compiling,
where it is swallowed (``Exception ignored in ...``: the run trains on) or
leaves native code half way (a segfault). The command lines therefore call
``exit_on_sigint`` first, before importing JAX: until the training loop
installs its own handler (``StopOnSigint``: finish the step, save, stop,
then raise ``TrainingInterrupted``), a Ctrl-C prints one line and ends the
process at once. Nothing saved is lost:
before the loop a run only reads its checkpoints, and the files it writes
(``config.json``) are written atomically. Imports nothing beyond the standard
library, so it can run before everything else.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable

__all__ = ["EXIT_INTERRUPTED", "StopOnSigint", "TrainingInterrupted", "active", "exit_on_sigint"]

EXIT_INTERRUPTED = 130  # the shell's status for a process stopped by SIGINT

_program: list[str] = []  # the command line that called exit_on_sigint, if one did
# A copy of the process's stderr taken when a handler is installed: a message written
# while file descriptor 2 is redirected (a checkpoint restore holds back orbax's
# output) still reaches the terminal before os._exit, which flushes nothing.
_stderr_fd: list[int] = []


def _say(text: str) -> None:
    """Writes ``text`` to the stderr the process started with, unbuffered."""
    if not _stderr_fd:
        _stderr_fd.append(os.dup(2))
    with contextlib.suppress(OSError):
        os.write(_stderr_fd[0], text.encode())


def active() -> bool:
    """Whether a command line of ours set ``exit_on_sigint`` in this process."""
    return bool(_program)


def exit_on_sigint(what: str, before=None) -> None:
    """From now on (outside a training loop), SIGINT prints one line and exits with 130.

    Args:
      what: the program, for the message (``"python -m train"``).
      before: called first, e.g. to stop worker processes (whose checkpoints are
        crash-safe: a run killed at any moment resumes exactly).
    """
    if threading.current_thread() is not threading.main_thread():
        return
    _program[:] = [what]
    _say("")  # takes the copy of stderr now, before anything redirects it

    def handler(signum, frame):
        if before is not None:
            before()
        _say(
            f"{what}: interrupted; no checkpoint was being written, nothing saved was lost "
            "(run the same command to start or resume)\n"
        )
        os._exit(EXIT_INTERRUPTED)

    signal.signal(signal.SIGINT, handler)


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


class StopOnSigint:
    """Within the block, the first SIGINT only sets ``requested``; the loop reads it
    between steps, so an interrupt never lands inside a step or a checkpoint write.

    A second SIGINT stops without a new checkpoint: at once (one line, exit
    status 130) when no checkpoint is being written, else as soon as the write
    in progress is complete (``now``; the loop then raises ``TrainingInterrupted``).
    It never raises inside the step: a ``KeyboardInterrupt`` there can land in
    the middle of a compile, which crashes the process. Signal handlers can only
    be set from the main thread; elsewhere this does nothing.

    Args:
      where: the run, for the message (its workdir).
      busy: whether a checkpoint is being written.
      last_checkpoint: the newest checkpoint's step, or None.
    """

    def __init__(self, where, busy: Callable[[], bool], last_checkpoint: Callable[[], int | None]):
        self.where, self.busy, self.last_checkpoint = where, busy, last_checkpoint
        self.requested = self.now = False
        self._previous = None

    def _handler(self, signum, frame):
        if not self.requested:
            self.requested = True
            return
        if self.busy():
            self.now = True
            return
        _say(
            f"{self.where}: interrupted twice: stopped at once; the last checkpoint is "
            f"step {self.last_checkpoint()} (run the same command to resume from it)\n"
        )
        os._exit(EXIT_INTERRUPTED)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            _say("")  # the copy of stderr, taken before anything redirects it
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        return False
