"""Ring attention (Liu, Zaharia and Abbeel, 2023): softmax attention over a sharded sequence.

The sequence is sharded over one mesh axis of P devices. Each device keeps its
queries and passes its keys and values around the ring with ``lax.ppermute``;
after P steps every query has met every k/v block:

* Forward. Step s on device i attends the local queries to the block of
  device ``i - s`` with blockwise attention (``attn.softmax.blockwise``), which returns
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
  its own diagonal block. The zigzag layout (``attn.ring.layouts``) balances
  it; ``attn.ring.work`` counts the tiles each device computes, from ``classify``.

The loop and its VJP are in ``attn.ring.kernels``; ``attn.ring.sharded`` runs
it on whole arrays over a mesh.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from attn import errors, scores
from attn.errors import as_arrays, fail
from attn.masks import Mask
from attn.merge import merge_attention
from attn.ring.kernels import RingInputs, ring_flash, ring_forward
from attn.softmax.blockwise import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, TILE_SCORES
from attn.softmax.call import check_call, check_default_queries, check_static
from attn.softmax.kernels import vary_like
from attn.softmax.score_tiles import score_tiles
from attn.softmax.tiles import qkv_tiles, tile_config, untile


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
    score_mod=None,
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
      q_segment_ids, kv_segment_ids: ``[B,T]``, ``[B,S]`` ints >= 0 (both or
        neither); queries see only keys with the same id, id 0 is padding.
      scale: logit scale, default ``1/sqrt(H)``.
      softcap: if given, logits become ``softcap * tanh(logits / softcap)``.
      score_mod: an ``attn.scores`` modifier with the local shard's data (its
        q leaves ``[B,T,N]`` for the local queries, its k leaves ``[B,S,N]``
        for the local keys, which travel with them), on absolute positions.
      sink_logits: ``[N]`` learned per-head logits that join the softmax
        denominator once (not once per ring step) without contributing a value.
      block_q, block_k: tile sizes of the blockwise steps (default those of
        ``attn.blockwise_attention``, capped at T and S).
      return_lse: also return the float32 log-sum-exp ``[B,T,N]``.

    Returns:
      ``out [B,T,N,E]`` in q's dtype, and ``lse [B,T,N]`` float32 if ``return_lse``.
    """
    q, k, v = as_arrays(q, k, v)
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
        score_mod=score_mod,
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
        score_mod=None,
        sink_logits=None,
        block_q=block_q,
        block_k=block_k,
    )
    return ring_forward(config, axis_name, *tiles, inputs)[2]


def _prepare(q, k, v, axis_name, *, mask, q_positions, kv_positions, block_q, block_k, **kw):
    """Checks a local call; returns its tile config, (q, kT, v, modifier) tiles, integer
    inputs and sink.

    ``kw`` holds the keywords checked by ``attn.softmax.call.check_call`` alone
    (scale, softcap, score_mod, sink logits and segment ids).
    """
    if not isinstance(axis_name, str):
        fail("axis_name", "the name (a str) of the mesh axis the sequence is sharded on", axis_name)
    d = errors.qkv_dims(q, k, v)
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
    config = dataclasses.replace(config, has_sink=False)
    inputs = RingInputs(
        call.q_positions, call.kv_positions, call.q_segment_ids, call.kv_segment_ids
    )
    # Replicated leaves (ALiBi's slopes) enter varying like q: their cotangent is then
    # summed over the devices (see attn.softmax.kernels.vary_like).
    mod = score_tiles(config, scores.split(call.score)[1])
    mod = jax.tree.map(lambda x: vary_like(x, q), mod)
    return config, (*qkv_tiles(config, q, k, v), mod), inputs, call.sink_logits


def _default_positions(d, mask, axis_name, num_devices, q_positions, kv_positions):
    """Positions of the contiguous layout where none are given, aligned as dense attention.

    Over the whole sequence the keys are ``arange(P*S)`` and the queries the last
    ``P*T`` of them, and device i holds the i-th run of each.
    """
    device = lax.axis_index(axis_name)
    T_all, S_all = num_devices * d.T, num_devices * d.S
    if q_positions is None:  # the rule of attn.dot_product_attention, on the whole sequence
        check_default_queries(T_all, S_all, mask, kv_positions is not None)
        q_positions = device * d.T + jnp.arange(d.T, dtype=jnp.int32) + (S_all - T_all)
    if kv_positions is None:
        kv_positions = device * d.S + jnp.arange(d.S, dtype=jnp.int32)
    return q_positions, kv_positions
