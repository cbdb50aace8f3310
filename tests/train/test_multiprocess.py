"""Real processes: ``python -m train`` as 2 processes of one job on this machine.

Each process is a JAX runtime of its own with fake CPU devices, joined by
``jax.distributed`` (coordinator on 127.0.0.1, gloo collectives), as on a
cluster of hosts. The run is the tiny config with a gated linear-attention layer and a
softmax layer on ``--mesh seq=4``, so the sequence's spans, the recurrence's
state chain and the ring cross process boundaries. One process with 4 devices
is the reference: 2 processes of 2 devices train its first 2 steps (and save),
and one process of 4 devices resumes that checkpoint for the last 2 (the
reference's program, from the compilation cache); the losses and the final
parameters equal the reference's. A killed process makes the other exit at once
with one ``error:`` line.
"""

import json
import os
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
    workdir, processes: int, devices: int, *extra: str, cache=None
) -> list[subprocess.Popen]:
    """``python -m train`` as ``processes`` processes of ``devices`` fake CPU devices each
    (compiling into ``cache``, the tests' folder, when given)."""
    port = free_port()
    procs = []
    for i in range(processes):
        env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
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
        procs.append(
            subprocess.Popen(
                argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
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


def test_a_killed_process_stops_the_others_with_one_line(tmp_path, compilation_cache_dir):
    # No checkpoints after the first: a kill that lands in orbax's save barrier is waited
    # out by the coordinator's heartbeat (~100 s), another path than this test's; here the
    # survivor is in its training steps' collectives, which fail at once.
    run = ("--mesh", "data=2", "--steps", "100000", "--ckpt-every", "100000")
    procs = launch(tmp_path / "w", 2, 1, *run, cache=compilation_cache_dir)
    metrics = tmp_path / "w" / "metrics.jsonl"
    deadline = time.monotonic() + TIMEOUT_S
    while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.5)
    procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    code, out, err = finish(procs[:1])[0]
    procs[1].wait()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 3 and out == "" and len(errors) == 1, err[-3000:]
    assert "another process of the job has stopped" in errors[0]
    assert time.monotonic() - killed < 60  # at once, not after the 100 s heartbeat timeout
