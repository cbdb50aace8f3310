"""Odd inputs to the library: dtypes that cannot be right, NumPy arrays, empty axes, huge logits."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

import attn
import models
from attn import masks
from tests.attn.impls import SMALL_FLOAT32, attend, impls_with

RNG = np.random.default_rng(0)
Q = RNG.normal(size=(1, 32, 2, 8)).astype(np.float32)


def calls(*flags):
    """Causal attention in every implementation with ``flags``, and linear attention."""
    softmax = {
        impl: lambda q, k, v, impl=impl: attend(impl)(q, k, v, mask=masks.causal())
        for impl in impls_with(*flags, auto=True)
    }
    return softmax | {"linear": lambda q, k, v: attn.linear_attention(q, k, v)}


# Inputs every implementation refuses before it sees them (the one front, check_call).
CALLS = calls()
# Q's inputs: float32, head dim 8.
TAKING_Q = calls(*SMALL_FLOAT32)


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.complex64])
@pytest.mark.parametrize("impl", sorted(CALLS))
def test_integer_bool_and_complex_inputs_are_refused(impl, dtype):
    x = Q.astype(dtype)
    with pytest.raises(ValueError, match=r"^q: expected a real floating-point array"):
        CALLS[impl](x, x, x)
    v = Q.astype(dtype)
    with pytest.raises(ValueError, match=r"^v: expected a real floating-point array"):
        CALLS[impl](Q, Q, v)


@pytest.mark.parametrize("impl", sorted(TAKING_Q))
def test_numpy_arrays_take_the_same_path_as_jax_arrays(impl):
    import jax.numpy as jnp

    got = np.asarray(TAKING_Q[impl](Q, Q, Q))
    want = np.asarray(TAKING_Q[impl](*(jnp.asarray(x) for x in (Q, Q, Q))))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("impl", sorted(CALLS))
@pytest.mark.parametrize(
    "shapes",
    [
        ((1, 32, 2, 0), (1, 32, 2, 0), (1, 32, 2, 0)),  # H = 0
        ((1, 0, 2, 8), (1, 32, 2, 8), (1, 32, 2, 8)),  # T = 0
        ((1, 32, 2, 8), (1, 0, 2, 8), (1, 0, 2, 8)),  # S = 0
        ((1, 32, 2, 8), (1, 32, 2, 8), (1, 32, 2, 0)),  # E = 0
    ],
)
def test_empty_axes_are_one_value_error_in_every_impl(impl, shapes):
    q, k, v = (np.zeros(s, np.float32) for s in shapes)
    with pytest.raises(ValueError, match=r"^[qkv]: expected non-empty axes"):
        CALLS[impl](q, k, v)


def test_dense_reference_survives_logits_of_1e10():
    """Logits of 2.8e10: float32 rounds them in ulps of 2048, which exp() must never see."""
    big = np.full((1, 16, 2, 8), 1e5, np.float32)
    big[:, ::2] *= -1  # alternate signs: every row has keys of logit +-2.8e10
    outs = {
        impl: np.asarray(attend(impl)(big, big, big, mask=masks.causal()))
        for impl in impls_with(*SMALL_FLOAT32)
    }
    for impl, out in outs.items():
        assert np.isfinite(out).all(), impl
        np.testing.assert_allclose(out, outs["xla"], rtol=1e-6, err_msg=impl)


def test_presets_build_lazily_so_one_bad_size_spoils_no_other():
    sized = models.presets(num_heads=3)
    assert models.pattern(("mha", "window"), sized)[0].num_heads == 3
    with pytest.raises(ValueError, match=r"^num_kv_heads: .*building preset 'gqa'"):
        sized["gqa"]
    assert "gqa" in list(sized)  # listed, built only when asked for


NAN, INF = float("nan"), float("inf")
Q4 = Q[:, :4]
IDS = np.array([[1, 1, 2**40, 1]], np.int64)  # wraps to 0 (padding) as int32
NEAR_2_31 = np.arange(4, dtype=np.int64) + 2**31 - 2  # crosses 2**31: wraps as int32


@pytest.mark.parametrize(
    ("call", "arg"),
    [
        (lambda: attn.dot_product_attention(Q4, Q4, Q4, scale=NAN), "scale"),
        (lambda: attn.blockwise_attention(Q4, Q4, Q4, scale=INF), "scale"),
        (lambda: attn.attention(Q4, Q4, Q4, softcap=NAN), "softcap"),
        (lambda: attn.decode_attention(Q4, Q4, Q4, lengths=[4], softcap=INF), "softcap"),
        (lambda: attn.scores.softcap(INF), "cap"),
        (lambda: attn.linear_attention(Q4, Q4, Q4, scale=NAN), "scale"),
        (lambda: attn.delta_rule(Q4, Q4, Q4, Q4[..., 0], scale=INF), "scale"),
        (
            lambda: attn.dot_product_attention(Q4, Q4, Q4, q_segment_ids=IDS, kv_segment_ids=IDS),
            "q_segment_ids",
        ),
        (
            lambda: attn.linear_attention(Q4, Q4, Q4, q_segment_ids=IDS, kv_segment_ids=IDS),
            "q_segment_ids",
        ),
        (
            lambda: attn.short_conv(Q4[..., 0], np.ones((2, 2), np.float32), segment_ids=IDS),
            "segment_ids",
        ),
        (
            lambda: attn.dot_product_attention(
                Q4, Q4, Q4, mask=masks.causal(), q_positions=NEAR_2_31, kv_positions=NEAR_2_31
            ),
            "q_positions",
        ),
        (lambda: attn.decode_attention(Q4, Q4, Q4, lengths=np.array([2**32 + 3])), "lengths"),
        # jax.nn-style arguments are named as the caller passed them (not the mask's "left")
        (lambda: attn.attention(Q4, Q4, Q4, local_window_size=(-1, 2)), "local_window_size"),
        (lambda: attn.attention(Q4, Q4, Q4, local_window_size=(1.5, 2)), "local_window_size"),
        (lambda: attn.attention(Q4, Q4, Q4, local_window_size=(None, 2)), "local_window_size"),
        (lambda: attn.attention(Q4, Q4, Q4, local_window_size=-3), "local_window_size"),
    ],
)
def test_values_that_cannot_be_right_are_refused_where_concrete(call, arg):
    """NaN/Inf scales and caps; int64 ids, positions and lengths beyond what int32 holds
    (which would wrap: an id of 2**40 into padding, positions into another order)."""
    with pytest.raises(ValueError, match=rf"^{arg}: expected"):
        call()


def test_model_inputs_beyond_int32_are_refused():
    model = models.Decoder(
        models.ModelConfig(vocab_size=8, width=8, layers=(models.presets()["mha"],)),
        rngs=nnx.Rngs(0),
    )
    tokens = np.zeros((1, 4), np.int32)
    with pytest.raises(ValueError, match=r"^segment_ids: expected"):
        model(tokens, segment_ids=IDS)
    with pytest.raises(ValueError, match=r"^positions: expected"):
        model(tokens, positions=NEAR_2_31[None])
