"""Sequence-parallel models on 8 fake CPU devices equal the unsharded models.

Softmax layers on the ring (``impl="ring"``, and "auto" under a seq mesh), a
batch split over data and fsdp, and the fixed-state layers sharded over "seq":
logits and gradients against the same model on one device. The checks that need
no devices are in ``tests/models/test_ring_models.py`` and
``tests/models/test_sequence_models.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from models import Decoder
from models.mesh import ring_layout
from tests.models.test_ring_models import ring_model_config
from tests.models.test_sequence_models import recurrent_model_config
from tests.util import rel_err

pytestmark = pytest.mark.devices

RTOL = 1e-5
# A bound on any one gradient leaf: the functions' gradient tolerance. A leaf that is a sum
# over every token (Mamba-2's skip D: sum_t dy_t x_t) can cancel to a small fraction of its
# terms, and float32 reordering alone (sharding over "data", no sequence parallelism) then
# moves it by up to 7e-5 in other models than this one. The gradients as one vector are held
# to RTOL; a shard's missing or doubled share would move a leaf by O(1).
LEAF_RTOL = 1e-4


def ring_decoder(axis_type):
    """The decoder on a data=2,fsdp=2,seq=2 mesh (tokens in the zigzag layout, with their
    positions, and packed segments) equals the unsharded decoder: logits and gradients."""
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


def batch_sharded_decoder():
    """Under data=4,fsdp=2 each device attends only its own rows: the blockwise layer (with
    sink logits, whose gradient is summed over the batch shards) equals the unsharded one,
    and the compiled step gathers nothing (parameters this small are replicated)."""
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


def recurrent_decoder(axis_type):
    """The decoder above on data=2,seq=4 (tokens contiguous, packed segments crossing the
    devices' spans) equals the unsharded decoder: logits and the gradients (as one vector;
    each leaf within ``LEAF_RTOL``). On a mesh of Auto axes (training's default);
    ``test_sharded_training.py`` trains a hybrid on Explicit ones."""
    B, T = 4, 16
    model = Decoder(recurrent_model_config(), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32, (B, T))
    seg = np.repeat(np.array([[1] * 7 + [2] * 6 + [0] * 3]), B, 0)
    positions = np.where(seg == 2, np.arange(T) - 7, np.arange(T))
    probe = rng.normal(size=(B, T, 32)).astype(np.float32)

    def loss(params, tokens, positions, seg, probe):
        logits = nnx.merge(graphdef, params)(tokens, positions=positions, segment_ids=seg)
        return (logits * probe).sum(), logits

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (_, ref), ref_grads = step(params, tokens, positions, seg, probe)
    mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(axis_type,) * 2)
    split = NamedSharding(mesh, P("data", "seq"))
    args = [jax.device_put(x, split) for x in (tokens, positions, seg, probe)]
    with jax.set_mesh(mesh):
        (_, logits), grads = step(params, *args)
    leaves = jax.tree.leaves_with_path(nnx.to_pure_dict(grads))
    ref_leaves = dict(jax.tree.leaves_with_path(nnx.to_pure_dict(ref_grads)))
    rel = {"logits": rel_err(logits, ref)}
    rel["grads"] = rel_err(
        np.concatenate([np.ravel(g) for _, g in leaves]),
        np.concatenate([np.ravel(ref_leaves[k]) for k, _ in leaves]),
    )
    worst = max(leaves, key=lambda kv: rel_err(kv[1], ref_leaves[kv[0]]))
    rel["worst_leaf"] = rel_err(worst[1], ref_leaves[worst[0]])
    ok = rel["logits"] <= RTOL and rel["grads"] <= RTOL and rel["worst_leaf"] <= LEAF_RTOL
    ok &= "seq" in str(logits.sharding.spec)
    return {"ok": bool(ok), "rel": rel, "worst": jax.tree_util.keystr(worst[0])}


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_ring_decoder_equals_the_unsharded_decoder(axis_type):
    """On Auto axes and on Explicit ones (``jax.make_mesh``'s default), where every array
    carries its sharding in its type."""
    result = ring_decoder(axis_type)
    assert result["ok"], result


def test_batch_sharded_decoder_attends_its_own_rows():
    result = batch_sharded_decoder()
    assert result["ok"], result


def test_recurrent_decoder_equals_the_unsharded_decoder():
    result = recurrent_decoder(AxisType.Auto)
    assert result["ok"], result
