"""The paged KV cache: its allocator, and paged decoding == contiguous decoding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import masks, paged
from tests.util import normal, rel_err

PAGE, PAGES, ROWS, M = 4, 24, 3, 8  # a row holds at most M * PAGE = 32 tokens
N, K, H = 4, 2, 8


def test_pages_are_taken_as_rows_grow_and_returned_when_they_finish():
    table = attn.PageTable(6, PAGE, 2, 5)
    table.grow(0, 5)  # two pages
    table.grow(1, 4)  # one page: exactly full
    assert table.pages_in_use == 3
    table.grow(1, 5)  # one more
    assert table.tables[:, :3].tolist() == [[0, 1, -1], [2, 3, -1]]  # the lowest free first
    with pytest.raises(paged.PoolExhausted, match="needs 3 more pages, the pool has 2 free"):
        table.grow(0, 17)
    assert table.lengths[0] == 5 and table.pages_in_use == 4  # nothing was taken
    table.release(0)
    assert table.pages_in_use == 2 and table.lengths[0] == 0
    assert (table.tables[0] == -1).all()
    held = table.tables[table.tables >= 0]
    assert len(set(held.tolist())) == len(held)


def test_a_window_frees_the_pages_behind_it_but_not_the_pinned_ones():
    table = attn.PageTable(10, PAGE, 1, 8)
    table.grow(0, 30)  # pages 0..7 of the row
    table.drop_before(0, 21, pinned=2)  # positions < 21 are out: row pages 1..4 end before
    assert (table.tables[0, 1:5] == -1).all()
    assert table.tables[0, 0] >= 0 and (table.tables[0, 5:] >= 0).all()
    assert table.pages_in_use == 4


def test_bad_tables_are_refused_when_concrete():
    q = normal(0, (2, 1, N, H))
    pool = normal(1, (PAGES, PAGE, K, H))
    tables = np.array([[0, 1, -1], [2, 3, -1]], np.int32)
    lengths = np.array([5, 8])
    for bad, match in [
        ([[0, 99, -1], [2, 3, -1]], "block_tables: expected page ids in \\[0, 24\\) or -1"),
        ([[0, 1, -1], [1, 3, -1]], "block_tables: expected each page in one place, got page 1"),
        ([[0, 1, -1], [2, 2, -1]], "page 2 twice"),
    ]:
        with pytest.raises(ValueError, match=match):
            attn.paged_decode_attention(q, pool, pool, np.array(bad, np.int32), lengths)
    with pytest.raises(ValueError, match="lengths: expected lengths in \\[0, 12\\]"):
        attn.paged_decode_attention(q, pool, pool, tables, np.array([5, 13]))
    with pytest.raises(ValueError, match="block_tables: expected a \\[2, M\\] array"):
        attn.paged_decode_attention(q, pool, pool, tables[0], lengths)
    with pytest.raises(ValueError, match="block_tables: expected a page for every token"):
        paged.write(pool, pool, tables, np.array([[4], [8]]), q[:, :, :K], q[:, :, :K])
    # A page past a row's length is not read, so a stale id there is no error.
    stale = np.array([[0, 1, 1], [2, 3, -1]], np.int32)
    attn.paged_decode_attention(q, pool, pool, stale, lengths)


def contiguous_reference(cache_k, cache_v, q, lengths, mask, **kw):
    return attn.decode_attention(q, cache_k, cache_v, lengths=lengths, mask=mask, **kw)


@jax.jit
def _write(pool_k, pool_v, tables, positions, k, v):
    return paged.write(pool_k, pool_v, tables, positions, k, v)


MASKS = {
    "causal": (masks.causal(), None, 0),
    "streaming": (masks.causal() & (masks.sliding_window(6) | masks.initial_tokens(2)), 6, 2),
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_paged_decoding_equals_contiguous_over_120_steps_with_rows_joining_and_leaving(name):
    """Three rows decode 120 steps; a row that reaches its planned length finishes and a
    new one joins in its place. Every step writes each active row's token into both
    caches and attends from it; the window's pages behind it are freed as it moves."""
    mask, window, pinned = MASKS[name]
    rng = np.random.default_rng(0)
    table = attn.PageTable(PAGES, PAGE, ROWS, M)
    pool_k = jnp.zeros((PAGES, PAGE, K, H))
    pool_v = jnp.zeros((PAGES, PAGE, K, H))
    cache_k = np.zeros((ROWS, M * PAGE, K, H), np.float32)
    cache_v = np.zeros_like(cache_k)
    planned = rng.integers(1, M * PAGE + 1, ROWS)
    sink = np.array([0.3, -0.5, 1.0, 0.0], np.float32)
    finished = checked = 0
    for step in range(120):
        for b in range(ROWS):  # a finished row leaves, a new one joins
            if table.lengths[b] == planned[b]:
                table.release(b)
                cache_k[b] = cache_v[b] = 0.0
                planned[b] = rng.integers(1, M * PAGE + 1)
                finished += 1
        pos = table.lengths.copy()
        for b in range(ROWS):
            table.grow(b, int(pos[b]) + 1)
        k, v = normal((step, 0), (ROWS, 1, K, H)), normal((step, 1), (ROWS, 1, K, H))
        cache_k[np.arange(ROWS), pos], cache_v[np.arange(ROWS), pos] = k[:, 0], v[:, 0]
        tables, lengths = table.arrays()
        pool_k, pool_v = _write(pool_k, pool_v, tables, pos[:, None], k, v)
        q = normal((step, 2), (ROWS, 1, N, H))
        kw = dict(mask=mask, sink_logits=sink, softcap=4.0, num_splits=3)
        got = attn.paged_decode_attention(q, pool_k, pool_v, tables, lengths, **kw)
        want = contiguous_reference(cache_k, cache_v, q, lengths, **kw)
        assert rel_err(got, want) < 2e-6, step
        checked += 1
        if window is not None:
            for b in range(ROWS):
                table.drop_before(b, int(pos[b]) - window + 2, pinned)
    assert checked == 120 and finished >= 5
    if window is not None:  # the window keeps at most a few pages per row
        assert table.pages_in_use <= ROWS * (pages_for_window(window, pinned) + 1)


def pages_for_window(window, pinned):
    return paged.pages_for(window, PAGE) + paged.pages_for(pinned, PAGE) + 1


def test_memory_is_the_valid_tokens_rounded_up_to_a_page_per_row():
    lengths = [1024, 4000, 16000, 32000]
    table = attn.PageTable(3400, 16, len(lengths), 32000 // 16)
    for b, n in enumerate(lengths):
        table.grow(b, n)
    used = table.bytes_in_use(num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16)
    valid = attn.kv_cache_bytes(
        num_layers=1, num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16, num_tokens=sum(lengths)
    )
    assert used == valid  # every length is a multiple of 16
    table.grow(0, 1025)
    assert table.bytes_in_use(num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16) < 1.01 * valid


def test_gradients_through_the_pages_equal_the_contiguous_ones():
    """d/dq and d/d(pool) of paged decoding: the pool's gradient is the contiguous
    cache's, at each token's page and slot (and zero on pages no row holds)."""
    table = attn.PageTable(PAGES, PAGE, 2, M)
    table.grow(1, 9)  # row 1 first: the rows' pages interleave
    table.grow(0, 6)
    table.grow(1, 13)
    tables, lengths = table.arrays()
    pool = normal(3, (PAGES, PAGE, K, H))
    q, ct = normal(4, (2, 1, N, H)), normal(5, (2, 1, N, H))
    kw = dict(mask=masks.causal(), num_splits=2)

    def paged_loss(q, pool):
        return jnp.sum(attn.paged_decode_attention(q, pool, pool, tables, lengths, **kw) * ct)

    def contiguous_loss(q, cache):
        return jnp.sum(attn.decode_attention(q, cache, cache, lengths=lengths, **kw) * ct)

    cache = paged.gather(pool, tables)
    dq, dpool = jax.grad(paged_loss, argnums=(0, 1))(q, pool)
    want_dq, dcache = jax.grad(contiguous_loss, argnums=(0, 1))(q, cache)
    assert rel_err(dq, want_dq) < 1e-6
    for b in range(2):
        for p in range(int(lengths[b])):
            page, slot = int(tables[b, p // PAGE]), p % PAGE
            np.testing.assert_allclose(dpool[page, slot], dcache[b, p], rtol=1e-6, atol=1e-7)
    held = np.asarray(tables)[np.asarray(tables) >= 0]
    free = np.setdiff1d(np.arange(PAGES), held)
    np.testing.assert_array_equal(np.asarray(dpool)[free], 0.0)


def test_extend_pages_gives_what_extend_slots_gives_a_full_cache():
    """A ragged prefill chunk into rows already holding tokens: the keys each new token
    sees (by position) and the attention over them, forward and gradients to q and the
    new keys and values, equal a full contiguous cache's; the pools then hold the real
    new tokens at their pages and slots (padding is not stored)."""
    T, start, count = 5, np.array([6, 0]), np.array([5, 3])
    table = attn.PageTable(PAGES, PAGE, 2, M)
    table.grow(1, 3)  # row 1 first: the rows' pages interleave
    table.grow(0, 11)
    tables = jnp.asarray(table.tables)
    old_k, old_v = normal(6, (2, M * PAGE, K, H)), normal(7, (2, M * PAGE, K, H))
    old_pos = np.where(np.arange(M * PAGE)[None] < start[:, None], np.arange(M * PAGE), -1)
    pools = tuple(
        paged.write_pages((jnp.zeros((PAGES, PAGE, K, H)),), tables,
                          np.arange(M * PAGE)[None].repeat(2, 0), (x,), old_pos >= 0)[0]
        for x in (old_k, old_v)
    )  # fmt: skip
    q, new_k, new_v = normal(8, (2, T, N, H)), normal(9, (2, T, K, H)), normal(10, (2, T, K, H))
    ct = normal(11, (2, T, N, H))
    positions = jnp.asarray(start[:, None] + np.arange(T))
    kw = dict(mask=masks.causal(), q_positions=positions, q_segment_ids=jnp.ones((2, T), int))

    def attend(q, visible, visible_pos):
        seg = (visible_pos >= 0).astype(jnp.int32)
        out = attn.dot_product_attention(q, *visible, kv_positions=visible_pos,
                                         kv_segment_ids=seg, **kw)  # fmt: skip
        return jnp.sum(out * ct)

    def paged_loss(q, new_k, new_v):
        (visible, pos), _ = paged.extend_pages(pools, tables, (new_k, new_v), start, count)
        return attend(q, visible, pos)

    def contiguous_loss(q, new_k, new_v):
        (visible, pos), _ = attn.cache.extend_slots(
            (old_k, old_v), jnp.asarray(old_pos, jnp.int32), (new_k, new_v), start, count
        )
        return attend(q, visible, pos)

    got = jax.value_and_grad(paged_loss, argnums=(0, 1, 2))(q, new_k, new_v)
    want = jax.value_and_grad(contiguous_loss, argnums=(0, 1, 2))(q, new_k, new_v)
    assert rel_err(got[0], want[0]) < 1e-6
    for g, w in zip(got[1], want[1], strict=True):
        assert rel_err(g, w) < 1e-6
    _, (pool_k, pool_v) = paged.extend_pages(pools, tables, (new_k, new_v), start, count)
    for b in range(2):
        for t in range(T):
            p = start[b] + t
            page, slot = int(tables[b, p // PAGE]), p % PAGE
            if t < count[b]:
                np.testing.assert_array_equal(pool_k[page, slot], new_k[b, t])
                np.testing.assert_array_equal(pool_v[page, slot], new_v[b, t])
            elif page >= 0:  # a padding token's slot keeps what it had
                np.testing.assert_array_equal(pool_k[page, slot], pools[0][page, slot])
    with pytest.raises(ValueError, match="block_tables: expected a page for every token"):
        paged.extend_pages(pools, tables, (new_k, new_v), start, np.array([5, 5]))  # row 1: 5


def test_a_page_of_another_row_or_of_no_row_holding_nan_changes_nothing():
    """Row 1 holds page 0 (the page an unused table entry used to read) and it holds NaN;
    the free pages hold Inf; row 0 has unused entries past its length and a page freed
    behind a window. Row 0's output and gradients are bit-identical to a clean pool's."""
    table = attn.PageTable(PAGES, PAGE, 2, M)
    table.grow(1, 3)  # page 0
    table.grow(0, 14)
    table.drop_before(0, 8)  # row 0's first two pages return to the pool: -1 entries
    tables, lengths = table.arrays()
    assert int(tables[1, 0]) == 0 and int(tables[0, 0]) == paged.UNUSED
    pool = normal(6, (PAGES, PAGE, K, H))
    q = normal(7, (2, 1, N, H))
    kw = dict(mask=masks.causal() & masks.sliding_window(6), num_splits=2)

    @jax.jit
    def run(q, pool_k, pool_v):
        def loss(q, pool_k, pool_v):
            out = attn.paged_decode_attention(q, pool_k, pool_v, tables, lengths, **kw)
            return jnp.sum(out[0] ** 2), out[0]

        return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, pool_k, pool_v)

    free = np.setdiff1d(np.arange(PAGES), np.asarray(tables)[np.asarray(tables) >= 0])
    dirty = pool.at[0].set(jnp.nan).at[free].set(jnp.inf)
    (dq, dk, dv), out = run(q, dirty, -dirty)
    (want_dq, want_dk, want_dv), want = run(q, pool, -pool)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(dq[0], want_dq[0])
    for page in np.asarray(tables[0])[np.asarray(tables[0]) >= 0]:
        np.testing.assert_array_equal(dk[page], want_dk[page])
        np.testing.assert_array_equal(dv[page], want_dv[page])
    assert not np.asarray(dk)[free].any() and not np.asarray(dv)[free].any()  # pages of no row
