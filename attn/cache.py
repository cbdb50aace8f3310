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
