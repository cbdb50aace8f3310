"""The fixed-state families with the sequence sharded over a mesh axis.

``sharded_linear_attention``, ``sharded_delta_rule``, ``sharded_delta_product``,
``sharded_dplr_delta_rule``, ``sharded_ssd`` and ``sharded_short_conv`` compute
``attn.linear_attention`` (causal), ``attn.delta_rule``, ``attn.delta_product``,
``attn.dplr_delta_rule``, ``attn.ssd`` and ``attn.short_conv`` on whole arrays
whose T is split over one mesh axis, each device running the single-device
form on its contiguous span and the states chained across devices
(``attn.linear.chain``). Any batch size (a multiple of the devices of
``batch_axes``, which split it), an initial state, the final state, packed
segments across device boundaries; T need not be a multiple of the devices
(the tail is padded with padding tokens, which change no state). The mesh has
Auto axes (``jax.sharding.Mesh``) or Explicit ones (``jax.make_mesh``), of one
axis or several, passed or the context mesh of ``jax.set_mesh``; the arrays
come whole or already laid out, and the call is eager or jitted.

Each family is one record here (added to ``attn.linear.family.FAMILIES``):
its arrays as named tuples, how a span runs, its zero state and how its
transition is read; every public function is one call of
``attn.linear.family.sharded``, which checks the call as the one-device form
does and then the mesh (``MeshArgs``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attn.checks import fail
from attn.conv import short_conv
from attn.linear import delta, dplr, mamba, reference
from attn.linear.attention import (
    LINEAR_FORMS,
    check_decay,
    linear_attention,
    linear_attention_step,
)
from attn.linear.delta import DELTA_FORMS, delta_rule, delta_rule_step
from attn.linear.dplr import DPLR_FORMS, dplr_delta_rule, dplr_delta_rule_step
from attn.linear.family import FAMILIES, Family, Ids, normal, run_sharded, uniform, unit, widen
from attn.linear.mamba import SSD_FORMS, ssd, ssd_step
from attn.linear.product import delta_product, delta_product_step

__all__ = [
    "sharded_delta_product",
    "sharded_delta_rule",
    "sharded_dplr_delta_rule",
    "sharded_linear_attention",
    "sharded_short_conv",
    "sharded_ssd",
]


def _ids(ids: Ids) -> dict:
    return dict(q_segment_ids=ids.q_seg, kv_segment_ids=ids.kv_seg)


def _key_state(t, p, options):
    """The delta rules' zero state ``[B,N,H,E]`` float32."""
    B, N, E = t.v.shape[0], t.v.shape[-2], t.v.shape[-1]
    return jnp.zeros((B, N, t.q.shape[-1], E), jnp.float32)


def _wide_v(t, p, extra):
    return t._replace(v=widen(t.v, extra)), p


# ----------------------------------------------------------------------------
# Linear attention (and with it Mamba-2's SSD, its special case)


class LinearTokens(NamedTuple):
    q: jax.Array  # [B,T,N,H]
    k: jax.Array  # [B,T,K,H]
    v: jax.Array  # [B,T,K,E]
    log_gates: jax.Array | None = None  # [B,T,N]


class LinearParams(NamedTuple):
    decay: jax.Array | None = None  # [N] or ()
    projection: jax.Array | None = None  # [H,F] (FAVOR+)


def _linear_run(fn, t, p, ids, state, options):
    return fn(*t[:3], log_gates=t.log_gates, decay=p.decay, projection=p.projection,
              negative_gates=ids.extra, initial_state=state, return_state=True, **_ids(ids),
              **options)  # fmt: skip


def _linear_zeros(t, p, options):
    # Traced on unsharded shapes: only the state's shape is wanted.
    plain = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (t, p))
    run = lambda t, p: _linear_run(linear_attention, t, p, Ids(), None, options)[1]  # noqa: E731
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(run, *plain))


def _linear_values(t, p, ids):
    B, T, N = t.q.shape[:3]
    check_decay(p.decay, t.log_gates, B, T, N, causal=True, ids=ids.kv_seg)


def _linear_reference(t, p, options):
    G = t.q.shape[2] // t.k.shape[2]
    qf, kf = (reference.feature_map(options["feature_map"], x) for x in (t.q, t.k))
    kf, v = (jnp.repeat(x, G, axis=2) for x in (kf, t.v))
    out, kv, z = reference.gated_linear(qf, kf, v, t.log_gates, normalize=True)
    return out, (kv, z)


def _linear_examples(rng, z):
    B, T, K, N, H = (z[n] for n in "BTKNH")
    tokens = LinearTokens(normal(rng, B, T, N, H), normal(rng, B, T, K, H),
                          normal(rng, B, T, K, H), -uniform(rng, 0.0, 0.2, B, T, N))  # fmt: skip
    return {"gated": (tokens, LinearParams(), dict(feature_map="elu1"))}


LINEAR = Family(
    "linear_attention", linear_attention, linear_attention_step, LINEAR_FORMS, _linear_run,
    _linear_zeros, "scalar", _wide_v, _linear_values, reference=_linear_reference,
    examples=_linear_examples, data=("q", "k", "v"),
)  # fmt: skip


def sharded_linear_attention(
    q, k, v, *, log_gates=None, decay=None, projection=None, negative_gates=None,
    q_segment_ids=None, kv_segment_ids=None, initial_state=None, return_state: bool = False,
    axis_name: str, **options,
):  # fmt: skip
    """Causal ``attn.linear_attention`` with T sharded over the mesh axis ``axis_name``.

    Args:
      q, k, v, log_gates, decay, projection, negative_gates, q_segment_ids,
        kv_segment_ids, initial_state, return_state: as in
        ``attn.linear_attention`` (whole arrays; causal only).
      axis_name, and in ``**options`` mesh, batch_axes, exchange:
        ``attn.linear.family.MeshArgs``.
      **options: besides those, ``form``, ``feature_map``, ``normalize``, ``chunk_size``,
        ``eps``, ``scale``: as in ``attn.linear_attention``.

    Returns:
      out ``[B,T,N,E]``, or ``(out, LinearState)`` with ``return_state``.
    """
    if options.pop("causal", True) is not True:
        fail("causal", "True (a sharded sequence is a causal recurrence)", "False")
    decay = None if decay is None else jnp.asarray(decay, jnp.float32)
    tokens, params = LinearTokens(q, k, v, log_gates), LinearParams(decay, projection)
    ids = Ids(q_segment_ids, kv_segment_ids, negative_gates)
    return run_sharded(LINEAR, tokens, params, ids, initial_state, return_state, axis_name, options)


class SsdTokens(NamedTuple):
    x: jax.Array  # [B,T,N,E]
    dt: jax.Array  # [B,T,N]
    B: jax.Array  # [B,T,K,H]
    C: jax.Array  # [B,T,K,H]


class SsdParams(NamedTuple):
    A: jax.Array  # [N]
    D: jax.Array | None = None  # [N]


def _ssd_run(fn, t, p, ids, state, options):
    return fn(t.x, t.dt, p.A, t.B, t.C, D=p.D, segment_ids=ids.kv_seg, initial_state=state,
              return_state=True, **options)  # fmt: skip


def _ssd_zeros(t, p, options):
    B, _, N, E = t.x.shape
    return jnp.zeros((B, N, t.B.shape[-1], E), jnp.float32)


def _ssd_values(t, p, ids):
    mamba.check_inputs(t.x, t.dt, p.A, t.B, t.C, p.D, step=False, ids=ids.kv_seg)


def _ssd_examples(rng, z):
    B, T, K, N, H = (z[n] for n in "BTKNH")
    tokens = SsdTokens(normal(rng, B, T, N, H), uniform(rng, 0.01, 0.3, B, T, N),
                       normal(rng, B, T, K, H), normal(rng, B, T, K, H))  # fmt: skip
    return {"mamba2": (tokens, SsdParams(-uniform(rng, 0.5, 1.5, N), normal(rng, N)), {})}


SSD = Family(
    "ssd", ssd, ssd_step, SSD_FORMS, _ssd_run, _ssd_zeros, "scalar",
    lambda t, p, extra: (t._replace(x=widen(t.x, extra)), p), _ssd_values, same_tokens=False,
    reference=lambda t, p, options: reference.ssd(t.x, t.dt, p.A, t.B, t.C, p.D),
    examples=_ssd_examples, data=("x", "B", "C"),
)  # fmt: skip


def sharded_ssd(
    x, dt, A, B, C, *, D=None, segment_ids=None, initial_state=None, return_state: bool = False,
    axis_name: str, **options,
):  # fmt: skip
    """``attn.ssd`` (Mamba-2) with T sharded over the mesh axis ``axis_name``.

    Args:
      x, dt, A, B, C, D, segment_ids, initial_state, return_state: as in
        ``attn.ssd``, whole arrays.
      axis_name, and in ``**options`` mesh, batch_axes, exchange:
        ``attn.linear.family.MeshArgs``.
      **options: besides those, ``form``, ``chunk_size``, ``negative_eigenvalues``.

    Returns:
      y ``[B,T,N,E]``, or ``(y, state [B,N,H,E])`` with ``return_state``.
    """
    tokens, params = SsdTokens(x, dt, B, C), SsdParams(A, D)
    ids = Ids(kv_seg=segment_ids)
    return run_sharded(SSD, tokens, params, ids, initial_state, return_state, axis_name, options)


# ----------------------------------------------------------------------------
# The delta rules: DeltaNet, Gated DeltaNet, KDA, DeltaProduct, and RWKV-7's DPLR


class DeltaTokens(NamedTuple):
    q: jax.Array  # [B,T,K,H]
    k: jax.Array  # [B,T,K,H] ([B,T,n,K,H] for DeltaProduct)
    v: jax.Array  # [B,T,N,E] ([B,T,n,N,E])
    beta: jax.Array  # [B,T,N] ([B,T,n,N])
    log_gates: jax.Array | None = None  # [B,T,N] or [B,T,N,H]


class NoParams(NamedTuple):
    pass


def _delta_run(fn, t, p, ids, state, options):
    return fn(*t[:4], log_gates=t.log_gates, initial_state=state, return_state=True,
              **_ids(ids), **options)  # fmt: skip


def _delta_values(t, p, ids):
    lead, N, H = t.q.shape[:2], t.v.shape[-2], t.q.shape[-1]
    delta.check_values(t.beta, t.log_gates, lead, N, H, ids.kv_seg)


def _delta_examples(rng, z, steps=()):
    B, T, K, N, H = (z[n] for n in "BTKNH")
    q, k = unit(rng, B, T, K, H), unit(rng, B, T, *steps, K, H)
    v, beta = normal(rng, B, T, *steps, N, H), uniform(rng, 0.05, 0.95, B, T, *steps, N)
    gates = {"gated": (B, T, N), "kda": (B, T, N, H), "plain": None}
    if steps:
        gates = {"gated": gates["gated"]}
    return {
        name: (DeltaTokens(q, k, v, beta, None if g is None else -uniform(rng, 0.0, 0.2, *g)),
               NoParams(), {})
        for name, g in gates.items()
    }  # fmt: skip


DELTA = Family(
    "delta_rule", delta_rule, delta_rule_step, DELTA_FORMS, _delta_run, _key_state, "matrix",
    _wide_v, _delta_values,
    reference=lambda t, p, options: reference.delta_rule(t.q, t.k, t.v, t.beta, t.log_gates),
    examples=_delta_examples, data=("q", "k", "v"),
)  # fmt: skip
PRODUCT = DELTA._replace(
    name="delta_product", fn=delta_product, step=delta_product_step,
    examples=lambda rng, z: _delta_examples(rng, z, steps=(z["steps"],)),
)  # fmt: skip


class DplrTokens(NamedTuple):
    q: jax.Array  # [B,T,K,H]
    k: jax.Array  # [B,T,K,H]
    v: jax.Array  # [B,T,N,E]
    a: jax.Array  # [B,T,K|N,H]
    b: jax.Array  # [B,T,K|N,H]
    log_w: jax.Array  # [B,T,N,H]


def _dplr_run(fn, t, p, ids, state, options):
    return fn(*t, initial_state=state, return_state=True, **_ids(ids), **options)


def _dplr_examples(rng, z):
    """RWKV-7's: ``a = -kappa`` (unit, per q/k head), ``b = kappa a_in`` (per value head),
    ``log_w`` in (-0.6, 0)."""
    B, T, K, N, H = (z[n] for n in "BTKNH")
    kappa, a_in = unit(rng, B, T, K, H), uniform(rng, 0.0, 1.0, B, T, N, H)
    b = np.repeat(kappa, N // K, axis=2) * a_in
    tokens = DplrTokens(
        normal(rng, B, T, K, H),
        0.5 * normal(rng, B, T, K, H),
        normal(rng, B, T, N, H),
        -kappa,
        b,
        -uniform(rng, 0.0, 0.6, B, T, N, H),
    )
    return {"rwkv7": (tokens, NoParams(), dict(scale=H**-0.5))}  # fmt: skip


DPLR = Family(
    "dplr_delta_rule", dplr_delta_rule, dplr_delta_rule_step, DPLR_FORMS, _dplr_run, _key_state,
    "matrix", _wide_v, lambda t, p, ids: dplr.check_values(t.a, t.b, t.log_w, ids.kv_seg),
    reference=lambda t, p, options: reference.dplr_delta_rule(*t, scale=options["scale"]),
    examples=_dplr_examples, data=("q", "k", "v", "a", "b"),
)  # fmt: skip


def sharded_delta_rule(
    q, k, v, beta, *, log_gates=None, q_segment_ids=None, kv_segment_ids=None,
    initial_state=None, return_state: bool = False, axis_name: str, **options,
):  # fmt: skip
    """``attn.delta_rule`` with T sharded over the mesh axis ``axis_name``.

    Args:
      q, k, v, beta, log_gates, q_segment_ids, kv_segment_ids, initial_state,
        return_state: as in ``attn.delta_rule`` (the same ids), whole arrays.
      axis_name, and in ``**options`` mesh, batch_axes, exchange:
        ``attn.linear.family.MeshArgs``.
      **options: besides those, ``form``, ``chunk_size``, ``scale``.

    Returns:
      out ``[B,T,N,E]``, or ``(out, state [B,N,H,E])`` with ``return_state``.
    """
    tokens, ids = DeltaTokens(q, k, v, beta, log_gates), Ids(q_segment_ids, kv_segment_ids)
    return run_sharded(
        DELTA, tokens, NoParams(), ids, initial_state, return_state, axis_name, options
    )


def sharded_delta_product(
    q, k, v, beta, *, log_gates=None, q_segment_ids=None, kv_segment_ids=None,
    initial_state=None, return_state: bool = False, axis_name: str, **options,
):  # fmt: skip
    """``attn.delta_product`` with T sharded over ``axis_name`` (as ``sharded_delta_rule``)."""
    tokens, ids = DeltaTokens(q, k, v, beta, log_gates), Ids(q_segment_ids, kv_segment_ids)
    return run_sharded(
        PRODUCT, tokens, NoParams(), ids, initial_state, return_state, axis_name, options
    )


def sharded_dplr_delta_rule(
    q, k, v, a, b, log_w, *, q_segment_ids=None, kv_segment_ids=None, initial_state=None,
    return_state: bool = False, axis_name: str, **options,
):  # fmt: skip
    """``attn.dplr_delta_rule`` with T sharded over the mesh axis ``axis_name``.

    Its state is affine in the state a span starts from, ``S_out = M S_in +
    S_span`` with ``M = prod_t (diag(w_t) + b_t a_t^T)`` on the key axis, read
    as the delta rule's (``attn.linear.family``).

    Args:
      q, k, v, a, b, log_w, q_segment_ids, kv_segment_ids, initial_state,
        return_state: as in ``attn.dplr_delta_rule``, whole arrays.
      axis_name, and in ``**options`` mesh, batch_axes, exchange:
        ``attn.linear.family.MeshArgs``.
      **options: besides those, ``form``, ``chunk_size``, ``scale``.

    Returns:
      out ``[B,T,N,E]``, or ``(out, state [B,N,H,E])`` with ``return_state``.
    """
    tokens, ids = DplrTokens(q, k, v, a, b, log_w), Ids(q_segment_ids, kv_segment_ids)
    return run_sharded(
        DPLR, tokens, NoParams(), ids, initial_state, return_state, axis_name, options
    )


# ----------------------------------------------------------------------------
# The short convolution


class ConvTokens(NamedTuple):
    x: jax.Array  # [B,T,D]


class ConvParams(NamedTuple):
    weight: jax.Array  # [W,D]
    bias: jax.Array | None = None  # [D]


def _conv_run(fn, t, p, ids, state, options):
    return fn(t.x, p.weight, p.bias, state=state, segment_ids=ids.kv_seg)


def _conv_zeros(t, p, options):
    B, _, D = t.x.shape
    return jnp.zeros((B, p.weight.shape[0] - 1, D), t.x.dtype)


def _conv_widen(t, p, extra):
    return ConvTokens(widen(t.x, extra)), ConvParams(widen(p.weight, extra), widen(p.bias, extra))


CONV = Family(
    "short_conv", short_conv, None, (), _conv_run, _conv_zeros, "matrix", _conv_widen,
    lambda t, p, ids: None, same_tokens=False,
)  # fmt: skip


def sharded_short_conv(
    x, weight, bias=None, *, state=None, segment_ids=None, axis_name: str,
    **options,
):  # fmt: skip
    """``attn.short_conv`` with T sharded over the mesh axis ``axis_name``.

    The state entering a device is the window of the W - 1 real inputs
    before its span: the halo. With fewer real inputs than that on a device
    (padding, short spans) part of it comes from devices further back, so it
    is chained as every recurrence here is (its transition, a ``"matrix"`` on
    the window's slots, selects which slots survive the span).

    Args:
      x, weight, bias, state, segment_ids: as in ``attn.short_conv``, whole arrays.
      axis_name, and in ``**options`` mesh, batch_axes, exchange:
        ``attn.linear.family.MeshArgs`` (nothing else).

    Returns:
      ``(y [B,T,D], new_state [B,W-1,D])`` as ``attn.short_conv``.
    """
    tokens, params = ConvTokens(x), ConvParams(weight, bias)
    ids = Ids(kv_seg=segment_ids)
    return run_sharded(CONV, tokens, params, ids, state, True, axis_name, options)


for _family, _fn in (
    (LINEAR, sharded_linear_attention),
    (SSD, sharded_ssd),
    (DELTA, sharded_delta_rule),
    (PRODUCT, sharded_delta_product),
    (DPLR, sharded_dplr_delta_rule),
    (CONV, sharded_short_conv),
):
    FAMILIES.add(_family.name, _family._replace(sharded=_fn))
