"""Ctrl-C before (or around) the training loop: one line, exit status 130, never a crash.

Python turns SIGINT into ``KeyboardInterrupt`` wherever the main thread is,
including inside callbacks that JAX and XLA run while importing or compiling,
where it is swallowed (``Exception ignored in ...``: the run trains on) or
leaves native code half way (a segfault). The command lines therefore call
``exit_on_sigint`` first, before importing JAX: until the training loop
installs its own handler (``train.loop``: finish the step, save, stop), a
Ctrl-C prints one line and ends the process at once. Nothing saved is lost:
before the loop a run only reads its checkpoints, and the files it writes
(``config.json``) are written atomically. Imports nothing beyond the standard
library, so it can run before everything else.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

__all__ = ["EXIT_INTERRUPTED", "active", "exit_on_sigint"]

EXIT_INTERRUPTED = 130  # the shell's status for a process stopped by SIGINT

_program: list[str] = []  # the command line that called exit_on_sigint, if one did


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

    def handler(signum, frame):
        if before is not None:
            before()
        sys.stderr.write(
            f"{what}: interrupted; no checkpoint was being written, nothing saved was lost "
            "(run the same command to start or resume)\n"
        )
        sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED)

    signal.signal(signal.SIGINT, handler)
