"""Position-based attention masks.

A mask is a small frozen, hashable description of which key positions a query
position may see. It is evaluated on absolute token positions, never on array
corners, so the same mask is right for training (positions ``arange``),
chunked prefill, decoding and ring-buffer caches (real positions passed in).

Each mask answers two questions:

* ``allowed(q_pos, k_pos)``: a boolean array, broadcasting ``q_pos[..., :, None]``
  against ``k_pos[..., None, :]``, so ``[..., T]`` and ``[..., S]`` give ``[..., T, S]``.
* ``classify(q_lo, q_hi, k_lo, k_hi)``: for every query position in ``[q_lo, q_hi]``
  and key position in ``[k_lo, k_hi]`` (inclusive bounds), whether the block is
  ``EMPTY`` (nothing allowed), ``FULL`` (everything allowed) or ``PARTIAL``.
  The answer is sound for any set of positions inside the bounds: EMPTY and
  FULL are only claimed when they hold for every pair in the box. Bounds may be
  Python ints (a static block schedule) or JAX arrays (runtime skipping).

Masks combine with ``&`` (both allow) and ``|`` (either allows). Examples::

    causal()                                    # GPT: k <= q
    sliding_window(4096)                        # Mistral: the last 4096 positions, itself included
    causal() & (sliding_window(w)
                | initial_tokens(4))            # StreamingLLM: the window plus the first 4
                                                # tokens (which it calls "attention sinks")
    global_tokens((0,)) | sliding_window(w)     # Longformer-style local + global (bidirectional:
                                                # use bidirectional_window for a two-sided band)
"""

from __future__ import annotations

import dataclasses
import enum
import math

import jax
import jax.numpy as jnp
import numpy as np

from attn.checks import fail, positive_int


class BlockKind(enum.IntEnum):
    """What a (query block, key block) pair needs: skip, compute unmasked, or mask."""

    EMPTY = 0
    FULL = 1
    PARTIAL = 2


def _xp(*xs):
    """NumPy for concrete bounds (static schedules), jax.numpy for traced ones."""
    return np if all(isinstance(x, int | np.integer | np.ndarray) for x in xs) else jnp


def _kind(xp, nonempty, full):
    return xp.where(nonempty, xp.where(full, int(BlockKind.FULL), int(BlockKind.PARTIAL)), 0)


class Mask:
    """Base class of the mask algebra; subclasses are frozen dataclasses.

    Every mask is a static pytree: it has no leaves and is its own (hashable)
    aux data, so it passes through ``jax.jit``, ``vmap``, ``grad`` and
    ``shard_map`` as an ordinary argument, and a new mask means a new trace.
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        jax.tree_util.register_static(cls)

    def allowed(self, q_pos, k_pos):
        """Boolean ``[..., T, S]`` from positions ``[..., T]`` and ``[..., S]``."""
        xp = _xp(q_pos, k_pos)
        q, k = xp.asarray(q_pos)[..., :, None], xp.asarray(k_pos)[..., None, :]
        return self._allowed(xp, q, k)

    def pairs(self, q, k):
        """``allowed`` on positions already laid out against each other: ``[..., T, 1]`` and
        ``[..., 1, S]``, or both ``[..., T, S]`` (a kernel's tile)."""
        return self._allowed(_xp(q, k), q, k)

    def classify(self, q_lo, q_hi, k_lo, k_hi):
        """``BlockKind`` of the box of positions ``[q_lo, q_hi] x [k_lo, k_hi]`` (inclusive).

        With Python ints this returns a ``BlockKind``; with arrays an int32 array
        of ``BlockKind`` values (broadcast over the bounds' shapes).
        """
        xp = _xp(q_lo, q_hi, k_lo, k_hi)
        nonempty, full = self._bounds(xp, q_lo, q_hi, k_lo, k_hi)
        kind = _kind(xp, nonempty, full)
        # Some masks ignore some bounds (full() all of them): broadcast to all four.
        shape = np.broadcast_shapes(*(np.shape(x) for x in (q_lo, q_hi, k_lo, k_hi)))
        if xp is np and shape == ():
            return BlockKind(int(kind))
        return xp.broadcast_to(xp.asarray(kind, xp.int32), shape)

    def _allowed(self, xp, q, k):
        raise NotImplementedError  # abstract: every concrete mask defines it

    def _bounds(self, xp, q_lo, q_hi, k_lo, k_hi):
        """Returns ``(nonempty, full)``: some pair may be allowed / every pair is allowed."""
        raise NotImplementedError  # abstract: every concrete mask defines it

    def __and__(self, other: Mask) -> Mask:
        _check_mask(other, "other")
        return And(self, other)

    def __or__(self, other: Mask) -> Mask:
        _check_mask(other, "other")
        return Or(self, other)


def _check_mask(m, name):
    if not isinstance(m, Mask):
        fail(name, "an attn.masks.Mask", type(m).__name__)


@dataclasses.dataclass(frozen=True)
class Full(Mask):
    """Every query sees every key (bidirectional attention)."""

    def _allowed(self, xp, q, k):
        return xp.ones(np.broadcast_shapes(q.shape, k.shape), bool)

    def _bounds(self, xp, q_lo, q_hi, k_lo, k_hi):
        true = xp.asarray(True)
        return true, true


@dataclasses.dataclass(frozen=True)
class Causal(Mask):
    """Query position ``q`` sees key positions ``k <= q``."""

    def _allowed(self, xp, q, k):
        return k <= q

    def _bounds(self, xp, q_lo, q_hi, k_lo, k_hi):
        return xp.asarray(k_lo <= q_hi), xp.asarray(k_hi <= q_lo)


@dataclasses.dataclass(frozen=True)
class SlidingWindow(Mask):
    """Query ``q`` sees keys ``q - w < k <= q``: the ``w`` latest positions, itself included.

    ``w = 1`` sees only itself; the window is causal by construction.
    """

    window: int

    def _allowed(self, xp, q, k):
        d = q - k
        return (d >= 0) & (d < self.window)

    def _bounds(self, xp, q_lo, q_hi, k_lo, k_hi):
        nonempty = (q_hi - k_lo >= 0) & (q_lo - k_hi < self.window)
        full = (q_lo - k_hi >= 0) & (q_hi - k_lo < self.window)
        return xp.asarray(nonempty), xp.asarray(full)


@dataclasses.dataclass(frozen=True)
class BidirectionalWindow(Mask):
    """Query ``q`` sees keys with ``|q - k| <= radius`` (Longformer's local band)."""

    radius: int

    def _allowed(self, xp, q, k):
        return abs(q - k) <= self.radius

    def _bounds(self, xp, q_lo, q_hi, k_lo, k_hi):
        nonempty = (k_lo - q_hi <= self.radius) & (q_lo - k_hi <= self.radius)
        full = (k_hi - q_lo <= self.radius) & (q_hi - k_lo <= self.radius)
        return xp.asarray(nonempty), xp.asarray(full)


@dataclasses.dataclass(frozen=True)
class Band(Mask):
    """Query ``q`` sees keys ``q - left <= k <= q + right`` (``jax.nn``'s ``local_window_size``)."""

    left: int
    right: int

    def _allowed(self, xp, q, k):
        d = q - k
        return (d <= self.left) & (d >= -self.right)

    def _bounds(self, xp, q_lo, q_hi, k_lo, k_hi):
        nonempty = (q_lo - k_hi <= self.left) & (q_hi - k_lo >= -self.right)
        full = (q_hi - k_lo <= self.left) & (q_lo - k_hi >= -self.right)
        return xp.asarray(nonempty), xp.asarray(full)


@dataclasses.dataclass(frozen=True)
class InitialTokens(Mask):
    """Every query sees the first ``n`` positions (``k < n``).

    StreamingLLM keeps these initial tokens visible beside a sliding window
    because models learn to park attention on them ("attention sinks").
    """

    n: int

    def _allowed(self, xp, q, k):
        return xp.broadcast_to(k < self.n, np.broadcast_shapes(q.shape, k.shape))

    def _bounds(self, xp, q_lo, q_hi, k_lo, k_hi):
        return xp.asarray(k_lo < self.n), xp.asarray(k_hi < self.n)


@dataclasses.dataclass(frozen=True)
class Chunked(Mask):
    """Queries see keys in the same chunk of ``c`` positions (``q // c == k // c``).

    Combine with ``causal()`` for Llama 4's chunked attention.
    """

    c: int

    def _allowed(self, xp, q, k):
        return q // self.c == k // self.c

    def _bounds(self, xp, q_lo, q_hi, k_lo, k_hi):
        c = self.c
        qa, qb, ka, kb = q_lo // c, q_hi // c, k_lo // c, k_hi // c
        nonempty = (qa <= kb) & (ka <= qb)
        full = (qa == qb) & (ka == kb) & (qa == ka)
        return xp.asarray(nonempty), xp.asarray(full)


@dataclasses.dataclass(frozen=True)
class GlobalTokens(Mask):
    """The listed positions see every key and are seen by every query (Longformer)."""

    positions: tuple[int, ...]

    def _allowed(self, xp, q, k):
        table = np.asarray(self.positions)
        return (q[..., None] == table).any(-1) | (k[..., None] == table).any(-1)

    def _bounds(self, xp, q_lo, q_hi, k_lo, k_hi):
        g = np.asarray(self.positions, np.int64)
        runs = _runs(self.positions)

        def touches(lo, hi):  # some global position lies in [lo, hi]
            lo, hi = xp.asarray(lo)[..., None], xp.asarray(hi)[..., None]
            return ((g >= lo) & (g <= hi)).any(-1)

        def covered(lo, hi):  # every position in [lo, hi] is global
            lo, hi = xp.asarray(lo)[..., None], xp.asarray(hi)[..., None]
            return ((runs[:, 0] <= lo) & (hi <= runs[:, 1])).any(-1)

        nonempty = touches(q_lo, q_hi) | touches(k_lo, k_hi)
        full = covered(q_lo, q_hi) | covered(k_lo, k_hi)
        return nonempty, full


def _runs(positions):
    """Maximal runs of consecutive positions as an ``[R, 2]`` array of inclusive bounds."""
    runs = []
    for p in positions:
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return np.asarray(runs, np.int64).reshape(-1, 2)


@dataclasses.dataclass(frozen=True)
class And(Mask):
    """Allowed where both masks allow."""

    a: Mask
    b: Mask

    def _allowed(self, xp, q, k):
        return self.a._allowed(xp, q, k) & self.b._allowed(xp, q, k)

    def _bounds(self, xp, *box):
        ne_a, full_a = self.a._bounds(xp, *box)
        ne_b, full_b = self.b._bounds(xp, *box)
        return ne_a & ne_b, full_a & full_b


@dataclasses.dataclass(frozen=True)
class Or(Mask):
    """Allowed where either mask allows."""

    a: Mask
    b: Mask

    def _allowed(self, xp, q, k):
        return self.a._allowed(xp, q, k) | self.b._allowed(xp, q, k)

    def _bounds(self, xp, *box):
        ne_a, full_a = self.a._bounds(xp, *box)
        ne_b, full_b = self.b._bounds(xp, *box)
        return ne_a | ne_b, full_a | full_b


def full() -> Mask:
    """Bidirectional attention: every query sees every key."""
    return Full()


def causal() -> Mask:
    """Causal attention on absolute positions: ``k_pos <= q_pos``."""
    return Causal()


def sliding_window(w: int) -> Mask:
    """Causal sliding window: query ``q`` sees keys ``q - w < k <= q`` (``w`` positions,
    itself included; ``w = 1`` is the diagonal). Equals ``jax.nn``'s
    ``local_window_size=(w - 1, 0)`` with ``is_causal=True``."""
    return SlidingWindow(positive_int(w, "w"))


def bidirectional_window(radius: int) -> Mask:
    """Two-sided band: query ``q`` sees keys with ``|q - k| <= radius``."""
    if isinstance(radius, bool) or not isinstance(radius, int | np.integer) or radius < 0:
        fail("radius", "a non-negative int", repr(radius))
    return BidirectionalWindow(int(radius))


def band(left: int, right: int) -> Mask:
    """Query ``q`` sees keys ``q - left <= k <= q + right``: ``jax.nn``'s
    ``local_window_size=(left, right)`` on our positions (not causal unless
    ``right == 0``; ``band(w - 1, 0)`` is ``sliding_window(w)``)."""
    for name, x in (("left", left), ("right", right)):
        if isinstance(x, bool) or not isinstance(x, int | np.integer) or x < 0:
            fail(name, "a non-negative int", repr(x))
    return Band(int(left), int(right))


def initial_tokens(n: int) -> Mask:
    """The first ``n`` positions (``k_pos < n``) are visible to every query.

    Alone it ignores causality; StreamingLLM is
    ``causal() & (sliding_window(w) | initial_tokens(n))``.
    """
    return InitialTokens(positive_int(n, "n"))


def chunked(c: int) -> Mask:
    """Attention within chunks of ``c`` positions: ``q_pos // c == k_pos // c``."""
    return Chunked(positive_int(c, "c"))


def global_tokens(positions) -> Mask:
    """Longformer global attention: the listed positions see, and are seen by, all positions.

    Args:
      positions: an int or a sequence of non-negative ints (duplicates ignored).
    """
    if isinstance(positions, int | np.integer):
        positions = (positions,)
    try:
        given = list(positions)
        ps = sorted({int(p) for p in given})
    except (TypeError, ValueError):
        fail("positions", "a sequence of non-negative ints", repr(positions))
    if not ps or ps[0] < 0 or any(float(p) != p for p in given):
        fail("positions", "a non-empty sequence of non-negative ints", repr(positions))
    return GlobalTokens(tuple(ps))


def block_schedule(
    mask: Mask,
    num_q: int,
    num_k: int,
    block_q: int,
    block_k: int,
    q_offset: int = 0,
    k_offset: int = 0,
) -> np.ndarray:
    """Static ``[num_q_blocks, num_k_blocks]`` array of ``BlockKind`` for ``arange`` positions.

    Query block ``i`` holds positions ``q_offset + [i*block_q, min((i+1)*block_q, num_q) - 1]``,
    and likewise for keys; the last blocks may be short. (Blockwise attention
    builds its own schedule, for any positions, segment ids and padding, in
    ``attn.softmax.schedule``.)
    """
    qi = np.arange(math.ceil(num_q / block_q))
    ki = np.arange(math.ceil(num_k / block_k))
    q_lo = q_offset + qi * block_q
    q_hi = q_offset + np.minimum((qi + 1) * block_q, num_q) - 1
    k_lo = k_offset + ki * block_k
    k_hi = k_offset + np.minimum((ki + 1) * block_k, num_k) - 1
    kinds = mask.classify(q_lo[:, None], q_hi[:, None], k_lo[None, :], k_hi[None, :])
    return np.broadcast_to(np.asarray(kinds), (qi.size, ki.size)).astype(np.int8)


# The segment id of padding tokens, in every implementation and layer kind.
PADDING = 0


def same_segment(q_seg, k_seg):
    """Boolean ``[..., T, S]``: query and key share a segment and neither is padding.

    The segment rule of every implementation: id 0 is padding (it sees no key
    and no query sees it), ids >= 1 are segments, tokens attend only within
    their own. A padding query therefore sees nothing and outputs 0.

    Args:
      q_seg: ``[..., T]`` ints; k_seg: ``[..., S]`` ints.
    """
    return (q_seg[..., :, None] == k_seg[..., None, :]) & (k_seg != PADDING)[..., None, :]


def drop_padding(x, ids):
    """``x [B,L,...]`` with every padding token's entries (``ids [B,L]`` == 0) set to 0.

    Padding holds whatever memory held, NaN and Inf included, and a zero
    weight does not hide it (``0 * NaN`` is NaN, forward and backward), so the
    implementations select it away where it enters; the select's gradient is
    exactly 0 there. ``ids`` None: nothing is padding, ``x`` is returned.
    """
    if ids is None:
        return x
    real = (ids != PADDING).reshape(ids.shape + (1,) * (x.ndim - ids.ndim))
    return jnp.where(real, x, jnp.zeros((), x.dtype))


def segment_ids_from_lengths(lengths, length: int):
    """Segment ids ``[B, length]`` for right padding: 1 for tokens, 0 (``PADDING``) for padding.

    Tokens attend only within their segment and padding is seen by no query,
    so queries never see padding keys; padding queries see nothing and output 0.
    """
    lengths = jnp.asarray(lengths)
    if lengths.ndim != 1:
        fail("lengths", "a [B] array of lengths", f"shape {lengths.shape}")
    return (jnp.arange(length)[None, :] < lengths[:, None]).astype(jnp.int32)
