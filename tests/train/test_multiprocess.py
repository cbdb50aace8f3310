"""Real processes: ``python -m train`` as 2 processes of one job on this machine.

Each process is a JAX runtime of its own with fake CPU devices, joined by
``jax.distributed`` (coordinator on 127.0.0.1, gloo collectives), as on a
cluster of hosts. The run is the tiny config with a gated linear-attention layer and a
softmax layer on ``--mesh seq=4``, so the sequence's spans, the recurrence's
state chain and the ring cross process boundaries. One process with 4 devices
is the reference: 2 processes of 2 devices train its first 2 steps (and save),
and one process of 4 devices resumes that checkpoint for the last 2 (the
reference's program, from the compilation cache); the losses and the final
parameters equal the reference's. A killed process, the coordinator (process 0)
included, makes the other exit at once with one ``error:`` line; one that never
joins (a typo in its flags) makes it exit after the join timeout, naming it.
"""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.util import rel_err

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TINY = str(Path(__file__).with_name("tiny_config.py"))
RUN = ["--config", TINY, "--no-progress", "--steps", "4", "--log-every", "1"]
RUN += ["--ckpt-every", "2", "--eval-every", "4", "--model.pattern", "linear_gated,mha"]
TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    workdir,
    processes: int,
    devices: int,
    *extra: str,
    cache=None,
    own=None,
    environ=None,
    logs=None,
) -> list[subprocess.Popen]:
    """``python -m train`` as ``processes`` processes of ``devices`` fake CPU devices each
    (compiling into ``cache``, the tests' folder, when given). ``own[i]``: process i's own
    flags; ``environ``: more variables; ``logs``: a folder for each process's stderr
    (``process{i}.err``), else a pipe."""
    port = free_port()
    procs = []
    for i in range(processes):
        env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", **(environ or {}))
        if cache is not None:
            env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
        flags = (
            f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
        )
        env["XLA_FLAGS"] = flags.strip()
        if processes > 1:
            env.update(
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes)
            )
            env["JAX_PROCESS_ID"] = str(i)
        argv = [sys.executable, "-m", "train", *RUN, "--workdir", str(workdir), *extra]
        argv += (own or {}).get(i, ())
        err = subprocess.PIPE if logs is None else (Path(logs) / f"process{i}.err").open("w")
        procs.append(
            subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        )
        if logs is not None:
            err.close()  # the process has its own copy
    return procs


def finish(procs) -> list[tuple[int, str, str]]:
    outputs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    return [(p.returncode, *out) for p, out in zip(procs, outputs, strict=True)]


def losses(workdir) -> list[float]:
    lines = (Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


def final_params(workdir) -> np.ndarray:
    """The last checkpoint's parameters as one vector (restored on this process's device)."""
    from tests.train.saved import saved_arrays
    from train.config import read_record

    cfg = read_record(Path(workdir))[0]
    saved = saved_arrays(workdir, cfg)
    names = sorted(k for k in saved if k.startswith("['params']"))
    return np.concatenate([np.ravel(saved[k]) for k in names])


def test_processes_train_and_resume_as_one_process(tmp_path, compilation_cache_dir):
    ref, job = tmp_path / "one", tmp_path / "job"
    cache = compilation_cache_dir
    for code, _, err in finish(launch(ref, 1, 4, "--mesh", "seq=4", cache=cache)):
        assert code == 0, err[-3000:]
    stop = ("--mesh", "seq=4", "--stop-at", "2")
    for code, out, err in finish(launch(job, 2, 2, *stop, cache=cache)):
        assert code == 0, err[-3000:]
        assert json.loads(out)["step"] == 2
    np.testing.assert_allclose(losses(job), losses(ref)[:2], rtol=1e-6)
    # Resumed by a job of another process count (orbax restores onto the new layout).
    for code, out, err in finish(launch(job, 1, 4, "--mesh", "seq=4", cache=cache)):
        assert code == 0, err[-3000:]
        assert json.loads(out)["step"] == 4
    np.testing.assert_allclose(losses(job), losses(ref), rtol=1e-6)
    assert rel_err(final_params(job), final_params(ref)) <= 1e-6


# No checkpoints after the first: a kill that lands in orbax's save barrier is waited out
# by the coordinator's heartbeat (~100 s), another path than these tests'.
LONG = ("--mesh", "data=2", "--steps", "100000", "--ckpt-every", "100000")


@contextlib.contextmanager
def ending(procs):
    """Kills the processes still running at the end: a failed check must not leave a job
    training (its training processes go with them)."""
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def wait_for(procs, path):
    """Until ``path`` holds something, every process still running."""
    deadline = time.monotonic() + TIMEOUT_S
    while not (path.exists() and path.read_text().strip()) and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.1)


def test_a_killed_process_stops_the_others_with_one_line(tmp_path, compilation_cache_dir):
    # Here the survivor is in its training steps' collectives, which fail at once.
    with ending(launch(tmp_path / "w", 2, 1, *LONG, cache=compilation_cache_dir)) as procs:
        wait_for(procs, tmp_path / "w" / "metrics.jsonl")
        procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        code, out, err = finish(procs[:1])[0]
        procs[1].wait()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 3 and out == "" and len(errors) == 1, err[-3000:]
    assert "another process of the job has stopped" in errors[0]
    assert time.monotonic() - killed < 60  # at once, not after the 100 s heartbeat timeout


# A C++ fatal log: glog's F lines, a check failure, the stack trace's frames.
FATAL_LOG = r"F\d{4} |\*\*\* |\s*@ +0x"


def lines_since(log: Path, offset: int) -> list[str]:
    """The non-empty lines written to ``log`` after its first ``offset`` bytes, XLA's
    warnings about its compilation cache aside (as ``test_signals.py``)."""
    text = log.read_bytes()[offset:].decode(errors="replace")
    return [line for line in text.splitlines() if line.strip() and "cpu_aot_loader" not in line]


def alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    with contextlib.suppress(OSError):
        return stat.read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    return False


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(sys.platform != "linux", reason="python -m train supervises on Linux")
@pytest.mark.parametrize("moment", ["config.json", "metrics.jsonl"])
def test_a_killed_coordinator_stops_the_others_with_one_line(
    tmp_path, compilation_cache_dir, moment
):
    """Process 0, the job's coordinator, killed while process 1 compiles its first step
    (``config.json`` is written: JAX's client aborts process 1, a fatal log and a stack
    trace) and while it trains (a collective fails, unless the abort wins the race): one
    line, and the command's training process goes with it."""
    kept = {"TMPDIR": str(tmp_path)}  # where JAX's log, held back, is kept
    job = launch(
        tmp_path / "w", 2, 1, *LONG, cache=compilation_cache_dir, environ=kept, logs=tmp_path
    )
    with ending(job) as procs:
        wait_for(procs, tmp_path / "w" / moment)
        trainer = children(procs[0].pid)
        offset = (tmp_path / "process1.err").stat().st_size
        procs[0].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        out, _ = procs[1].communicate(timeout=TIMEOUT_S)
        took = time.monotonic() - killed
        procs[0].wait()
    lines = lines_since(tmp_path / "process1.err", offset)
    assert procs[1].returncode == 3 and out == "" and len(lines) == 1, lines
    assert lines[0].startswith("error: process 1 of 2") and "Check failure" not in lines[0]
    assert took < 10, took  # at once, not after the 100 s heartbeat timeout
    assert len(trainer) == 1  # process 0's training process, which its end took along
    deadline = time.monotonic() + 10
    while alive(trainer[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(trainer[0])


@pytest.mark.skipif(sys.platform != "linux", reason="python -m train supervises on Linux")
def test_a_process_that_never_joins_is_named_by_the_others(tmp_path, compilation_cache_dir):
    """A typo in one process's flags: it exits with status 2 before joining, and the other
    ends after the join timeout (3 s here, 60 by default) naming it; both ways round."""
    jobs = {
        bad: launch(tmp_path / f"bad{bad}", 2, 1, "--mesh", "data=2", own={bad: ["--no-such"]},
                    environ={"ATTNLAB_JOIN_TIMEOUT": "3", "TMPDIR": str(tmp_path)},
                    cache=compilation_cache_dir)
        for bad in (0, 1)
    }  # fmt: skip
    started = time.monotonic()
    with ending([*jobs[0], *jobs[1]]):
        for bad, procs in jobs.items():
            out, _ = procs[bad].communicate(timeout=TIMEOUT_S)
            assert procs[bad].returncode == 2 and out == ""
        for bad, procs in jobs.items():
            out, err = procs[1 - bad].communicate(timeout=TIMEOUT_S)
            lines = [line for line in err.splitlines() if line.strip()]
            errors = [line for line in lines if line.startswith("error:")]
            assert procs[1 - bad].returncode == 3 and out == "" and len(errors) == 1, lines
            assert not [line for line in lines if re.match(FATAL_LOG, line)], lines
            assert errors[0].startswith(
                f"error: process {1 - bad} of 2: the job did not form within 3 s "
                f"(ATTNLAB_JOIN_TIMEOUT): process {bad} did not join"
            )
            kept = re.search(r"\(JAX's log: (\S+)\)$", errors[0])  # the abort held back
            assert "RegisterTask" in Path(kept.group(1)).read_text()
    assert time.monotonic() - started < 30  # not jax.distributed's 300 s
