"""Trainable sparse attention: each query reads a few blocks or tokens of the keys, exactly.

Modules:

* ``layout``: where a query's blocks lie among the keys (blocks by position,
  within each segment's run of keys);
* ``gather``: softmax attention over the key ranges each query selected, the
  core every method ends in;
* ``moba``: MoBA (Lu et al. 2025): ``moba_attention``, blocks chosen by the
  query against each block's mean key in float32 (``block_key_sums``,
  ``window_key_sums``: block sums a cache keeps, the same bits);
* ``exact``: scores of fixed bits in any shape: fixed-order float32 sums
  (MoBA's gate) and exact 8-bit dot products (DSA's indexer);
* ``nsa``: NSA (Yuan et al. 2025): ``nsa_attention``, compressed, selected and
  window branches, one selection per kv head's group; ``compression_windows``;
* ``dsa``: DeepSeek-V3.2's sparse attention: ``lightning_indexer``,
  ``indexer_scores``, ``indexer_topk``, ``indexed_topk_attention`` and ``indexer_loss``;
* ``pallas``: a block-sparse Pallas kernel for MoBA's and NSA's selected
  blocks (``impl="pallas"``), each query block looping over the union of its
  queries' blocks.
"""

from attn.sparse.dsa import (
    indexed_topk_attention,
    indexer_loss,
    indexer_scores,
    indexer_topk,
    lightning_indexer,
)
from attn.sparse.moba import block_key_sums, moba_attention, moba_select, window_key_sums
from attn.sparse.nsa import compressed_at_ends, compression_windows, nsa_attention

__all__ = [
    "block_key_sums",
    "compressed_at_ends",
    "compression_windows",
    "indexed_topk_attention",
    "indexer_loss",
    "indexer_scores",
    "indexer_topk",
    "lightning_indexer",
    "moba_attention",
    "moba_select",
    "nsa_attention",
    "window_key_sums",
]
