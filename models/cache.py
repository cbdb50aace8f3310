"""Decode caches: functional pytrees, one per layer, and their sizes.

Softmax and MLA layers keep ``slots`` entries per sequence, each stored with
the absolute position of its token (``EMPTY`` for a slot never written).
Attention reads the stored positions with the layer's position-based mask, so
one layout serves every mask:

* full cache: ``slots = max_len``, entry of position p in slot p;
* ring buffer (sliding window ``w``, optionally the ``n`` initial tokens of StreamingLLM):
  ``slots = n + w``; positions ``p < n`` are pinned in slot p, later ones cycle
  through slots ``n + (p - n) % w``. Generation then continues far past the
  window with constant memory, and the mask
  ``causal() & (sliding_window(w) | initial_tokens(n))`` on the stored positions picks
  exactly the entries the full forward pass would see.

Linear-attention layers keep ``attn.linear.LinearState`` (kv ``[B,N,F,E]``,
z ``[B,N,F]``, float32), whose size does not depend on the length.

Sizes: ``cache_bytes`` counts the payload (K/V, latents, states), the arrays
``attn.kv_cache_bytes``, ``latent_cache_bytes`` and ``linear_state_bytes``
price; ``bookkeeping_bytes`` counts the rest (stored positions ``[B,S]`` int32
per layer and the lengths ``[B]``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from attn.cache import latent_cache_bytes, linear_state_bytes  # noqa: F401  (re-exported)
from attn.linear import LinearState

EMPTY = -1  # stored position of a slot that holds no token


@struct.dataclass
class KVCache:
    """Keys and values of one softmax layer.

    Attributes:
      k: ``[B,S,K,H]`` keys (RoPE already applied at their positions).
      v: ``[B,S,K,E]`` values.
      pos: ``[B,S]`` int32 absolute position of each slot's token, ``EMPTY`` if none.
      pinned: slots ``[0, pinned)`` hold positions ``[0, pinned)`` forever (initial tokens);
        the other ``S - pinned`` are a ring buffer. Static.
      ring: True for a window layer's ring buffer, which never fills; False for
        a full cache, which holds positions ``[0, S)`` and refuses more (see
        ``cache_overflow``). Static.
    """

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    pinned: int = struct.field(pytree_node=False, default=0)
    ring: bool = struct.field(pytree_node=False, default=False)


@struct.dataclass
class LatentCache:
    """What one multi-head latent attention layer keeps: the latent and the RoPE key.

    Attributes:
      c_kv: ``[B,S,R]`` compressed keys/values (after the latent norm).
      k_rope: ``[B,S,Hr]`` decoupled RoPE key shared by all heads (rotated).
      pos: ``[B,S]`` int32 positions, ``EMPTY`` if none.
      pinned, ring: as in ``KVCache``. Static.
    """

    c_kv: jax.Array
    k_rope: jax.Array
    pos: jax.Array
    pinned: int = struct.field(pytree_node=False, default=0)
    ring: bool = struct.field(pytree_node=False, default=False)


@struct.dataclass
class CrossCache:
    """Cross-attention keys and values of the encoder output, computed once.

    Attributes:
      k: ``[B,S,K,H]``; v: ``[B,S,K,E]``.
      segment_ids: ``[B,S]`` int32, 1 on source tokens, 0 on source padding.
    """

    k: jax.Array
    v: jax.Array
    segment_ids: jax.Array


@struct.dataclass
class DecodeCache:
    """A model's decode cache.

    Attributes:
      layers: one ``KVCache``, ``LatentCache`` or ``LinearState`` per layer.
      lengths: ``[B]`` int32 tokens processed per row, i.e. the next position.
      cross: one ``CrossCache`` per decoder layer (``EncoderDecoder``), else ().
    """

    layers: tuple
    lengths: jax.Array
    cross: tuple = ()


# ----------------------------------------------------------------------------
# Room left


def full_cache_slots(cache: DecodeCache) -> int | None:
    """Slots of the smallest full (non-ring) layer cache: the positions it can hold, or None."""
    sizes = [
        layer.pos.shape[1]
        for layer in cache.layers
        if isinstance(layer, KVCache | LatentCache) and not layer.ring
    ]
    return min(sizes) if sizes else None


def cache_overflow(cache: DecodeCache, count):
    """Rows whose next ``count`` tokens do not fit a full (non-ring) layer cache.

    A full cache holds positions ``[0, S)``, one slot each. Writing past it
    would cycle through the slots and silently turn full attention into a
    window of S, so it is an error: with concrete lengths this raises; under a
    trace it returns the rows that overflow, whose logits the caller makes NaN.

    Args:
      cache: the ``DecodeCache`` before the new tokens.
      count: ``[B]`` or a Python int, new real tokens per row.

    Returns:
      ``[B]`` bool (True: overflows), or None if no layer has a full cache.

    Raises:
      ValueError: concrete lengths that overflow.
    """
    room = full_cache_slots(cache)
    if room is None:
        return None
    end = cache.lengths + count  # [B] one past the last new position
    try:
        value = np.asarray(end)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return end > room
    if (value > room).any():
        raise ValueError(
            f"cache: expected room for positions up to {int(value.max()) - 1}, got a full cache "
            f"of {room} slots (positions 0..{room - 1}); make it with a larger max_len"
        )
    return end > room


# ----------------------------------------------------------------------------
# Writing entries


def slot_of(positions, pinned: int, slots: int):
    """The slot of each absolute position: itself if pinned, else its ring slot."""
    ring = slots - pinned
    return jnp.where(positions < pinned, positions, pinned + (positions - pinned) % ring)


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
      count: ``[B]`` int32 valid new tokens per row (the rest is padding).
      pinned: slots ``[0, pinned)`` are pinned, the rest a ring.

    Returns:
      ``(arrays [B,S,...], positions [B,S])``.
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
      old: arrays ``[B,S,...]``; old_pos: ``[B,S]``.
      new: arrays ``[B,1,...]``.
      position: ``[B]`` int32 positions of the new tokens.

    Returns:
      ``(arrays [B,S,...], positions [B,S])``.
    """
    rows = jnp.arange(old_pos.shape[0])
    slot = slot_of(position, pinned, old_pos.shape[1])
    arrays = tuple(
        o.at[rows, slot].set(n[:, 0].astype(o.dtype)) for o, n in zip(old, new, strict=True)
    )
    return arrays, old_pos.at[rows, slot].set(position.astype(jnp.int32))


def _expand(mask, ndim: int):
    return mask.reshape(mask.shape + (1,) * (ndim - mask.ndim))


# ----------------------------------------------------------------------------
# Sizes


def _nbytes(x) -> int:
    """Bytes of an array or a ``jax.ShapeDtypeStruct`` (so ``jax.eval_shape`` caches work)."""
    return int(np.prod(x.shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize


def _payload(layer) -> tuple:
    if isinstance(layer, KVCache | CrossCache):
        return (layer.k, layer.v)
    if isinstance(layer, LatentCache):
        return (layer.c_kv, layer.k_rope)
    if isinstance(layer, LinearState):
        return (layer.kv, layer.z)
    raise ValueError(f"cache: expected a layer cache, got {type(layer).__name__}")


def cache_bytes(cache: DecodeCache) -> int:
    """Bytes of the payload of a ``DecodeCache``: K/V, latents and RoPE keys, linear states.

    Stored positions and lengths are excluded (see ``bookkeeping_bytes``); the
    cross-attention K/V of an encoder-decoder are included.
    """
    if not isinstance(cache, DecodeCache):
        raise ValueError(f"cache: expected a DecodeCache, got {type(cache).__name__}")
    return sum(_nbytes(x) for layer in (*cache.layers, *cache.cross) for x in _payload(layer))


def bookkeeping_bytes(cache: DecodeCache) -> int:
    """Bytes of a ``DecodeCache`` that are not payload: stored positions, segment ids, lengths."""
    if not isinstance(cache, DecodeCache):
        raise ValueError(f"cache: expected a DecodeCache, got {type(cache).__name__}")
    total = _nbytes(cache.lengths)
    for layer in (*cache.layers, *cache.cross):
        extra = getattr(layer, "pos", None)
        extra = getattr(layer, "segment_ids", extra)
        if extra is not None:
            total += _nbytes(extra)
    return total
