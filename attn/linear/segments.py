"""Segment ids (packing and padding) for linear attention, as masks and log decays.

Internal to ``attn.linear``. Id 0 is padding (``attn.masks.PADDING``); any
other id names a segment.

Causal: the forms need no segment logic of their own. A padding key gets
zero features and log decay 0, so it leaves the state exactly as it was; the
first key of a new segment gets log decay ``-inf``, which erases the state
(the forms already handle a zero gate exactly, without NaN); a query reads
the state only when its id is the id of the segment the state holds.

Not causal: the keys and queries are sorted by id into one causal sequence of
``M = S + T`` tokens (``M`` is this file's extra axis letter), each segment's
keys before its queries (``merge``), so every query reads the sum over exactly
the keys with its id; ``unmerge`` puts the outputs back in query order.

Cost: with segment ids the log decay is never None, so even without decay the
forms take their decayed path (a state per query head, G times the no-decay
path's state work); the masks themselves are elementwise.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from attn.masks import PADDING, same_segment


class Causal(NamedTuple):
    """What segment ids mean to a causal recurrence over T tokens."""

    key_real: jax.Array  # [B,T] bool: the key enters the state
    log_a: jax.Array  # [B,T,N] float32: 0 on padding, -inf where a segment starts
    q_read: jax.Array  # [B,T] bool: the query belongs to the segment the state holds


def causal(q_seg, kv_seg, log_a, num_heads: int) -> Causal:
    """Masks and log decays ``[B,T,N]`` for ids ``[B,T]``; log_a ``[B,T,N]`` or None.

    A segment is a run of equal non-padding key ids, padding between them
    skipped: the state resets where a key's id differs from the previous
    non-padding key's. The first segment continues the initial state.
    """
    B, T = kv_seg.shape
    key_real = kv_seg != PADDING
    # Id of the segment the state holds after token t: that of the last real key <= t.
    last = lax.cummax(jnp.where(key_real, jnp.arange(T), -1), axis=1)
    held = jnp.where(last >= 0, jnp.take_along_axis(kv_seg, jnp.maximum(last, 0), 1), PADDING)
    held_before = jnp.pad(held[:, :-1], ((0, 0), (1, 0)), constant_values=PADDING)
    starts = key_real & (held_before != PADDING) & (kv_seg != held_before)
    base = jnp.zeros((B, T, num_heads), jnp.float32) if log_a is None else log_a
    log_a = jnp.where(key_real[..., None], base, 0.0)  # padding does not decay the state
    log_a = jnp.where(starts[..., None], -jnp.inf, log_a)
    q_read = (q_seg != PADDING) & (q_seg == held)
    return Causal(key_real, log_a, q_read)


def visible(q_seg, kv_seg):
    """``[B,T,S]`` bool: query t sees key s (same id, not padding), as in dense attention."""
    return same_segment(q_seg, kv_seg)


class Merged(NamedTuple):
    """Keys and queries of a non-causal call as one causal sequence of M = S + T tokens."""

    q: jax.Array  # [B,M,K,G,H]; rows at key tokens are never read
    k: jax.Array  # [B,M,K,H]
    v: jax.Array  # [B,M,K,E]
    q_seg: jax.Array  # [B,M] int32: the id at query tokens, PADDING at key tokens
    kv_seg: jax.Array  # [B,M] int32: the id at key tokens, PADDING at query tokens
    q_at: jax.Array  # [B,T] int32: where each query is in the merged sequence


def _take(x, index):
    """``x[b, index[b]]`` for every row b: a gather along axis 1 with per-row indices."""
    return jax.vmap(lambda row, i: row[i])(x, index)


def merge(q, k, v, q_seg, kv_seg) -> Merged:
    """Sorts q ``[B,T,K,G,H]``, k ``[B,S,K,H]``, v ``[B,S,K,E]`` by segment id.

    Keys come first in the concatenation and the sort is stable, so within an
    id the keys precede the queries, which then read the sum over all of them.
    """
    S, T = kv_seg.shape[1], q_seg.shape[1]
    ids = jnp.concatenate([kv_seg, q_seg], axis=1)  # [B,M]
    order = jnp.argsort(ids, axis=1, stable=True)
    is_query = order >= S
    sorted_ids = jnp.take_along_axis(ids, order, axis=1)
    # Indices are clipped rather than the inputs padded with zeros: the rows they
    # pick at the other kind of token are masked (keys) or never read (queries).
    q_m = _take(q, jnp.clip(order - S, 0, T - 1))
    k_m, v_m = (_take(x, jnp.clip(order, 0, S - 1)) for x in (k, v))
    inverse = jnp.argsort(order, axis=1)  # position of each token in the merged sequence
    return Merged(
        q=q_m,
        k=k_m,
        v=v_m,
        q_seg=jnp.where(is_query, sorted_ids, PADDING),
        kv_seg=jnp.where(is_query, PADDING, sorted_ids),
        q_at=inverse[:, S:],
    )


def unmerge(x, merged: Merged):
    """Rows ``[B,M,...]`` of the merged sequence back to query order ``[B,T,...]``."""
    return _take(x, merged.q_at)
