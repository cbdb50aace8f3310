"""Sequence-parallel recurrent models: the fixed-state layers sharded over "seq".

The comparisons need several devices: ``case_*`` below run in the subprocess of
``tests/train/sharding_cases.py`` (8 CPU devices); the tests here read their
results. The rest is cheap and runs in this process.
"""

import dataclasses

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import attn
from models import Decoder, ModelConfig, presets
from models.mesh import in_sequence, ring_layout
from tests.train import sharding_cases
from tests.util import rel_err
from train import sharding

RTOL = 1e-5
# A bound on any one gradient leaf: the functions' gradient tolerance. A leaf that is a sum
# over every token (Mamba-2's skip D: sum_t dy_t x_t) can cancel to a small fraction of its
# terms, and float32 reordering alone (sharding over "data", no sequence parallelism) then
# moves it by up to 7e-5 in other models than this one. The gradients as one vector are held
# to RTOL; a shard's missing or doubled share would move a leaf by O(1).
LEAF_RTOL = 1e-4


def recurrent_model_config() -> ModelConfig:
    """A softmax layer with a short convolution in front, which runs on the ring in the
    contiguous layout, and Mamba-2 with its own. (Each function's every option is checked
    sharded in ``tests/attn/linear/test_sharded.py``; the Gated DeltaNet and Mamba-2 hybrid
    trains on an Explicit mesh in ``case_hybrids_train_as_one_device``.)"""
    kinds = presets(num_heads=2, head_dim=8)
    mha = dataclasses.replace(kinds["mha"], short_conv=3)
    layers = (mha, kinds["mamba2_conv"])
    return ModelConfig(vocab_size=32, width=16, mlp_width=32, layers=layers)


def case_recurrent_decoder(root, axis_type=AxisType.Auto):
    """The decoder above on data=2,seq=4 (tokens contiguous, packed segments crossing the
    devices' spans) equals the unsharded decoder: logits and the gradients (as one vector;
    each leaf within ``LEAF_RTOL``). On a mesh of Auto axes (training's default);
    ``case_hybrids_train_as_one_device`` trains on Explicit ones."""
    del root
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


def test_recurrent_decoder_equals_the_unsharded_decoder(tmp_path_factory):
    result = sharding_cases.results(tmp_path_factory)["recurrent_decoder"]
    assert result["ok"], result


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


def test_recurrent_hybrids_train_as_on_one_device(tmp_path_factory):
    result = sharding_cases.results(tmp_path_factory)["hybrids_train_as_one_device"]
    assert result["ok"], result
