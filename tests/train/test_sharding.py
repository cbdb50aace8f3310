"""Sharded training (``train.sharding``): mesh strings, sharding rules, and sharded runs.

The sharded runs need several devices: ``tests/devices/test_sharded_training.py``,
in the fake-device tier.
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from train import sharding
from train.config import RESULT_FIELDS, TrainConfig


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


def test_sequence_parallel_batches_are_zigzag_with_their_positions():
    from types import SimpleNamespace

    mesh = SimpleNamespace(shape={"data": 1, "fsdp": 1, "seq": 2})  # seq_layout reads the sizes
    tokens = np.arange(16).reshape(2, 8)
    out = sharding.seq_layout(mesh, {"tokens": tokens, "weights": tokens * 10, "n": np.ones(2)})
    order = [0, 1, 6, 7, 2, 3, 4, 5]
    np.testing.assert_array_equal(out["tokens"], tokens[:, order])
    np.testing.assert_array_equal(out["weights"], tokens[:, order] * 10)
    np.testing.assert_array_equal(out["positions"], [order, order])
    np.testing.assert_array_equal(out["n"], np.ones(2))
    mesh.shape["seq"] = 1
    assert sharding.seq_layout(mesh, {"tokens": tokens}).keys() == {"tokens"}


def test_the_config_checks_the_mesh_syntax_and_resumes_on_another_mesh():
    assert TrainConfig().mesh is None
    assert TrainConfig(mesh="data=2,fsdp=2").mesh == "data=2,fsdp=2"
    with pytest.raises(ValueError, match=r"^mesh:"):
        TrainConfig(mesh="model=2")
    assert "mesh" not in RESULT_FIELDS  # a run may resume on another mesh
    assert TrainConfig(mesh="data=2", mesh_axis_types="explicit").mesh_axis_types == "explicit"
    with pytest.raises(
        ValueError, match=r"^mesh_axis_types: expected one of \('auto', 'explicit'\)"
    ):
        TrainConfig(mesh_axis_types="manual")
    assert "mesh_axis_types" not in RESULT_FIELDS  # the same result on either axis type
    mesh = sharding.make_mesh("data=1", devices=jax.devices()[:1], axis_types="explicit")
    assert sharding.is_explicit(mesh) and not sharding.is_explicit(sharding.make_mesh(""))


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
