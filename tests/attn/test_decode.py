"""Split-K decode attention against float64 attention over each row's valid keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import masks, scores
from tests.util import normal, np_attention, qkv, rel_err

TOL = 2e-6
H_DIM = 8  # tests.util.qkv's default head dim
S = 20  # cache slots; the rows hold one key, 8 (across a split's end), all 20 and none
LENGTHS = np.array([1, 8, 20, 0])


def allowed(mask, lengths, T, q_positions=None):
    """``[B,T,S]``: the mask on absolute positions, keys in valid slots only (NumPy)."""
    if q_positions is None:
        q_positions = lengths[:, None] - T + np.arange(T)[None, :]
    k_pos = np.broadcast_to(np.arange(S), (len(lengths), S))
    ok = True if mask is None else np.asarray(mask.allowed(np.asarray(q_positions), k_pos))
    return ok & (k_pos < lengths[:, None])[:, None, :]


MASKS = {
    "full": None,
    "causal": masks.causal(),
    "window": masks.causal() & masks.sliding_window(5),
    "streaming": masks.causal() & (masks.sliding_window(3) | masks.initial_tokens(2)),
    "chunked": masks.causal() & masks.chunked(6),
}


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("splits", [1, 3, 7])
def test_every_mask_and_split_count_matches_attention_over_the_valid_keys(name, splits):
    q, k, v = qkv(0, B=4, T=2, S=S, N=4, K=2)
    out = attn.decode_attention(q, k, v, lengths=LENGTHS, num_splits=splits, mask=MASKS[name])
    want = np_attention(q, k, v, allowed(MASKS[name], LENGTHS, 2))
    assert rel_err(out, want) < TOL
    assert not np.any(np.isnan(np.asarray(out)))
    np.testing.assert_array_equal(np.asarray(out[3]), 0.0)  # no valid key: zeros


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_mha_and_mqa_with_sinks_and_softcap(kv_heads):
    q, k, v = qkv(1, B=4, T=1, S=S, N=4, K=kv_heads)
    q = q * 8.0  # logits large enough for the cap to matter
    sink = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    out, lse = attn.decode_attention(
        q, k, v, lengths=LENGTHS, num_splits=4, mask=masks.causal(), softcap=5.0,
        sink_logits=sink, return_lse=True,
    )  # fmt: skip
    ok = allowed(masks.causal(), LENGTHS, 1)
    assert rel_err(out, np_attention(q, k, v, ok, softcap=5.0, sink_logits=sink)) < TOL
    # A row with no key has the sink alone: lse is its logit, the output zero.
    np.testing.assert_allclose(np.asarray(lse[3, 0]), sink, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out[3]), 0.0)


def test_score_modifiers_are_cut_like_the_keys():
    """ALiBi (a head leaf) and FoX (query and key leaves): split == one dense call."""
    B, T, N = 4, 1, 4
    q, k, v = qkv(2, B=B, T=T, S=S, N=N)
    log_f = -jax.nn.softplus(normal(3, (B, S, N)))
    cum = jnp.cumsum(log_f, axis=1)
    q_pos = jnp.asarray(np.maximum(LENGTHS - 1, 0)[:, None])
    q_cum = jnp.take_along_axis(cum, q_pos[..., None], axis=1)  # [B,1,N] the query's sum
    mod = scores.alibi(scores.alibi_slopes(N)) + scores.Forgetting(q_cum, cum)
    out = attn.decode_attention(
        q, k, v, lengths=LENGTHS, num_splits=3, mask=masks.causal(), score_mod=mod,
        q_positions=q_pos,
    )  # fmt: skip
    valid = (np.arange(S)[None] < LENGTHS[:, None]).astype(np.int32)
    want = attn.dot_product_attention(
        q, k, v, mask=masks.causal(), score_mod=mod, q_positions=q_pos,
        q_segment_ids=np.ones((B, T), np.int32), kv_segment_ids=valid,
    )  # fmt: skip
    assert rel_err(out, want) < TOL


def test_traced_lengths_and_the_default_split_count():
    q, k, v = qkv(4, B=4, T=1, S=S, N=4, K=2)
    out = jax.jit(lambda q, k, v, n: attn.decode_attention(q, k, v, lengths=n))(q, k, v, LENGTHS)
    want = np_attention(q, k, v, allowed(None, LENGTHS, 1))
    assert rel_err(out, want) < TOL
    assert attn.decode.default_splits(64 * 1024) == 16
    assert attn.decode.default_splits(3000) == 2
    assert attn.decode.default_splits(S) == 1


def test_bfloat16_inputs_keep_float32_statistics():
    q, k, v = qkv(5, B=4, T=1, S=S, N=4, K=2, dtype=jnp.bfloat16)
    out = attn.decode_attention(q, k, v, lengths=LENGTHS, num_splits=4)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, np_attention(q, k, v, allowed(None, LENGTHS, 1))) < 1e-2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lengths": np.array([1, 2, 3, 21])}, r"lengths: expected lengths in \[0, 20\]"),
        ({"lengths": np.array([-1, 2, 3, 4])}, r"lengths: expected lengths in \[0, 20\]"),
        ({"lengths": np.array([1, 2])}, r"lengths: expected integer lengths of shape \(4,\)"),
        ({"lengths": np.ones(4, np.float32)}, "lengths: expected integer lengths"),
        ({"lengths": LENGTHS, "num_splits": 0}, "num_splits: expected a positive int"),
        ({"lengths": LENGTHS, "sink_logits": np.zeros(3)}, r"sink_logits: expected shape \(4,\)"),
    ],
)
def test_bad_input_names_the_argument(kwargs, match):
    q, k, v = qkv(6, B=4, T=1, S=S, N=4, K=2)
    with pytest.raises(ValueError, match=match):
        attn.decode_attention(q, k, v, **kwargs)


def test_pallas_splits_equal_the_xla_ones():
    """The Pallas kernel (interpret mode here) computing every split: GQA, a window, sinks."""
    q, k, v = qkv(7, B=4, T=1, S=S, N=4, K=2)
    kw = dict(lengths=LENGTHS, num_splits=3, mask=MASKS["streaming"],
              sink_logits=np.array([0.5, -1.0, 2.0, 0.0], np.float32), return_lse=True)  # fmt: skip
    out, lse = attn.decode_attention(q, k, v, impl="pallas", interpret=True, **kw)
    want, want_lse = attn.decode_attention(q, k, v, **kw)
    assert rel_err(out, want) < TOL
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-6)
    with pytest.raises(ValueError, match="impl: expected one of"):
        attn.decode_attention(q, k, v, lengths=LENGTHS, impl="cudnn")
    with pytest.raises(ValueError, match=r"^interpret: expected True to run impl='pallas'"):
        attn.decode_attention(q, k, v, lengths=LENGTHS, impl="pallas")  # never in silence
    with pytest.raises(ValueError, match=r"^interpret: expected None for impl='dense'"):
        attn.decode_attention(q, k, v, lengths=LENGTHS, interpret=True)


def test_gradients_equal_one_dense_call_over_the_valid_keys():
    """d/dq, dk, dv and the sinks' through the splits and the merge (the dense call's
    own gradients are checked against float64 in test_dense.py)."""
    q, k, v = qkv(8, B=4, T=1, S=S, N=4, K=2)
    sink = jnp.array([0.5, -1.0, 2.0, 0.0])
    valid = (np.arange(S)[None] < LENGTHS[:, None]).astype(np.int32)
    q_pos = jnp.asarray(LENGTHS[:, None] - 1)
    ct = normal(9, (4, 1, 4, H_DIM))

    def split(q, k, v, sink):
        out = attn.decode_attention(q, k, v, lengths=LENGTHS, num_splits=3, sink_logits=sink,
                                    mask=masks.causal())  # fmt: skip
        return jnp.sum(out * ct)

    def dense(q, k, v, sink):
        out = attn.dot_product_attention(
            q, k, v, sink_logits=sink, mask=masks.causal(), q_positions=q_pos,
            q_segment_ids=np.ones((4, 1), np.int32), kv_segment_ids=valid,
        )  # fmt: skip
        return jnp.sum(out * ct)

    got = jax.grad(split, argnums=(0, 1, 2, 3))(q, k, v, sink)
    want = jax.grad(dense, argnums=(0, 1, 2, 3))(q, k, v, sink)
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) < 1e-5
    assert np.all(np.asarray(got[1])[3] == 0.0)  # the empty row's keys get nothing


def test_slots_past_the_lengths_and_invalid_slots_may_hold_anything():
    """NaN and Inf in slots past a row's length or marked invalid change nothing, bit for
    bit: outputs, lse and the gradients of q, k, v and the sinks (zero on those slots)."""
    q, k, v = qkv(10, B=4, T=1, S=S, N=4, K=2)
    sink = jnp.array([0.5, -1.0, 2.0, 0.0])
    kv_valid = np.ones((4, S), bool)
    kv_valid[1, 2] = kv_valid[2, 11] = False  # e.g. pages freed behind a window
    unused = (np.arange(S)[None] >= LENGTHS[:, None]) | ~kv_valid
    junk = np.where(np.arange(S) % 2, np.nan, np.inf)[None, :, None, None]

    @jax.jit
    def run(q, k, v, sink):
        def loss(q, k, v, sink):
            out, lse = attn.decode_attention(
                q, k, v, lengths=LENGTHS, num_splits=3, kv_valid=kv_valid, sink_logits=sink,
                mask=masks.causal(), return_lse=True,
            )  # fmt: skip
            return jnp.sum(out * out), (out, lse)

        return jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, sink)

    clean = run(q, k, v, sink)
    bad = jnp.asarray(unused[..., None, None])
    dirty = run(q, jnp.where(bad, -junk, k), jnp.where(bad, junk, v), sink)
    jax.tree.map(np.testing.assert_array_equal, dirty, clean)
    (_, dk, dv, _), _ = dirty
    assert not np.asarray(dk)[unused].any() and not np.asarray(dv)[unused].any()
