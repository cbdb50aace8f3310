"""Blockwise softmax attention: the FlashAttention algorithm in JAX.

The same function as ``attn.dot_product_attention``, computed tile by tile so
the ``[T,S]`` score matrix never exists:

* Forward (online softmax). Queries are cut into blocks of ``block_q`` rows and
  keys/values into blocks of ``block_k``. For each query block, the key blocks
  it can see are visited one at a time; each gives a partial result
  ``(row max, row sum, weighted values)`` in float32 that is merged into the
  running one with ``attn.merge.merge_unnormalized``. The output and the row
  log-sum-exp are what remains when the last key block has been merged.
* Block skipping. The mask's block classification (``Mask.classify``) marks
  each (query block, key block) pair EMPTY, FULL or PARTIAL. Only non-empty
  pairs are visited (causal attention: about half of them; a sliding window of
  ``w``: ``O(T w)`` work) and only PARTIAL pairs evaluate the mask. With the
  default ``arange`` positions, or positions and segment ids given as concrete
  arrays, the schedule is computed in NumPy when tracing; with traced positions
  or segment ids it is computed at run time from each block's min/max position
  (and segment id), so packed sequences skip the blocks between segments too.
* Backward (FlashAttention-2). A ``jax.custom_vjp`` saves only q, k, v, the
  output and the log-sum-exp, and recomputes the probabilities block by block:
  ``P = exp(logits - lse)``, ``dV += P^T dO``, ``dP = dO V^T``,
  ``dS = P * (dP - D)`` with ``D = rowsum(dO * O)``, ``dQ += dS K``,
  ``dK += dS^T Q``. Memory grows linearly in T and S.

Any T and S work: both are padded to whole blocks; padded keys are masked (the
last key block is never treated as FULL when it holds padding) and padded
query rows are computed on the last real row's position and dropped.

The code is in the modules of ``attn.softmax``: this one holds the public
functions; ``call`` checks the call (as for every implementation); ``tiles``
the call's configuration and the tile layout of every operand, the score
modifier's arrays included (with the tile axis letters X, Q, J);
``schedule`` which tiles to visit; ``kernels`` the forward and backward loops
and the custom VJP.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Unpack

import jax
import jax.numpy as jnp

from attn import scores
from attn.checks import as_arrays
from attn.softmax.call import Call, CallArgs, check_call, takes_call_args
from attn.softmax.kernels import KernelInputs, flash, forward, kernel_inputs, vary_like
from attn.softmax.schedule import num_blocks
from attn.softmax.tiles import (
    ScoreTiles,
    TileConfig,
    qkv_tiles,
    score_tiles,
    tile_config,
    untile,
)

# Default tile sizes: the best sum of the forward and backward times measured on
# a 2-core CPU (the table is in bench/results/blockwise-tiles-cpu.md). Smaller
# tiles pay the loop's fixed cost per tile more often, bigger ones waste work on
# the diagonal of causal and banded masks. Heads are grouped so a tile holds at
# most TILE_SCORES float32 scores (one head at 1024 x 512: 2 MB, half of it per
# core, in its L2 cache).
DEFAULT_BLOCK_Q = 1024
DEFAULT_BLOCK_K = 512
TILE_SCORES = 2**19


class BlockCounts(NamedTuple):
    """(query block, key block) pairs the forward pass visits, counted by its loop."""

    full: int  # computed without evaluating the mask
    partial: int  # computed with the mask
    total: int  # all pairs, ceil(T / block_q) * ceil(S / block_k)


@takes_call_args
def blockwise_attention(
    q,
    k,
    v,
    *,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    return_lse: bool = False,
    **call_args: Unpack[CallArgs],
):
    """Softmax attention computed block by block, never materializing ``[T,S]``.

    Computes exactly ``attn.dot_product_attention``'s function (same masks,
    positions, segment ids, soft-cap, score modifiers and learned sink logits; a
    query with no visible key gets zeros and zero gradients), with memory
    linear in T and S in the forward and the backward pass, and work
    proportional to the non-empty blocks of the mask. A score modifier is
    evaluated on each tile (forward and backward) from the tile's positions
    and its slice of the modifier's arrays, which get gradients.

    Args:
      q: ``[B,T,N,H]`` queries.
      k: ``[B,S,K,H]`` keys, ``N % K == 0`` (MHA, GQA, MQA; K/V are never repeated).
      v: ``[B,S,K,E]`` values.
      block_q: query rows per block (C of the query tiles); any T works.
      block_k: keys per block; any S works.
      return_lse: also return the float32 log-sum-exp ``[B,T,N]`` (``-inf`` for a
        row that sees nothing), so partial results can be merged with
        ``attn.merge.merge_attention``.
      **call_args: the call (``attn.softmax.call.CallArgs``), as in
        ``attn.dot_product_attention``.

    Returns:
      ``out [B,T,N,E]`` in q's dtype, and ``lse [B,T,N]`` float32 if ``return_lse``.
    """
    q, k, v = as_arrays(q, k, v)
    call = check_call(q, k, v, **call_args)
    return attend(call, q, k, v, block_q=block_q, block_k=block_k, return_lse=return_lse)


def attend(call: Call, q, k, v, *, block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K,
           return_lse=False):  # fmt: skip
    """``blockwise_attention`` of a checked call (see there)."""
    q, k, v = call.isolate(q, k, v)
    config, inputs, sink, mod = _prepare(call, q.dtype, block_q, block_k)
    sink, mod = vary_like(sink, q), jax.tree.map(lambda x: vary_like(x, q), mod)
    out, lse = flash(config, *qkv_tiles(config, q, k, v), sink, mod, inputs)
    out = untile(config, out)
    return (out, untile(config, lse[..., None])[..., 0]) if return_lse else out


@takes_call_args
def count_blocks(
    q,
    k,
    v,
    *,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    **call_args: Unpack[CallArgs],
) -> BlockCounts:
    """Runs the forward pass of ``blockwise_attention`` and counts the block pairs it computes.

    The counts come from counters carried by the kernel's own loops, so they show
    what is computed, not what the schedule promises. Arguments as in
    ``blockwise_attention``; under ``jit`` the counts are int32 arrays.
    """
    q, k, v = as_arrays(q, k, v)
    config, inputs, sink, mod = _prepare(
        check_call(q, k, v, **call_args), q.dtype, block_q, block_k
    )
    n_full, n_partial = _count_tiles(config, q, k, v, sink, mod, inputs)
    # The loop counts tiles; each block pair is one tile per head group.
    n_full, n_partial = n_full // config.groups, n_partial // config.groups
    total = num_blocks(config.call.T, config.block_q) * num_blocks(config.call.S, config.block_k)
    if isinstance(n_full, jax.core.Tracer):  # under jit: the counts are arrays
        return BlockCounts(n_full, n_partial, total)
    return BlockCounts(int(n_full), int(n_partial), total)


@functools.partial(jax.jit, static_argnums=0)
def _count_tiles(config: TileConfig, q, k, v, sink, mod: ScoreTiles, inputs: KernelInputs):
    """The forward pass's tile counters (compiled as one program, not op by op)."""
    *_, counts = forward(config, *qkv_tiles(config, q, k, v), sink, mod, inputs)
    return counts


def _prepare(call: Call, dtype, block_q, block_k):
    """A checked call's tile configuration, integer inputs, ``[K,G]`` sink logits and
    the modifier's leaves in tile layout."""
    config = tile_config(call, block_q, block_k, dtype, TILE_SCORES)
    inputs = kernel_inputs(config, call.rows(), call.static_rows(), call.keep)
    if config.call.has_sink:
        sink = call.sink_logits
    else:
        sink = jnp.zeros((call.dims.K, call.dims.G), jnp.float32)
    return config, inputs, sink, score_tiles(config, scores.split(call.score)[1], call.bias)
