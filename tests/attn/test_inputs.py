"""Odd inputs to the library: dtypes that cannot be right, NumPy arrays, empty axes, huge logits."""

from __future__ import annotations

import numpy as np
import pytest

import attn
import models
from attn import masks
from attn.pallas import flash_attention

RNG = np.random.default_rng(0)
Q = RNG.normal(size=(1, 32, 2, 8)).astype(np.float32)

CALLS = {
    "auto": lambda q, k, v: attn.attention(q, k, v, mask=masks.causal()),
    "dense": lambda q, k, v: attn.attention(q, k, v, mask=masks.causal(), impl="dense"),
    "blockwise": lambda q, k, v: attn.blockwise_attention(q, k, v, mask=masks.causal()),
    "xla": lambda q, k, v: attn.attention(q, k, v, mask=masks.causal(), impl="xla"),
    "pallas": lambda q, k, v: flash_attention(q, k, v, mask=masks.causal(), interpret=True),
    "linear": lambda q, k, v: attn.linear_attention(q, k, v),
}


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.complex64])
@pytest.mark.parametrize("impl", sorted(CALLS))
def test_integer_bool_and_complex_inputs_are_refused(impl, dtype):
    x = Q.astype(dtype)
    with pytest.raises(ValueError, match=r"^q: expected a real floating-point array"):
        CALLS[impl](x, x, x)
    v = Q.astype(dtype)
    with pytest.raises(ValueError, match=r"^v: expected a real floating-point array"):
        CALLS[impl](Q, Q, v)


@pytest.mark.parametrize("impl", sorted(CALLS))
def test_numpy_arrays_take_the_same_path_as_jax_arrays(impl):
    import jax.numpy as jnp

    got = np.asarray(CALLS[impl](Q, Q, Q))
    want = np.asarray(CALLS[impl](*(jnp.asarray(x) for x in (Q, Q, Q))))
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
        impl: np.asarray(attn.attention(big, big, big, mask=masks.causal(), impl=impl))
        for impl in ("dense", "blockwise", "xla")
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
