"""Softmax attention: the call contract, the dense reference and blockwise (FlashAttention).

Modules, in the order a reader needs them:

* ``call``: the contract every softmax implementation shares: its keyword
  arguments, declared once (``CallArgs``), checked once into the one call
  object every implementation receives (``Call``), the visibility rule, and
  the static spec kernels are traced with;
* ``dense``: ``dot_product_attention``, the reference with ``[T,S]`` materialized,
  and ``logits``, its front (the logits and which keys each query sees), which
  attention functions beside softmax build on (``attn.functions``);
* ``jax_nn``: ``jax.nn.dot_product_attention``'s arguments in the call's terms;
* ``pairs``: a bias and a boolean mask array, read per tile;
* ``schedule``: which (query block, key block) pairs to visit, from the
  masks' block classification (shared with ``attn.ring`` and ``attn.pallas``);
* ``tiles``: the tile layout of the blockwise kernels' operands, a score
  modifier's arrays included;
* ``kernels``: the online-softmax forward and the FlashAttention-2 backward;
* ``blockwise``: ``blockwise_attention`` and ``count_blocks``;
* ``path``: PaTH attention (Householder-like transforms as position encoding),
  naive and blockwise; ``path_decode``: its decode-cache updates.

Ring attention (``attn.ring``) and the Pallas kernels (``attn.pallas``) build
on the same contract and schedule.
"""

from attn.softmax.blockwise import (
    DEFAULT_BLOCK_K,
    DEFAULT_BLOCK_Q,
    BlockCounts,
    blockwise_attention,
    count_blocks,
)
from attn.softmax.call import Call, CallArgs, check_call
from attn.softmax.dense import dot_product_attention, logits
from attn.softmax.path import PATH_FORMS, path_attention
from attn.softmax.path_decode import path_transform_keys, path_transform_queries, path_update_keys

__all__ = [
    "DEFAULT_BLOCK_K",
    "DEFAULT_BLOCK_Q",
    "PATH_FORMS",
    "BlockCounts",
    "Call",
    "CallArgs",
    "blockwise_attention",
    "check_call",
    "count_blocks",
    "dot_product_attention",
    "logits",
    "path_attention",
    "path_transform_keys",
    "path_transform_queries",
    "path_update_keys",
]
