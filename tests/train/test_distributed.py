"""Several hosts (``train.distributed``): start-up from the environment, each process's block.

No second process is started: the environment and the process index are faked,
and the slicing is checked against the mesh layout it must reproduce.
"""

import itertools
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
