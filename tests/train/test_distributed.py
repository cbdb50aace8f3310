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

from train import distributed

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
    assert calls == [{"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 2}]


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
    assert calls == [{}]


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
