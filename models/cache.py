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

import dataclasses
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
from attn.paged import UNUSED, extend_pages, pages_for


@struct.dataclass
class SlotCache:
    """Entries of one softmax or MLA layer, each stored with its token's position.

    Subclasses name their payload arrays ``[B,S,...]`` in ``PAYLOAD``.

    A paged cache (``paged_layer``; ``Decoder.init_cache(..., page_size=...)``)
    keeps each payload in a pool ``[P, page_size, ...]`` shared by the rows,
    with ``tables`` mapping each row's positions to pages
    (``attn.paged``); it stores no positions (``pos`` is None): position p of
    a row is slot p of its pages.

    Attributes:
      pos: ``[B,S]`` int32 absolute position of each slot's token, ``EMPTY`` if
        none; None for a paged cache.
      tables: ``[B,M]`` int32 block tables of a paged cache (-1: no page), else None.
      pinned: slots ``[0, pinned)`` hold positions ``[0, pinned)`` forever (initial tokens);
        the other ``S - pinned`` are a ring buffer. Static.
      ring: True for a window layer's ring buffer, which never fills; False for
        a full cache, which holds positions ``[0, S)`` and refuses more (see
        ``cache_overflow``). Static.
    """

    pos: jax.Array | None = struct.field(kw_only=True)
    tables: jax.Array | None = struct.field(default=None, kw_only=True)
    pinned: int = struct.field(pytree_node=False, default=0, kw_only=True)
    ring: bool = struct.field(pytree_node=False, default=False, kw_only=True)

    PAYLOAD: ClassVar[tuple[str, ...]] = ()
    # False for a kind whose steps rewrite a row's old entries (PaTH's keys): never paged.
    PAGEABLE: ClassVar[bool] = True

    @property
    def paged(self) -> bool:
        return self.tables is not None

    @property
    def page_size(self) -> int | None:
        """Tokens per page of a paged cache (the pools' second axis), else None."""
        return getattr(self, self.PAYLOAD[0]).shape[1] if self.paged else None

    @property
    def capacity(self) -> int:
        """Positions a row can hold: S slots, or M pages of ``page_size``."""
        return self.tables.shape[1] * self.page_size if self.paged else self.pos.shape[1]

    def extend(self, new: tuple, start, lengths=None):
        """Stores T new tokens' payload ``[B,T,...]`` at positions ``start[b] + t``.

        Args:
          new: one array ``[B,T,...]`` per ``PAYLOAD`` name.
          start: ``[B]`` position of ``new[:, 0]``.
          lengths: ``[B]`` real tokens per row, or None (all T).

        Returns:
          ``(visible, visible_pos, cache)``: the payload arrays ``[B,S',...]`` and
          positions ``[B,S']`` the new tokens attend to (``attn.cache.extend_slots``,
          or ``attn.paged.extend_pages`` for a paged cache), and the updated cache.
        """
        old = tuple(getattr(self, name) for name in self.PAYLOAD)
        if self.paged:
            (visible, visible_pos), stored = extend_pages(old, self.tables, new, start, lengths)
            cache = self.replace(**dict(zip(self.PAYLOAD, stored, strict=True)))
            return visible, visible_pos, cache
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
    """Positions the smallest full (non-ring) layer cache can hold per row, or None."""
    sizes = [layer.capacity for layer in _slot_layers(cache) if not layer.ring]
    return min(sizes) if sizes else None


def _slot_layers(cache: DecodeCache) -> list[SlotCache]:
    return [layer for layer in cache.layers if isinstance(layer, SlotCache)]


def cache_overflow(cache: DecodeCache, count):
    """Rows whose next ``count`` tokens do not fit a full (non-ring) layer cache.

    A full cache holds positions ``[0, S)``, one slot each. Writing past it
    would cycle through the slots and silently turn full attention into a
    window of S, so it is an error: with concrete lengths this raises; under a
    trace it returns the rows that overflow, whose logits the caller makes NaN.
    A paged layer overflows where a new token's page is not held (the block
    table was not grown for it), which would drop the token.

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
    over = end > room
    for layer in _slot_layers(cache):
        if layer.paged:
            over = over | _missing_pages(layer, cache.lengths, end)
    try:
        value, missing = np.asarray(end), np.asarray(over)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return over
    if (value > room).any():
        raise ValueError(
            f"cache: expected room for positions up to {int(value.max()) - 1}, got a full cache "
            f"of {room} slots (positions 0..{room - 1}); make it with a larger max_len"
        )
    if missing.any():
        b = int(np.nonzero(missing)[0][0])
        raise ValueError(
            f"cache: expected pages for row {b}'s positions {int(np.asarray(cache.lengths)[b])}.."
            f"{int(value[b]) - 1} in its block table (attn.PageTable.grow, then "
            "models.cache.set_block_tables), got a table without them"
        )
    return over


def _missing_pages(layer: SlotCache, start, end):
    """``[B]`` bool: rows whose positions ``[start, end)`` reach a page the table lacks."""
    page, (start, end) = layer.page_size, (start[:, None], end[:, None])
    m = jnp.arange(layer.tables.shape[1])[None, :]
    needed = (end > start) & ((m + 1) * page > start) & (m * page < end)  # [B,M]
    return jnp.any(needed & (layer.tables < 0), axis=1)


# ----------------------------------------------------------------------------
# Paged caches and rows that come and go


def paged_layer(layer: SlotCache, num_pages: int, page_size: int) -> SlotCache:
    """The paged form of a full layer cache (it may be a ``jax.eval_shape`` of one).

    Each payload ``[B,S,...]`` becomes a zero pool ``[num_pages, page_size, ...]``
    and every row an empty block table of ``ceil(S / page_size)`` entries; the
    layer's other per-row arrays (FoX's gate totals) are zeros as in a new cache.
    """
    if not isinstance(layer, SlotCache) or layer.ring:
        raise ValueError(f"layer: expected a full SlotCache, got {type(layer).__name__}")
    B, S = layer.pos.shape
    fields = {}
    for f in dataclasses.fields(layer):
        x = getattr(layer, f.name)
        if f.name in layer.PAYLOAD:
            fields[f.name] = jnp.zeros((num_pages, page_size, *x.shape[2:]), x.dtype)
        elif f.metadata.get("pytree_node", True) and f.name not in ("pos", "tables"):
            fields[f.name] = jnp.zeros(x.shape, x.dtype)
    tables = jnp.full((B, pages_for(S, page_size)), UNUSED, jnp.int32)
    return layer.replace(pos=None, tables=tables, **fields)


def set_block_tables(cache: DecodeCache, tables) -> DecodeCache:
    """The cache with every paged layer reading ``tables`` ``[B,M]`` (a host
    ``attn.PageTable``'s, after it grew or released rows)."""
    tables = jnp.asarray(tables, jnp.int32)

    def put(layer):
        if not isinstance(layer, SlotCache) or not layer.paged:
            return layer
        if tables.shape != layer.tables.shape:
            raise ValueError(
                f"tables: expected block tables of shape {layer.tables.shape}, got {tables.shape}"
            )
        return layer.replace(tables=tables)

    return cache.replace(layers=tuple(put(layer) for layer in cache.layers))


def clear_rows(cache: DecodeCache, empty: DecodeCache, rows) -> DecodeCache:
    """The cache with ``rows`` as they are in ``empty`` (a new cache of the same
    model and shape): a finished row's slot, cleared for the next sequence.

    Per-row arrays (stored positions, states, convolution inputs, lengths, block
    tables) take ``empty``'s values at the rows; a paged layer's pools, shared by
    every row, are left as they are (the rows' pages return through the host's
    ``attn.PageTable.release``).

    Args:
      cache, empty: ``DecodeCache``s of equal structure.
      rows: ``[B]`` bools, True for the rows to clear.
    """
    B = cache.lengths.shape[0]
    rows = jnp.asarray(rows)
    if rows.shape != (B,) or rows.dtype != jnp.bool_:
        raise ValueError(f"rows: expected bools of shape ({B},), got {rows.dtype} {rows.shape}")

    def pick(old, new):
        keep = rows.reshape((B,) + (1,) * (old.ndim - 1))
        return jnp.where(keep, new, old)

    def layer_rows(old, new):
        if isinstance(old, SlotCache) and old.paged:
            none = dict.fromkeys(old.PAYLOAD)  # the pools are not per row: set aside
            cleared = jax.tree.map(pick, old.replace(**none), new.replace(**none))
            return cleared.replace(**{name: getattr(old, name) for name in old.PAYLOAD})
        return jax.tree.map(pick, old, new)

    layers = tuple(layer_rows(o, n) for o, n in zip(cache.layers, empty.layers, strict=True))
    conv = jax.tree.map(pick, cache.conv, empty.conv)
    return cache.replace(layers=layers, conv=conv, lengths=pick(cache.lengths, empty.lengths))


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
    """Bytes of a ``DecodeCache`` that are not payload: stored positions, block tables,
    segment ids, lengths."""
    if not isinstance(cache, DecodeCache):
        raise ValueError(f"cache: expected a DecodeCache, got {type(cache).__name__}")
    total = _nbytes(cache.lengths)
    for layer in (*cache.layers, *cache.cross):
        for name in ("pos", "tables", "segment_ids"):
            extra = getattr(layer, name, None)
            if extra is not None:
                total += _nbytes(extra)
    return total
