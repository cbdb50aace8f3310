"""Sequence-parallel models: softmax layers on the ring (``impl="ring"``) under a seq mesh.

The comparisons need several devices: ``case_*`` below run in the subprocess of
``tests/train/sharding_cases.py`` (8 CPU devices, one process for every
fake-device check); the tests here read their results. The rest is cheap and
runs in this process.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from models import Decoder, LatentConfig, LinearConfig, ModelConfig, SoftmaxConfig
from models.mesh import ring_layout
from tests.train import sharding_cases
from tests.util import rel_err

RTOL = 1e-5


def ring_model_config(impl: str = "ring") -> ModelConfig:
    """One layer with the ring's features: GQA, a soft-cap, sink logits, and StreamingLLM's
    window plus initial tokens. (train's sequence-parallel step covers plain MHA as "auto".)"""
    layer = SoftmaxConfig(
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        impl=impl,
        softcap=20.0,
        sink_logits=True,
        window=5,
        initial_tokens=2,
    )
    return ModelConfig(vocab_size=32, width=32, mlp_width=32, layers=(layer,))


def case_ring_decoder(root, axis_type=AxisType.Auto):
    """The decoder on a data=2,fsdp=2,seq=2 mesh (tokens in the zigzag layout, with their
    positions, and packed segments) equals the unsharded decoder: logits and gradients."""
    del root
    B, T = 4, 16
    model = Decoder(ring_model_config(), rngs=nnx.Rngs(0))
    # Sink logits start at 0; random ones test that their gradient is summed once.
    model.blocks[0].attn.sink_logits[...] = jnp.linspace(-1.0, 1.0, 4)
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32, (B, T))
    seg = np.repeat(np.array([[1] * 11 + [2] * 5]), B, 0)  # two packed sequences a row
    positions = np.where(seg == 1, np.arange(T), np.arange(T) - 11)
    probe = rng.normal(size=(B, T, 32)).astype(np.float32)  # a cotangent for the logits

    def loss(params, tokens, positions, seg, probe):
        logits = nnx.merge(graphdef, params)(tokens, positions=positions, segment_ids=seg)
        return (logits * probe).sum(), logits

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (_, ref), ref_grads = step(params, tokens, positions, seg, probe)

    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "seq"), axis_types=(axis_type,) * 3)
    order = ring_layout(T, 2)
    split = NamedSharding(mesh, P(("data", "fsdp"), "seq"))
    args = [jax.device_put(x[:, order], split) for x in (tokens, positions, seg, probe)]
    with jax.set_mesh(mesh):
        (_, logits), grads = step(params, *args)
        # impl="ring" raises on a T the seq devices do not divide.
        try:
            Decoder(ring_model_config(), rngs=nnx.Rngs(0))(jnp.zeros((2, 15), jnp.int32))
            message = None
        except ValueError as e:
            message = str(e)
    inverse = np.argsort(order)
    rel = {"logits": rel_err(np.asarray(logits)[:, inverse], ref)}
    leaves = jax.tree.leaves_with_path(nnx.to_pure_dict(grads))
    ref_leaves = dict(jax.tree.leaves_with_path(nnx.to_pure_dict(ref_grads)))
    rel["grads"] = max(rel_err(g, ref_leaves[k]) for k, g in leaves)
    ok = all(e <= RTOL for e in rel.values()) and "seq" in str(logits.sharding.spec)
    ok &= message is not None and message.startswith("x:") and "T=15" in message
    return {"ok": bool(ok), "rel": rel, "T=15": message}


def case_ring_decoder_explicit(root):
    """As ``case_ring_decoder`` on a mesh of Explicit axes (``jax.make_mesh``'s default),
    where every array carries its sharding in its type."""
    return case_ring_decoder(root, AxisType.Explicit)


def case_batch_sharded_decoder(root):
    """Under data=4,fsdp=2 each device attends only its own rows: the blockwise layer (with
    sink logits, whose gradient is summed over the batch shards) equals the unsharded one,
    and the compiled step gathers nothing (parameters this small are replicated)."""
    del root
    B, T = 8, 12
    graphdef, params = nnx.split(Decoder(ring_model_config("blockwise"), rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(1)
    tokens, probe = rng.integers(0, 32, (B, T)), rng.normal(size=(B, T, 32)).astype(np.float32)

    def loss(params, tokens, probe):
        logits = nnx.merge(graphdef, params)(tokens)
        return (logits * probe).sum(), logits

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (_, ref), ref_grads = step(params, tokens, probe)
    mesh = jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    split = NamedSharding(mesh, P(("data", "fsdp")))
    args = [jax.device_put(x, split) for x in (tokens, probe)]
    with jax.set_mesh(mesh):
        (_, logits), grads = step(params, *args)
        hlo = step.lower(params, *args).compile().as_text()
    leaves = jax.tree.leaves_with_path(nnx.to_pure_dict(grads))
    ref_leaves = dict(jax.tree.leaves_with_path(nnx.to_pure_dict(ref_grads)))
    rel = {"logits": rel_err(logits, ref)}
    rel["grads"] = max(rel_err(g, ref_leaves[k]) for k, g in leaves)
    gathers = hlo.count("all-gather-start") + hlo.count(" all-gather(")
    ok = all(e <= RTOL for e in rel.values()) and gathers == 0
    return {"ok": bool(ok), "rel": rel, "all_gathers": gathers}


def test_batch_sharded_decoder_attends_its_own_rows(tmp_path_factory):
    result = sharding_cases.results(tmp_path_factory)["batch_sharded_decoder"]
    assert result["ok"], result


def test_ring_decoder_equals_the_unsharded_decoder(tmp_path_factory):
    result = sharding_cases.results(tmp_path_factory)["ring_decoder"]
    assert result["ok"], result


def test_ring_decoder_on_explicit_axes_equals_the_unsharded_decoder(tmp_path_factory):
    result = sharding_cases.results(tmp_path_factory)["ring_decoder_explicit"]
    assert result["ok"], result


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
