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
from typing import Unpack

import jax
import jax.numpy as jnp
from jax import lax

from attn import checks, scores
from attn.checks import as_arrays, fail
from attn.merge import merge_attention
from attn.ring.kernels import RingInputs, ring_flash, ring_forward
from attn.softmax.blockwise import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, TILE_SCORES
from attn.softmax.call import (
    Call,
    CallArgs,
    check_call,
    check_default_queries,
    check_static,
    takes_call_args,
)
from attn.softmax.kernels import vary_like
from attn.softmax.tiles import qkv_tiles, score_tiles, tile_config, untile


@takes_call_args
def ring_attention(
    q,
    k,
    v,
    *,
    axis_name: str,
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
    **call_args: Unpack[CallArgs],
):
    """Softmax attention over a sequence sharded on ``axis_name``; call it inside ``jax.shard_map``.

    Each device passes its shard; the result is the local rows of
    ``attn.dot_product_attention`` on the whole sequence (same masks, segment
    ids, soft-cap, score modifiers and sink logits; a query with no visible
    key gets zeros and zero gradients). K/V are never gathered: they travel
    around the ring.

    Args:
      q: ``[B,T,N,H]`` the local queries (T per device).
      k: ``[B,S,K,H]`` the local keys, ``N % K == 0`` (K/V are never repeated).
      v: ``[B,S,K,E]`` the local values.
      axis_name: the mesh axis (a str) the sequence is sharded over, bound by
        the enclosing ``shard_map``; its size is the ring's device count P.
      block_q, block_k: tile sizes of the blockwise steps (default those of
        ``attn.blockwise_attention``, capped at T and S).
      return_lse: also return the float32 log-sum-exp ``[B,T,N]``.
      **call_args: the call (``attn.softmax.call.CallArgs``) on the local
        shard, as in ``attn.dot_product_attention``, except:
        ``q_positions`` are the local queries' positions in the whole sequence,
        default the contiguous layout (device i holds ``i*T + arange(T)``,
        shifted by ``P*S - P*T`` so the queries are the last of the keys, as
        ``attn.dot_product_attention`` aligns them); ``kv_positions`` default
        ``i*S + arange(S)``; a ``score_mod``'s q leaves ``[B,T,N]`` are the local
        queries', its k leaves ``[B,S,N]`` the local keys' (they travel with
        them); ``sink_logits`` join the softmax once, not once per ring step.

    Returns:
      ``out [B,T,N,E]`` in q's dtype, and ``lse [B,T,N]`` float32 if ``return_lse``.
    """
    q, k, v = as_arrays(q, k, v)
    call = _check(q, k, v, axis_name, call_args)
    q, k, v = call.isolate(q, k, v)  # before K/V travel: the ring carries no padding
    config, tiles, inputs = _prepare(call, q, k, v, block_q, block_k)
    out, lse = ring_flash(config, axis_name, *tiles, inputs)
    out, lse = untile(config, out), untile(config, lse[..., None])[..., 0]
    if call.sink_logits is not None:
        # The sink is one more logit with no value: a partial with out 0 and lse = sink.
        sink = jnp.broadcast_to(call.sink_logits.reshape(-1), lse.shape)
        out, lse = merge_attention(out, lse, jnp.zeros_like(out), sink)
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out


@takes_call_args
def count_ring_tiles(
    q,
    k,
    v,
    *,
    axis_name: str,
    block_q: int | None = None,
    block_k: int | None = None,
    **call_args: Unpack[CallArgs],
):
    """Runs the forward of ``ring_attention`` and returns what this device computed.

    The counts come from counters carried by the ring's and the kernels' own
    loops, so they show what is computed, not what a schedule promises.
    Arguments as in ``ring_attention``.

    Returns:
      int32 ``[3]``: ring steps computed (the others were skipped), FULL tiles
      and PARTIAL tiles (query block x key block pairs).
    """
    q, k, v = as_arrays(q, k, v)
    call = _check(q, k, v, axis_name, call_args)
    config, tiles, inputs = _prepare(call, q, k, v, block_q, block_k)
    return ring_forward(config, axis_name, *tiles, inputs)[2]


def _check(q, k, v, axis_name, call_args: dict):
    """The local call, its positions defaulting to the contiguous layout."""
    if not isinstance(axis_name, str):
        fail("axis_name", "the name (a str) of the mesh axis the sequence is sharded on", axis_name)
    d = checks.qkv_dims(q, k, v)
    mask, _, _ = check_static(call_args.get("mask"), call_args.get("scale"),
                              call_args.get("softcap"))  # fmt: skip
    try:
        num_devices = lax.axis_size(axis_name)
    except NameError:
        fail("axis_name", "a mesh axis bound by an enclosing jax.shard_map", f"{axis_name!r}")
    positions = _default_positions(d, mask, axis_name, num_devices, call_args)
    call = check_call(q, k, v, **{**call_args, **positions})
    call.refuse_pairs("ring attention (a Mask, positions and segment ids travel with the shards)")
    return call


def _prepare(call: Call, q, k, v, block_q, block_k):
    """A local call's tile config, its (q, kT, v, modifier) tiles and integer inputs."""
    block_q = DEFAULT_BLOCK_Q if block_q is None else block_q
    block_k = DEFAULT_BLOCK_K if block_k is None else block_k
    config = tile_config(call, block_q, block_k, jnp.float32, TILE_SCORES)
    # Steps return float32 partials (merged in float32) and never see the sink.
    config = dataclasses.replace(config, call=dataclasses.replace(config.call, has_sink=False))
    inputs = RingInputs(
        call.q_positions, call.kv_positions, call.q_segment_ids, call.kv_segment_ids
    )
    # Replicated leaves (ALiBi's slopes) enter varying like q: their cotangent is then
    # summed over the devices (see attn.softmax.kernels.vary_like).
    mod = score_tiles(config, scores.split(call.score)[1])
    mod = jax.tree.map(lambda x: vary_like(x, q), mod)
    return config, (*qkv_tiles(config, q, k, v), mod), inputs


def _default_positions(d, mask, axis_name, num_devices, call_args: dict) -> dict:
    """Positions of the contiguous layout where none are given, aligned as dense attention.

    Over the whole sequence the keys are ``arange(P*S)`` and the queries the last
    ``P*T`` of them, and device i holds the i-th run of each.
    """
    device = lax.axis_index(axis_name)
    T_all, S_all = num_devices * d.T, num_devices * d.S
    q_positions, kv_positions = call_args.get("q_positions"), call_args.get("kv_positions")
    if q_positions is None:  # the rule of attn.dot_product_attention, on the whole sequence
        check_default_queries(T_all, S_all, mask, kv_positions is not None)
        q_positions = device * d.T + jnp.arange(d.T, dtype=jnp.int32) + (S_all - T_all)
    if kv_positions is None:
        kv_positions = device * d.S + jnp.arange(d.S, dtype=jnp.int32)
    return dict(q_positions=q_positions, kv_positions=kv_positions)
