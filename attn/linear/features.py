"""Feature maps of linear attention: ``phi: x [..., H] -> [..., F]``.

``phi(q).phi(k)`` replaces softmax's ``exp(q.k)``. The maps here are pure
functions of one array (``favor`` also takes its random projection); any
callable with that signature works as a user map, passed directly or added
by name with ``register_feature_map`` (then a layer config can name it).
``attn.linear`` exports the public names (``from attn.linear import FEATURE_MAPS, elu1``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp

from attn.checks import fail, positive_float
from attn.registry import Registry

__all__ = [
    "EXP_KERNEL_MAPS",
    "FEATURE_MAPS",
    "elu1",
    "favor",
    "favor_projection",
    "identity",
    "linear_feature_dim",
    "register_feature_map",
    "relu",
    "silu",
    "taylor",
]

# Names of the maps that approximate exp(scale * q.k): they get softmax's default
# scale. Built-ins here; register_feature_map(..., approximates_exp=True) adds to it.
EXP_KERNEL_MAPS: set[str] = {"taylor", "favor"}


def identity(x):
    """phi(x) = x, F = H. Not positive: use with ``normalize=False``."""
    return x


def elu1(x):
    """phi(x) = elu(x) + 1 (Katharopoulos et al., 2020), positive, F = H."""
    # exp(x) on x <= 0 is elu(x) + 1 without expm1's extra cost; the inner
    # where keeps exp's argument <= 0, so its unused branch cannot overflow.
    return jnp.where(x > 0, x + 1.0, jnp.exp(jnp.where(x > 0, 0.0, x)))


def relu(x):
    """phi(x) = max(x, 0), non-negative, F = H."""
    return jax.nn.relu(x)


def silu(x):
    """phi(x) = x sigmoid(x), F = H; not positive: use with ``normalize=False`` (MiniMax-01's
    lightning attention maps q, k and v so and reads no normalizer)."""
    return jax.nn.silu(x)


def taylor(x):
    """Second-order Taylor features (Based): ``[1, x, x (x) x / sqrt(2)]``, F = 1 + H + H^2.

    ``phi(q).phi(k) = 1 + q.k + (q.k)^2 / 2`` approximates ``exp(q.k)`` and is
    positive for every q, k.
    """
    # The outer product is formed on rows of H (leading axes flattened, a free
    # reshape). Formed on the chunkwise layout [U,B,K,G,C,H] instead, its
    # backward pass is a rank-7 multiply-reduce that jaxlib 0.10.2's CPU backend
    # hands to YNNPACK, which segfaults on it when G == 1
    # (tools/repro_jaxlib_0_10_2_segfault.py).
    rows = x.reshape(-1, x.shape[-1])
    outer = (rows[:, :, None] * rows[:, None, :]).reshape(*x.shape[:-1], -1)
    one = jnp.ones((*x.shape[:-1], 1), x.dtype)
    return jnp.concatenate([one, x, outer * (1.0 / math.sqrt(2.0))], axis=-1)


def favor(x, *, projection):
    """Performer FAVOR+ positive random features, F = ``projection.shape[1]``.

    ``phi(x) = exp(x W - |x|^2 / 2) / sqrt(F)`` with ``W = projection [H, F]``
    gives ``E[phi(q).phi(k)] = exp(q.k)`` when the columns of W are Gaussian
    (or orthogonal with Gaussian norms, see ``favor_projection``).
    """
    num_features = projection.shape[-1]
    logits = x @ projection.astype(x.dtype) - 0.5 * jnp.sum(x * x, axis=-1, keepdims=True)
    return jnp.exp(logits) * (1.0 / math.sqrt(num_features))


FEATURE_MAPS: Registry[Callable[..., jax.Array]] = Registry("feature map", "feature_map")


def register_feature_map(name: str, fn=None, *, approximates_exp: bool = False):
    """Adds a feature map ``phi: x [..., H] -> [..., F]`` under ``name``.

    Any layer config or call may then name it (``feature_map=name``); F is
    found by tracing ``fn`` abstractly, so it needs no declaration. Usable as
    a call, ``register_feature_map("softplus", jax.nn.softplus)``, or a decorator,
    ``@register_feature_map("softplus")``.

    Args:
      name: the map's name.
      fn: a function of one array (no parameters: a learned map is a layer kind
        of its own); None returns a decorator.
      approximates_exp: ``phi(q).phi(k)`` approximates ``exp(q.k)``, so calls
        default to softmax's scale ``1/sqrt(H)`` instead of 1 (as ``taylor`` does).

    Raises:
      ValueError: the name is taken by another map (naming both), or ``fn`` is not callable.
    """

    def add(fn):
        if not callable(fn):
            fail("fn", "a callable x [..., H] -> [..., F]", repr(fn))
        FEATURE_MAPS.add(name, fn)
        if approximates_exp:
            EXP_KERNEL_MAPS.add(name)
        else:
            EXP_KERNEL_MAPS.discard(name)
        return fn

    return add if fn is None else add(fn)


for _name, _fn in (
    ("identity", identity),
    ("elu1", elu1),
    ("relu", relu),
    ("silu", silu),
    ("taylor", taylor),
    ("favor", favor),  # also needs projection=[H, F]
):
    register_feature_map(_name, _fn, approximates_exp=_name in EXP_KERNEL_MAPS)


def favor_projection(key, head_dim: int, num_features: int) -> jax.Array:
    """Orthogonal random features for ``"favor"`` (Performer's ORF).

    Columns come in blocks of ``head_dim`` mutually orthogonal directions (QR of
    a Gaussian matrix), each rescaled by the norm of an independent Gaussian
    vector so every column is marginally ``N(0, I_H)``: the estimator stays
    unbiased and orthogonality lowers its variance.

    Args:
        key: a ``jax.random`` key.
        head_dim: H.
        num_features: F.

    Returns:
        projection ``[H, F]`` float32.
    """
    if int(head_dim) < 1:
        fail("head_dim", "a positive int", head_dim)
    if int(num_features) < 1:
        fail("num_features", "a positive int", num_features)
    return _favor_projection(key, int(head_dim), int(num_features))


@partial(jax.jit, static_argnums=(1, 2))
def _favor_projection(key, H: int, F: int):
    num_blocks = -(-F // H)
    block_key, norm_key = jax.random.split(key)
    gaussian = jax.random.normal(block_key, (num_blocks, H, H), jnp.float32)
    orthonormal = jax.vmap(lambda m: jnp.linalg.qr(m)[0])(gaussian)  # columns orthonormal
    directions = jnp.moveaxis(orthonormal, 0, 1).reshape(H, num_blocks * H)[:, :F]
    norms = jnp.linalg.norm(jax.random.normal(norm_key, (F, H), jnp.float32), axis=-1)
    return directions * norms[None, :]


def resolve(feature_map, projection, head_dim: int) -> Callable[[jax.Array], jax.Array]:
    """Validates ``feature_map``/``projection`` and returns x ``[...,H]`` -> ``[...,F]``."""
    if callable(feature_map):
        if projection is not None:
            fail("projection", "None unless feature_map='favor'", "an array")
        return feature_map
    if feature_map not in FEATURE_MAPS:
        fail("feature_map", f"one of {sorted(FEATURE_MAPS)} or a callable", repr(feature_map))
    if feature_map != "favor":
        if projection is not None:
            fail("projection", "None unless feature_map='favor'", "an array")
        return FEATURE_MAPS[feature_map]
    if projection is None:
        fail("projection", "an [H, F] array (see favor_projection) for feature_map='favor'", None)
    if getattr(projection, "ndim", None) != 2 or projection.shape[0] != head_dim:
        fail("projection", f"shape ({head_dim}, F)", f"shape {getattr(projection, 'shape', None)}")
    return partial(favor, projection=jnp.asarray(projection, jnp.float32))


def output_dim(phi: Callable[[jax.Array], jax.Array], head_dim: int) -> int:
    """F of the resolved map ``phi`` for head dim H (traced abstractly, no compute)."""
    return jax.eval_shape(phi, jax.ShapeDtypeStruct((head_dim,), jnp.float32)).shape[-1]


def root_scale(scale, feature_map, head_dim: int) -> float:
    """Returns the factor applied to q and to k before the map (sqrt of ``scale``)."""
    if scale is None:
        scale = head_dim**-0.5 if feature_map in EXP_KERNEL_MAPS else 1.0
    return math.sqrt(positive_float(scale, "scale", "a positive finite Python number (static)"))


def linear_feature_dim(feature_map="elu1", head_dim: int = 64, *, projection=None) -> int:
    """F, the feature dim of ``feature_map`` for head dim H (for ``init_linear_state``)."""
    return output_dim(resolve(feature_map, projection, head_dim), head_dim)
