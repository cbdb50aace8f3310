"""Ring attention (Liu, Zaharia and Abbeel, 2023): softmax attention over a sharded sequence.

The sequence is sharded over one mesh axis of P devices. Each device keeps its
queries and passes its keys and values around the ring with ``lax.ppermute``;
after P steps every query has met every k/v block:

* Forward. Step s on device i attends the local queries to the block of
  device ``i - s`` with blockwise attention (``attn.blockwise``), which returns
  ``(out, lse)``; the partials are combined with ``attn.merge.merge_attention``.
  A step whose whole block the mask empties (``Mask.classify`` on the bounds
  of the local and the visiting positions and segment ids) is skipped by a
  ``lax.cond`` and does no matmul; inside a visited step the blockwise schedule
  skips empty tiles as usual. Learned sink logits join the softmax once, as
  one more partial merged after the ring.
* Backward. A ``jax.custom_vjp`` saves the local q, k, v, out and lse, and
  runs the ring again: each step is the blockwise (FlashAttention-2) backward
  of the local queries against the visiting block, with the merged lse, and
  the block's dk, dv travel with it, arriving home after the last shift.
  Memory per device stays linear in the shard length; no step holds more than
  one tile of scores.
* Positions. Masks are evaluated on absolute positions, so a shard needs only
  its real positions: ``ring_attention`` defaults to the contiguous layout
  (device i holds positions ``[i*T, (i+1)*T)`` of its T local ones), and
  ``sharded_attention`` passes the positions of any layout.
* Balance. With a causal mask and the contiguous layout device i computes
  ``i + 1`` of the P steps (the later blocks are all masked), so the last
  device computes about 2P - 1 times the tiles of the first, which meets only
  its own diagonal block. The zigzag layout (also called dual-chunk swap) cuts the sequence into
  2P chunks and gives device i chunks i and ``2P - 1 - i``: every device then
  holds one early and one late chunk and does the same work.
  ``attn.ring_work`` counts the tiles each device computes, from ``classify``.

The loop and its VJP are in ``attn.ring_kernels``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from attn import _checks
from attn._checks import fail
from attn.blockwise import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, TILE_SCORES
from attn.blockwise_tiles import qkv_tiles, tile_config, untile
from attn.dense import check_call, check_static
from attn.masks import Full, Mask
from attn.merge import merge_attention
from attn.ring_kernels import RingInputs, ring_flash, ring_forward

LAYOUTS = ("contiguous", "zigzag")


def ring_attention(
    q,
    k,
    v,
    *,
    axis_name: str,
    mask: Mask | None = None,
    q_positions=None,
    kv_positions=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    scale: float | None = None,
    softcap: float | None = None,
    sink_logits=None,
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
):
    """Softmax attention over a sequence sharded on ``axis_name``; call it inside ``jax.shard_map``.

    Each device passes its shard; the result is the local rows of
    ``attn.dot_product_attention`` on the whole sequence (same masks, segment
    ids, soft-cap and sink logits; a query with no visible key gets zeros and
    zero gradients). K/V are never gathered: they travel around the ring.

    Args:
      q: ``[B,T,N,H]`` the local queries (T per device).
      k: ``[B,S,K,H]`` the local keys, ``N % K == 0`` (K/V are never repeated).
      v: ``[B,S,K,E]`` the local values.
      axis_name: the mesh axis (a str) the sequence is sharded over, bound by
        the enclosing ``shard_map``; its size is the ring's device count P.
      mask: an ``attn.masks.Mask`` on absolute positions; None is bidirectional.
      q_positions: ``[T]`` or ``[B,T]`` ints, the local queries' positions in the
        whole sequence. Default: the contiguous layout, device i holds
        ``i*T + arange(T)``, shifted by ``P*S - P*T`` so the queries are the last
        of the keys (as ``attn.dot_product_attention`` aligns them).
      kv_positions: ``[S]`` or ``[B,S]`` ints; default ``i*S + arange(S)``.
      q_segment_ids, kv_segment_ids: ``[B,T]``, ``[B,S]`` ints (both or neither);
        queries see only keys with the same id.
      scale: logit scale, default ``1/sqrt(H)``.
      softcap: if given, logits become ``softcap * tanh(logits / softcap)``.
      sink_logits: ``[N]`` learned per-head logits that join the softmax
        denominator once (not once per ring step) without contributing a value.
      block_q, block_k: tile sizes of the blockwise steps (default those of
        ``attn.blockwise_attention``, capped at T and S).
      return_lse: also return the float32 log-sum-exp ``[B,T,N]``.

    Returns:
      ``out [B,T,N,E]`` in q's dtype, and ``lse [B,T,N]`` float32 if ``return_lse``.
    """
    config, tiles, inputs, sink = _prepare(
        q,
        k,
        v,
        axis_name,
        mask=mask,
        q_positions=q_positions,
        kv_positions=kv_positions,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        scale=scale,
        softcap=softcap,
        sink_logits=sink_logits,
        block_q=block_q,
        block_k=block_k,
    )
    out, lse = ring_flash(config, axis_name, *tiles, inputs)
    out, lse = untile(config, out), untile(config, lse[..., None])[..., 0]
    if sink is not None:
        # The sink is one more logit with no value: a partial with out 0 and lse = sink.
        sink = jnp.broadcast_to(sink.reshape(-1), lse.shape)
        out, lse = merge_attention(out, lse, jnp.zeros_like(out), sink)
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out


def count_ring_tiles(
    q,
    k,
    v,
    *,
    axis_name: str,
    mask: Mask | None = None,
    q_positions=None,
    kv_positions=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    block_q: int | None = None,
    block_k: int | None = None,
):
    """Runs the forward of ``ring_attention`` and returns what this device computed.

    The counts come from counters carried by the ring's and the kernels' own
    loops, so they show what is computed, not what a schedule promises.
    Arguments as in ``ring_attention``.

    Returns:
      int32 ``[3]``: ring steps computed (the others were skipped), FULL tiles
      and PARTIAL tiles (query block x key block pairs).
    """
    config, tiles, inputs, _ = _prepare(
        q,
        k,
        v,
        axis_name,
        mask=mask,
        q_positions=q_positions,
        kv_positions=kv_positions,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        scale=None,
        softcap=None,
        sink_logits=None,
        block_q=block_q,
        block_k=block_k,
    )
    return ring_forward(config, axis_name, *tiles, inputs)[2]


def _prepare(q, k, v, axis_name, *, mask, q_positions, kv_positions, block_q, block_k, **kw):
    """Checks a local call; returns its tile config, (q, kT, v) tiles, integer inputs, sink.

    ``kw`` holds the keywords checked by ``attn.dense.check_call`` alone (scale,
    softcap, sink logits and segment ids).
    """
    if not isinstance(axis_name, str):
        fail("axis_name", "the name (a str) of the mesh axis the sequence is sharded on", axis_name)
    d = _checks.qkv_dims(q, k, v)
    mask, _, _ = check_static(mask, kw["scale"], kw["softcap"])
    try:
        num_devices = lax.axis_size(axis_name)
    except NameError:
        fail("axis_name", "a mesh axis bound by an enclosing jax.shard_map", f"{axis_name!r}")
    q_positions, kv_positions = _default_positions(
        d, mask, axis_name, num_devices, q_positions, kv_positions
    )
    call = check_call(q, k, v, mask=mask, q_positions=q_positions, kv_positions=kv_positions, **kw)
    block_q = DEFAULT_BLOCK_Q if block_q is None else block_q
    block_k = DEFAULT_BLOCK_K if block_k is None else block_k
    config = tile_config(call, block_q, block_k, jnp.float32, TILE_SCORES)
    # Steps return float32 partials (merged in float32) and never see the sink.
    config = config._replace(has_sink=False)
    inputs = RingInputs(
        call.q_positions, call.kv_positions, call.q_segment_ids, call.kv_segment_ids
    )
    return config, qkv_tiles(config, q, k, v), inputs, call.sink_logits


def _default_positions(d, mask, axis_name, num_devices, q_positions, kv_positions):
    """Positions of the contiguous layout where none are given, aligned as dense attention.

    Over the whole sequence the keys are ``arange(P*S)`` and the queries the last
    ``P*T`` of them, and device i holds the i-th run of each.
    """
    device = lax.axis_index(axis_name)
    T_all, S_all = num_devices * d.T, num_devices * d.S
    if q_positions is None:
        if T_all != S_all and not isinstance(mask, Full):  # as attn.dot_product_attention
            if T_all > S_all:
                fail(
                    "q_positions",
                    f"explicit positions for T={T_all} queries over S={S_all} keys (T > S) with "
                    f"mask {mask!r}: by default the queries are the last T key positions",
                    None,
                )
            if kv_positions is not None:
                fail(
                    "q_positions",
                    f"explicit positions with kv_positions and T={T_all} != S={S_all} under "
                    f"mask {mask!r} (the default, the last T key indices, ignores kv_positions)",
                    None,
                )
        q_positions = device * d.T + jnp.arange(d.T, dtype=jnp.int32) + (S_all - T_all)
    if kv_positions is None:
        kv_positions = device * d.S + jnp.arange(d.S, dtype=jnp.int32)
    return q_positions, kv_positions


# Layouts of a sequence over the devices of the ring.


def layout_order(length: int, num_devices: int, layout: str = "zigzag") -> np.ndarray:
    """The sequence indices in layout order: device i holds ``order[i*L : (i+1)*L]``, L = length/P.

    ``"contiguous"``: ``arange(length)``. ``"zigzag"``: the sequence in ``2P``
    chunks, device i holding chunks i and ``2P - 1 - i`` (``zigzag_order``).
    """
    if layout not in LAYOUTS:
        fail("layout", f"one of {LAYOUTS}", repr(layout))
    num_devices = _checks.positive_int(num_devices, "num_devices")
    if layout == "zigzag":
        return zigzag_order(length, num_devices)
    if isinstance(length, bool) or not isinstance(length, int | np.integer) or length < 1:
        fail("length", "a positive int", repr(length))
    if length % num_devices:
        fail("length", f"a multiple of the {num_devices} devices (contiguous layout)", length)
    return np.arange(length)


def zigzag_order(length: int, num_devices: int) -> np.ndarray:
    """Indices of the zigzag (dual-chunk swap) layout, ``[length]``.

    The sequence is cut into ``2P`` chunks of ``length / 2P``; device i holds
    chunk i followed by chunk ``2P - 1 - i``. E.g. length 8 on 2 devices:
    ``[0 1 6 7 | 2 3 4 5]``.
    """
    num_devices = _checks.positive_int(num_devices, "num_devices")
    length = _checks.positive_int(length, "length")
    chunks = 2 * num_devices
    if length % chunks:
        fail("length", f"a multiple of 2 x {num_devices} devices (zigzag layout)", length)
    c = length // chunks
    order = [(i, chunks - 1 - i) for i in range(num_devices)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for pair in order for j in pair])


def to_layout(x, num_devices: int, layout: str = "zigzag", axis: int = 1):
    """Reorders the sequence axis of ``x`` (e.g. ``[B,T,...]``) into the layout."""
    x = jnp.asarray(x)
    return jnp.take(x, layout_order(x.shape[axis], num_devices, layout), axis=axis)


def from_layout(x, num_devices: int, layout: str = "zigzag", axis: int = 1):
    """Inverse of ``to_layout``: the sequence axis back in its original order."""
    x = jnp.asarray(x)
    order = layout_order(x.shape[axis], num_devices, layout)
    return jnp.take(x, np.argsort(order), axis=axis)


def default_blocks(layout: str, T: int, S: int, block_q, block_k) -> tuple[int, int]:
    """Tile sizes for a layout's shards of T queries and S keys (given sizes are kept).

    A zigzag shard is two chunks far apart in the sequence; a tile that spans
    both covers early and late positions and is non-empty against almost every
    key block, which undoes the balance. Default tiles stop at the chunk length.
    """
    cap_q, cap_k = (T // 2, S // 2) if layout == "zigzag" else (T, S)
    block_q = min(DEFAULT_BLOCK_Q, cap_q) if block_q is None else block_q
    block_k = min(DEFAULT_BLOCK_K, cap_k) if block_k is None else block_k
    return block_q, block_k


def sharded_attention(
    q,
    k,
    v,
    *,
    mesh: Mesh,
    axis_name: str,
    layout: str = "zigzag",
    mask: Mask | None = None,
    q_positions=None,
    kv_positions=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    scale: float | None = None,
    softcap: float | None = None,
    sink_logits=None,
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
):
    """``attn.dot_product_attention`` on whole arrays, computed by ring attention over a mesh axis.

    Reorders the sequence into the layout, shards it over ``axis_name`` (other
    mesh axes replicate), runs ``ring_attention`` on every device with the
    shard's real positions (so zigzag needs no special mask) and returns the
    result in the original order.

    Args:
      q: ``[B,T,N,H]``; k: ``[B,S,K,H]``; v: ``[B,S,K,E]``: whole sequences.
      mesh: a ``jax.sharding.Mesh`` with the axis ``axis_name`` of P devices.
      axis_name: the mesh axis the sequence is sharded on.
      layout: ``"zigzag"`` (balanced for causal masks; T and S multiples of 2P)
        or ``"contiguous"`` (T and S multiples of P).
      mask, q_positions, kv_positions, q_segment_ids, kv_segment_ids, scale,
        softcap, sink_logits, return_lse: as in ``attn.dot_product_attention``,
        over the whole sequence.
      block_q, block_k: tile sizes of each device's blockwise steps; by default
        those of ``attn.blockwise_attention``, capped at a shard (at a zigzag chunk).

    Returns:
      ``out [B,T,N,E]`` in q's dtype, and ``lse [B,T,N]`` float32 if ``return_lse``.
    """
    if not isinstance(mesh, Mesh):
        fail("mesh", "a jax.sharding.Mesh", type(mesh).__name__)
    if axis_name not in mesh.axis_names:
        fail("axis_name", f"one of the mesh's axes {mesh.axis_names}", repr(axis_name))
    if layout not in LAYOUTS:
        fail("layout", f"one of {LAYOUTS}", repr(layout))
    call = check_call(
        q,
        k,
        v,
        mask=mask,
        scale=scale,
        softcap=softcap,
        sink_logits=sink_logits,
        q_positions=q_positions,
        kv_positions=kv_positions,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
    )
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
    take = lambda x, order: None if x is None else jnp.take(x, order, axis=1)  # noqa: E731
    args = (
        take(q, q_order),
        take(k, kv_order),
        take(v, kv_order),
        take(call.q_positions, q_order),
        take(call.kv_positions, kv_order),
        take(call.q_segment_ids, q_order),
        take(call.kv_segment_ids, kv_order),
        None if call.sink_logits is None else call.sink_logits.reshape(d.N),
    )
    local = functools.partial(
        _local_attention,
        axis_name=axis_name,
        mask=call.mask,
        scale=call.scale,
        softcap=call.softcap,
        block_q=block_q,
        block_k=block_k,
    )
    seq = PartitionSpec(None, axis_name)
    out, lse = jax.shard_map(
        local, mesh=mesh, in_specs=(seq,) * 7 + (PartitionSpec(),), out_specs=(seq, seq)
    )(*args)
    inverse = np.argsort(q_order)
    out, lse = jnp.take(out, inverse, axis=1), jnp.take(lse, inverse, axis=1)
    return (out, lse) if return_lse else out


def _local_attention(q, k, v, q_pos, kv_pos, q_seg, kv_seg, sink, **kw):
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
        return_lse=True,
        **kw,
    )
