"""A fixed-state family as one record, and the one driver that shards any of them.

``Family`` says what the sharded driver (and ``models.mesh``) needs of a
family: its one-device function and step, its forms, its arrays as named
tuples (``tokens``: float ``[B,T,...]``, differentiated; ``params``:
replicated float arrays, differentiated; ``Ids``: segment ids and other
``[B,T,...]`` ints or bools, not differentiated), how one span is run from a
state, the zero state, and how its transition over a span is read.

``sharded(family, tokens, params, ids, state, ...)`` then checks the call as
the one-device function checks it, checks the mesh, and runs
``attn.linear.chain`` over the mesh axis (``attn.linear.drive``). Each public
``sharded_*`` function of ``attn.linear.sharded`` is one call of it.

How a transition ``M`` is read off one pass from a zero state: the state's
columns along the value axis evolve independently, each by the same
transition, and values only write. So the pass runs with ``extra`` value
columns that receive zero values and start from the identity (``"matrix"``:
the delta rules' ``H x H`` on the key axis, a convolution's ``W - 1`` window
slots) or from ones (``"scalar"``: a state decayed by scalar gates, one column;
``M`` is the product of the span's gates, zero past a segment start). The
value columns are the last axis of the state's first leaf; ``widen`` adds the
zero columns to the family's value arrays. The transition is then exactly the
one the form applies: segments, signs and chunking included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Required, TypedDict

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from attn.checks import fail, same_token_segment_ids, segment_values
from attn.linear.chain import Recurrence
from attn.linear.drive import check_mesh, check_whole, drive
from attn.registry import Registry

__all__ = ["FAMILIES", "MESH_ARGS", "Family", "Ids", "MeshArgs", "run_sharded", "sharded", "widen"]


class Ids(NamedTuple):
    """A call's ``[B,T]`` segment ids (either may be None), and a family's other
    non-differentiated per-token arrays (``extra``: linear attention's gate signs)."""

    q_seg: jax.Array | None = None
    kv_seg: jax.Array | None = None
    extra: jax.Array | None = None


class MeshArgs(TypedDict, total=False):
    """The keyword arguments every sharded function takes besides its family's.

    Attributes:
      axis_name: the mesh axis T is split over (contiguous spans); required.
      mesh: a ``jax.sharding.Mesh`` (Auto or Explicit axes, from ``Mesh`` or
        ``jax.make_mesh``), or None for the context mesh of ``jax.set_mesh``.
      batch_axes: other mesh axes, splitting B (their devices must divide it);
        the remaining axes split nothing (Auto ones are left to XLA).
      exchange: how the devices pass their states on (``attn.linear.chain.EXCHANGES``):
        ``"gather"`` (one all-gather of every device's transition and state,
        the default) or ``"scan"`` (an associative scan in log2 P rounds of
        ``ppermute``); the same result.
    """

    axis_name: Required[str]
    mesh: Mesh | None
    batch_axes: tuple[str, ...]
    exchange: str


MESH_ARGS = tuple(MeshArgs.__annotations__)


class Family(NamedTuple):
    """One fixed-state family, as ``sharded`` and ``models.mesh`` read it.

    Attributes:
      name: the family's name.
      fn: the one-device function over a whole sequence.
      step: its one-token function (decoding), or None.
      forms: the names of its forms.
      run: ``(fn, tokens, params, ids, state, options) -> (y, final)``: ``fn``
        over a span from ``state`` (None: zeros), returning its final state.
      zeros: ``(tokens, params, options) -> state``: the zero state of a span's rows.
      kind: ``"scalar"`` or ``"matrix"``: how its transition is read (the
        module docstring).
      widen: ``(tokens, params, extra) -> (tokens, params)``: the value arrays
        with ``extra`` zero columns.
      check_values: ``(tokens, params, ids) -> None``: the one-device form's
        value checks, on the values as given.
      same_tokens: its queries and keys are one set of tokens (``q_seg`` is
        checked against ``kv_segment_ids``, ``checks.same_token_segment_ids``).
      sharded: its public sharded function (``attn.linear.sharded``), taking
        ``fn``'s arguments and ``MeshArgs``; None where its transition admits no
        exchange (``kind`` ``"none"``: log-linear attention's levels span the sequence).
      reference: ``(tokens, params, options) -> (y, final)``: the float64 reference
        (``attn.linear.reference``) of ``run`` from a zero state, on its arrays.
      examples: ``(rng, sizes) -> {variant: (tokens, params, options)}``: NumPy float32
        inputs of its variants at ``sizes`` (B, T, K, N, H, and the family's own, e.g.
        ``steps``, ``levels``), drawn as its users draw them (unit keys, gates in range),
        with the options its reference takes: what the benchmarks' numerics run.
      data: the token fields a lower-precision run takes in its dtype (the rest, gates
        and strengths, stay float32 as a model keeps them).
    """

    name: str
    fn: Callable
    step: Callable | None
    forms: tuple[str, ...]
    run: Callable
    zeros: Callable
    kind: str
    widen: Callable
    check_values: Callable
    same_tokens: bool = True
    sharded: Callable | None = None
    reference: Callable | None = None
    examples: Callable | None = None
    data: tuple[str, ...] = ()


def normal(rng, *shape):
    """Standard normal float32 NumPy draws (the records' ``examples``)."""
    return rng.standard_normal(shape).astype(np.float32)


def unit(rng, *shape):
    """Unit vectors along the last axis, float32."""
    x = normal(rng, *shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def uniform(rng, low: float, high: float, *shape):
    return rng.uniform(low, high, shape).astype(np.float32)


def widen(x, extra: int):
    """``x [..., E]`` with ``extra`` zero columns appended (None stays None)."""
    if x is None:
        return None
    return jnp.concatenate([x, jnp.zeros((*x.shape[:-1], extra), x.dtype)], axis=-1)


def _scalar(M, S):
    """A per-row, per-head scalar ``M [B,N]`` times state leaves ``[B,N,...]``."""
    return jax.tree.map(lambda x: M.reshape(M.shape + (1,) * (x.ndim - 2)) * x, S)


def _matrix(M, S):
    """``M [...,H,H] @ S [...,H,E]``: the key axis (or a window's slots)."""
    return jnp.einsum("...ij,...je->...ie", M, S)


def _matrix_t(M, G):
    """``M^T G``."""
    return jnp.einsum("...ji,...je->...ie", M, G)


def recurrence(family: Family, options: dict) -> Recurrence:
    """The family as ``attn.linear.chain`` drives it (``options``: the forms' keywords)."""

    def run(t, p, ids, state):
        return family.run(family.fn, t, p, ids, state, options)

    def zeros(t, p):
        return family.zeros(t, p, options)

    def transition(t, p, ids):
        leaves, tree = jax.tree.flatten(zeros(t, p))
        value = leaves[0]  # [..., rows, E]: the value columns on the last axis
        if family.kind == "scalar":
            extra, eye = 1, jnp.ones((1,), value.dtype)
        else:
            extra = value.shape[-2]
            eye = jnp.eye(extra, dtype=value.dtype)
        start = jnp.concatenate([value, jnp.broadcast_to(eye, (*value.shape[:-1], extra))], -1)
        wide_t, wide_p = family.widen(t, p, extra)
        _, final = run(wide_t, wide_p, ids, jax.tree.unflatten(tree, [start, *leaves[1:]]))
        final_leaves = jax.tree.leaves(final)
        last = final_leaves[0]
        span = jax.tree.unflatten(tree, [last[..., :-extra], *final_leaves[1:]])
        M = last[..., 0, -1] if family.kind == "scalar" else last[..., -extra:]
        return span, M

    if family.kind == "scalar":
        return Recurrence(run, transition, _scalar, _scalar, zeros)
    return Recurrence(run, transition, _matrix, _matrix_t, zeros)


def sharded(
    family: Family,
    tokens,
    params,
    ids: Ids,
    state,
    *,
    return_state: bool,
    options: dict,
    mesh_args: dict,
):
    """``family.fn`` with T sharded over ``mesh_args["axis_name"]``: out, or ``(out, final)``.

    Args:
      family: the family's record.
      tokens: its ``tokens`` named tuple of whole ``[B,T,...]`` arrays (None fields allowed).
      params: its ``params`` named tuple of replicated arrays (or None fields).
      ids: the segment ids (and gate signs), whole.
      state: the initial state, or None (zeros).
      return_state: also return the final state.
      options: the one-device function's other keywords (form, chunk size, ...).
      mesh_args: ``MeshArgs``.

    The call is checked first as the one-device function checks it: shapes and
    options by tracing it on the whole shapes (``attn.linear.drive.check_whole``),
    values (gates, segment ids) by its own checks where they are concrete; then
    the mesh and its axes. All before ``shard_map`` sees them.
    """
    mesh_args = dict(mesh=None, batch_axes=(), exchange="gather") | dict(mesh_args)
    tokens = jax.tree.map(jnp.asarray, tokens)
    params = jax.tree.map(jnp.asarray, params)
    check_whole(lambda t, p, i, s: family.run(family.fn, t, p, i, s, options), tokens, params,
                ids, state)  # fmt: skip
    B, T = jax.tree.leaves(tokens)[0].shape[:2]
    check_mesh(mesh_args["mesh"], mesh_args["axis_name"], mesh_args["batch_axes"], B)
    segment_values(ids.q_seg, "q_segment_ids" if family.same_tokens else "segment_ids")
    segment_values(ids.kv_seg, "kv_segment_ids" if family.same_tokens else "segment_ids")
    if family.same_tokens and ids.q_seg is not None and ids.kv_seg is not None:
        same_token_segment_ids(ids.q_seg, ids.kv_seg, B, T)
    family.check_values(tokens, params, ids)  # the values, as given
    if family.kind == "matrix" and family.zeros(tokens, params, options).shape[-2] == 0:
        return family.run(family.fn, tokens, params, ids, state, options)  # no state to chain
    if family.kind not in ("scalar", "matrix"):
        fail("family", f"a family whose transition is exchanged (not {family.name!r})", family.kind)
    y, final = drive(recurrence(family, options), tokens, params, ids, state, T=T, **mesh_args)
    return (y, final) if return_state else y


def run_sharded(family, tokens, params, ids, state, return_state, axis_name, kwargs):
    """``sharded`` with a public function's keywords split: the mesh's (``MeshArgs``) and the
    form's."""
    mesh_args = {name: kwargs.pop(name) for name in MESH_ARGS if name in kwargs}
    mesh_args["axis_name"] = axis_name
    return sharded(family, tokens, params, ids, state, return_state=return_state,
                   options=kwargs, mesh_args=mesh_args)  # fmt: skip


# The fixed-state families by name, each with its public sharded function (``models.mesh``
# reads them): ``attn.linear.sharded`` adds the first six, a family's own module the others.
FAMILIES: Registry[Family] = Registry("fixed-state family", "family")
