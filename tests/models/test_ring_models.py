"""Sequence-parallel models: softmax layers on the ring (``impl="ring"``) under a seq mesh.

The comparisons with the unsharded decoder need several devices:
``tests/devices/test_sequence_parallel_models.py``, in the fake-device tier.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh

from models import Decoder, LatentConfig, LinearConfig, ModelConfig, SoftmaxConfig
from models.mesh import ring_layout
from tests.util import rel_err


def ring_model_config(impl: str = "ring") -> ModelConfig:
    """One layer with the ring's features: GQA, a soft-cap, sink logits, StreamingLLM's
    window plus initial tokens, and the output gate. (train's sequence-parallel step covers
    plain MHA as "auto".)"""
    layer = SoftmaxConfig(
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        impl=impl,
        softcap=20.0,
        sink_logits=True,
        window=5,
        initial_tokens=2,
        output_gate="elementwise",
    )
    return ModelConfig(vocab_size=32, width=32, mlp_width=32, layers=(layer,))


def test_ring_without_a_seq_mesh_computes_as_auto():
    ring = Decoder(ring_model_config("ring"), rngs=nnx.Rngs(0))
    auto = Decoder(ring_model_config("auto"), rngs=nnx.Rngs(0))
    tokens = jnp.arange(12).reshape(2, 6) % 32
    assert rel_err(ring(tokens), auto(tokens)) == 0.0


def test_auto_takes_the_ring_under_a_seq_mesh_that_divides_the_sequence():
    layer = Decoder(ring_model_config("auto"), rngs=nnx.Rngs(0)).blocks[0].attn
    ring = Decoder(ring_model_config("ring"), rngs=nnx.Rngs(0)).blocks[0].attn
    assert not layer._on_ring(16) and not ring._on_ring(16)  # no mesh: plain attention
    with jax.sharding.use_abstract_mesh(AbstractMesh((2, 4), ("data", "seq"))):
        assert layer._on_ring(16) and ring._on_ring(16)
        assert not layer._on_ring(15)  # auto: XLA partitions the plain call instead
        with pytest.raises(ValueError, match=r"^x:.*4 devices.*T=15"):
            ring._on_ring(15)
    with jax.sharding.use_abstract_mesh(AbstractMesh((2, 1), ("data", "seq"))):
        assert not layer._on_ring(16) and ring._on_ring(16)  # a ring of one device
    with jax.sharding.use_abstract_mesh(AbstractMesh((8,), ("data",))):
        assert not layer._on_ring(16) and not ring._on_ring(16)


def test_ring_is_a_softmax_impl():
    assert SoftmaxConfig(impl="ring").impl == "ring"
    with pytest.raises(ValueError, match=r"^impl:.*ring"):
        LatentConfig(impl="ring")
    with pytest.raises(TypeError, match="'impl'"):  # a linear layer has no impl
        LinearConfig(rope=False, impl="ring")
    with pytest.raises(ValueError, match=r"^impl:"):
        dataclasses.replace(SoftmaxConfig(), impl="rings")


def test_ring_layout_is_zigzag_where_it_can_be():
    np.testing.assert_array_equal(ring_layout(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
    np.testing.assert_array_equal(ring_layout(6, 2), np.arange(6))  # 4 does not divide 6
    with pytest.raises(ValueError, match=r"^length:"):
        ring_layout(7, 2)
