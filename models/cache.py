"""Decode caches: functional pytrees, one per layer, and their sizes.

Softmax and MLA layers keep ``slots`` entries per sequence, each stored with
the absolute position of its token (``EMPTY`` for a slot never written), in a
full layout or a ring buffer (sliding windows, with pinned initial tokens);
the slot arithmetic is pure and lives in ``attn.cache`` (``slot_of``,
``write_tokens``, ``extend_slots``). Attention reads the stored positions with
the layer's position-based mask, so one layout serves every mask:

* full cache: ``slots = max_len``, entry of position p in slot p;
* ring buffer (sliding window ``w``, optionally the ``n`` initial tokens of StreamingLLM):
  ``slots = n + w``; positions ``p < n`` are pinned in slot p, later ones cycle
  through slots ``n + (p - n) % w``. Generation then continues far past the
  window with constant memory, and the mask
  ``causal() & (sliding_window(w) | initial_tokens(n))`` on the stored positions picks
  exactly the entries the full forward pass would see.

Linear-attention layers keep ``attn.linear.LinearState`` (kv ``[B,N,F,E]``,
z ``[B,N,F]``, float32), whose size does not depend on the length.

A layer with a short convolution (``AttentionConfig.short_conv = W``) also keeps
its last W-1 inputs ``[B,W-1,D]`` (``DecodeCache.conv``, next to the layer's
cache), in the compute dtype: what ``attn.short_conv_step`` continues from.

Sizes: ``cache_bytes`` counts the payload (K/V, latents, states, convolution
states), the arrays ``attn.kv_cache_bytes``, ``latent_cache_bytes`` and
``linear_state_bytes`` price plus ``B (W-1) D`` per convolution;
``bookkeeping_bytes`` counts the rest (stored positions ``[B,S]`` int32 per
layer and the lengths ``[B]``).
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from attn.cache import (  # noqa: F401  (EMPTY and the sizes are re-exported)
    EMPTY,
    extend_slots,
    latent_cache_bytes,
    linear_state_bytes,
)
from attn.linear import LinearState


@struct.dataclass
class SlotCache:
    """Entries of one softmax or MLA layer, each stored with its token's position.

    Subclasses name their payload arrays ``[B,S,...]`` in ``PAYLOAD``.

    Attributes:
      pos: ``[B,S]`` int32 absolute position of each slot's token, ``EMPTY`` if none.
      pinned: slots ``[0, pinned)`` hold positions ``[0, pinned)`` forever (initial tokens);
        the other ``S - pinned`` are a ring buffer. Static.
      ring: True for a window layer's ring buffer, which never fills; False for
        a full cache, which holds positions ``[0, S)`` and refuses more (see
        ``cache_overflow``). Static.
    """

    pos: jax.Array = struct.field(kw_only=True)
    pinned: int = struct.field(pytree_node=False, default=0, kw_only=True)
    ring: bool = struct.field(pytree_node=False, default=False, kw_only=True)

    PAYLOAD: ClassVar[tuple[str, ...]] = ()

    def extend(self, new: tuple, start, lengths=None):
        """Stores T new tokens' payload ``[B,T,...]`` at positions ``start[b] + t``.

        Args:
          new: one array ``[B,T,...]`` per ``PAYLOAD`` name.
          start: ``[B]`` position of ``new[:, 0]``.
          lengths: ``[B]`` real tokens per row, or None (all T).

        Returns:
          ``(visible, visible_pos, cache)``: the payload arrays ``[B,S',...]`` and
          positions ``[B,S']`` the new tokens attend to (``attn.cache.extend_slots``),
          and the updated cache.
        """
        old = tuple(getattr(self, name) for name in self.PAYLOAD)
        (visible, visible_pos), (stored, pos) = extend_slots(
            old, self.pos, new, start, lengths, pinned=self.pinned
        )
        cache = self.replace(pos=pos, **dict(zip(self.PAYLOAD, stored, strict=True)))
        return visible, visible_pos, cache


@struct.dataclass
class KVCache(SlotCache):
    """Keys and values of one softmax layer (plus ``SlotCache``'s pos, pinned, ring).

    Attributes:
      k: ``[B,S,K,H]`` keys (RoPE already applied at their positions).
      v: ``[B,S,K,E]`` values.
    """

    k: jax.Array
    v: jax.Array

    PAYLOAD: ClassVar[tuple[str, ...]] = ("k", "v")


@struct.dataclass
class ForgetCache(KVCache):
    """A FoX layer's keys and values, with the running sums of its forget gates.

    Attributes:
      c: ``[B,S,N]`` float32: at each slot, the sum of the log forget gates of the
        row's tokens up to and including the slot's token (``attn.scores.Forgetting``'s
        key side).
      total: ``[B,N]`` float32: the same sum up to the last token stored, where
        the next tokens' sums continue from.
    """

    c: jax.Array
    total: jax.Array

    PAYLOAD: ClassVar[tuple[str, ...]] = ("k", "v", "c")


@struct.dataclass
class LatentCache(SlotCache):
    """What one MLA layer keeps (plus ``SlotCache``'s pos, pinned, ring).

    Attributes:
      c_kv: ``[B,S,R]`` compressed keys/values (after the latent norm).
      k_rope: ``[B,S,Hr]`` decoupled RoPE key shared by all heads (rotated).
    """

    c_kv: jax.Array
    k_rope: jax.Array

    PAYLOAD: ClassVar[tuple[str, ...]] = ("c_kv", "k_rope")


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
      conv: one short-convolution state ``[B,W-1,D]`` per layer (the layer's last
        W-1 attention inputs; None for a layer without ``short_conv``), or ()
        when no layer has one.
    """

    layers: tuple
    lengths: jax.Array
    cross: tuple = ()
    conv: tuple = ()


# ----------------------------------------------------------------------------
# Room left


def full_cache_slots(cache: DecodeCache) -> int | None:
    """Slots of the smallest full (non-ring) layer cache: the positions it can hold, or None."""
    sizes = [
        layer.pos.shape[1]
        for layer in cache.layers
        if isinstance(layer, SlotCache) and not layer.ring
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
# Sizes


def _nbytes(x) -> int:
    """Bytes of an array or a ``jax.ShapeDtypeStruct`` (so ``jax.eval_shape`` caches work)."""
    return int(np.prod(x.shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize


def _payload(layer) -> tuple:
    if isinstance(layer, CrossCache):
        return (layer.k, layer.v)
    if isinstance(layer, SlotCache):
        return tuple(getattr(layer, name) for name in layer.PAYLOAD)
    if isinstance(layer, LinearState):
        return (layer.kv, layer.z)
    leaves = jax.tree.leaves(layer)  # a kind's own cache (e.g. the delta rule's): all payload
    if not leaves or not all(hasattr(x, "shape") for x in leaves):
        raise ValueError(f"cache: expected a layer cache, got {type(layer).__name__}")
    return tuple(leaves)


def cache_bytes(cache: DecodeCache) -> int:
    """Bytes of the payload of a ``DecodeCache``: K/V, latents and RoPE keys, linear
    states, short-convolution states.

    Stored positions and lengths are excluded (see ``bookkeeping_bytes``); the
    cross-attention K/V of an encoder-decoder are included.
    """
    if not isinstance(cache, DecodeCache):
        raise ValueError(f"cache: expected a DecodeCache, got {type(cache).__name__}")
    payload = sum(_nbytes(x) for layer in (*cache.layers, *cache.cross) for x in _payload(layer))
    return payload + sum(_nbytes(x) for x in cache.conv if x is not None)


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
