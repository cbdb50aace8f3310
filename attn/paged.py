"""A paged KV cache: rows of a batch share one pool of fixed-size pages.

A contiguous cache gives every row ``max_len`` slots, so a batch whose rows
hold 1K to 32K tokens pays for 32K in each. A paged cache (vLLM's
PagedAttention; Kwon et al., "Efficient memory management for large language
model serving with PagedAttention", 2023) keeps keys and values in a pool
``[P, page_size, K, H]`` and gives each row a block table, the ids of the
pages holding its tokens in order: position p of row b is slot
``p % page_size`` of page ``block_tables[b, p // page_size]``. A row takes a
page when it grows past the last one and returns them all when it finishes,
so the memory in use is the valid tokens rounded up to a page per row.

The pieces:

* ``PageTable``: the host-side allocator (NumPy, like a serving engine's block
  manager): the free pages, each row's table and length; ``grow``,
  ``release``, and ``drop_before`` (a sliding-window layer frees the pages that
  left its window, keeping the pages of pinned initial tokens);
* ``write``: new tokens' keys and values into the pool (pure; jittable);
  ``write_pages`` for any payload, and ``extend_pages``, what new tokens
  attend to and the pools after them (a model's paged layer cache);
* ``gather``: a row's pages as one contiguous ``[B, M * page_size, K, H]``
  view, and ``valid_slots``, which of its slots hold keys;
* ``paged_decode_attention``: ``attn.decode_attention`` over the pages, the
  same function as over the contiguous cache.

Unused block-table entries are -1. Tables are checked where they are concrete
(outside a trace): a page id outside the pool, or a page two rows (or two
entries) share, is a ``ValueError``, never a silently mixed-up cache.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from attn import checks
from attn.cache import EMPTY
from attn.checks import fail
from attn.decode import decode_attention

__all__ = [
    "PageTable",
    "PoolExhausted",
    "check_block_tables",
    "extend_pages",
    "gather",
    "paged_decode_attention",
    "pages_for",
    "valid_slots",
    "write",
    "write_pages",
]

UNUSED = -1  # a block-table entry that holds no page


class PoolExhausted(RuntimeError):
    """The pool has fewer free pages than a ``grow`` needs (nothing was allocated)."""


def pages_for(length: int, page_size: int) -> int:
    """Pages that hold ``length`` tokens: ``ceil(length / page_size)``."""
    return -(-int(length) // int(page_size))


class PageTable:
    """The pages of a pool and which rows hold them (host state, NumPy).

    Attributes:
      page_size: tokens per page.
      tables: ``[B, M]`` int32 page ids per row, ``UNUSED`` (-1) where none.
      lengths: ``[B]`` int32 tokens per row (positions ``0..lengths[b]-1``,
        some of whose pages a sliding window may have freed).
    """

    def __init__(self, num_pages: int, page_size: int, batch: int, max_pages_per_row: int):
        self.num_pages = checks.positive_int(num_pages, "num_pages")
        self.page_size = checks.positive_int(page_size, "page_size")
        batch = checks.positive_int(batch, "batch")
        self.max_pages = checks.positive_int(max_pages_per_row, "max_pages_per_row")
        self.tables = np.full((batch, self.max_pages), UNUSED, np.int32)
        self.lengths = np.zeros(batch, np.int32)
        self._free = list(range(self.num_pages - 1, -1, -1))  # a stack: page 0 first

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self._free)

    def _row(self, row) -> int:
        B = len(self.lengths)
        if isinstance(row, bool) or not isinstance(row, int | np.integer) or not 0 <= row < B:
            fail("row", f"a row index in [0, {B})", repr(row))
        return int(row)

    def grow(self, row: int, length: int) -> None:
        """Row ``row`` now holds ``length`` tokens: pages are taken for the new ones.

        Raises:
          ValueError: ``length`` shorter than the row or beyond its table.
          PoolExhausted: not enough free pages (the row is left as it was).
        """
        row = self._row(row)
        old = int(self.lengths[row])
        if isinstance(length, bool) or not isinstance(length, int | np.integer) or length < old:
            fail("length", f"an int >= the row's {old} tokens", repr(length))
        first, last = pages_for(old, self.page_size), pages_for(length, self.page_size)
        if last > self.max_pages:
            fail("length", f"at most {self.max_pages * self.page_size} tokens a row", length)
        if last - first > len(self._free):
            raise PoolExhausted(
                f"row {row} needs {last - first} more pages, the pool has {len(self._free)} free"
            )
        for i in range(first, last):
            self.tables[row, i] = self._free.pop()
        self.lengths[row] = length

    def release(self, row: int) -> None:
        """Row ``row`` finished: its pages return to the pool and it holds nothing."""
        row = self._row(row)
        self._give_back(row, np.arange(self.max_pages))
        self.lengths[row] = 0

    def drop_before(self, row: int, position: int, pinned: int = 0) -> None:
        """Frees the row's pages whose every position is below ``position``, except
        those holding one of the first ``pinned`` positions (initial tokens).

        A sliding window of w keys at query position p needs positions from
        ``p - w + 1``: ``drop_before(row, p - w + 1, pinned)`` after each step.
        """
        row = self._row(row)
        below = int(position) // self.page_size  # pages 0..below-1 end before `position`
        keep = pages_for(int(pinned), self.page_size)
        self._give_back(row, np.arange(keep, max(below, keep)))

    def _give_back(self, row: int, pages) -> None:
        for i in pages:
            if self.tables[row, i] != UNUSED:
                self._free.append(int(self.tables[row, i]))
                self.tables[row, i] = UNUSED

    def arrays(self):
        """``(block_tables [B, M] int32, lengths [B] int32)`` as JAX arrays."""
        return jnp.asarray(self.tables), jnp.asarray(self.lengths)

    def bytes_in_use(self, *, num_kv_heads: int, head_dim: int, dtype, num_layers: int = 1) -> int:
        """Bytes of keys and values the pages in use hold (both pools, all layers)."""
        per_page = 2 * self.page_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize
        return num_layers * self.pages_in_use * per_page


def check_block_tables(block_tables, lengths, num_pages: int, page_size: int) -> None:
    """Refuses tables that cannot be right, where their values are known.

    Every entry a row's length reaches must be a page of the pool or
    ``UNUSED`` (a page freed behind a window), and no page may appear twice
    (two rows, or two places of one row, would overwrite each other).
    """
    tables, lens = checks.concrete(block_tables), checks.concrete(lengths)
    if tables is None or lens is None:
        return
    M = tables.shape[1]
    if lens.max(initial=0) > M * page_size or lens.min(initial=0) < 0:
        fail("lengths", f"lengths in [0, {M * page_size}] (the tables' pages)", lens.tolist())
    reached = np.arange(M)[None, :] < np.asarray([pages_for(n, page_size) for n in lens])[:, None]
    used = tables[reached]
    bad = used[(used != UNUSED) & ((used < 0) | (used >= num_pages))]
    if bad.size:
        fail("block_tables", f"page ids in [0, {num_pages}) or -1", f"page {int(bad[0])}")
    held = used[used != UNUSED]
    ids, counts = np.unique(held, return_counts=True)
    if np.any(counts > 1):
        fail("block_tables", "each page in one place", f"page {int(ids[counts > 1][0])} twice")


def _check_tables(block_tables, B: int):
    block_tables = jnp.asarray(block_tables)
    if block_tables.ndim != 2 or block_tables.shape[0] != B:
        fail("block_tables", f"a [{B}, M] array of page ids", f"shape {block_tables.shape}")
    if not jnp.issubdtype(block_tables.dtype, jnp.integer):
        fail("block_tables", "integer page ids", f"dtype {block_tables.dtype}")
    return block_tables.astype(jnp.int32)


def _check_pool(pool, name: str):
    if getattr(pool, "ndim", None) != 4:
        fail(name, "a page pool [P, page_size, K, H]", f"shape {getattr(pool, 'shape', None)}")


def write(pool_k, pool_v, block_tables, positions, k, v, valid=None):
    """Stores new tokens' keys and values in their rows' pages.

    Args:
      pool_k: ``[P, page_size, K, H]``; pool_v ``[P, page_size, K, E]``.
      block_tables: ``[B, M]`` int32 (the pages must have been allocated).
      positions: ``[B, T]`` ints: the tokens' positions in their rows.
      k: ``[B, T, K, H]``; v ``[B, T, K, E]``.
      valid: ``[B, T]`` bools, or None (all): tokens that are written (a
        ragged prefill's padding is not).

    Returns:
      ``(pool_k, pool_v)`` with the tokens stored.

    Raises:
      ValueError: a token's page is -1 (not allocated), when the values are
        concrete. Under a trace such a token is dropped.
    """
    return write_pages((pool_k, pool_v), block_tables, positions, (k, v), valid)


def write_pages(pools: tuple, block_tables, positions, new: tuple, valid=None) -> tuple:
    """``write`` for any payload: one pool ``[P, page_size, ...]`` per array ``[B, T, ...]``
    of ``new`` (keys and values; an MLA layer's latents; FoX's gate sums)."""
    P, page = pools[0].shape[:2]
    positions = jnp.asarray(positions, jnp.int32)
    index = positions // page
    M = block_tables.shape[1]
    pages = jnp.take_along_axis(block_tables, jnp.clip(index, 0, M - 1), axis=1)  # [B,T]
    pages = jnp.where((index >= 0) & (index < M), pages, UNUSED)  # past the table: no page
    _check_allocated(pages, valid)
    ok = pages >= 0 if valid is None else (pages >= 0) & valid
    # Tokens not written go to an index past the pool, which the scatter drops.
    pages, slots = jnp.where(ok, pages, P), positions % page
    return tuple(
        pool.at[pages, slots].set(x.astype(pool.dtype), mode="drop")
        for pool, x in zip(pools, new, strict=True)
    )


def extend_pages(pools: tuple, block_tables, new: tuple, start, lengths=None):
    """What T new tokens attend to, and the pools after storing them: the paged
    counterpart of ``attn.cache.extend_slots``.

    The new tokens see each row's held slots below ``start`` (its earlier
    tokens, in position order) followed by themselves, so decoding (T = 1)
    and a ragged prefill are one path.

    Args:
      pools: arrays ``[P, page_size, ...]``.
      block_tables: ``[B, M]`` int32 page ids (-1: none); the pages of the new
        tokens must be held.
      new: arrays ``[B, T, ...]`` of the tokens at positions ``start[b] + t``.
      start: ``[B]`` int32 position of ``new[:, 0]`` (the tokens each row holds).
      lengths: ``[B]`` real new tokens per row (the rest is padding, not
        stored), or None (all T).

    Returns:
      ``((visible arrays [B, M * page_size + T, ...], visible positions
      [B, M * page_size + T]), pools)``; the visible positions are
      ``attn.cache.EMPTY`` where there is no token.
    """
    T = new[0].shape[1]
    page = pools[0].shape[1]
    start = jnp.asarray(start, jnp.int32)
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B,T]
    real = None if lengths is None else jnp.arange(T)[None, :] < jnp.asarray(lengths)[:, None]
    slots = jnp.arange(block_tables.shape[1] * page, dtype=jnp.int32)[None, :]
    held = valid_slots(block_tables, page) & (slots < start[:, None])
    visible = tuple(
        jnp.concatenate([gather(pool, block_tables), x.astype(pool.dtype)], axis=1)
        for pool, x in zip(pools, new, strict=True)
    )
    new_pos = positions if real is None else jnp.where(real, positions, EMPTY)
    visible_pos = jnp.concatenate([jnp.where(held, slots, EMPTY), new_pos], axis=1)
    return (visible, visible_pos), write_pages(pools, block_tables, positions, new, real)


def _check_allocated(pages, valid) -> None:
    """Refuses, where the values are known, a token written to a page no row holds."""
    held, ok = checks.concrete(pages), None if valid is None else checks.concrete(valid)
    if held is None or (valid is not None and ok is None):
        return
    missing = (held < 0) if ok is None else (held < 0) & ok
    if missing.any():
        b, t = (int(i[0]) for i in np.nonzero(missing))
        fail("block_tables", "a page for every token written (PageTable.grow first)",
             f"none for row {b}'s token {t}")  # fmt: skip


def gather(pool, block_tables):
    """``[B, M * page_size, ...]``: each row's pages in order.

    An unused entry (-1) reads page 0, which another row may hold: its slots
    are invalid (``valid_slots``), and attention selects invalid slots away
    where they enter (``attn.softmax.call.Call.isolate``), so whatever page 0
    holds, NaN included, reaches nothing of this row.
    """
    B, M = block_tables.shape
    x = pool[jnp.maximum(block_tables, 0)]  # [B, M, page, ...]
    return x.reshape(B, M * pool.shape[1], *pool.shape[2:])


def valid_slots(block_tables, page_size: int):
    """``[B, M * page_size]`` bools: the slots whose page is held (not ``UNUSED``)."""
    return jnp.repeat(block_tables >= 0, page_size, axis=1)


def paged_decode_attention(q, pool_k, pool_v, block_tables, lengths, **kwargs):
    """``attn.decode_attention`` over a paged cache: the same function as over the
    contiguous cache that holds each row's tokens at their positions.

    Args:
      q: ``[B, T, N, H]`` queries (by default the last T positions of each row).
      pool_k: ``[P, page_size, K, H]``; pool_v ``[P, page_size, K, E]``.
      block_tables: ``[B, M]`` int32 page ids, ``-1`` where a row holds none
        (past its length, or freed behind a sliding window).
      lengths: ``[B]`` tokens per row, at most ``M * page_size``.
      kwargs: as ``attn.decode_attention`` (``num_splits``, ``mask``, ``softcap``,
        ``score_mod``, ``sink_logits``, ``q_positions``, ``return_lse``).
    """
    q, pool_k, pool_v = checks.as_arrays(q, pool_k, pool_v)
    _check_pool(pool_k, "pool_k")
    _check_pool(pool_v, "pool_v")
    block_tables = _check_tables(block_tables, q.shape[0])
    P, page = pool_k.shape[:2]
    check_block_tables(block_tables, lengths, P, page)
    if "kv_positions" in kwargs or "kv_valid" in kwargs:
        fail("kwargs", "no kv_positions or kv_valid (the block tables give them)", sorted(kwargs))
    return decode_attention(
        q,
        gather(pool_k, block_tables),
        gather(pool_v, block_tables),
        lengths=lengths,
        kv_valid=valid_slots(block_tables, page),
        **kwargs,
    )
