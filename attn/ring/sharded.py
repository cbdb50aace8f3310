"""``sharded_attention``: ring attention on whole arrays, over one axis of a device mesh."""

from __future__ import annotations

import functools
from typing import Unpack

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from attn import scores
from attn.checks import as_arrays, fail
from attn.ring.attention import ring_attention
from attn.ring.layouts import LAYOUTS, default_blocks, layout_order
from attn.softmax.call import CallArgs, check_call, takes_call_args


@takes_call_args
def sharded_attention(
    q,
    k,
    v,
    *,
    mesh: Mesh,
    axis_name: str,
    layout: str = "zigzag",
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
    **call_args: Unpack[CallArgs],
):
    """``attn.dot_product_attention`` on whole arrays, computed by ring attention over a mesh axis.

    Reorders the sequence into the layout, shards it over ``axis_name`` (other
    mesh axes replicate), runs ``ring_attention`` on every device with the
    shard's real positions (so zigzag needs no special mask) and returns the
    result in the original order. The mesh may have Auto axes
    (``jax.sharding.Mesh``) or Explicit ones (``jax.make_mesh``); with Explicit
    axes the result is replicated over the mesh.

    Args:
      q: ``[B,T,N,H]``; k: ``[B,S,K,H]``; v: ``[B,S,K,E]``: whole sequences.
      mesh: a ``jax.sharding.Mesh`` with the axis ``axis_name`` of P devices
        (Auto or Explicit axis types).
      axis_name: the mesh axis the sequence is sharded on.
      layout: ``"zigzag"`` (balanced for causal masks; T and S multiples of 2P)
        or ``"contiguous"`` (T and S multiples of P).
      block_q, block_k: tile sizes of each device's blockwise steps; by default
        those of ``attn.blockwise_attention``, capped at a shard (at a zigzag chunk).
      return_lse: also return the float32 log-sum-exp ``[B,T,N]``.
      **call_args: the call (``attn.softmax.call.CallArgs``) over the whole
        sequence, as in ``attn.dot_product_attention`` (a modifier's per-token
        leaves are sharded with their tokens, the others replicated).

    Returns:
      ``out [B,T,N,E]`` in q's dtype, and ``lse [B,T,N]`` float32 if ``return_lse``.
    """
    q, k, v = as_arrays(q, k, v)
    if not isinstance(mesh, Mesh):
        fail("mesh", "a jax.sharding.Mesh", type(mesh).__name__)
    if axis_name not in mesh.axis_names:
        fail("axis_name", f"one of the mesh's axes {mesh.axis_names}", repr(axis_name))
    if layout not in LAYOUTS:
        fail("layout", f"one of {LAYOUTS}", repr(layout))
    call = check_call(q, k, v, **call_args)
    call.refuse_pairs("sharded_attention (a Mask, positions and segment ids are sharded)")
    d, num_devices = call.dims, mesh.shape[axis_name]
    per = 2 * num_devices if layout == "zigzag" else num_devices
    for name, length, letter in (("q", d.T, "T"), ("k", d.S, "S")):
        if length % per:
            fail(
                name,
                f"a length {letter} divisible by {per} ({layout} layout over the "
                f"{num_devices} devices of axis {axis_name!r})",
                f"{letter}={length}",
            )
    block_q, block_k = default_blocks(
        layout, d.T // num_devices, d.S // num_devices, block_q, block_k
    )
    q_order, kv_order = (
        layout_order(d.T, num_devices, layout),
        layout_order(d.S, num_devices, layout),
    )
    explicit = mesh.axis_types[mesh.axis_names.index(axis_name)] == AxisType.Explicit
    seq = PartitionSpec(None, axis_name)
    shard = functools.partial(_reorder, mesh=mesh, spec=seq, explicit=explicit)
    sink = call.sink_logits
    sink = None if sink is None else _replicated(sink.reshape(d.N), mesh, explicit)
    args = (
        shard(q, q_order),
        shard(k, kv_order),
        shard(v, kv_order),
        shard(call.q_positions, q_order),
        shard(call.kv_positions, kv_order),
        shard(call.q_segment_ids, q_order),
        shard(call.kv_segment_ids, kv_order),
        sink,
    )
    structure, leaves = scores.split(call_args.get("score_mod"))
    roles = () if structure is None else structure.roles
    orders = {"q": q_order, "k": kv_order}
    leaves = [
        _replicated(x, mesh, explicit) if role == "head" else shard(x, orders[role])
        for x, role in zip(leaves, roles, strict=True)
    ]
    leaf_specs = tuple(PartitionSpec() if role == "head" else seq for role in roles)
    local = functools.partial(
        _local_attention,
        axis_name=axis_name,
        mask=call.mask,
        scale=call.scale,
        softcap=call.softcap,
        structure=structure,
        block_q=block_q,
        block_k=block_k,
    )
    in_specs = (seq,) * 7 + (PartitionSpec(), leaf_specs)
    out, lse = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(seq, seq))(
        *args, tuple(leaves)
    )
    inverse = np.argsort(q_order)
    whole = functools.partial(_reorder, mesh=mesh, spec=PartitionSpec(), explicit=explicit)
    out, lse = whole(out, inverse), whole(lse, inverse)
    return (out, lse) if return_lse else out


def _replicated(x, mesh: Mesh, explicit: bool):
    """``x`` whole on every device of ``mesh`` (stated for Explicit axes; Auto ones infer it)."""
    return jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec())) if explicit else x


def _reorder(x, order, *, mesh: Mesh, spec: PartitionSpec, explicit: bool):
    """``x[:, order]`` of ``[B, L, ...]``, laid out by ``spec`` over an Explicit mesh.

    Under Explicit axes every array states its sharding and a gather along a
    sharded axis is refused, so ``x`` is made whole first (nothing moves when it
    is already) and the result resharded by ``spec``; Auto axes let
    ``shard_map`` and XLA place it.
    """
    if x is None:
        return None
    x = jnp.take(_replicated(x, mesh, explicit), order, axis=1)
    return jax.sharding.reshard(x, NamedSharding(mesh, spec)) if explicit else x


def _local_attention(q, k, v, q_pos, kv_pos, q_seg, kv_seg, sink, leaves, *, structure, **kw):
    """One device's ``ring_attention`` with its shard's positions (positional for shard_map)."""
    return ring_attention(
        q,
        k,
        v,
        q_positions=q_pos,
        kv_positions=kv_pos,
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
        sink_logits=sink,
        score_mod=None if structure is None else structure.rebuild(leaves),
        return_lse=True,
        **kw,
    )
