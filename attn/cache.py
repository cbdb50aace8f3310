"""Decode-cache sizes: what a model must keep per generated token."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from attn._checks import fail


def _count(x, name, minimum=1):
    if isinstance(x, bool) or not isinstance(x, int | np.integer) or x < minimum:
        fail(name, f"an int >= {minimum}", repr(x))
    return int(x)


def _itemsize(dtype) -> int:
    try:
        return jnp.dtype(dtype).itemsize
    except TypeError:
        fail("dtype", "a numeric dtype such as jnp.bfloat16", repr(dtype))


def kv_cache_bytes(
    *, num_layers: int, num_kv_heads: int, head_dim: int, dtype, num_tokens: int = 1, batch: int = 1
) -> int:
    """Bytes of a key/value cache: ``2 x layers x kv heads x head dim x bytes x tokens x batch``.

    The 2 counts keys and values. Llama 3 8B (32 layers, 8 kv heads, head dim
    128, float16) needs 131072 bytes (128 KiB) per token and 1 GiB for 8192
    tokens; with 32 kv heads (MHA) 4x more.

    Args:
      num_layers: L, attention layers holding a cache.
      num_kv_heads: K, key/value heads per layer.
      head_dim: H (keys and values of the same width).
      dtype: the cache's element type.
      num_tokens: cached positions per sequence.
      batch: sequences.

    Returns:
      The size in bytes, a Python int.
    """
    per_token = (
        2
        * _count(num_layers, "num_layers")
        * _count(num_kv_heads, "num_kv_heads")
        * _count(head_dim, "head_dim")
        * _itemsize(dtype)
    )
    return per_token * _count(num_tokens, "num_tokens", 0) * _count(batch, "batch")


def latent_cache_bytes(
    *,
    num_layers: int,
    kv_rank: int,
    rope_head_dim: int,
    dtype,
    num_tokens: int = 1,
    batch: int = 1,
) -> int:
    """Bytes of an MLA cache: ``layers x (R + rope dim) x bytes x tokens x batch``.

    One latent of rank R and one decoupled RoPE key shared by all heads per
    token, instead of ``2 x K x H`` for keys and values. DeepSeek-V2 (60 layers,
    R = 512, rope dim 64, bfloat16) keeps 69120 bytes per token, against
    7.5 MiB for MHA with 128 heads of dim 128 (``attn.kv_cache_bytes``).

    Args:
      num_layers: L, MLA layers.
      kv_rank: R.
      rope_head_dim: width of the shared RoPE key.
      dtype: the cache's element type.
      num_tokens: cached positions per sequence.
      batch: sequences.
    """
    per_token = (
        _count(num_layers, "num_layers")
        * (_count(kv_rank, "kv_rank") + _count(rope_head_dim, "rope_head_dim", 0))
        * _itemsize(dtype)
    )
    return per_token * _count(num_tokens, "num_tokens", 0) * _count(batch, "batch")


def linear_state_bytes(
    *,
    num_layers: int,
    num_heads: int,
    feature_dim: int,
    value_dim: int,
    dtype=jnp.float32,
    batch: int = 1,
) -> int:
    """Bytes of linear-attention states: ``layers x N x F x (E + 1) x bytes x batch``.

    The state ``kv [B,N,F,E]`` plus the normalizer ``z [B,N,F]``, float32 in
    ``attn.linear`` whatever the input dtype; independent of the length.

    Args:
      num_layers: L, linear-attention layers.
      num_heads: N (states are per query head).
      feature_dim: F of the feature map (``attn.linear.linear_feature_dim``).
      value_dim: E.
      dtype: the state's element type (float32 in ``attn.linear``).
      batch: sequences.
    """
    return (
        _count(num_layers, "num_layers")
        * _count(num_heads, "num_heads")
        * _count(feature_dim, "feature_dim")
        * (_count(value_dim, "value_dim") + 1)
        * _itemsize(dtype)
        * _count(batch, "batch")
    )
