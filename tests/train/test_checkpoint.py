"""Checkpoints round-trip parameters, RNG streams and optimizer state bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from train.checkpoint import Checkpointer, load_state, snapshot


class Noisy(nnx.Module):
    """A module that owns an RNG stream (as dropout would) and a list of layers."""

    def __init__(self, seed: int):
        self.rngs = nnx.Rngs(noise=seed)
        self.layers = nnx.List([nnx.Linear(3, 3, rngs=nnx.Rngs(seed)) for _ in range(2)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x) + 0.1 * jax.random.normal(self.rngs.noise(), x.shape)
        return x


@nnx.jit
def _step(model, optimizer):
    grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((2, 3))) ** 2))(model)
    optimizer.update(model, grads)


def _leaves(module):
    return [
        np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
        for x in jax.tree.leaves(nnx.state(module))
    ]


def test_round_trip_with_rng_streams_and_lists(tmp_path):
    model = Noisy(0)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    for _ in range(3):
        _step(model, optimizer)
    saved_model, saved_opt = _leaves(model), _leaves(optimizer)
    ckpt = Checkpointer(tmp_path, keep=1)
    ckpt.save(3, snapshot(model, optimizer, 3), {"note": "three steps"})
    ckpt.wait()

    fresh = Noisy(1)  # different parameters and RNG state
    fresh_opt = nnx.Optimizer(fresh, optax.adam(1e-2), wrt=nnx.Param)
    tree, meta = ckpt.restore(ckpt.latest_step(), snapshot(fresh, fresh_opt, 0))
    ckpt.close()
    assert meta == {"note": "three steps"}
    assert load_state(fresh, fresh_opt, tree) == 3
    for a, b in zip(_leaves(fresh) + _leaves(fresh_opt), saved_model + saved_opt, strict=True):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    # The restored RNG stream continues exactly where the saved one was.
    _step(model, optimizer)
    _step(fresh, fresh_opt)
    for a, b in zip(_leaves(fresh), _leaves(model), strict=True):
        assert a.tobytes() == b.tobytes()


def test_restore_rejects_a_different_architecture(tmp_path):
    model = Noisy(0)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, snapshot(model, optimizer, 1), {})
    ckpt.wait()
    other = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    other_opt = nnx.Optimizer(other, optax.adam(1e-2), wrt=nnx.Param)
    with pytest.raises(ValueError):
        ckpt.restore(1, snapshot(other, other_opt, 0))
    ckpt.close()


def test_keeps_the_last_k(tmp_path):
    model = Noisy(0)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    ckpt = Checkpointer(tmp_path, keep=2, async_save=False)
    for step in (1, 2, 3, 4):
        ckpt.save(step, snapshot(model, optimizer, step), {})
    assert ckpt.all_steps() == [3, 4] and ckpt.latest_step() == 4
    ckpt.close()


def test_an_async_save_keeps_the_metadata_as_it_was_at_the_call(tmp_path, monkeypatch):
    # The loop keeps appending to its window of losses after a save returns, while an
    # asynchronous save may serialize the metadata later in another thread (a resume
    # once averaged one extra loss into its next record that way). What orbax is given
    # must therefore be a copy that the caller cannot change.
    given = []
    json_save = ocp.args.JsonSave
    monkeypatch.setattr(ocp.args, "JsonSave", lambda item: given.append(item) or json_save(item))
    model = Noisy(0)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    ckpt = Checkpointer(tmp_path, async_save=True)
    window = [(1.0, 0.5)]
    ckpt.save(1, snapshot(model, optimizer, 1), {"window": window})
    window.append((2.0, 0.25))
    ckpt.wait()
    _, meta = ckpt.restore(1, snapshot(model, optimizer, 0))
    ckpt.close()
    assert meta["window"] == [[1.0, 0.5]] and given[0]["window"] is not window
