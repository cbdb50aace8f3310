"""Several hosts (``train.distributed``): start-up from the environment, each process's block.

The environment and the process index are faked, and the slicing is checked
against the mesh layout it must reproduce. Two real processes on 127.0.0.1
(gloo) check what the command line promises: one JSON summary on stdout, and
processes given different runs refused in one line before training.
"""

import itertools
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from train import distributed, supervisor

EXPLICIT = {
    "JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234",
    "JAX_NUM_PROCESSES": "4",
    "JAX_PROCESS_ID": "2",
}


def test_a_single_process_does_not_initialize():
    calls = []
    assert distributed.multihost_settings({}) is None
    assert distributed.multihost_settings({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None
    assert distributed.multihost_settings({"TPU_WORKER_HOSTNAMES": "localhost"}) is None
    assert not distributed.initialize({}, init=lambda **kw: calls.append(kw))
    assert calls == []


def test_an_explicit_launch_passes_its_variables():
    calls = []
    assert distributed.initialize(EXPLICIT, init=lambda **kw: calls.append(kw))
    address = {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 2}
    assert calls == [{**address, "initialization_timeout": 60}]


@pytest.mark.parametrize(
    "env",
    [
        {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8"},
        {"OMPI_MCA_orte_hnp_uri": "1.2.3.4:5", "OMPI_COMM_WORLD_SIZE": "2"},
        {"TPU_WORKER_HOSTNAMES": "host0,host1"},
    ],
)
def test_detected_clusters_leave_the_settings_to_jax(env):
    calls = []
    assert distributed.initialize(env, init=lambda **kw: calls.append(kw))
    assert calls == [{"initialization_timeout": 60}]  # but how long to wait for the others


def test_the_join_timeout_is_60_s_or_the_variable():
    assert supervisor.join_timeout({}) == 60
    settings = distributed.multihost_settings({**EXPLICIT, "ATTNLAB_JOIN_TIMEOUT": "5"})
    assert settings["initialization_timeout"] == 5
    for bad in ("0", "x", "1.5", ""):
        with pytest.raises(ValueError, match=r"^ATTNLAB_JOIN_TIMEOUT: expected"):
            distributed.multihost_settings({**EXPLICIT, "ATTNLAB_JOIN_TIMEOUT": bad})


@pytest.mark.parametrize(
    ("env", "job"),
    [
        ({}, None),
        (EXPLICIT, (2, 4)),
        ({**EXPLICIT, "JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"}, None),  # no other
        ({**EXPLICIT, "JAX_PROCESS_ID": "x"}, None),  # the run itself says what is wrong
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8", "SLURM_PROCID": "3"}, (3, 8)),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}, None),
        ({"OMPI_MCA_orte_hnp_uri": "1.2.3.4:5", "OMPI_COMM_WORLD_SIZE": "2"}, (None, 2)),
        ({"TPU_WORKER_HOSTNAMES": "h0,h1,h2", "TPU_WORKER_ID": "1"}, (1, 3)),
        ({"TPU_WORKER_HOSTNAMES": "localhost"}, None),
    ],
)
def test_the_supervisor_knows_the_jobs_that_initialize(env, job):
    """``python -m train`` supervises where ``initialize`` joins a job of several processes
    (``train.supervisor`` reads the environment without importing JAX)."""
    assert supervisor.processes(env) == job
    if job is not None:
        assert distributed.multihost_settings(env) is not None
        assert supervisor.wanted(env) == (sys.platform == "linux")
        assert not supervisor.wanted({**env, supervisor.CHILD: "1"})


@pytest.mark.parametrize(
    ("name", "value"),
    [("JAX_NUM_PROCESSES", None), ("JAX_NUM_PROCESSES", "0"), ("JAX_PROCESS_ID", "x")],
)
def test_a_malformed_explicit_launch_names_the_variable(name, value):
    env = {k: v for k, v in EXPLICIT.items() if k != name}
    if value is not None:
        env[name] = value
    with pytest.raises(ValueError, match=f"^{name}:"):
        distributed.multihost_settings(env)
    with pytest.raises(ValueError, match=r"^JAX_PROCESS_ID:.*\[0, JAX_NUM_PROCESSES=4\)"):
        distributed.multihost_settings({**EXPLICIT, "JAX_PROCESS_ID": "4"})


def fake_mesh(sizes, processes):
    """A mesh of ``data * fsdp * seq`` fake devices, ordered process by process as
    ``jax.devices()`` lists them (``train.sharding.make_mesh``)."""
    count = int(np.prod(sizes))
    per = count // processes
    devices = [SimpleNamespace(process_index=i // per) for i in range(count)]
    return SimpleNamespace(devices=np.asarray(devices, dtype=object).reshape(sizes))


def expected_block(batch, sizes, coords):
    """What the device at mesh coordinates ``(d, f, s)`` holds: its rows (over data x fsdp)
    and its columns (over seq), as ``train.sharding.batch_sharding`` splits a batch."""
    data, fsdp, seq = sizes
    B, T = batch.shape
    d, f, s = coords
    b, t = B // (data * fsdp), T // seq
    r = d * fsdp + f
    return batch[r * b : (r + 1) * b, s * t : (s + 1) * t]


@pytest.mark.parametrize(
    ("sizes", "processes"),
    [
        ((8, 1, 1), 2),
        ((2, 4, 1), 2),
        ((2, 2, 2), 4),
        ((1, 2, 4), 2),
        ((2, 1, 4), 4),
        ((1, 1, 8), 8),
    ],
)
def test_each_process_gets_the_blocks_of_its_devices(sizes, processes):
    mesh = fake_mesh(sizes, processes)
    B, T = 16, 24
    tokens = np.arange(B * T).reshape(B, T)
    batch = {"tokens": tokens, "lengths": np.arange(B)}
    covered = np.zeros((B, T), int)
    for p in range(processes):
        local = distributed.local_batch(mesh, batch, process_index=p)
        rows, cols = distributed.process_block(
            np.vectorize(lambda d: d.process_index)(mesh.devices), p, (B, T)
        )
        np.testing.assert_array_equal(local["tokens"], tokens[rows, cols])
        np.testing.assert_array_equal(local["lengths"], np.arange(B)[rows])
        covered[rows, cols] += 1
        # Every device of the process finds its own block inside the process's part.
        for coords in itertools.product(*map(range, sizes)):
            if mesh.devices[coords].process_index == p:
                block = expected_block(tokens, sizes, coords)
                assert np.isin(block, local["tokens"]).all()
        assert local["tokens"].size == tokens.size // processes
    assert (covered == 1).all()  # the processes' parts tile the global batch


def test_blocks_that_are_not_one_rectangle_raise():
    grid = np.array([[[0, 1]], [[1, 0]]])  # data=2, seq=2, processes crossing
    with pytest.raises(ValueError, match=r"^process_grid:"):
        distributed.process_block(grid, 0, (4, 4))
    with pytest.raises(ValueError, match=r"^process_index:"):
        distributed.process_block(grid, 3, (4, 4))


REPO = Path(__file__).resolve().parents[2]
TINY = str(Path(__file__).with_name("tiny_config.py"))


def _two_processes(tmp_path, extra, timeout=180):
    """``python -m train`` of the tiny run as processes 0 and 1 of one job: their
    ``(returncode, stdout, stderr)``; ``extra[i]`` are process i's own flags."""
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for i in range(2):
        job = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
               "JAX_PROCESS_ID": str(i)}  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO), **job}
        argv = [sys.executable, "-m", "train", "--config", TINY, "--workdir", str(tmp_path / "w"),
                "--no-progress", "--steps", "2", "--eval-every", "2", *extra[i]]  # fmt: skip
        procs.append(subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    outputs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, *out) for p, out in zip(procs, outputs, strict=True)]


@pytest.mark.integration
def test_two_processes_refuse_different_arguments(tmp_path):
    # Training as several processes (one JSON summary each on stdout, gloo's lines on
    # stderr): tests/train/test_multiprocess.py.
    for code, out, err in _two_processes(tmp_path, [["--seed", "0"], ["--seed", "1"]]):
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and out == "" and len(errors) == 1, err[-2000:]
        assert "arguments differ from process 0's (process 1)" in errors[0]


def test_runtime_failures_are_told_from_our_own_errors():
    gloo = ValueError("UNKNOWN: Gloo AllGather failed: Connection closed by peer [127.0.0.1]:1")
    assert distributed.is_runtime_failure(gloo)  # multihost_utils raises it as a ValueError
    assert not distributed.is_runtime_failure(ValueError("mesh: expected ..., got 'x'"))
    assert not distributed.is_runtime_failure(RuntimeError("UNKNOWN: not from XLA's runtime"))
    line = distributed.lost_peer(gloo)
    assert "another process of the job has stopped" in line and "\n" not in line
    assert "Gloo AllGather failed" in line


# What process 1 printed when process 0 (the coordinator) was killed, shortened; then the
# abort, or Python's error path if it won the race.
LOST_COORDINATOR = b"""\
W1205 00:11:34.327550   10581 preemption_sync_manager.cc:146] Failed to retrieve preemption notice
Additional GRPC error information from remote target coordination_service while calling /x:
:UNKNOWN:Error received from peer  {grpc_message:"Socket closed", grpc_status:14}.
E1205 00:23:32.224347   15088 coordination_service_agent.cc:289] Polled an error from coordination service
F1205 00:23:32.224382   15088 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died
:UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"Socket closed"}
*** Check failure stack trace: ***
    @     0x7fcdf9d72104  absl::lts_20260107::log_internal::LogMessage::SendToLog()
"""  # noqa: E501
NEVER_JOINED = b"""\
F1205 00:14:55.968547   12482 client.h:80] Terminating process because the JAX distributed service detected fatal errors. absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded

RPC: /xla.coordination.CoordinationService/RegisterTask
*** Check failure stack trace: ***
    @     0x7fcda149f582  xla::CoordinationServiceAgent::Connect()
"""  # noqa: E501


def test_the_relay_drops_the_log_of_a_dying_process():
    shown = []
    relay = supervisor.Relay(shown.append, hold_s=2.0)
    relay.feed(b"[Gloo] Rank 1 is connected to 1 peer ranks.\n", now=0.0)
    assert shown == [b"[Gloo] Rank 1 is connected to 1 peer ranks.\n"]  # not a log: at once
    relay.feed(LOST_COORDINATOR[:200], now=1.0)  # in pieces, as a pipe gives them
    relay.feed(LOST_COORDINATOR[200:] + b"error: process 1 of 2: a collective failed\n", now=1.0)
    relay.release(now=9.0)  # a fatal log came: nothing more is let through
    assert len(shown) == 1
    dropped = relay.end(drop=True)
    assert shown[1:] == [b"error: process 1 of 2: a collective failed\n"]
    assert b"".join(dropped) == LOST_COORDINATOR


def test_the_relay_lets_other_logs_through_late_and_in_order():
    shown = []
    relay = supervisor.Relay(shown.append, hold_s=2.0)
    warning = b"E1205 00:12:48.934979   11733 cpu_aot_loader.cc:195] Loading XLA:CPU AOT result\n"
    relay.feed(warning + b"step 1\n", now=0.0)
    relay.feed(b"\r 50%|#####", now=1.0)  # a progress bar's line waits behind the log line
    assert shown == [] and relay.due(now=1.0) == 1.0
    relay.release(now=2.0)
    assert shown == [warning, b"step 1\n", b"\r 50%|#####"]
    relay.feed(b"\r 60%|######", now=2.5)  # nothing held: drawn at once
    assert shown[3:] == [b"\r 60%|######"]
    relay.feed(warning, now=3.0)
    assert relay.end(drop=False) == [] and shown[-1] == warning  # the child ended well


def test_verdicts_name_what_happened():
    lost = LOST_COORDINATOR.decode()
    line = supervisor.verdict(lost, 1, 2, 60)
    assert line.startswith("process 1 of 2 lost the job's coordinator (process 0 stopped)")
    assert "\n" not in line
    assert "process 3 of the job stopped" in supervisor.verdict("/task:0 /task:3 down", 0, 4, 60)
    why = "(Terminating process because the JAX distributed service detected fatal errors)"
    assert f"JAX's runtime stopped it {why}" in supervisor.verdict(lost, 0, 2, 60)
    joined = NEVER_JOINED.decode()
    assert supervisor.verdict(joined, 0, 2, 5).startswith(
        "process 0 of 2: the job did not form within 5 s (ATTNLAB_JOIN_TIMEOUT): "
        "process 1 did not join"
    )
    assert "process 0 did not join" in supervisor.verdict(joined, 1, 2, 5)
    assert "processes 0 to 3 were expected" in supervisor.verdict(joined, 2, 4, 5)
