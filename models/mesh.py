"""The mesh policy of the models: which mesh axes split what, read from the context mesh.

A model holds no mesh. Its layers read the mesh the caller set with
``jax.set_mesh(mesh)`` (``jax.sharding.get_abstract_mesh()`` while tracing):

* ``SEQ_AXIS`` ("seq") splits sequences: softmax layers run as ring attention
  over it (``models.softmax``), the recurrent layers and short convolutions as
  their sharded forms (``in_sequence``: ``attn.linear.sharded``, states chained
  across devices), and ``ring_layout`` is the order a sequence is laid out in
  over its devices (contiguous where a layer runs in array order);
* ``BATCH_AXES`` ("data", "fsdp") split the batch: attention runs per shard
  of rows (``batch_axes``).

The mesh may have Auto or Explicit axes (``jax.sharding.Mesh`` gives Auto,
``jax.make_mesh`` Explicit ones); the layers shard their calls with
``shard_map``, which takes both. ``train.sharding`` lays batches and
parameters out by the same axes.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, PartitionSpec

import attn
from attn import ring, scores
from attn.checks import fail

__all__ = [
    "BATCH_AXES",
    "SEQ_AXIS",
    "batch_axes",
    "explicit_spec",
    "in_sequence",
    "ring_layout",
    "seq_devices",
    "shard_rows",
]

# The mesh axis a sequence-parallel model splits its sequences over.
SEQ_AXIS = "seq"
# The mesh axes a data- or fully-sharded-parallel model splits its batch over.
BATCH_AXES = ("data", "fsdp")


def seq_devices() -> int | None:
    """Devices on ``SEQ_AXIS`` of the mesh set by ``jax.set_mesh``; None without that axis."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or SEQ_AXIS not in mesh.axis_names:
        return None
    return mesh.shape[SEQ_AXIS]


def batch_axes(batch: int) -> tuple[str, ...]:
    """The ``BATCH_AXES`` of the context mesh (of more than one device) that split ``batch``.

    Empty without a mesh, or when their devices do not divide ``batch`` (then
    XLA partitions the call as it can).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
    return axes if batch % math.prod(mesh.shape[a] for a in axes) == 0 else ()


def ring_layout(length: int, num_devices: int, in_order: bool = False) -> np.ndarray:
    """The order in which to lay a sequence of ``length`` out over ``num_devices`` devices.

    ``x[:, order]`` puts device i's tokens in the i-th run of ``length / P``
    (a sharded ``[B,T]`` array's layout) and ``order`` is their positions. The
    zigzag layout (``attn.ring.zigzag_order``, every device one early and one
    late chunk: the same causal work on each) where ``2P`` divides the length
    and no layer runs in array order (``in_order``: a recurrence or a short
    convolution, whose devices hold contiguous spans), else the contiguous one.

    Raises:
      ValueError: naming ``length`` unless ``num_devices`` divides it.
    """
    zigzag = not in_order and length % (2 * num_devices) == 0
    return ring.layout_order(length, num_devices, "zigzag" if zigzag else "contiguous")


def in_sequence(fn):
    """``fn`` (one of ``attn``'s recurrences or ``short_conv``), run the way the context mesh
    splits sequences.

    Without a "seq" axis of several devices, ``fn`` itself; with one, its
    ``attn.linear.sharded`` form over ``SEQ_AXIS`` (the batch split over the
    ``batch_axes`` that divide it), called with the same arguments. The
    sequence must be laid out contiguously (``ring_layout(..., in_order=True)``).
    """
    devices = seq_devices()
    if devices is None or devices == 1:
        return fn
    family = next((f for f in attn.linear.FAMILIES.values() if f.fn is fn), None)
    if family is None or family.sharded is None:
        names = sorted(n for n, f in attn.linear.FAMILIES.items() if f.sharded is not None)
        fail("fn", f"the function of a family in attn.linear.FAMILIES {names}", fn)

    def call(*args, **kwargs):
        rows = batch_axes(np.shape(args[0])[0])
        return family.sharded(*args, axis_name=SEQ_AXIS, batch_axes=rows, **kwargs)

    return call


def explicit_spec(x) -> PartitionSpec | None:
    """The ``PartitionSpec`` of ``x``'s type where its sharding is Explicit; else None.

    Under Explicit axes an op whose output sharding is ambiguous (a gather of
    sharded indices, a ``shard_map``'s inputs) needs it stated; under Auto axes,
    or without a mesh, XLA chooses it and nothing is stated.
    """
    sharding = jax.typeof(x).sharding
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or AxisType.Explicit not in mesh.axis_types:
        return None
    return sharding.spec


def shard_rows(fn, split: PartitionSpec, axes: set[str], q, k, v, **rows):
    """``fn(q, k, v, **rows)`` run per shard by ``jax.shard_map`` over the context mesh's
    ``axes``.

    ``rows`` are an attention call's arrays named as ``attn.attention`` names them
    (None ones are left out). Every array is split by ``split`` except the per-head
    ones, which every shard takes whole: ``sink_logits`` and a ``score_mod``'s head
    leaves (its per-token leaves are split with their tokens), and so is the output.
    Under Explicit axes the arrays are resharded to those specs first (a ``shard_map``
    takes its inputs as they are typed) and the output back to q's sharding; Auto axes
    are laid out by XLA.
    """
    args = {"q": q, "k": k, "v": v, **{name: x for name, x in rows.items() if x is not None}}
    specs = {name: _spec(name, x, split) for name, x in args.items()}
    given = explicit_spec(q)
    if given is not None:
        args = jax.tree.map(jax.sharding.reshard, args, specs)
    out = jax.shard_map(lambda a: fn(**a), in_specs=(specs,), out_specs=split, axis_names=axes)(
        args
    )
    return out if given is None else jax.sharding.reshard(out, given)


def _spec(name: str, x, split: PartitionSpec):
    """The spec of one argument of ``shard_rows`` (a tree of them for a score modifier)."""
    if name == "sink_logits":
        return PartitionSpec()
    if name == "score_mod":
        structure, _ = scores.split(x)
        specs = [PartitionSpec() if role == "head" else split for role in structure.roles]
        return structure.rebuild(specs)
    return split
