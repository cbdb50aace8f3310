"""Decode caches as pure functions: their sizes, and the slot bookkeeping of KV caches.

Sizes: what a model must keep per generated token (``kv_cache_bytes``,
``latent_cache_bytes``, ``linear_state_bytes``).

Slots: softmax and MLA caches store each entry with the absolute position of
its token, in a full layout (position p in slot p) or a ring buffer for
sliding windows with pinned initial tokens. ``slot_of`` maps positions to
slots, ``write_tokens`` / ``write_token`` store new entries, and
``extend_slots`` gives what new tokens attend to and the cache after them.
The arrays are any payload ``[B,S,...]`` (keys and values, or MLA latents).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from attn.checks import fail


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
    3.75 MiB for bfloat16 MHA with 128 heads of dim 128 (``attn.kv_cache_bytes``).

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


# ----------------------------------------------------------------------------
# Slot caches: entries stored with their absolute positions (full caches and rings)
#
# A layer cache holds ``S`` slots per row, each with the absolute position of
# its token in ``pos [B,S]`` (``EMPTY`` if never written). A full cache keeps
# position p in slot p. A ring buffer (sliding window ``w``, optionally with
# ``n`` pinned initial tokens) has ``S = n + w`` slots: positions ``p < n`` stay
# in slot p forever and later ones cycle through slots ``n + (p - n) % w``.
# Attention reads the stored positions with the layer's position-based mask,
# so one layout serves every mask and ring order never matters.

EMPTY = -1  # the stored position of a slot that holds no token


def slot_of(positions, pinned: int, slots: int):
    """The slot of each absolute position: itself if pinned (``< pinned``), else its ring slot.

    Args:
      positions: int array of any shape.
      pinned: slots ``[0, pinned)`` hold positions ``[0, pinned)``.
      slots: S, the slots per row.
    """
    ring = slots - pinned
    return jnp.where(positions < pinned, positions, pinned + (positions - pinned) % ring)


def _expand(mask, ndim: int):
    return mask.reshape(mask.shape + (1,) * (ndim - mask.ndim))


def write_tokens(old: tuple, old_pos, new: tuple, start, count, pinned: int):
    """Writes ``count[b]`` new tokens at positions ``start[b], start[b] + 1, ...`` per row.

    Computed as a gather: each slot takes the latest position that maps to it,
    from the new tokens if that position is new, otherwise it keeps its entry.
    So more new tokens than slots (a long prompt into a ring buffer) is fine,
    and no two writes ever target one slot (a scatter with duplicate indices
    would leave the winner unspecified).

    Args:
      old: arrays ``[B,S,...]`` (the cache's payload).
      old_pos: ``[B,S]`` int32 stored positions.
      new: arrays ``[B,T,...]``, matching ``old`` past the second axis.
      start: ``[B]`` int32 position of ``new[:, 0]``.
      count: ``[B]`` int32 real new tokens per row (the first ``count[b]``; the rest is padding).
      pinned: slots ``[0, pinned)`` are pinned, the rest a ring.

    Returns:
      ``(arrays [B,S,...], positions [B,S] int32)``.
    """
    S = old_pos.shape[1]
    T = new[0].shape[1]
    ring = S - pinned
    j = jnp.arange(S)[None, :]  # [1,S]
    last = (start + count - 1)[:, None]  # [B,1] the newest position written
    # The largest p <= last with p = j (mod ring): the newest position of ring slot j.
    p = jnp.where(j < pinned, j, last - (last - j) % ring)
    take = (p >= start[:, None]) & (p <= last) & ((j < pinned) | (p >= pinned))
    t = jnp.clip(p - start[:, None], 0, T - 1)  # [B,S] index into the new tokens
    rows = jnp.arange(old_pos.shape[0])[:, None]
    arrays = tuple(
        jnp.where(_expand(take, o.ndim), n[rows, t].astype(o.dtype), o)
        for o, n in zip(old, new, strict=True)
    )
    return arrays, jnp.where(take, p, old_pos).astype(jnp.int32)


def write_token(old: tuple, old_pos, new: tuple, position, pinned: int):
    """Writes one token per row (decoding): a scatter to one distinct slot per row.

    Args:
      old: arrays ``[B,S,...]``; old_pos: ``[B,S]`` int32.
      new: arrays ``[B,1,...]``.
      position: ``[B]`` int32 positions of the new tokens.
      pinned: as in ``write_tokens``.

    Returns:
      ``(arrays [B,S,...], positions [B,S] int32)``.
    """
    rows = jnp.arange(old_pos.shape[0])
    slot = slot_of(position, pinned, old_pos.shape[1])
    arrays = tuple(
        o.at[rows, slot].set(n[:, 0].astype(o.dtype)) for o, n in zip(old, new, strict=True)
    )
    return arrays, old_pos.at[rows, slot].set(position.astype(jnp.int32))


def extend_slots(old: tuple, old_pos, new: tuple, start, lengths=None, *, pinned: int = 0):
    """What T new tokens attend to, and the cache after storing them.

    Decoding (T = 1, ``lengths`` None) writes first and attends over the slots
    alone: in a ring the entry it overwrites is ``w`` positions back, already
    outside the window. A prefill chunk may be longer than a ring, so it
    attends over the old slots followed by all new tokens (padding marked
    ``EMPTY``), and only then keeps what the slots can hold.

    Args:
      old: arrays ``[B,S,...]``; old_pos: ``[B,S]`` int32 stored positions.
      new: arrays ``[B,T,...]`` of the new tokens at positions ``start[b] + t``.
      start: ``[B]`` int32 position of ``new[:, 0]``.
      lengths: ``[B]`` real new tokens per row (the rest is padding), or None (all T).
      pinned: slots ``[0, pinned)`` are pinned, the rest a ring.

    Returns:
      ``((visible arrays [B,S',...], visible positions [B,S']), (arrays [B,S,...],
      positions [B,S]))`` with ``S' = S`` when decoding, else ``S + T``. The
      visible positions are ``EMPTY`` where there is no token.
    """
    B, T = new[0].shape[:2]
    start = jnp.asarray(start, jnp.int32)
    if T == 1 and lengths is None:
        stored = write_token(old, old_pos, new, start, pinned)
        return stored, stored
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B,T]
    count = jnp.full((B,), T, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    real = jnp.arange(T)[None, :] < count[:, None]
    visible = tuple(
        jnp.concatenate([o, n.astype(o.dtype)], axis=1) for o, n in zip(old, new, strict=True)
    )
    visible_pos = jnp.concatenate([old_pos, jnp.where(real, positions, EMPTY)], axis=1)
    return (visible, visible_pos), write_tokens(old, old_pos, new, start, count, pinned)
