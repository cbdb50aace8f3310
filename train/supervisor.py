"""A job of several processes: ``python -m train`` trains in a child process and speaks for it.

When one process of a job stops (killed, crashed, a typo in its flags), every
other process must end too, with one line saying why. Python sees most of
these ends (a collective fails: ``train.distributed.lost_peer``), but not all:
JAX's coordination-service client aborts the process from a thread of its own
(``LOG(FATAL)``: a fatal log, a stack trace, status 134) when it loses the job's
coordinator (process 0), racing Python's error path, and when the job has not
formed within the join timeout. ``jax.distributed.initialize`` takes no
callback to stop that. So in a job of several processes ``python -m train``
supervises: it runs the training in a child process (the same command, marked
by ``ATTNLAB_TRAIN_CHILD``) and

- relays the child's stdout as is and its stderr line by line, holding back
  C++ log lines (glog's ``E1204 12:00:00.000000 ...``, a check failure's stack
  trace) for ``HOLD_S`` seconds: those followed by the child's end are the
  noise of its dying, not news, and are dropped; others come through late;
- forwards SIGINT and SIGTERM to it (the child has a process group of its own,
  so a Ctrl-C at the terminal reaches it once), and takes it along when killed
  (``PR_SET_PDEATHSIG``): killing the command stops the process of the job;
- when it aborts, prints one ``error:`` line naming what happened and exits
  with status 3 (``EXIT_PEER_LOST``); the log held back goes to a file the line names.

The processes of a job wait ``ATTNLAB_JOIN_TIMEOUT`` seconds (60 by default) for
each other to join, then each ends naming the process missing. Single-process
runs have no child. Imports only the standard library: it runs before JAX is
imported.
"""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping

__all__ = [
    "CHILD",
    "EXIT_PEER_LOST",
    "JOIN_TIMEOUT",
    "Relay",
    "join_timeout",
    "processes",
    "supervise",
    "verdict",
]

CHILD = "ATTNLAB_TRAIN_CHILD"  # set in the child's environment: it trains, never supervises
JOIN_TIMEOUT = "ATTNLAB_JOIN_TIMEOUT"
JOIN_TIMEOUT_S = 60  # long enough for hosts that start a little apart, short enough to wait out
# ``python -m train``'s exit status when the job lost a process (``train.distributed``'s too).
EXIT_PEER_LOST = 3
# A log line is let through this long after it came, unless the child ends first: the
# fatal logs of a lost coordinator come a few milliseconds before the abort.
HOLD_S = 2.0
SAVED = (
    "the checkpoints saved are complete: restart every process with the same command "
    "to resume from the last one"
)

# glog's prefix (``F1204 00:11:34.327663   10581 client.h:80] ``) and a crash's report.
_LOG = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")
_CRASH = re.compile(rb"^(\*\*\* |\s*@ +0x|PC: @|Fatal Python error)")
_FATAL = re.compile(rb"^(F\d{4} \d\d:|\*\*\* )")  # after these, only the end comes
# The coordinator's connection went (gRPC's UNAVAILABLE is status 14).
_NO_COORDINATOR = re.compile(
    r"Socket closed|Connection (reset|refused)|failed to connect|grpc_status:14"
)


def _count(environ: Mapping[str, str], index: str, count: str) -> tuple[int | None, int] | None:
    n, i = environ.get(count, ""), environ.get(index, "")
    if not n.isdigit() or int(n) < 2:
        return None
    return (int(i) if i.isdigit() and int(i) < int(n) else None), int(n)


def processes(environ: Mapping[str, str] | None = None) -> tuple[int | None, int] | None:
    """``(this process's index or None, process count)`` of a job of several processes.

    The same environments as ``train.distributed.multihost_settings`` (which
    imports JAX): an explicit launch, Slurm, Open MPI, a Cloud TPU pod slice.
    None for a single process, and for an explicit launch whose variables are
    malformed (the run itself reports them, in one line).
    """
    environ = os.environ if environ is None else environ
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        job = _count(environ, "JAX_PROCESS_ID", "JAX_NUM_PROCESSES")
        return job if job is not None and job[0] is not None else None
    if "SLURM_JOB_ID" in environ and (job := _count(environ, "SLURM_PROCID", "SLURM_NTASKS")):
        return job
    if "OMPI_MCA_orte_hnp_uri" in environ and (
        job := _count(environ, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
    ):
        return job
    hosts = [h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(hosts) > 1:
        worker = environ.get("TPU_WORKER_ID", "")
        return (int(worker) if worker.isdigit() else None), len(hosts)
    return None


def join_timeout(environ: Mapping[str, str] | None = None) -> int:
    """Seconds the processes of a job wait for each other to join: ``ATTNLAB_JOIN_TIMEOUT``
    or 60 (``jax.distributed``'s own default, 300, keeps a job whose process died at
    its start waiting five minutes)."""
    environ = os.environ if environ is None else environ
    value = environ.get(JOIN_TIMEOUT)
    if value is None:
        return JOIN_TIMEOUT_S
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError(f"{JOIN_TIMEOUT}: expected a whole number of seconds >= 1, got {value!r}")
    return int(value)


def wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this ``python -m train`` supervises: a job of several processes, not the
    child, on Linux (the child's end with its parent needs ``prctl``)."""
    environ = os.environ if environ is None else environ
    return sys.platform == "linux" and CHILD not in environ and processes(environ) is not None


def supervise(argv: list[str]) -> int:
    """Runs ``python -m train ARGV`` as a child; returns the exit status to leave with.

    That is the child's own status, with its own lines; 3 and one line when it
    aborted (the job lost a process, or never formed); 128 + N and one line when
    a signal N ended it. A signal this process forwarded and the child died of
    ends this process the same way (the shell sees what it would without a child).
    """
    index, count = processes()
    child = _spawn(argv)
    forwarded = set()

    def forward(signum, frame):
        forwarded.add(signum)
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, forward)
    relay = Relay(_writer(2))
    _pump(child, relay)
    status = child.wait()
    if -status in forwarded:  # a signal the child has no handler for: nothing to add
        relay.end(drop=False)
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        return 128 - status  # where the signal is blocked
    aborted = status in (134, -signal.SIGABRT)
    held = relay.end(drop=aborted or status == EXIT_PEER_LOST)
    if not aborted and status >= 0:
        return status  # its own status, with its own line if it had one
    if aborted and relay.said_error:  # Python's error path printed its line, then the abort
        return EXIT_PEER_LOST
    line = (
        verdict(b"".join(held).decode(errors="replace"), index, count, join_timeout())
        if aborted
        else f"{_who(index, count)} was ended by {signal.Signals(-status).name}; {SAVED}"
    )
    if held:
        line += f" (JAX's log: {_keep(held, index)})"
    _writer(2)(f"error: {line}\n".encode())
    return EXIT_PEER_LOST if aborted else 128 - status


def verdict(log: str, index: int | None, count: int, timeout: int) -> str:
    """What an aborted process of a job says (after ``error: ``), from the log it left.

    Args:
      log: the C++ log held back, ending in the abort.
      index: the process (None where the environment does not say); count: the processes.
      timeout: the join timeout, in seconds.
    """
    who = _who(index, count)
    if "RegisterTask" in log:  # it never joined: the coordination service's registration
        if count == 2 and index is not None:  # both joined the one that is left, if both came
            missing = f"process {1 - index} did not join"
        else:
            missing = f"processes 0 to {count - 1} were expected and not all joined"
        return (
            f"{who}: the job did not form within {timeout} s ({JOIN_TIMEOUT}): {missing}; "
            f"start every process with the same command, or set {JOIN_TIMEOUT} to wait longer"
        )
    if index != 0 and _NO_COORDINATOR.search(log):
        return f"{who} lost the job's coordinator (process 0 stopped); {SAVED}"
    tasks = sorted({int(t) for t in re.findall(r"/task:(\d+)", log)} - {index})
    if tasks:
        return f"{who}: process {tasks[0]} of the job stopped, so JAX ended this one; {SAVED}"
    fatal = re.search(r"^F\d{4} [^\]]*\] ([^.\n]*)", log, re.MULTILINE)
    why = fatal.group(1) if fatal else "an abort"
    return f"{who}: JAX's runtime stopped it ({why}); another process may have stopped; {SAVED}"


class Relay:
    """The child's stderr, line by line: C++ log lines (and all after one) wait ``HOLD_S``.

    Args:
      write: takes the bytes to show.
      hold_s: how long a log line waits.
    """

    def __init__(self, write: Callable[[bytes], object], hold_s: float = HOLD_S):
        self.write, self.hold_s = write, hold_s
        self.partial = b""
        self.held: list[tuple[float, bytes]] = []
        self.fatal = False  # a fatal log came: the child is aborting, nothing more is news
        self.said_error = False  # the child printed its own ``error:`` line

    def feed(self, data: bytes, now: float) -> None:
        *lines, self.partial = (self.partial + data).split(b"\n")
        for line in lines:
            self._line(line + b"\n", now)
        self.release(now)

    def _line(self, line: bytes, now: float) -> None:
        self.said_error |= line.startswith(b"error:")
        self.fatal |= bool(_FATAL.match(line))
        if self.held or _is_log(line):  # in order: whatever follows a held line waits too
            self.held.append((now, line))
        else:
            self.write(line)

    def release(self, now: float) -> None:
        """Lets through the lines held ``hold_s`` (none after a fatal log)."""
        while self.held and not self.fatal and now - self.held[0][0] >= self.hold_s:
            self.write(self.held.pop(0)[1])
        # A line still being written (a progress bar redrawn after "\r") goes at once.
        if self.partial and not self.held and not _is_log(self.partial.lstrip(b"\r")):
            self.write(self.partial)
            self.partial = b""

    def due(self, now: float) -> float | None:
        """Seconds until a held line is let through, None if none will be."""
        if not self.held or self.fatal:
            return None
        return max(0.0, self.held[0][0] + self.hold_s - now)

    def end(self, drop: bool) -> list[bytes]:
        """The child ended: lets through what is held, or with ``drop`` only its ``error:``
        lines (the rest, the noise of its dying, is returned)."""
        if self.partial:
            self._line(self.partial, float("inf"))
            self.partial = b""
        dropped = []
        for _, line in self.held:
            if drop and not line.startswith(b"error:"):
                dropped.append(line)
            else:
                self.write(line)
        self.held = []
        return dropped


def _who(index: int | None, count: int) -> str:
    return f"process {index} of {count}" if index is not None else f"a process of {count}"


def _is_log(line: bytes) -> bool:
    return bool(_LOG.match(line) or _CRASH.match(line))


def _spawn(argv: list[str]) -> subprocess.Popen:
    """The child: this command, in a process group of its own, killed when this process dies."""
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def die_with_parent():  # in the child, between fork and exec
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    # The interpreter's own options (-X, -W) too, as multiprocessing passes them on.
    command = [sys.executable, *subprocess._args_from_interpreter_flags(), "-m", "train", *argv]
    return subprocess.Popen(
        command,
        env={**os.environ, CHILD: "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        process_group=0,
        preexec_fn=die_with_parent,
    )


def _pump(child: subprocess.Popen, relay: Relay) -> None:
    """Copies the child's stdout to ours and its stderr through ``relay`` until both close."""
    out = _writer(1)
    with selectors.DefaultSelector() as selector:
        selector.register(child.stdout, selectors.EVENT_READ, out)
        selector.register(child.stderr, selectors.EVENT_READ, None)
        while selector.get_map():
            for key, _ in selector.select(relay.due(time.monotonic())):
                data = os.read(key.fd, 1 << 16)
                if not data:
                    selector.unregister(key.fileobj)
                elif key.data is out:
                    out(data)
                else:
                    relay.feed(data, time.monotonic())
            relay.release(time.monotonic())


def _writer(fd: int) -> Callable[[bytes], None]:
    def write(data: bytes) -> None:
        with contextlib.suppress(OSError):  # a closed terminal must not stop the relay
            while data:
                data = data[os.write(fd, data) :]

    return write


def _keep(lines: list[bytes], index: int | None) -> str:
    """Writes the log a child left at its end to a file; returns its path."""
    name = "attnlab-process-" if index is None else f"attnlab-process{index}-"
    fd, path = tempfile.mkstemp(prefix=name, suffix=".log")
    with os.fdopen(fd, "wb") as f:
        f.writelines(lines)
    return path
