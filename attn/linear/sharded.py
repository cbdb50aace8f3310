"""The fixed-state families with the sequence sharded over a mesh axis.

``sharded_linear_attention``, ``sharded_delta_rule``, ``sharded_delta_product``,
``sharded_ssd`` and ``sharded_short_conv`` compute ``attn.linear_attention``
(causal), ``attn.delta_rule``, ``attn.delta_product``, ``attn.ssd`` and
``attn.short_conv`` on whole arrays whose T is split over one mesh axis, each
device running the single-device form on its contiguous span and the states
chained across devices (``attn.linear.chain``). Any batch size (a multiple
of the devices of ``batch_axes``, which split it), an initial state, the final
state, packed segments across device boundaries; T need not be a multiple of
the devices (the tail is padded with padding tokens, which change no state).
The mesh has Auto axes (``jax.sharding.Mesh``) or Explicit ones
(``jax.make_mesh``), passed or the context mesh of ``jax.set_mesh``; the arrays
come whole or already laid out, and the call is eager or jitted.

The arguments are checked as the one-device form checks them: shapes and
options by tracing it on the whole shapes (``attn.linear.drive.check_whole``),
values (gate signs, ``A``, ``dt``, segment ids) by its own checks on the
values as given, so where they are concrete and not under a trace; then the
mesh and its axes (``check_mesh``). All before ``shard_map`` sees them.

How each family reads its transition ``M`` off one pass from a zero state:
the state's columns along the value axis evolve independently, each by the
same transition, and values only write. So the pass runs with extra value
columns that receive zero values and start from the identity (the delta rule:
``H`` columns, ``M`` is ``H x H``; a convolution: ``W - 1`` channels, ``M``
selects window slots) or from ones (a state decayed by scalar gates: one
column, ``M`` the product of the span's gates, zero past a segment start).
The transition is then exactly the one the form applies, segments, signs and
chunking included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from attn.checks import fail, segment_values
from attn.conv import short_conv
from attn.linear import attention, delta, mamba
from attn.linear.attention import LinearState, linear_attention
from attn.linear.chain import Recurrence
from attn.linear.delta import delta_rule
from attn.linear.drive import check_mesh, check_whole, drive, finish
from attn.linear.mamba import ssd
from attn.linear.product import delta_product

__all__ = [
    "sharded_delta_product",
    "sharded_delta_rule",
    "sharded_linear_attention",
    "sharded_short_conv",
    "sharded_ssd",
]


# ----------------------------------------------------------------------------
# Transitions


def _scalar(M, S):
    """A per-row, per-head scalar ``M [B,N]`` times state leaves ``[B,N,...]``."""
    return jax.tree.map(lambda x: M.reshape(M.shape + (1,) * (x.ndim - 2)) * x, S)


def _left(M, S):
    """``M [B,N,H,H] @ S [B,N,H,E]`` (the delta rule's key axis)."""
    return jnp.einsum("bnij,bnje->bnie", M, S)


def _left_t(M, G):
    return jnp.einsum("bnji,bnje->bnie", M, G)


def _slots(M, S):
    """``M [B,W-1,W-1] @ S [B,W-1,D]`` (a window's slots)."""
    return jnp.einsum("bij,bjd->bid", M, S)


def _slots_t(M, G):
    return jnp.einsum("bji,bjd->bid", M, G)


def _widen(x, extra: int):
    """``x [..., E]`` with ``extra`` zero columns appended."""
    return jnp.concatenate([x, jnp.zeros((*x.shape[:-1], extra), x.dtype)], axis=-1)


def _start(zeros, eye):
    """A state ``[..., E + e]``: zeros, then ``eye [..., e]`` (the extra columns)."""
    return jnp.concatenate([zeros, jnp.broadcast_to(eye, (*zeros.shape[:-1], eye.shape[-1]))], -1)


# ----------------------------------------------------------------------------
# Values
#
# check_whole traces the one-device form on abstract values, where its value
# checks see nothing; each sharded form calls those same checks again on the
# values as given (skipped under a trace, as there), before shard_map traces them.


def _check_ids(**ids):
    """Segment ids ``[B,T]`` (or None) by name: the values every one-device form refuses."""
    for name, x in ids.items():
        segment_values(x, name)


def _continued(aux: dict, state, options: dict) -> dict:
    """The keywords of a one-device call on a span: its ids, the state it continues from
    and returns, and the caller's options."""
    ids = dict(q_segment_ids=aux.get("q_seg"), kv_segment_ids=aux.get("seg"))
    return dict(ids, initial_state=state, return_state=True, **options)


# ----------------------------------------------------------------------------
# Linear attention (and with it Mamba-2's SSD, its special case)


def _linear(options):
    def run(t, p, a, state):
        return linear_attention(
            t["q"],
            t["k"],
            t["v"],
            log_gates=t.get("log_gates"),
            decay=p.get("decay"),
            projection=p.get("projection"),
            negative_gates=a.get("neg"),
            **_continued(a, state, options),
        )

    def zeros(t, p):
        # Traced on unsharded shapes: only the state's shape is wanted.
        plain = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (t, p))
        shape = jax.eval_shape(lambda t, p: run(t, p, {}, None)[1], *plain)
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape)

    def transition(t, p, a):
        kv0, z0 = zeros(t, p)
        start = LinearState(_start(kv0, jnp.ones((1,), jnp.float32)), z0)
        _, (kv, z) = run({**t, "v": _widen(t["v"], 1)}, p, a, start)
        return LinearState(kv[..., :-1], z), kv[..., 0, -1]

    return Recurrence(run, transition, _scalar, _scalar, zeros)


def sharded_linear_attention(
    q,
    k,
    v,
    *,
    axis_name: str,
    mesh: Mesh | None = None,
    batch_axes: tuple[str, ...] = (),
    exchange: str = "gather",
    log_gates=None,
    decay=None,
    projection=None,
    negative_gates=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    initial_state: LinearState | None = None,
    return_state: bool = False,
    **options,
):
    """Causal ``attn.linear_attention`` with T sharded over the mesh axis ``axis_name``.

    Args:
      q, k, v, log_gates, decay, projection, negative_gates, q_segment_ids,
        kv_segment_ids, initial_state, return_state: as in
        ``attn.linear_attention`` (whole arrays; causal only).
      axis_name: the mesh axis T is split over (contiguous spans).
      mesh: a ``jax.sharding.Mesh`` (Auto or Explicit axes), or None for the
        context mesh of ``jax.set_mesh``.
      batch_axes: other mesh axes, splitting B (their devices must divide it);
        the remaining axes split nothing (Auto ones are left to XLA).
      exchange: how the devices pass their states on (``attn.linear.chain.EXCHANGES``):
        ``"gather"`` (one all-gather of every device's transition and state,
        the default) or ``"scan"`` (an associative scan in log2 P rounds of
        ``ppermute``); the same result.
      **options: ``form``, ``feature_map``, ``normalize``, ``chunk_size``,
        ``eps``, ``scale``: as in ``attn.linear_attention``.

    Returns:
      out ``[B,T,N,E]``, or ``(out, LinearState)`` with ``return_state``.
    """
    if options.get("causal", True) is not True:
        fail("causal", "True (a sharded sequence is a causal recurrence)", repr(options["causal"]))
    options.pop("causal", None)
    arrays = dict(q=q, k=k, v=v, log_gates=log_gates)
    state = initial_state
    # The whole call's arguments are checked once, with their whole shapes.
    check_whole(
        linear_attention,
        **arrays,
        decay=decay,
        projection=projection,
        negative_gates=negative_gates,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        initial_state=state,
        **options,
    )
    B, T, N = jnp.shape(q)[:3]
    check_mesh(mesh, axis_name, batch_axes, B)
    _check_ids(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
    attention.check_decay(decay, log_gates, B, T, N, causal=True, ids=kv_segment_ids)
    params = dict(decay=None if decay is None else jnp.asarray(decay, jnp.float32))
    params["projection"] = projection
    aux = dict(neg=negative_gates, q_seg=q_segment_ids, seg=kv_segment_ids)
    rec = _linear(options)
    kw = dict(T=T, axis_name=axis_name, mesh=mesh, batch_axes=batch_axes, exchange=exchange)
    arrays = {k_: None if x is None else jnp.asarray(x) for k_, x in arrays.items()}
    y, final = drive(rec, arrays, params, aux, state, **kw)
    return finish(y, final, return_state)


def _ssd(options):
    def run(t, p, a, state):
        return ssd(
            t["x"],
            t["dt"],
            p["A"],
            t["B"],
            t["C"],
            D=p.get("D"),
            segment_ids=a.get("seg"),
            initial_state=state,
            return_state=True,
            **options,
        )

    def zeros(t, p):
        B, _, N, E = t["x"].shape
        return jnp.zeros((B, N, t["B"].shape[-1], E), jnp.float32)

    def transition(t, p, a):
        start = _start(zeros(t, p), jnp.ones((1,), jnp.float32))
        _, final = run({**t, "x": _widen(t["x"], 1)}, p, a, start)
        return final[..., :-1], final[..., 0, -1]

    return Recurrence(run, transition, _scalar, _scalar, zeros)


def sharded_ssd(
    x,
    dt,
    A,
    B,
    C,
    *,
    axis_name: str,
    mesh: Mesh | None = None,
    batch_axes: tuple[str, ...] = (),
    exchange: str = "gather",
    D=None,
    segment_ids=None,
    initial_state=None,
    return_state: bool = False,
    **options,
):
    """``attn.ssd`` (Mamba-2) with T sharded over the mesh axis ``axis_name``.

    Args:
      x, dt, A, B, C, D, segment_ids, initial_state, return_state: as in
        ``attn.ssd``, whole arrays.
      axis_name, mesh, batch_axes, exchange: as in ``sharded_linear_attention``.
      **options: ``form``, ``chunk_size``, ``negative_eigenvalues``.

    Returns:
      y ``[B,T,N,E]``, or ``(y, state [B,N,H,E])`` with ``return_state``.
    """
    check_whole(
        ssd, x, dt, A, B, C, D=D, segment_ids=segment_ids, initial_state=initial_state, **options
    )
    check_mesh(mesh, axis_name, batch_axes, jnp.shape(x)[0])
    mamba.check_inputs(x, dt, A, B, C, D, step=False, ids=segment_ids)  # the values, as given
    tokens = dict(x=jnp.asarray(x), dt=jnp.asarray(dt), B=jnp.asarray(B), C=jnp.asarray(C))
    params = dict(A=jnp.asarray(A), D=None if D is None else jnp.asarray(D))
    kw = dict(
        T=jnp.shape(x)[1], axis_name=axis_name, mesh=mesh, batch_axes=batch_axes, exchange=exchange
    )
    y, final = drive(_ssd(options), tokens, params, dict(seg=segment_ids), initial_state, **kw)
    return finish(y, final, return_state)


# ----------------------------------------------------------------------------
# The delta rule (DeltaNet, Gated DeltaNet, KDA) and DeltaProduct


def _delta(options, product: bool):
    fn = delta_product if product else delta_rule

    def run(t, p, a, state):
        return fn(
            t["q"],
            t["k"],
            t["v"],
            t["beta"],
            log_gates=t.get("log_gates"),
            **_continued(a, state, options),
        )

    def zeros(t, p):
        B, N, E = t["v"].shape[0], t["v"].shape[-2], t["v"].shape[-1]
        return jnp.zeros((B, N, t["q"].shape[-1], E), jnp.float32)

    def transition(t, p, a):
        H = t["q"].shape[-1]
        start = _start(zeros(t, p), jnp.eye(H, dtype=jnp.float32))
        _, final = run({**t, "v": _widen(t["v"], H)}, p, a, start)
        return final[..., :-H], final[..., -H:]

    return Recurrence(run, transition, _left, _left_t, zeros)


def _delta_call(product, q, k, v, beta, log_gates, ids, state, return_state, kw, options):
    """Both sharded delta forms; ``ids`` ``(q_segment_ids, kv_segment_ids)``."""
    fn = delta_product if product else delta_rule
    q_seg, seg = ids
    check_whole(
        fn,
        q,
        k,
        v,
        beta,
        log_gates=log_gates,
        q_segment_ids=q_seg,
        kv_segment_ids=seg,
        initial_state=state,
        **options,
    )
    check_mesh(kw["mesh"], kw["axis_name"], kw["batch_axes"], jnp.shape(q)[0])
    lead, N, H = jnp.shape(q)[:2], jnp.shape(v)[-2], jnp.shape(q)[-1]
    _check_ids(q_segment_ids=q_seg, kv_segment_ids=seg)
    delta.check_values(beta, log_gates, lead, N, H, seg)  # the values, as given
    tokens = dict(q=q, k=k, v=v, beta=beta, log_gates=log_gates)
    tokens = {name: None if x is None else jnp.asarray(x) for name, x in tokens.items()}
    kw = dict(kw, T=jnp.shape(q)[1])
    aux = dict(q_seg=q_seg, seg=seg)
    y, final = drive(_delta(options, product), tokens, {}, aux, state, **kw)
    return finish(y, final, return_state)


def sharded_delta_rule(
    q,
    k,
    v,
    beta,
    *,
    axis_name: str,
    mesh: Mesh | None = None,
    batch_axes: tuple[str, ...] = (),
    exchange: str = "gather",
    log_gates=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    initial_state=None,
    return_state: bool = False,
    **options,
):
    """``attn.delta_rule`` with T sharded over the mesh axis ``axis_name``.

    Args:
      q, k, v, beta, log_gates, q_segment_ids, kv_segment_ids, initial_state,
        return_state: as in ``attn.delta_rule`` (the same ids), whole arrays.
      axis_name, mesh, batch_axes, exchange: as in ``sharded_linear_attention``.
      **options: ``form``, ``chunk_size``, ``scale``.

    Returns:
      out ``[B,T,N,E]``, or ``(out, state [B,N,H,E])`` with ``return_state``.
    """
    ids = (q_segment_ids, kv_segment_ids)
    kw = dict(axis_name=axis_name, mesh=mesh, batch_axes=batch_axes, exchange=exchange)
    args = (q, k, v, beta, log_gates, ids, initial_state, return_state, kw, options)
    return _delta_call(False, *args)


def sharded_delta_product(
    q,
    k,
    v,
    beta,
    *,
    axis_name: str,
    mesh: Mesh | None = None,
    batch_axes: tuple[str, ...] = (),
    exchange: str = "gather",
    log_gates=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    initial_state=None,
    return_state: bool = False,
    **options,
):
    """``attn.delta_product`` with T sharded over ``axis_name`` (as ``sharded_delta_rule``)."""
    ids = (q_segment_ids, kv_segment_ids)
    kw = dict(axis_name=axis_name, mesh=mesh, batch_axes=batch_axes, exchange=exchange)
    args = (q, k, v, beta, log_gates, ids, initial_state, return_state, kw, options)
    return _delta_call(True, *args)


# ----------------------------------------------------------------------------
# The short convolution


def _conv(W: int):
    def run(t, p, a, state):
        return short_conv(t["x"], p["weight"], p.get("bias"), state=state, segment_ids=a.get("seg"))

    def zeros(t, p):
        B, _, D = t["x"].shape
        return jnp.zeros((B, W - 1, D), t["x"].dtype)

    def transition(t, p, a):
        x, weight, bias = t["x"], p["weight"], p.get("bias")
        start = _start(zeros(t, p), jnp.eye(W - 1, dtype=x.dtype))
        params = {"weight": _widen(weight, W - 1)}
        if bias is not None:
            params["bias"] = _widen(bias, W - 1)
        _, final = run({"x": _widen(x, W - 1)}, params, a, start)
        return final[..., : -(W - 1)], final[..., -(W - 1) :]

    return Recurrence(run, transition, _slots, _slots_t, zeros)


def sharded_short_conv(
    x,
    weight,
    bias=None,
    *,
    axis_name: str,
    mesh: Mesh | None = None,
    batch_axes: tuple[str, ...] = (),
    exchange: str = "gather",
    state=None,
    segment_ids=None,
):
    """``attn.short_conv`` with T sharded over the mesh axis ``axis_name``.

    The state entering a device is the window of the W - 1 real inputs
    before its span: the halo. With fewer real inputs than that on a device
    (padding, short spans) part of it comes from devices further back, so it
    is chained as every recurrence here is (its transition selects which
    slots survive the span).

    Args:
      x, weight, bias, state, segment_ids: as in ``attn.short_conv``, whole arrays.
      axis_name, mesh, batch_axes, exchange: as in ``sharded_linear_attention``.

    Returns:
      ``(y [B,T,D], new_state [B,W-1,D])`` as ``attn.short_conv``.
    """
    check_whole(short_conv, x, weight, bias, state=state, segment_ids=segment_ids)
    check_mesh(mesh, axis_name, batch_axes, jnp.shape(x)[0])
    _check_ids(segment_ids=segment_ids)
    W = jnp.shape(weight)[0]
    x = jnp.asarray(x)
    if W == 1:  # no window: every token alone
        return short_conv(x, weight, bias, state=state, segment_ids=segment_ids)
    params = dict(weight=jnp.asarray(weight), bias=None if bias is None else jnp.asarray(bias))
    kw = dict(
        T=x.shape[1], axis_name=axis_name, mesh=mesh, batch_axes=batch_axes, exchange=exchange
    )
    return drive(_conv(W), dict(x=x), params, dict(seg=segment_ids), state, **kw)
