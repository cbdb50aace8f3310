"""RoPE: relative positions in the score, norms preserved, both layouts."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import attn
from tests.chex_util import VariantTestCase
from tests.util import normal, rel_err

LAYOUTS = ["half", "interleaved"]


def rotate_one(x, pos, **kw):
    """RoPE of a single vector ``[H]`` at one position."""
    return attn.apply_rope(x[None, None, None], jnp.array([pos]), **kw)[0, 0, 0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_score_depends_only_on_relative_position(layout):
    q, k = normal(0, (16,)), normal(1, (16,))
    score = lambda m, n: float(rotate_one(q, m, layout=layout) @ rotate_one(k, n, layout=layout))  # noqa: E731
    for m, n in [(5, 2), (3, 0), (103, 100), (1003, 1000)]:
        assert score(m, n) == pytest.approx(score(3, 0), rel=1e-4)
    assert score(3, 0) != pytest.approx(score(4, 0), rel=1e-2)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rotary_dim", [None, 8])
def test_norm_preserved_and_gradient_is_the_inverse_rotation(layout, rotary_dim):
    x = normal(2, (2, 5, 3, 16))
    pos = jnp.array([[0, 1, 2, 30, 400], [7, 7, 7, 7, 7]])
    y = attn.apply_rope(x, pos, layout=layout, rotary_dim=rotary_dim)
    assert rel_err(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1)) <= 1e-6
    if rotary_dim:
        chex.assert_trees_all_equal(y[..., 8:], x[..., 8:])
    # RoPE is a rotation R: d<R x, g>/dx = R^T g, the rotation by -position.
    g = normal(3, x.shape)
    grad = jax.grad(
        lambda x: (attn.apply_rope(x, pos, layout=layout, rotary_dim=rotary_dim) * g).sum()
    )(x)
    assert rel_err(grad, attn.apply_rope(g, -pos, layout=layout, rotary_dim=rotary_dim)) <= 1e-5


def test_layouts_are_a_permutation_of_each_other():
    x = normal(4, (1, 6, 2, 8))
    pos = jnp.arange(6)
    perm = np.array([0, 4, 1, 5, 2, 6, 3, 7])  # interleaved channel 2i,2i+1 <-> half channel i,i+4
    inter = attn.apply_rope(x[..., perm], pos, layout="interleaved")
    half = attn.apply_rope(x, pos, layout="half")
    assert rel_err(inter, half[..., perm]) <= 1e-6


def test_position_zero_is_identity_and_bfloat16_keeps_dtype():
    x = normal(5, (1, 3, 2, 8), jnp.bfloat16)
    y = attn.apply_rope(x, jnp.zeros(3, int))
    assert y.dtype == jnp.bfloat16
    chex.assert_trees_all_equal(y, x, strict=True)  # same dtype, same values


def test_matches_the_paper_formula():
    # Interleaved pair (x0, x1) at position m rotates by m * base^0 = m radians.
    x = jnp.array([1.0, 0.0, 0.0, 1.0])
    y = rotate_one(x, 2, layout="interleaved")
    theta1 = 2 * 10000.0 ** (-2 / 4)
    want = [np.cos(2), np.sin(2), -np.sin(theta1), np.cos(theta1)]
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"x": jnp.ones((2, 4, 8))}, "x: expected a rank-4"),
        ({"positions": jnp.arange(5)}, "positions"),
        ({"rotary_dim": 3}, "rotary_dim"),
        ({"rotary_dim": 10}, "rotary_dim"),
        ({"layout": "neox"}, "layout"),
        ({"base": 0.0}, "base"),
    ],
)
def test_bad_input(kwargs, match):
    args = {"x": jnp.ones((2, 4, 2, 8)), "positions": jnp.arange(4)}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        attn.apply_rope(args.pop("x"), args.pop("positions"), **args)


def np_rope(x, positions, *, base=10000.0, rotary_dim=None, layout="half"):
    """Float64 RoPE: channel pairs (a, b) rotated by ``position * base ** (-2i / rotary_dim)``."""
    x = np.asarray(x, np.float64)
    R = rotary_dim or x.shape[-1]
    angle = np.asarray(positions, np.float64)[..., None, None] * base ** (-np.arange(0, R, 2) / R)
    if layout == "half":
        ia, ib = np.arange(R // 2), np.arange(R // 2) + R // 2
    else:
        ia, ib = np.arange(0, R, 2), np.arange(1, R, 2)
    a, b = x[..., ia], x[..., ib]
    out = x.copy()
    out[..., ia] = a * np.cos(angle) - b * np.sin(angle)
    out[..., ib] = a * np.sin(angle) + b * np.cos(angle)
    return out


class RopeVariantsTest(VariantTestCase):
    # Positions up to 64: float32 angles are then within ~1e-6 of exact.
    POSITIONS = np.array([[0, 1, 2, 3, 31, 64], [64, 63, 7, 7, 5, 0]], np.int32)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        ("half", "half", None, 10000.0),
        ("half_partial", "half", 6, 10000.0),
        ("interleaved", "interleaved", None, 500000.0),  # Llama 3's base
        ("interleaved_partial", "interleaved", 6, 10000.0),
    )
    def test_matches_numpy_rotation_and_gradient(self, layout, rotary_dim, base):
        x, g = normal(40, (2, 6, 3, 10)), normal(41, (2, 6, 3, 10))
        kw = dict(layout=layout, rotary_dim=rotary_dim, base=base)
        rope = self.traced_variant(lambda x, pos: attn.apply_rope(x, pos, **kw))
        want = np_rope(x, self.POSITIONS, **kw)
        chex.assert_trees_all_close(rope(x, self.POSITIONS), want, rtol=1e-5, atol=1e-6)
        # d<R x, g>/dx = R^T g: the rotation by minus the positions.
        grad = self.traced_variant(
            jax.grad(lambda x, pos: (attn.apply_rope(x, pos, **kw) * g).sum())
        )
        want_grad = np_rope(g, -self.POSITIONS, **kw)
        chex.assert_trees_all_close(grad(x, self.POSITIONS), want_grad, rtol=1e-5, atol=1e-6)


def test_an_odd_head_dim_blames_x_unless_rotary_dim_is_passed():
    x = jnp.ones((1, 2, 1, 7))
    with pytest.raises(ValueError, match=r"x: expected an even head dim H .*H = 7"):
        attn.apply_rope(x, jnp.arange(2))
    out = attn.apply_rope(x, jnp.arange(2), rotary_dim=6)  # partial rotary works with H odd
    np.testing.assert_array_equal(np.asarray(out[..., 6]), np.ones((1, 2, 1)))
