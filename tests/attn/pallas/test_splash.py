"""impl="splash": our masks on JAX's TPU splash attention, in interpret mode on the CPU.

The mapping is checked without running a kernel (each splash mask, materialized,
equals ``Mask.allowed`` on the positions, for every mask kind); three kernel runs
check the semantics splash lacks (scale, empty rows, padding, sinks, soft-cap,
segment ids, T != S) against ``attn.dot_product_attention``, forward and gradients.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import masks
from attn.pallas import splash, splash_attention, splash_reason
from tests.util import normal, qkv, rel_err

TOL = 1e-5
GRAD_TOL = 1e-4
SINKS = jnp.array([0.5, -1.0, 2.0, 0.0])


@pytest.mark.parametrize(
    ("mask", "T", "S", "q0", "kind", "hides_padding"),
    [
        (masks.full(), 100, 150, 50, "FullMask", True),
        (masks.causal(), 100, 150, 50, "CausalMask", False),
        (masks.sliding_window(9), 150, 150, 0, "LocalMask", False),
        (masks.causal() & masks.sliding_window(9), 100, 150, 50, "LocalMask", False),
        (masks.bidirectional_window(6), 150, 150, 0, "LocalMask", True),
        (masks.band(5, 2), 100, 150, 50, "LocalMask", True),
        (masks.causal() & masks.band(5, 2), 150, 150, 0, "LocalMask", False),
        (masks.causal() & masks.chunked(32), 150, 150, 0, "ChunkedCausalMask", False),
        (masks.chunked(32) & masks.causal(), 100, 150, 50, "NumpyMask", False),  # offset
        (masks.initial_tokens(4), 150, 150, 0, "NumpyMask", False),
        (masks.causal() & (masks.sliding_window(9) | masks.initial_tokens(4)), 150, 150, 0,
         "NumpyMask", False),
        (masks.global_tokens((0, 70)) | masks.sliding_window(5), 150, 150, 0, "NumpyMask", False),
    ],
)  # fmt: skip
def test_every_mask_maps_to_the_same_visibility(mask, T, S, q0, kind, hides_padding):
    q_pos, k_pos = np.arange(T) + q0, np.arange(S)
    Tp, Sp = 256, 256
    got, hide = splash._splash_mask(mask, q_pos, k_pos, Tp, Sp)
    assert type(got).__name__ == kind and hide == hides_padding
    table = np.asarray(got[0:Tp, 0:Sp])
    np.testing.assert_array_equal(table[:T, :S], mask.allowed(q_pos, k_pos))
    # Padding keys are hidden from real queries by the mask itself, or else by a segment id.
    assert hide or not table[:T, S:].any()


def outputs_and_grads(fn, q, k, v, **kw):
    cot = normal(99, q.shape[:3] + v.shape[3:])

    def loss(q, k, v):
        out = fn(q, k, v, **kw)
        return (out.astype(jnp.float32) * cot).sum(), out

    grads, out = jax.jit(jax.grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def assert_matches_dense(q, k, v, **kw):
    out, grads = outputs_and_grads(splash_attention, q, k, v, interpret=True, **kw)
    want, want_grads = outputs_and_grads(attn.dot_product_attention, q, k, v, **kw)
    assert out.dtype == want.dtype and rel_err(out, want) <= TOL
    for g, w in zip(grads, want_grads, strict=True):
        assert np.isfinite(np.asarray(g)).all() and rel_err(g, w) <= GRAD_TOL
    return out, grads


def test_causal_t_ne_s_gqa_softcap_and_scale():
    q, k, v = qkv(1, B=2, T=100, S=150, N=4, K=2, H=8)  # padded to 128 x 256: 1 x 2 blocks
    assert_matches_dense(3 * q, k, v, mask=masks.causal(), softcap=2.5, scale=0.3)


def test_numpy_mask_sinks_and_segment_ids_with_empty_rows_mqa():
    q, k, v = qkv(2, B=2, T=150, N=4, K=1, H=8)
    q_seg = np.r_[np.full(60, 1), np.full(50, 2), np.full(40, 9)]  # no key has id 9
    kv_seg = np.r_[np.full(60, 1), np.full(50, 2), np.full(40, 3)]
    q_seg = jnp.asarray(np.stack([q_seg, np.ones(150)]), jnp.int32)
    kv_seg = jnp.asarray(np.stack([kv_seg, np.ones(150)]), jnp.int32)
    mask = masks.causal() & (masks.sliding_window(20) | masks.initial_tokens(4))
    kw = dict(mask=mask, q_segment_ids=q_seg, kv_segment_ids=kv_seg, sink_logits=SINKS)
    out, (gq, *_) = assert_matches_dense(q, k, v, **kw)
    assert not np.asarray(out)[0, 110:].any() and not np.asarray(gq)[0, 110:].any()


def test_full_mask_hides_padding_keys_and_empty_rows_without_sinks():
    q, k, v = qkv(3, B=1, T=150, N=2, K=2, H=8)
    seg = jnp.asarray(np.r_[np.full(140, 1), np.full(10, 4)], jnp.int32)[None]
    kv_seg = jnp.asarray(np.r_[np.full(140, 1), np.full(10, 5)], jnp.int32)[None]
    kw = dict(mask=masks.full(), q_segment_ids=seg, kv_segment_ids=kv_seg)
    out = splash_attention(q, k, v, interpret=True, **kw)
    assert rel_err(out, attn.dot_product_attention(q, k, v, **kw)) <= TOL
    assert not np.asarray(out)[0, 140:].any()  # splash alone would give a mean of V


def test_what_does_not_map_is_refused_with_the_reason(monkeypatch):
    q, k, v = qkv(4, B=2, T=150, N=2, H=8)
    with pytest.raises(ValueError, match="return_lse: expected False for impl='splash'"):
        splash_attention(q, k, v, return_lse=True, interpret=True)
    with pytest.raises(ValueError, match="kv_positions: expected the same positions"):
        splash_attention(
            q, k, v, kv_positions=jnp.stack([jnp.arange(150), jnp.arange(150) + 1]), interpret=True
        )
    with pytest.raises(ValueError, match="q_positions: expected concrete positions"):
        jax.jit(
            lambda p: splash_attention(q, k, v, mask=masks.causal(), q_positions=p, interpret=True)
        )(jnp.arange(150))
    with pytest.raises(ValueError, match="bias"):
        attn.attention(q, k, v, impl="splash", bias=jnp.zeros((1, 2, 150, 150)))
    monkeypatch.setattr(splash, "NUMPY_MASK_LIMIT", 2**10)
    reason = splash_reason(q, k, v, mask=masks.initial_tokens(4))
    assert reason.startswith("mask: expected a mask splash computes")
    assert splash_reason(q, k, v, mask=masks.causal()) is None  # computed masks need no table
