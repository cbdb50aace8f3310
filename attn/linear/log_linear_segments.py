"""Log-linear attention's segments: positions within each segment, and the aligned layout.

A segment starts a fresh Fenwick tree, so each token's level depends on its
position in its segment (``sequence``). The chunkwise forms need those
positions aligned with their chunks: ``on_aligned_layout`` runs a form over a
buffer of ``2T - 1`` slots where each segment starts at a multiple of its
length rounded up to a power of 2 (``aligned_layout``), and reads the outputs
back at each token's slot.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from attn.linear import log_linear_forms as forms
from attn.linear import segments
from attn.masks import PADDING


class Segments(NamedTuple):
    key_real: jax.Array  # [B,T] bool: the token writes
    log_a: jax.Array  # [B,T,N]: 0 at padding, -inf where a later segment starts
    q_read: jax.Array  # [B,T] bool: the query reads its segment
    starts: jax.Array  # [B,T] bool: the first real token of every segment
    pos: jax.Array  # [B,T] int32: position in the segment (0 at padding)


def segments_of(q_seg, kv_seg, log_a, N: int) -> Segments:
    rules = segments.causal(q_seg, kv_seg, log_a, N)
    real = rules.key_real
    T = real.shape[1]
    last = lax.cummax(jnp.where(real, jnp.arange(T), -1), axis=1)
    held = jnp.where(last >= 0, jnp.take_along_axis(kv_seg, jnp.maximum(last, 0), 1), PADDING)
    held_before = jnp.pad(held[:, :-1], ((0, 0), (1, 0)), constant_values=PADDING)
    starts = real & (kv_seg != held_before)
    count = jnp.cumsum(real.astype(jnp.int32), axis=1)  # real tokens up to t
    before = lax.cummax(jnp.where(starts, count - 1, 0), axis=1)  # ... before t's segment
    pos = jnp.where(real, count - 1 - before, 0)
    return Segments(real, rules.log_a, rules.q_read, starts, pos)


class Layout(NamedTuple):
    src: jax.Array  # [B,M] int32: the token at each buffer slot, T where empty
    dest: jax.Array  # [B,T] int32: the slot of each real token (M for padding)


def aligned_layout(seg: Segments) -> Layout:
    """Each segment at an offset that is a multiple of its size (its length rounded up to
    a power of 2): the sizes sorted largest first and laid end to end, in M = 2T - 1 slots
    (a size is below twice the length, so they fit)."""
    real, pos = seg.key_real, seg.pos
    B, T = real.shape
    M = 2 * T - 1
    rows = jnp.arange(B)[:, None]
    index = jnp.maximum(jnp.cumsum(seg.starts.astype(jnp.int32), axis=1) - 1, 0)  # [B,T]
    counts = jnp.zeros((B, T), jnp.int32).at[rows, index].add(real.astype(jnp.int32))
    sizes = jnp.where(counts > 0, 1 << forms.bit_length(jnp.maximum(counts - 1, 0)), 0)
    order = jnp.argsort(-sizes, axis=1, stable=True)
    placed = jnp.take_along_axis(sizes, order, axis=1)
    starts_sorted = jnp.cumsum(placed, axis=1) - placed  # exact: whole numbers
    offsets = jnp.zeros((B, T), jnp.int32).at[rows, order].set(starts_sorted)
    dest = jnp.where(real, jnp.take_along_axis(offsets, index, axis=1) + pos, M)
    src = jnp.full((B, M), T, jnp.int32).at[rows, dest].set(jnp.arange(T), mode="drop")
    return Layout(src, dest)


def to_slots(x, src):
    """``x [B,T,...]`` gathered to the buffer ``[B,M,...]`` (zeros at empty slots)."""
    x = jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)
    return jnp.take_along_axis(x, src.reshape(*src.shape, *(1,) * (x.ndim - 2)), axis=1)


def last_real(real):
    """``(index [B] of the last real token (0 if none), any real [B])``."""
    T = real.shape[1]
    last = jnp.max(jnp.where(real, jnp.arange(T), -1), axis=1)
    return jnp.maximum(last, 0), last >= 0


class Sequence(NamedTuple):
    """What segment ids (or their absence) mean to the forms."""

    pos: jax.Array  # [B,T] int32: each token's position in its segment
    key_real: jax.Array | None  # [B,T] bool, None: all real
    q_read: jax.Array | None  # [B,T] bool, None: all read
    log_a: jax.Array  # [B,T,N] float32 with the segment rules applied
    last: jax.Array  # [B] int32: the last real token
    length: jax.Array  # [B] int32: the last segment's real tokens
    seg: Segments | None


def sequence(q_seg, kv_seg, log_a, B: int, T: int, N: int, start=None) -> Sequence:
    """``start [B]`` int32 (an initial state's length) or None: the first segment's
    positions continue from it (a row without real tokens keeps it as its length)."""
    start = jnp.zeros((B,), jnp.int32) if start is None else start
    if q_seg is None:
        pos = jnp.arange(T, dtype=jnp.int32)[None, :] + start[:, None]
        last = jnp.full((B,), T - 1, jnp.int32)
        return Sequence(pos, None, None, log_a, last, start + T, None)
    seg = segments_of(q_seg, kv_seg, log_a, N)
    first = seg.key_real & (jnp.cumsum(seg.starts.astype(jnp.int32), axis=1) == 1)
    pos = seg.pos + jnp.where(first, start[:, None], 0)
    last, any_real = last_real(seg.key_real)
    length = jnp.where(any_real, take(pos, last) + 1, start)
    return Sequence(pos, seg.key_real, seg.q_read, seg.log_a, last, length, seg)


def on_aligned_layout(run, arrays, log_index: int, seg: Segments, last):
    """A chunkwise form with segment ids, run over the aligned layout (``aligned_layout``).

    In the buffer every segment starts at a multiple of its size, so a token's
    level is a function of its slot; the first slot of each segment gets a log
    decay of ``-inf`` (``arrays[log_index]``: nothing crosses it) and empty
    slots hold zeros (they write nothing). ``run(*arrays, filled, last)`` is the
    form on the buffer; its outputs are read back at each token's slot.
    """
    T = seg.pos.shape[1]
    layout = aligned_layout(seg)
    slotted = [to_slots(x, layout.src) for x in arrays]
    filled = layout.src < T
    first = filled & (to_slots(seg.pos, layout.src) == 0)
    slotted[log_index] = jnp.where(first[:, :, None, None], -jnp.inf, slotted[log_index])
    last = None if last is None else jnp.minimum(take(layout.dest, last), 2 * T - 2)
    out, levels = run(*slotted, filled, last)
    return to_slots_back(out, layout.dest), levels


def take(x, index):
    """``x[b, index[b]]`` for ``x [B,T]`` and ``index [B]``."""
    return jnp.take_along_axis(x, index[:, None], axis=1)[:, 0]


def to_slots_back(x, dest):
    """The buffer ``x [B,M,...]`` read back at each token's slot ``dest [B,T]`` (padding,
    whose slot is M, reads zeros)."""
    x = jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)
    return jnp.take_along_axis(x, dest.reshape(*dest.shape, *(1,) * (x.ndim - 2)), axis=1)
