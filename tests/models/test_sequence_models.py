"""Sequence-parallel recurrent models: the fixed-state layers sharded over "seq".

The comparisons with the unsharded decoder need several devices:
``tests/devices/test_sequence_parallel_models.py``, in the fake-device tier.
"""

import dataclasses

import jax
import numpy as np
from jax.sharding import AbstractMesh

import attn
from models import ModelConfig, presets
from models.mesh import in_sequence, ring_layout
from train import sharding


def recurrent_model_config() -> ModelConfig:
    """A softmax layer with a short convolution in front, which runs on the ring in the
    contiguous layout, Mamba-2 with its own, RWKV-7 (its token shift a sharded
    convolution), MesaNet (a solve of the incoming state at every token) and MiniMax's
    lightning attention (its norm over the heads and its gate after the sharded sums). (Each
    function's every option is checked sharded in ``tests/devices/test_sharded_linear.py``;
    the Gated DeltaNet and Mamba-2 hybrid trains on an Explicit mesh in
    ``tests/devices/test_sharded_training.py``.)"""
    kinds = presets(num_heads=2, head_dim=8)
    mha = dataclasses.replace(kinds["mha"], short_conv=3)
    layers = (mha, kinds["mamba2_conv"], dataclasses.replace(kinds["rwkv7"], chunk_size=4),
              dataclasses.replace(kinds["mesanet"], chunk_size=4, cg_steps=4),
              dataclasses.replace(kinds["lightning"], chunk_size=4))  # fmt: skip
    return ModelConfig(vocab_size=32, width=16, mlp_width=32, layers=layers)


def test_recurrences_follow_the_mesh():
    assert in_sequence(attn.delta_rule) is attn.delta_rule  # no mesh: the function itself
    with jax.sharding.use_abstract_mesh(AbstractMesh((2, 1), ("data", "seq"))):
        assert in_sequence(attn.ssd) is attn.ssd  # one seq device
    with jax.sharding.use_abstract_mesh(AbstractMesh((2, 4), ("data", "seq"))):
        assert in_sequence(attn.short_conv) is not attn.short_conv


def test_a_recurrent_model_is_laid_out_in_order():
    model = recurrent_model_config()
    assert sharding.in_order(model)
    assert not sharding.in_order(ModelConfig(layers=(presets()["mha"],)))
    with_conv = ModelConfig(layers=(dataclasses.replace(presets()["mha"], short_conv=4),))
    assert sharding.in_order(with_conv)
    np.testing.assert_array_equal(ring_layout(16, 4, in_order=True), np.arange(16))
    sharding.check_sequence_parallel(model)  # every kind here runs sequence-parallel
