"""A fixed-state recurrence split over a mesh axis: each device its span, the states chained.

Every fixed-state layer of ``attn.linear`` (linear attention with its
normalizer, decays and gates; the delta rule; Mamba-2's SSD) and the short
convolution of ``attn.conv`` is affine in the state it starts from: over a
span of tokens,

    S_out = M S_in + S_span            y = y(S_in), affine too

where ``S_span`` is the span's final state from a zero state and ``M`` its
transition (a scalar per head where the state decays by gates, an ``H x H``
matrix for the delta rule, a slot selection for a convolution's window).
So with the sequence sharded over P devices (contiguous spans, device i
holding the i-th), device i

1. runs its span from a zero state, reading off ``(M_i, S_i)`` (``transition``;
   how each family reads ``M`` is in ``attn.linear.sharded``);
2. all-gathers the pairs and chains ``S <- M_j S + S_j`` over the devices
   before it, from the initial state: its incoming state (and, chained over
   all P, the final state, the same on every device);
3. runs its span again from that state (``run``): its outputs.

Packed segments across devices: the state crosses from device i - 1 to
device i only where device i's first real token continues the segment held by
the last real token before it (``continues``); otherwise device i starts from
a zero state, as one device would at that segment boundary. Boundaries inside
a span are the forms' own (they make ``M_i`` zero).

The backward pass is a rule of its own (``jax.custom_vjp``), the same chain
run in reverse: with ``G_i`` the cotangent of device i's outgoing state and
``D_i`` that of its incoming state through its outputs alone (the VJP of
``run`` with a zero state cotangent), ``G_{i-1} = c_i (D_i + M_i^T G_i)``,
from ``G_{P-1}`` the final state's cotangent. Device i all-gathers
``(D_j, M_j)``, chains to its own ``G_i`` and takes one VJP of ``run`` with
``(dy_i, G_i)``. What is kept between the passes per device: its inputs, its
incoming state and its transition (not the P gathered pairs, which autodiff
of the chain would keep).

Two exchanges (``EXCHANGES``), the same result. ``"gather"`` (the default):
one all-gather, ``P - 1`` pairs (transition plus state) received per device
and pass. ``"scan"``: an associative scan over the axis, log2 P rounds of
``ppermute`` composing affine maps (``_scan_chain``, and a suffix scan
backward), then a shift of each device's outgoing state and an all-reduce of
the final one: log2 P pairs plus about three states, fewer bytes from 8
devices on (``bench/parallel.py`` measured 1.5x to 1.75x fewer), in log2 P + 2
dependent collectives, each round a product of transitions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from attn.checks import fail
from attn.masks import PADDING

__all__ = ["EXCHANGES", "Recurrence", "chain_over_axis", "continues"]

# How the devices exchange their (transition, state) pairs: see the module docstring.
EXCHANGES = ("gather", "scan")


class Recurrence(NamedTuple):
    """One family's affine recurrence, as ``chain_over_axis`` drives it.

    ``tokens`` (a named tuple of float ``[B,T_local,...]`` arrays, differentiated),
    ``params`` (a named tuple of replicated float arrays, differentiated), ``aux``
    (``attn.linear.family.Ids``: segment ids, gate signs, ``[B,T_local,...]``;
    not differentiated) and a state pytree whose leaves lead with B. None
    fields are absent arrays.

    Attributes:
      run: ``(tokens, params, aux, state) -> (y, final state)``: the
        single-device form over one span from ``state``.
      transition: ``(tokens, params, aux) -> (S_span, M)``: the span's final
        state from a zero state and its transition (leaves leading with B).
      apply: ``(M, S) -> M S``.
      apply_t: ``(M, G) -> M^T G``.
      zeros: ``(tokens, params) -> state``: the zero state of a span's rows.
    """

    run: Callable
    transition: Callable
    apply: Callable
    apply_t: Callable
    zeros: Callable


def _rows(c, x):
    """``c [B]`` times every row of ``x [B,...]``."""
    return c.reshape(c.shape + (1,) * (x.ndim - 1)) * x


def _scale_rows(c, tree):
    return jax.tree.map(lambda x: _rows(c, x), tree)


def _add(a, b):
    return jax.tree.map(jnp.add, a, b)


def _select(flag, a, b):
    return jax.tree.map(lambda x, y: jnp.where(flag, x, y), a, b)


def continues(seg, axis_name: str, num_devices: int):
    """``[P,B]`` float32: 1 where device j's span continues the state entering it.

    With ``seg [B,T_local]`` (this device's ids; None: one sequence per row,
    all ones), device j continues unless its first real token starts a new
    segment: its id differs from that of the last real token on the devices
    before it (a row of padding only, before or here, continues). The same on
    every device.
    """
    if seg is None:
        return None
    T = seg.shape[1]
    real = seg != PADDING
    first = jnp.take_along_axis(seg, jnp.argmax(real, axis=1)[:, None], 1)[:, 0]
    last_at = T - 1 - jnp.argmax(real[:, ::-1], axis=1)
    last = jnp.take_along_axis(seg, last_at[:, None], 1)[:, 0]
    any_real = jnp.any(real, axis=1)
    first = jnp.where(any_real, first, PADDING)
    last = jnp.where(any_real, last, PADDING)
    firsts, lasts = lax.all_gather((first, last), axis_name)  # [P,B] each
    held = jnp.full_like(first, PADDING)  # the id held before device j
    flags = []
    for j in range(num_devices):
        keep = (held == PADDING) | (firsts[j] == PADDING) | (firsts[j] == held)
        flags.append(keep.astype(jnp.float32))
        held = jnp.where(lasts[j] != PADDING, lasts[j], held)
    return jnp.stack(flags)


def _chain(rec: Recurrence, pairs, cs, state0, me, num_devices: int):
    """Forward chain: ``(incoming state of device me, final state)``.

    ``pairs = (M [P,...], S_span [P,...])`` gathered; ``cs [P,B]`` or None.
    """
    Ms, spans = pairs
    state, incoming = state0, state0
    for j in range(num_devices):
        if j and cs is not None:
            state = _scale_rows(cs[j], state)
        incoming = _select(me == j, state, incoming)
        at = jax.tree.map(lambda x, j=j: x[j], (Ms, spans))
        state = _add(rec.apply(at[0], state), at[1])
    return incoming, state


def _chain_back(rec: Recurrence, Ms, Ds, cs, d_final, me, num_devices: int):
    """Backward chain: ``(G of device me's outgoing state, cotangent of the initial state)``."""
    G = d_final
    mine = d_final
    for j in range(num_devices - 1, -1, -1):
        mine = _select(me == j, G, mine)
        at = jax.tree.map(lambda x, j=j: x[j], (Ms, Ds))
        G = _add(at[1], rec.apply_t(at[0], G))  # cotangent of device j's incoming state
        if j and cs is not None:
            G = _scale_rows(cs[j], G)
    return mine, G


def _scan_chain(rec: Recurrence, M, span, c, state0, me, axis_name: str, num_devices: int):
    """Forward chain as an associative scan over the axis: ``(incoming, final)``.

    Device j's map is ``S -> c_j M_j S + S_j``; log2 P rounds of ``ppermute``
    compose each device's prefix of maps (``(A, b) o (A', b') = (A A', A b' + b)``),
    one more hands each device its predecessor's outgoing state and an
    all-reduce the last device's to every device.
    """
    A, b = (M if c is None else _scale_rows(c, M)), span
    d = 1
    while d < num_devices:
        pairs = [(j, j + d) for j in range(num_devices - d)]
        A_in, b_in = lax.ppermute((A, b), axis_name, pairs)
        later = me >= d
        A, b = _select(later, rec.apply(A, A_in), A), _select(later, _add(rec.apply(A, b_in), b), b)
        d *= 2
    out = _add(rec.apply(A, state0), b)  # device me's outgoing state
    before = lax.ppermute(out, axis_name, [(j, j + 1) for j in range(num_devices - 1)])
    incoming = _select(me == 0, state0, before if c is None else _scale_rows(c, before))
    last = _select(me == num_devices - 1, out, jax.tree.map(jnp.zeros_like, out))
    return incoming, lax.psum(last, axis_name)


def _scan_chain_back(rec: Recurrence, M, D, c, d_final, me, axis_name: str, num_devices: int):
    """Backward chain as a suffix scan over the axis: ``(G of device me, initial's cotangent)``.

    Device j's map takes the cotangent of its outgoing state to that of the
    state before it, ``G -> c_j (D_j + M_j^T G)``; the suffix of these maps is
    composed as ``_scan_chain`` composes prefixes, keeping the transposes as
    products of the transitions themselves (``M_j^T M_k^T = (M_k M_j)^T``).
    """
    N, b = (M, D) if c is None else (_scale_rows(c, M), _scale_rows(c, D))
    d = 1
    while d < num_devices:
        pairs = [(j + d, j) for j in range(num_devices - d)]
        N_in, b_in = lax.ppermute((N, b), axis_name, pairs)
        earlier = me + d < num_devices
        composed = (rec.apply(N_in, N), _add(rec.apply_t(N, b_in), b))
        N, b = _select(earlier, composed[0], N), _select(earlier, composed[1], b)
        d *= 2
    value = _add(rec.apply_t(N, d_final), b)  # the cotangent of the state entering me
    after = lax.ppermute(value, axis_name, [(j + 1, j) for j in range(num_devices - 1)])
    mine = _select(me == num_devices - 1, d_final, after)
    first = _select(me == 0, value, jax.tree.map(jnp.zeros_like, value))
    return mine, lax.psum(first, axis_name)


def _stacked(tree):
    return jax.tree.map(lambda x: x[None], tree)


def chain_over_axis(
    rec: Recurrence,
    tokens,
    params,
    aux,
    state0,
    *,
    axis_name: str,
    mesh=None,
    batch_axes: tuple[str, ...] = (),
    exchange: str = "gather",
):
    """``rec.run`` over whole sequences sharded on T over ``axis_name``: ``(y, final state)``.

    Args:
      rec: the family (``Recurrence``).
      tokens, params, aux: as ``Recurrence`` says, whole: ``[B,T,...]`` with T
        a multiple of the axis's devices (spans are contiguous).
      state0: the initial state (leaves ``[B,...]``), or None: zeros.
      axis_name: the mesh axis the sequence is split over.
      mesh: a ``jax.sharding.Mesh`` (Auto or Explicit axes) or None: the
        context mesh (``jax.set_mesh``).
      batch_axes: mesh axes that split B (they must divide it).
      exchange: ``"gather"`` (all-gather the pairs, chain locally) or
        ``"scan"`` (an associative scan of ``ppermute`` rounds); the same result.

    Returns:
      ``(y, final)``: y as ``rec.run`` gives it over the whole sequence, the
      final state of every row.
    """
    abstract = mesh.abstract_mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    P = abstract.shape[axis_name]
    rows = batch_axes or None
    token_spec = PartitionSpec(rows, axis_name)
    row_spec, stack_spec = PartitionSpec(rows), PartitionSpec(axis_name, rows)
    manual = {axis_name, *batch_axes}
    explicit = AxisType.Explicit in abstract.axis_types

    def place(tree, spec):
        if not explicit:
            return tree
        return jax.tree.map(lambda x: jax.sharding.reshard(x, NamedSharding(abstract, spec)), tree)

    def smap(fn, in_specs, out_specs):
        # Unchecked: every output is per device (stacked) or summed by hand,
        # and the starts each span builds are local by construction.
        return jax.shard_map(
            fn,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names=manual,
            check_vma=False,
        )

    if exchange not in EXCHANGES:
        fail("exchange", f"one of {EXCHANGES}", repr(exchange))

    def forward_local(tokens, params, aux, state0):
        me = lax.axis_index(axis_name)
        span, M = rec.transition(tokens, params, aux)
        cs = continues(aux.kv_seg, axis_name, P)
        if exchange == "scan":
            c = None if cs is None else cs[me]
            incoming, final = _scan_chain(rec, M, span, c, state0, me, axis_name, P)
        else:
            pairs = lax.all_gather((M, span), axis_name)
            incoming, final = _chain(rec, pairs, cs, state0, me, P)
        y, _ = rec.run(tokens, params, aux, incoming)
        return y, final, _stacked(incoming), _stacked(M)

    def backward_local(tokens, params, aux, incoming, M, dy, d_final):
        me = lax.axis_index(axis_name)
        incoming, M = jax.tree.map(lambda x: x[0], (incoming, M))

        def run(tokens, params, state):
            return rec.run(tokens, params, aux, state)

        (_, final_local), vjp = jax.vjp(run, tokens, params, incoming)
        zero = jax.tree.map(jnp.zeros_like, final_local)
        D = vjp((dy, zero))[2]  # through the outputs alone; XLA drops the rest
        cs = continues(aux.kv_seg, axis_name, P)
        if exchange == "scan":
            c = None if cs is None else cs[me]
            G, d_state0 = _scan_chain_back(rec, M, D, c, d_final, me, axis_name, P)
        else:
            Ms, Ds = lax.all_gather((M, D), axis_name)
            G, d_state0 = _chain_back(rec, Ms, Ds, cs, d_final, me, P)
        d_tokens, d_params, _ = vjp((dy, G))
        d_params = lax.psum(d_params, (axis_name, *batch_axes))  # every shard's share
        return d_tokens, d_params, d_state0

    specs = (token_spec, PartitionSpec(), token_spec, row_spec)
    # The final state and the initial state's cotangent are computed alike on
    # every device of the axis, so their specs take them unsplit.
    fwd_map = smap(forward_local, specs, (token_spec, row_spec, stack_spec, stack_spec))
    bwd_specs = (*specs[:3], stack_spec, stack_spec, token_spec, row_spec)
    bwd_map = smap(backward_local, bwd_specs, (token_spec, PartitionSpec(), row_spec))

    def forward(*args):
        y, final, incoming, M = fwd_map(*args)
        return (y, final), (args, incoming, M)

    def backward(res, cot):
        (tokens, params, aux, _), incoming, M = res
        dy, d_final = cot
        dy, d_final = place(dy, token_spec), place(d_final, row_spec)
        d_tokens, d_params, d_state0 = bwd_map(tokens, params, aux, incoming, M, dy, d_final)
        return d_tokens, d_params, None, d_state0

    @jax.custom_vjp
    def sharded(tokens, params, aux, state0):
        return forward(tokens, params, aux, state0)[0]

    sharded.defvjp(forward, backward)
    if state0 is None:
        state0 = rec.zeros(tokens, params)
    y, final = sharded(
        place(tokens, token_spec),
        place(params, PartitionSpec()),
        place(aux, token_spec),
        place(state0, row_spec),
    )
    given = jax.typeof(jax.tree.leaves(tokens)[0]).sharding
    if explicit and not given.mesh.empty:  # back in the layout the tokens came in
        y = jax.tree.map(lambda x: jax.sharding.reshard(x, given), y)
    return y, final
