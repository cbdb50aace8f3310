"""Sharded training (``train.sharding``): mesh strings, sharding rules, and sharded runs.

The runs need several devices: ``sharding_cases.py`` runs them in one subprocess
with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` on CPU (set before
JAX starts, which this process has already done).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from jax.sharding import PartitionSpec as P

from train import sharding
from train.config import RESULT_FIELDS, TrainConfig

CASES = Path(__file__).with_name("sharding_cases.py")


def test_mesh_strings_give_axis_sizes():
    assert sharding.mesh_shape("data=2,fsdp=4", 8) == {"data": 2, "fsdp": 4, "seq": 1}
    assert sharding.mesh_shape(" fsdp=4 , data=1,seq=1", 4) == {"data": 1, "fsdp": 4, "seq": 1}
    assert sharding.mesh_shape(None, 8) == {"data": 8, "fsdp": 1, "seq": 1}
    assert sharding.mesh_shape("", 2) == {"data": 2, "fsdp": 1, "seq": 1}


@pytest.mark.parametrize(
    "spec", ["data=3", "gpu=8", "data=2,data=4", "data=0,fsdp=8", "data8", "data=x", "data=2,"]
)
def test_bad_mesh_strings_raise_naming_mesh(spec):
    with pytest.raises(ValueError, match=r"^mesh:"):
        sharding.mesh_shape(spec, 8)


def test_sequence_parallelism_is_refused_until_ring_attention_is_wired():
    with pytest.raises(ValueError, match=r"^mesh:.*ring"):
        sharding.mesh_shape("data=4,seq=2", 8)


def test_the_config_checks_the_mesh_syntax_and_resumes_on_another_mesh():
    assert TrainConfig().mesh is None
    assert TrainConfig(mesh="data=2,fsdp=2").mesh == "data=2,fsdp=2"
    with pytest.raises(ValueError, match=r"^mesh:"):
        TrainConfig(mesh="model=2")
    assert "mesh" not in RESULT_FIELDS  # a run may resume on another mesh


def test_fsdp_shards_the_largest_divisible_dim_of_large_arrays():
    big = sharding.FSDP_MIN_SIZE
    assert sharding.param_spec((64, 128), 4) == P(None, "fsdp")
    assert sharding.param_spec((128, 64), 4) == P("fsdp", None)
    assert sharding.param_spec((128, 6, 64), 4) == P("fsdp", None, None)
    assert sharding.param_spec((6, 4, big), 8) == P(None, None, "fsdp")
    assert sharding.param_spec((7, big + 1), 4) == P()  # no divisible dim
    assert sharding.param_spec((big // 2,), 2) == P()  # small: replicated
    assert sharding.param_spec((), 4) == P()  # scalars: replicated
    assert sharding.param_spec((64, 128), 1) == P()


def test_sharded_runs_match_single_device(tmp_path, compilation_cache_dir):
    """One step on data=8 and on fsdp=8 equals one device's; a run saved on data=8
    resumes on fsdp=4,data=2 and ends where an uninterrupted single-device run does
    (rel <= 1e-5); bad meshes and batches raise naming the field."""
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": compilation_cache_dir,
    }
    out = subprocess.run(
        [sys.executable, str(CASES), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr[-3000:]}"
    assert {r["case"] for r in results} == {
        "layout",
        "one_step",
        "resume_on_another_mesh",
        "bad_meshes",
    }
    assert all(r["ok"] for r in results), results
