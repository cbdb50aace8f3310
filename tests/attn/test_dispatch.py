"""attn.attention: implementations agree or refuse, never change the math."""

import jax
import jax.numpy as jnp
import pytest

import attn
from attn import masks
from tests.util import qkv, rel_err


@pytest.mark.parametrize(
    "mask",
    [None, masks.causal(), masks.sliding_window(3), masks.causal() & masks.sliding_window(2)],
)
def test_xla_equals_dense_where_semantics_match(mask):
    q, k, v = qkv(0, B=2, T=9, N=4, K=2)
    dense = attn.attention(q, k, v, impl="dense", mask=mask)
    assert rel_err(attn.attention(q, k, v, impl="xla", mask=mask), dense) <= 1e-5
    assert rel_err(attn.attention(q, k, v, mask=mask), dense) <= 1e-5


def test_bidirectional_band_maps_to_jax_nn():
    q, k, v = qkv(1, B=1, T=8, N=2)
    mask = masks.bidirectional_window(2)
    assert (
        rel_err(
            attn.attention(q, k, v, impl="xla", mask=mask),
            attn.attention(q, k, v, impl="dense", mask=mask),
        )
        <= 1e-5
    )


def test_xla_gradients_equal_dense():
    q, k, v = qkv(2, B=1, T=7, N=2)
    g = lambda impl: jax.grad(  # noqa: E731
        lambda q: attn.attention(q, k, v, impl=impl, mask=masks.causal()).sum()
    )(q)
    assert rel_err(g("xla"), g("dense")) <= 1e-5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sink_logits": jnp.zeros(4)}, "sink_logits"),
        ({"softcap": 5.0}, "softcap"),
        (
            {"kv_segment_ids": jnp.ones((2, 9), int), "q_segment_ids": jnp.ones((2, 9), int)},
            "segment ids",
        ),
        ({"q_positions": jnp.arange(9)}, "q_positions"),
        ({"mask": masks.chunked(4)}, "mask"),
        ({"return_weights": True}, "return_weights"),
    ],
)
def test_xla_refuses_other_semantics(kwargs, match):
    q, k, v = qkv(3, B=2, T=9, N=4, K=2)
    with pytest.raises(ValueError, match=match):
        attn.attention(q, k, v, impl="xla", **kwargs)
    # ...while auto falls back to an implementation that has them.
    auto = attn.attention(q, k, v, **kwargs)
    dense = attn.attention(q, k, v, impl="dense", **kwargs)
    assert (
        rel_err(
            auto[0] if isinstance(auto, tuple) else auto,
            dense[0] if isinstance(dense, tuple) else dense,
        )
        <= 1e-5
    )


def test_causal_with_t_different_from_s_is_refused_by_xla():
    q, k, v = qkv(4, B=1, T=3, S=8, N=2)
    with pytest.raises(ValueError, match="T != S"):
        attn.attention(q, k, v, impl="xla", mask=masks.causal())


def test_cudnn_needs_a_gpu_and_unknown_impl_is_named():
    q, k, v = qkv(5, B=1, T=4, N=2, dtype=jnp.bfloat16)
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="cudnn"):
            attn.attention(q, k, v, impl="cudnn")
    else:
        out = attn.attention(q, k, v, impl="cudnn")
        assert rel_err(out, attn.attention(q, k, v, impl="dense")) <= 1e-2
    with pytest.raises(ValueError, match="impl"):
        attn.attention(q, k, v, impl="flash")
