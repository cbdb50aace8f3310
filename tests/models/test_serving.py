"""Paged caches and continuous batching: every request's logits are a forward pass's.

``models.serve`` runs more requests than rows: rows finish and new ones join
between steps, a joining row's prompt is prefilled in the same call in which
the other rows decode, and (paged) a request waits until the pool can hold
its pages. Whatever the schedule, request r's logits must equal one
teacher-forced forward pass over its prompt and tokens.
"""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attn
import models
from models.cache import bookkeeping_bytes, clear_rows, paged_layer, set_block_tables
from tests.models.common import VOCAB, forward, model_for, tokens
from tests.util import rel_err

RTOL = 1e-4  # composed float32 functions

# Every layer kind and every form of cache in one stack: full caches (gated GQA with soft-cap,
# sinks and a convolution; MLA latents; FoX with its gate sums; T5 buckets), ring buffers
# (streaming with pinned tokens; Diff over a window), a linear state and the delta rule's
# (Gated DeltaNet in chunks, KDA step by step) and Mamba-2's (SSD state, conv inputs), and
# the sparse kinds (MoBA, NSA; DSA with its indexer's keys as payload).
EVERY_KIND = (
    "gqa_gated_softcap_sinks_conv", "mla_conv", "fox", "t5_gqa", "streaming_conv",
    "diff_window_gqa", "linear_decay_gated_conv", "gated_deltanet_grouped", "kda_recurrent_conv",
    "mamba2_groups_negative", "moba_small", "nsa_small", "dsa_small", "rwkv7_chunks",
    "path_fox_small", "log_linear_mamba2_small", "log_linear_gdn_grouped", "comba_grouped",
)  # fmt: skip
PROMPTS = (1, 6, 3, 9, 2, 5, 4, 7, 3)  # prompt lengths of the requests
PAGE = 4


def _requests(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n) for n in PROMPTS]


def _check_against_forward(model, prompts, out, logits):
    """Row r of a padded batch of ``prompt + tokens[:-1]``: one forward pass for all."""
    seqs = [np.concatenate([p, o[:-1]]) for p, o in zip(prompts, out, strict=True)]
    batch = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for r, s in enumerate(seqs):
        batch[r, : len(s)] = s
    full = forward(model, jnp.asarray(batch))
    for r, p in enumerate(prompts):
        want = full[r, len(p) - 1 : len(p) - 1 + len(out[r])]
        assert logits[r].shape == want.shape
        assert rel_err(logits[r], want) <= RTOL, (r, rel_err(logits[r], want))
        np.testing.assert_array_equal(out[r], np.argmax(want, axis=-1))  # greedy


SMALL = ("mha", "fox", "window")


# The small tests share one program per cache: two rows of 20 slots, prompts of up to 9
# tokens, contiguous or in 6 pages of 4 (fewer than the 10 two rows of 20 would need).
ROWS = dict(batch=2, max_len=20)
PAGED = dict(page_size=PAGE, num_pages=6)


def test_sampling_does_not_depend_on_which_requests_share_the_batch():
    """Requests 1 and 3 stop early in the second run, so the others share the batch with
    different requests at different steps: each request's tokens stay the same."""
    model = model_for(SMALL)
    prompts = _requests(1)[:4]
    kw = dict(temperature=1.0, top_k=8, key=jax.random.PRNGKey(3), **ROWS)
    full = models.serve(model, prompts, 6, **kw)
    early = models.serve(model, prompts, [6, 2, 6, 2], **kw, **PAGED)
    for a, b in zip(full, early, strict=True):
        np.testing.assert_array_equal(b, a[: len(b)])
    greedy = models.serve(model, prompts, 6, **ROWS)
    assert any((a != b).any() for a, b in zip(full, greedy, strict=True))


def test_a_request_ends_at_eos_and_its_row_goes_to_the_next():
    model = model_for(SMALL)
    prompts = _requests(2)[:4]
    free = models.serve(model, prompts, 8, **ROWS)
    eos = int(free[0][2])
    out, logits = models.serve(model, prompts, 8, eos_id=eos, return_logits=True, **ROWS, **PAGED)
    for r, tokens_r in enumerate(free):
        hits = np.nonzero(tokens_r == eos)[0]
        n = hits[0] + 1 if hits.size else 8
        np.testing.assert_array_equal(out[r], tokens_r[:n])  # the EOS is kept
        assert logits[r].shape == (n, VOCAB)
    _check_against_forward(model, prompts, out, logits)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=[2, 3, 4]), "max_new_tokens"),
        (dict(batch=0), "batch"),
        (dict(prompts=[[1, 2], []]), "prompts\\[1\\]"),
        (dict(prompts=[[1, VOCAB]]), "prompts"),
        (dict(max_len=4), "max_len"),
        (dict(page_size=4, num_pages=1), "num_pages"),
        (dict(temperature=0.5), "key"),
        (dict(top_k=0), "top_k"),
        (dict(eos_id=VOCAB), "eos_id"),
    ],
)
def test_serve_errors(kwargs, field):
    args = dict(prompts=[[1, 2, 3], [4]], max_new_tokens=3, batch=2) | kwargs
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        models.serve(model_for(SMALL), args.pop("prompts"), args.pop("max_new_tokens"), **args)


def test_serve_takes_a_decoder_only():
    with pytest.raises(ValueError, match=r"^model: expected a Decoder, got Encoder"):
        models.serve(model_for(("mha",), cls=models.Encoder), [[1, 2]], 2, batch=1)


# ----------------------------------------------------------------------------
# The paged cache's pieces


def _paged_cache(model, batch=2, max_len=16, num_pages=9):
    return model.init_cache(batch, max_len, page_size=PAGE, num_pages=num_pages)


def test_a_paged_cache_pages_the_full_layers_only():
    model = model_for(SMALL)
    cache = _paged_cache(model)
    mha, fox, window = cache.layers
    assert mha.paged and mha.pos is None and mha.k.shape[:2] == (9, PAGE)
    assert fox.paged and fox.c.shape[:2] == (9, PAGE) and fox.total.shape[0] == 2
    assert not window.paged and window.ring  # its ring buffer already holds only the window
    assert mha.tables.shape == (2, 4) and (np.asarray(mha.tables) == -1).all()
    assert models.cache.full_cache_slots(cache) == 16
    contiguous = model.init_cache(2, 16)
    per_token = 2 * (2 * 4 * 8 * 4) + 4 * 4  # mha's and fox's K/V (4 heads of 8), fox's sums
    more = models.cache_bytes(cache) - models.cache_bytes(contiguous)
    assert more == (9 * PAGE - 2 * 16) * per_token  # 36 pooled tokens against 2 rows of 16
    # Positions [B,S] of the two full layers give way to their tables [B,M].
    assert bookkeeping_bytes(contiguous) - bookkeeping_bytes(cache) == 2 * (2 * 16 - 2 * 4) * 4


def test_a_token_without_a_page_is_refused_or_nan():
    model = model_for(SMALL)
    cache = _paged_cache(model)
    table = attn.PageTable(9, PAGE, 2, 4)
    table.grow(0, 4)
    table.grow(1, 3)
    cache = set_block_tables(cache, table.tables)
    prompt = tokens(4, (2, 5))
    with pytest.raises(ValueError, match=r"cache: expected pages for row 0's positions 0\.\.4"):
        model.prefill(prompt, cache)
    _, cache = model.prefill(prompt, cache, jnp.asarray([4, 3]))  # no error
    logits, _ = jax.jit(lambda c: model.decode_step(jnp.asarray([1, 2]), c))(cache)
    assert np.isnan(logits[0]).all() and np.isfinite(logits[1]).all()  # row 0 has no page 1
    with pytest.raises(ValueError, match="tables: expected block tables of shape \\(2, 4\\)"):
        set_block_tables(cache, table.tables[:, :3])


def test_clear_rows_empties_a_row_and_leaves_the_others():
    """A cleared row decodes as a new sequence; the other row goes on undisturbed."""
    model = model_for(SMALL)
    seq = tokens(5, (2, 8))
    full = forward(model, seq)
    table = attn.PageTable(9, PAGE, 2, 4)
    for b in range(2):
        table.grow(b, 5)
    cache = set_block_tables(_paged_cache(model), table.tables)
    _, cache = model.prefill(tokens(6, (2, 5)), cache)  # row 0 is replaced below
    table.release(0)
    cache = clear_rows(cache, _paged_cache(model), jnp.asarray([True, False]))
    np.testing.assert_array_equal(cache.lengths, [0, 5])
    with pytest.raises(ValueError, match=r"rows: expected bools of shape \(2,\), got int32"):
        clear_rows(cache, cache, jnp.asarray([1, 0]))
    table.grow(0, 3)
    table.grow(1, 6)
    cache = set_block_tables(cache, table.tables)
    chunk = jnp.asarray([np.asarray(seq[0, :3]).tolist(), [int(seq[1, 0]), 0, 0]])
    logits, cache = model.prefill(chunk, cache, jnp.asarray([3, 1]))
    assert rel_err(logits[0], full[0, :3]) <= RTOL
    row1 = jnp.concatenate([tokens(6, (2, 5))[1], seq[1, :1]])[None]  # its 5 tokens, then one
    assert rel_err(logits[1, 0], forward(model, row1)[0, 5]) <= RTOL


def test_paged_layer_refuses_a_ring_buffer():
    model = model_for(SMALL)
    ring = model.init_cache(2, 16).layers[2]
    with pytest.raises(ValueError, match="layer: expected a full SlotCache"):
        paged_layer(ring, 4, PAGE)


def test_generate_on_pages_sized_to_each_row():
    """A ragged batch on a paged cache: the same tokens as on the contiguous cache, with
    a pool of exactly the rows' pages; a cache whose tables lack one is refused."""
    model = model_for(SMALL)
    prompts = _requests(3)[:3]  # 1, 6 and 3 tokens
    want = models.generate(model, prompts, 5)
    np.testing.assert_array_equal(models.generate(model, prompts, 5, page_size=PAGE), want)
    fed = [len(p) + 5 - 1 for p in prompts]
    cache = importlib.import_module("models.generate")._paged_cache(model, fed, 11, PAGE)
    assert cache.layers[0].k.shape[0] == sum(-(-n // PAGE) for n in fed)  # 2 + 3 + 2 pages
    short = attn.PageTable(8, PAGE, 3, 3)
    for b, n in enumerate(fed):
        short.grow(b, n - 2 * (b == 1))  # row 1 (10 tokens) lacks the page of its last two
    cache = set_block_tables(model.init_cache(3, 11, page_size=PAGE, num_pages=8),
                                    short.tables)  # fmt: skip
    with pytest.raises(ValueError, match=r"cache: expected pages for row 1's positions 0\.\.9"):
        models.generate(model, prompts, 5, cache=cache)
    with pytest.raises(ValueError, match="page_size: expected None when a cache is given"):
        models.generate(model, prompts, 5, cache=cache, page_size=PAGE)


@pytest.mark.integration  # two compiles at T = 32: the fast tier's minutes are full
def test_generate_and_serve_compile_once_per_bucket_of_prompt_lengths():
    """Prompts of 17 and 30 tokens share the bucket of 32: the second call of each of
    generate and serve runs the first's programs, and its tokens are the forward pass's."""
    generate, serving = (importlib.import_module(f"models.{m}") for m in ("generate", "serving"))
    bucket = importlib.import_module("models.inputs").bucket
    assert [bucket(n) for n in (1, 16, 17, 32, 33)] == [16, 16, 32, 32, 64]
    assert bucket(30, limit=20) == 30 and bucket(17, limit=20) == 20
    model = model_for(SMALL)
    rng = np.random.default_rng(5)
    sizes = []
    for n in (17, 30):
        prompt = rng.integers(0, VOCAB, n)
        out = models.generate(model, [prompt], 3)
        sizes.append(generate._generate._cache_size())
        full = forward(model, jnp.asarray(np.concatenate([prompt, out[0, :-1]]))[None])
        np.testing.assert_array_equal(out[0], np.argmax(full[0, n - 1 :], axis=-1))
        served = models.serve(model, [prompt[:5], prompt], 2, batch=2)
        sizes.append(serving._prefill_and_sample._cache_size())
        np.testing.assert_array_equal(served[1], out[0, :2])
    assert sizes[2:] == sizes[:2]  # no new program for the second length


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_pages=4), "page_size: expected a positive int with num_pages"),
        (dict(page_size=0), "page_size: expected a positive int, got 0"),
        (dict(page_size=4, num_pages=0), "num_pages: expected a positive int, got 0"),
    ],
)
def test_init_cache_refuses_bad_pages(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        model_for(SMALL).init_cache(2, 16, **kwargs)


def test_a_request_whose_pages_hold_nan_and_inf_leaves_the_others_bit_identical():
    """Request 0 reads two embedding rows no other request reads, one NaN and one Inf, so
    every page it writes holds NaN. It finishes first and its pages return to the pool; the
    next request takes them, with NaN in every slot it has not written yet. The other
    requests' tokens and logits are bit-identical to a run with a clean request in its
    place (same lengths, so the same rows, pages and steps)."""
    _nan_request_leaves_the_others_bit_identical(SMALL)


@pytest.mark.integration
def test_every_kind_serves_as_it_runs_forward_and_keeps_a_nan_request_to_itself():
    """On a model of all 13 kinds (one program set, ~20 s: in the integration tier), served
    on 6 pages of 4 for two rows, so requests wait for pages and rows join and leave: the
    clean requests' logits and greedy tokens are one forward pass's, and a NaN request
    reaches none of them through any kind's cache: pages, ring buffers, fixed states (a
    row's state cleared for its next request), the sparse kinds' key sums, compressed blocks
    and indexer keys."""
    _nan_request_leaves_the_others_bit_identical(EVERY_KIND, check_forward=True)


def _nan_request_leaves_the_others_bit_identical(names, check_forward=False):
    model = nnx.clone(model_for(names, tied_embeddings=False))  # the head reads no bad row
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, VOCAB, n) for n in (3, 6, 1, 9)]
    new = [2, 6, 6, 6]
    want, want_logits = models.serve(model, prompts, new, return_logits=True, **ROWS, **PAGED)
    if check_forward:
        _check_against_forward(model, prompts, want, want_logits)
    read = set(np.concatenate([*prompts[1:], *want[1:]]).tolist())
    nan_id, inf_id = sorted(set(range(VOCAB)) - read)[:2]  # ids the clean requests never read
    table = model.embed.embedding[...]
    model.embed.embedding.set_value(table.at[nan_id].set(jnp.nan).at[inf_id].set(jnp.inf))
    bad = [np.array([nan_id, inf_id, nan_id]), *prompts[1:]]
    out, logits = models.serve(model, bad, new, return_logits=True, **ROWS, **PAGED)
    assert np.isnan(logits[0]).all()  # the bad request's own logits
    for r in range(1, 4):
        assert np.isfinite(want_logits[r]).all()
        np.testing.assert_array_equal(out[r], want[r])
        np.testing.assert_array_equal(logits[r], want_logits[r])


def _relu_over_length(q, k, v, *, kv_length, **call):
    """ReLU attention over the sequence length (Wortsman et al. 2023): a kind whose math
    reads ``kv_length``, so a cache's capacity or page size must never reach it."""
    c = attn.softmax.check_call(q, k, v, **call)
    q, k, v = c.isolate(q, k, v)
    s, ok = attn.softmax.logits(c, q, k)
    w = jnp.where(ok, jax.nn.relu(s), 0.0) / kv_length[:, None, None, :, None]
    out = jnp.einsum("BKGTS,BSKE->BTKGE", w, v.astype(jnp.float32))
    return out.reshape(*q.shape[:3], -1).astype(q.dtype)


def test_function_kinds_serve_on_pages_as_they_generate_and_train():
    """Sigmoid attention (its -log n) and a kind dividing by ``kv_length``: served on
    pages of 4 (rows joining and leaving), generated on contiguous caches, and teacher
    forced, the logits agree; a window's ring buffer (softpick) too."""
    models.attention_kind("test_over_length", _relu_over_length, family="relu")
    try:
        layers = models.pattern(("sigmoid", "softpick"), dict(models.presets()))
        over = models.KINDS["test_over_length"].config_class(num_heads=4, head_dim=8)
        layers = (layers[0], over, dataclasses.replace(layers[1], window=3))
        config = models.ModelConfig(vocab_size=VOCAB, width=32, layers=layers)
        model = models.Decoder(config, rngs=nnx.Rngs(0))
        prompts = _requests(4)[:4]
        out, logits = models.serve(model, prompts, 6, return_logits=True, **ROWS, **PAGED)
        _check_against_forward(model, prompts, out, logits)
        generated = models.generate(model, prompts, 6)
        for r, tokens_r in enumerate(out):
            np.testing.assert_array_equal(tokens_r, generated[r])
    finally:
        models.KINDS.remove("test_over_length")
