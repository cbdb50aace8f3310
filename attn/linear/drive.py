"""Whole arrays in and out of ``attn.linear.chain``: the checks, the mesh, whole spans.

Internal to ``attn.linear.sharded``: a call's arguments checked once on their
whole shapes (``check_whole``), the mesh and its axes (``check_mesh``), T padded
to whole spans with padding tokens and cut back, all of it one jitted program
(``drive``), and the layout of the result on an Explicit mesh.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from attn.checks import fail
from attn.linear.chain import chain_over_axis
from attn.masks import PADDING

__all__ = ["abstract_mesh", "check_mesh", "check_whole", "drive"]


def abstract_mesh(mesh):
    """The abstract mesh of ``mesh``, or of the context mesh when None."""
    if mesh is None:
        return jax.sharding.get_abstract_mesh()
    if not isinstance(mesh, Mesh):
        fail("mesh", "a jax.sharding.Mesh or None (the context mesh)", type(mesh).__name__)
    return mesh.abstract_mesh


def check_whole(fn, *args, **kwargs):
    """Checks a call's arguments by tracing ``fn`` on their whole shapes (nothing runs).

    The arrays are traced unsharded: what is checked is the call, not its layout
    (on an Explicit mesh the one-device form could not even trace a sharded T).
    Traced, their values are not seen: the callers check those apart.
    """

    leaves, tree = jax.tree.flatten((args, kwargs))
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array | np.ndarray)]

    def call(*values):
        filled = list(leaves)
        for i, value in zip(arrays, values, strict=True):
            filled[i] = value
        a, k = jax.tree.unflatten(tree, filled)
        return fn(*a, **k)

    shapes = [jax.ShapeDtypeStruct(np.shape(leaves[i]), leaves[i].dtype) for i in arrays]
    jax.eval_shape(call, *shapes)


def check_mesh(mesh, axis_name, batch_axes, B: int) -> None:
    """Refuses, in one line each, a mesh and axes that cannot split a ``[B,T,...]`` call.

    ``mesh`` a ``jax.sharding.Mesh`` (or None inside ``jax.set_mesh``),
    ``axis_name`` one of its axes, ``batch_axes`` distinct others whose devices
    divide B. Left to ``shard_map``, these fail in many lines naming none of
    the arguments.
    """
    abstract = abstract_mesh(mesh)
    if abstract.empty:
        fail("mesh", "a jax.sharding.Mesh, or None inside jax.set_mesh", "None outside any mesh")
    names = abstract.axis_names
    if axis_name not in names:
        fail("axis_name", f"an axis of the mesh {names}", repr(axis_name))
    others = tuple(name for name in names if name != axis_name)
    if (
        not isinstance(batch_axes, tuple | list)
        or any(axis not in others for axis in batch_axes)
        or len(set(batch_axes)) != len(batch_axes)
    ):
        want = f"a tuple of distinct axes of the mesh {names} other than axis_name={axis_name!r}"
        fail("batch_axes", want, repr(batch_axes))
    devices = math.prod(abstract.shape[axis] for axis in batch_axes)
    if B % devices:
        want = f"axes whose number of devices divides B={B}"
        fail("batch_axes", want, f"{tuple(batch_axes)} of {devices} devices")


def pad_time(tokens, ids, T: int, P: int):
    """Pads every ``[B,T,...]`` array to a multiple of P: zeros, and padding ids.

    ``tokens`` a named tuple of arrays, ``ids`` an ``attn.linear.family.Ids``.
    Without segment ids the real tokens get id 1, so the tail is padding,
    which neither writes nor decays a state and outputs 0.
    """
    pad = -T % P
    if not pad:
        return tokens, ids

    def grow(x, value=0):
        widths = [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
        return jnp.pad(x, widths, constant_values=value)

    B = jax.tree.leaves(tokens)[0].shape[0]
    ones = jnp.ones((B, T), jnp.int32)
    q_seg, kv_seg = (ones if x is None else jnp.asarray(x) for x in (ids.q_seg, ids.kv_seg))
    extra = None if ids.extra is None else grow(jnp.asarray(ids.extra))
    ids = ids._replace(q_seg=grow(q_seg, PADDING), kv_seg=grow(kv_seg, PADDING), extra=extra)
    return jax.tree.map(grow, tokens), ids


def drive(rec, tokens, params, ids, state0, *, T, axis_name, mesh, batch_axes, exchange):
    """Pads T, runs ``chain_over_axis`` and cuts the padding off: ``(y, final)``.

    ``tokens``: a named tuple of ``[B,T,...]`` arrays (None fields absent);
    ``params``: one of replicated arrays; ``ids``: ``attn.linear.family.Ids``;
    ``state0``: leaves ``[B,...]`` or None. The mesh and its axes are checked
    already (``check_mesh``).
    """
    run = functools.partial(
        _drive,
        rec,
        T=T,
        axis_name=axis_name,
        mesh=mesh,
        batch_axes=tuple(batch_axes),
        exchange=exchange,
    )
    # Always jitted: eagerly, shard_map over some of a mesh's axes refuses its
    # own specs (naming an axis the call never named), a reshard onto an
    # Explicit mesh needs a mesh context, and the chain runs op by op (20 s
    # instead of 1 s on 8 CPU devices). Under a caller's jit this is inlined.
    return jax.jit(run)(tokens, params, ids, state0)


def _drive(rec, tokens, params, ids, state0, *, T, axis_name, mesh, batch_axes, exchange):
    P = abstract_mesh(mesh).shape[axis_name]
    if T % P and is_explicit(mesh):  # an Explicit axis pads only whole: gather T first
        whole = rows_whole(mesh, batch_axes)
        tokens, ids = jax.tree.map(lambda x: jax.sharding.reshard(x, whole), (tokens, ids))
    tokens, ids = pad_time(tokens, ids, T, P)
    kw = dict(axis_name=axis_name, mesh=mesh, batch_axes=batch_axes, exchange=exchange)
    y, final = chain_over_axis(rec, tokens, params, ids, state0, **kw)
    if y.shape[1] == T:
        return y, final
    if is_explicit(mesh):  # an Explicit axis cuts only at shard boundaries: gather T first
        y = jax.sharding.reshard(y, rows_whole(mesh, batch_axes))
    return y[:, :T], final


def rows_whole(mesh, batch_axes):
    """Arrays ``[B,T,...]`` split over ``batch_axes`` on B only, T whole."""
    return NamedSharding(abstract_mesh(mesh), PartitionSpec(tuple(batch_axes) or None))


def is_explicit(mesh) -> bool:
    """Whether ``mesh`` (or the context mesh) has Explicit axes."""
    return AxisType.Explicit in abstract_mesh(mesh).axis_types
