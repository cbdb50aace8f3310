"""The checked front every fixed-state family shares (``attn.linear.front``).

One default chunk size, read by every entry point and every layer config; the
same refusals in every family for the same bad front argument: a real query id
that is not its key's (q and k are the same tokens), a state of the wrong
shape or of an integer dtype, a form the family lacks, a chunk size that is
not a positive int. A query id of 0 (padding) beside a real key id stays
allowed: the token writes and its query reads nothing.
"""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
import models
from attn.linear.front import CHUNK_SIZE
from tests.util import normal

B, T, K, H = 2, 6, 1, 4
L = 3  # log-linear levels


def call(name: str):
    """``(fn, args, kwargs, state)``: a valid tiny call of family ``name`` and a zero state."""
    q, k, v = normal(1, (B, T, K, H)), normal(2, (B, T, K, H)), normal(3, (B, T, K, H))
    beta = jax.nn.sigmoid(normal(4, (B, T, K)))
    gates = -jax.nn.softplus(normal(5, (B, T, K)))
    weights = jnp.ones((B, T, K, L))
    delta_state = attn.init_delta_state(B, K, H, H)
    if name == "linear_attention":
        return attn.linear_attention, (q, k, v), {}, attn.init_linear_state(B, K, H, H)
    if name == "delta_rule":
        return attn.delta_rule, (q, k, v, beta), {}, delta_state
    if name == "delta_product":
        args = (q, k[:, :, None], v[:, :, None], beta[:, :, None])
        return attn.delta_product, args, {}, delta_state
    if name == "dplr_delta_rule":
        args = (q, k, v, -k, k * 0.5, gates[..., None] * jnp.ones(H))
        return attn.dplr_delta_rule, args, {}, delta_state
    if name == "log_linear_attention":
        state = attn.init_log_linear_state(B, K, H, H, L)
        return attn.log_linear_attention, (q, k, v, gates, weights), {}, state
    if name == "log_linear_delta_rule":
        state = attn.init_log_linear_state(B, K, H, H, L)
        return attn.log_linear_delta_rule, (q, k, v, beta, weights), {}, state
    if name == "path_attention":
        w = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
        return attn.path_attention, (q, k, v, w, beta), dict(mask=attn.masks.causal()), None
    raise KeyError(name)


SAME_TOKENS = (
    "linear_attention",
    "delta_rule",
    "delta_product",
    "dplr_delta_rule",
    "log_linear_attention",
    "log_linear_delta_rule",
    "path_attention",
)


@pytest.mark.parametrize("name", SAME_TOKENS)
def test_a_query_id_other_than_its_keys_is_refused_by_name(name):
    fn, args, kw, _ = call(name)
    kv_seg = np.array([[1, 1, 1, 2, 2, 2], [1, 1, 0, 0, 1, 1]], np.int32)
    q_seg = kv_seg.copy()
    q_seg[0, 4] = 1  # a token of segment 2 whose query claims segment 1
    with pytest.raises(ValueError, match=r"^q_segment_ids: expected the id of kv_segment_ids"):
        fn(*args, **kw, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    # A padding query (0) on a real key, and a real query on a padding key, are fine.
    q_seg = kv_seg.copy()
    q_seg[0, 1], q_seg[1, 2] = 0, 1
    # One compiled program (the ids are constants: still checked as concrete ids).
    out = jax.jit(lambda *a: fn(*a, **kw, q_segment_ids=q_seg, kv_segment_ids=kv_seg))(*args)
    assert np.isfinite(np.asarray(out)).all()
    assert not np.asarray(out)[0, 1].any()


@pytest.mark.parametrize("name", SAME_TOKENS[:-1])
def test_the_state_and_the_front_options_are_refused_alike(name):
    fn, args, kw, state = call(name)
    forms = "recurrent" if name.startswith("log_linear") else "chunkwise"
    as_int = jax.tree.map(lambda x: x.astype(jnp.int32), state)
    with pytest.raises(ValueError, match=r"^initial_state(\.\w+)?: expected a real floating"):
        fn(*args, **kw, initial_state=as_int, form=forms)
    nan = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan) if x.dtype.kind == "f" else x,
                       state)  # fmt: skip
    with pytest.raises(ValueError, match=r"^initial_state(\.\w+)?: expected finite values"):
        fn(*args, **kw, initial_state=nan, form=forms)  # (it reached every output of the row)
    short = jax.tree.map(lambda x: x[:1], state)
    with pytest.raises(ValueError, match=r"^initial_state(\.\w+)?: expected"):
        fn(*args, **kw, initial_state=short, form=forms)
    with pytest.raises(ValueError, match=r"^form: expected one of \("):
        fn(*args, **kw, form="parallel_scan")
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match=r"^chunk_size: expected"):
            fn(*args, **kw, chunk_size=bad)


ENTRY_POINTS = (
    attn.linear_attention,
    attn.delta_rule,
    attn.delta_product,
    attn.dplr_delta_rule,
    attn.ssd,
    attn.log_linear_attention,
    attn.log_linear_delta_rule,
)


def test_one_default_chunk_size_for_every_family_and_layer():
    for fn in ENTRY_POINTS:
        assert inspect.signature(fn).parameters["chunk_size"].default == CHUNK_SIZE, fn
    configs = [kind.config for kind in models.KINDS.values()]
    chunked = [c for c in configs if "chunk_size" in {f.name for f in dataclasses.fields(c)}]
    assert len(chunked) >= 6  # linear, delta, mamba2, both log-linear kinds, rwkv7
    for config in chunked:
        field = {f.name: f for f in dataclasses.fields(config)}["chunk_size"]
        assert field.default == CHUNK_SIZE, config
