"""Attention as pure JAX functions.

Nothing here owns parameters or imports Flax: every function takes arrays and
static keyword arguments, and is jittable, vmappable and differentiable.

Axis vocabulary, used by every einsum string, shape comment and docstring in
the project:

    B  batch
    T  query length
    S  key/value length
    N  query heads
    K  key/value heads (N % K == 0; K == N is MHA, K == 1 is MQA, else GQA)
    G  query heads per kv head, N // K
    H  query/key head dim
    E  value head dim, where it differs from H (MLA)
    D  model width
    C  chunk length (linear attention, blockwise blocks)
    F  feature dim of a linear-attention feature map (and of DSA's indexer)
    R  latent rank (MLA)
    L  layers
    V  vocabulary
    M  blocks or tokens a sparse query scores or reads (attn.sparse)
    I  indexer heads (DSA's lightning indexer)

Arrays are laid out like ``jax.nn.dot_product_attention``: q ``[B,T,N,H]``,
k ``[B,S,K,H]``, v ``[B,S,K,E]``, out ``[B,T,N,E]``. Grouped-query attention
reshapes q to ``[B,T,K,G,H]``; K/V are never repeated in memory.

The families, each a package whose docstring lists its pieces:

    softmax/   the call contract every softmax implementation shares (call.py),
               the dense reference, and blockwise attention on the shared
               tiling layer (schedule, tiles, kernels); PaTH attention
    ring/      ring attention over a mesh axis, layouts, sharded_attention, work counts
    pallas/    fused accelerator kernels on the same contract and schedule; splash on TPU
    linear/    linear attention in three forms, segments, feature maps; the delta rule,
               DeltaProduct, the DPLR rule (RWKV-7) and Comba; Mamba-2's SSD;
               log-linear attention; each a record (family.py), sharded over a mesh
               axis by one driver (and the short conv); float64 references
    sparse/    trainable sparse attention: MoBA, NSA, DSA's indexed top-k, each query
               reading a few blocks or tokens exactly

beside the pieces every family uses: ``masks`` (which keys a query sees),
``scores`` (how much: ALiBi, T5 buckets, FoX gates, soft-cap, for every softmax impl),
``checks`` (the input checks and their one ``ValueError`` format), ``merge``
(partial results), ``rope``, ``conv`` (short convolutions), ``latent`` (MLA),
``cache`` (cache sizes and slots), ``decode`` (split-K decode attention over
rows of their own lengths), ``paged`` (a paged KV cache: a page pool,
block tables, their allocator), ``dispatch`` (``attention(impl=...)``, which
takes ``jax.nn.dot_product_attention``'s arguments too), ``interop`` (an
``attention_fn`` for Flax's attention layers), ``functions`` (attention
functions beside softmax: sigmoid, softpick) and ``registry`` (the named
registries feature maps, and the models' layer kinds, presets and variants,
are added to).
"""

from attn import checks, linear, masks, paged, pallas, registry, ring, scores, softmax, sparse
from attn.cache import kv_cache_bytes, latent_cache_bytes, linear_state_bytes
from attn.conv import short_conv, short_conv_step
from attn.decode import decode_attention
from attn.dispatch import IMPLS, attention
from attn.functions import sigmoid_attention, softpick_attention
from attn.interop import flax_attention_fn
from attn.latent import LATENT_FORMS, latent_attention
from attn.linear import *  # noqa: F403  (the fixed-state families: attn.linear.__all__)
from attn.masks import Mask
from attn.merge import merge_attention
from attn.paged import PageTable, paged_decode_attention
from attn.ring import ring_attention, sharded_attention
from attn.rope import apply_rope
from attn.softmax import (
    PATH_FORMS,
    CallArgs,
    blockwise_attention,
    dot_product_attention,
    path_attention,
    path_transform_keys,
    path_transform_queries,
    path_update_keys,
)
from attn.sparse import indexed_topk_attention, moba_attention, nsa_attention

__all__ = [
    "IMPLS",
    "LATENT_FORMS",
    "PATH_FORMS",
    "CallArgs",
    "Mask",
    "PageTable",
    "apply_rope",
    "attention",
    "blockwise_attention",
    "checks",
    "decode_attention",
    "dot_product_attention",
    "flax_attention_fn",
    "indexed_topk_attention",
    "kv_cache_bytes",
    "latent_attention",
    "latent_cache_bytes",
    "linear",
    "linear_state_bytes",
    "masks",
    "merge_attention",
    "moba_attention",
    "nsa_attention",
    "paged",
    "paged_decode_attention",
    "pallas",
    "path_attention",
    "path_transform_keys",
    "path_transform_queries",
    "path_update_keys",
    "registry",
    "ring",
    "ring_attention",
    "scores",
    "sharded_attention",
    "short_conv",
    "short_conv_step",
    "sigmoid_attention",
    "softmax",
    "softpick_attention",
    "sparse",
    *linear.__all__,
]
