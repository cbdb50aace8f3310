"""Prefill + decode gives the full forward pass's logits, for every cache kind.

The decoding invariant: for each kind, logits from prefilling a prompt
(in chunks, rows of different lengths, padding in between) and then decoding
one token at a time equal the logits of one teacher-forced forward pass over
the same tokens (float32, relative error <= 1e-4). Short convolutions and
their states ride on the ``gqa`` (full KV cache) and ``hybrid`` (linear with
decay and gates, MLA, window ring buffer) kinds, see ``common.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
import models
from models.cache import DecodeCache, bookkeeping_bytes
from tests.models.common import (
    KINDS,
    MAX_LEN,
    VOCAB,
    WIDTH,
    B,
    config_for,
    extend,
    forward,
    init_cache,
    model_for,
    tokens,
)
from tests.util import rel_err

RTOL = 1e-4  # composed float32 functions


def _check_rows(logits, full, starts, counts):
    """Row b of ``logits [B,T,V]``, first ``counts[b]`` entries, vs ``full[b, starts[b]:]``."""
    for b in range(logits.shape[0]):
        got = logits[b, : counts[b]]
        want = full[b, starts[b] : starts[b] + counts[b]]
        assert rel_err(got, want) <= RTOL, (b, rel_err(got, want))


def _row_chunk(seq, starts, counts, filler):
    """Row b holds ``seq[b, starts[b]:][:counts[b]]``, then ``filler``'s other tokens."""
    out = np.array(filler)
    for b in range(seq.shape[0]):
        out[b, : counts[b]] = np.asarray(seq[b, starts[b] : starts[b] + counts[b]])
    return jnp.asarray(out, jnp.int32)


@pytest.mark.parametrize("kind", list(KINDS))
def test_chunked_prefill_then_decode_matches_forward(kind):
    """Two prefill chunks with per-row lengths, then decode steps: rows at different lengths."""
    model = model_for(KINDS[kind])
    seq = tokens(1, (B, MAX_LEN))
    full = forward(model, seq)
    cache = init_cache(model)

    first = np.array([5, 2])  # real tokens of the first chunk per row
    chunk = _row_chunk(seq, [0, 0], first, np.asarray(tokens(2, (B, 5))))  # padding: other tokens
    logits, cache = extend(model, chunk, cache, jnp.asarray(first))
    _check_rows(logits, full, [0, 0], first)

    second = np.array([3, 1])  # the same chunk shape as the first: one compile for both
    chunk = _row_chunk(seq, first, second, np.asarray(tokens(3, (B, 5))))
    logits, cache = extend(model, chunk, cache, jnp.asarray(second))
    _check_rows(logits, full, first, second)

    pos = first + second
    np.testing.assert_array_equal(cache.lengths, pos)
    rows = np.arange(B)
    for _ in range(6):
        logits, cache = extend(model, seq[rows, pos][:, None], cache)
        _check_rows(logits, full, pos, [1, 1])
        pos = pos + 1
    np.testing.assert_array_equal(cache.lengths, pos)


@pytest.mark.parametrize("kind", list(KINDS))
def test_prompt_of_length_one(kind):
    model = model_for(KINDS[kind])
    seq = tokens(4, (B, MAX_LEN))
    full = forward(model, seq)
    cache = init_cache(model)
    for t in range(MAX_LEN):
        logits, cache = extend(model, seq[:, t : t + 1], cache)
        _check_rows(logits, full, [t, t], [1, 1])


def test_blockwise_impl_computes_the_dense_function():
    """``impl`` never changes the math: same parameters (same seed), same logits."""
    seq = tokens(9, (B, MAX_LEN))
    blockwise = forward(model_for(KINDS["blockwise"]), seq)
    dense = forward(model_for(("streaming", "gqa")), seq)
    assert rel_err(blockwise, dense) <= 1e-5


STREAMING = ("streaming", "streaming")


def test_streaming_generates_far_past_the_window_with_constant_cache():
    """StreamingLLM: 5x the window decoded through a ring of initial + window slots."""
    model = model_for(STREAMING)
    layer = model.config.layers[0]
    w, n = layer.window, layer.initial_tokens
    steps = 5 * w
    seq = tokens(5, (B, 1 + steps))
    full = forward(model, seq)  # the same mask, causal & (window | initial), on arange positions

    cache = init_cache(model, max_len=1 + steps)
    shapes = jax.tree.map(jnp.shape, cache)
    assert shapes == jax.tree.map(jnp.shape, init_cache(model, max_len=10_000))
    assert cache.layers[0].k.shape[1] == n + w
    for t in range(1 + steps):
        logits, cache = extend(model, seq[:, t : t + 1], cache)
        _check_rows(logits, full, [t, t], [1, 1])
        assert jax.tree.map(jnp.shape, cache) == shapes
    # The initial tokens stay pinned; the ring holds the latest w positions.
    np.testing.assert_array_equal(cache.layers[0].pos[0, :n], np.arange(n))
    assert sorted(np.asarray(cache.layers[0].pos[0, n:]).tolist()) == list(
        range(steps + 1 - w, steps + 1)
    )


def test_streaming_generates_4x_window():
    model = model_for(STREAMING)
    w = model.config.layers[0].window
    prompt = tokens(6, (B, 3))
    new = 4 * w
    out = models.generate(model, prompt, new)
    assert out.shape == (B, new)
    assert models.cache_bytes(model.init_cache(B, 3 + new)) == models.cache_bytes(
        model.init_cache(B, 100 * new)
    )
    # Greedy generation is the argmax of the forward pass over its own output.
    logits = forward(model, jnp.concatenate([prompt, out], 1))
    np.testing.assert_array_equal(out, jnp.argmax(logits[:, 2:-1], -1))


def test_generate_greedy_with_rows_of_different_lengths():
    model = model_for(KINDS["hybrid"])
    prompt = tokens(7, (B, 5))
    lengths = np.array([5, 2])
    new = 6
    out = np.asarray(models.generate(model, prompt, new, prompt_lengths=jnp.asarray(lengths)))
    # Row b's own sequence (its prompt, then its output), right-padded.
    seq = np.zeros((B, 5 + new), np.int32)
    for b in range(B):
        seq[b, : lengths[b] + new] = np.concatenate([prompt[b, : lengths[b]], out[b]])
    logits = forward(model, jnp.asarray(seq))
    for b in range(B):
        predicted = jnp.argmax(logits[b, lengths[b] - 1 : lengths[b] - 1 + new], -1)
        np.testing.assert_array_equal(out[b], predicted)


def test_generate_takes_a_list_of_prompts_of_different_lengths():
    """The same as the padded prompt with its lengths (same shapes: the same compile)."""
    model = model_for(KINDS["hybrid"])
    prompt = np.asarray(tokens(7, (B, 5)))
    padded = models.generate(model, prompt, 6, prompt_lengths=jnp.array([5, 2]))
    listed = models.generate(model, [prompt[0].tolist(), prompt[1, :2]], 6)
    np.testing.assert_array_equal(listed, padded)
    refused = {"prompt: expected at least one prompt": [],
               r"prompt\[1\]: expected a non-empty 1-D": [[1, 2], []]}  # fmt: skip
    for match, bad in refused.items():
        with pytest.raises(ValueError, match=match):
            models.generate(model, bad, 2)


def test_generate_sampling_top_k_and_eos():
    # Same shapes as the test above: options are traced, so this reuses its compile.
    model = model_for(KINDS["hybrid"])
    prompt = tokens(8, (B, 5))
    greedy = models.generate(model, prompt, 6)
    top1 = models.generate(model, prompt, 6, temperature=0.7, top_k=1, key=jax.random.PRNGKey(1))
    np.testing.assert_array_equal(top1, greedy)
    key = jax.random.PRNGKey(3)
    a = np.asarray(models.generate(model, prompt, 6, temperature=1.0, top_k=4, key=key))
    b = np.asarray(models.generate(model, prompt, 6, temperature=1.0, top_k=4, key=key))
    np.testing.assert_array_equal(a, b)
    # Every sampled token is among the 4 most likely under teacher forcing.
    logits = forward(model, jnp.concatenate([prompt, jnp.asarray(a)], 1))[:, 4:-1]
    top4 = np.argsort(np.asarray(logits), -1)[..., -4:]
    assert (top4 == a[..., None]).any(-1).all()
    eos = int(greedy[0, 1])
    stopped = np.asarray(models.generate(model, prompt, 6, eos_id=eos))
    first = int(np.argmax(stopped[0] == eos))
    assert first <= 1
    assert (stopped[0, first:] == eos).all()
    np.testing.assert_array_equal(stopped[0, :first], np.asarray(greedy)[0, :first])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": 1.0}, "key"),
        ({"top_k": 0}, "top_k"),
        ({"eos_id": 99}, "eos_id"),
        ({"prompt_lengths": jnp.array([0, 2])}, "prompt_lengths"),
    ],
)
def test_generate_errors(kwargs, field):
    model = model_for(KINDS["mha"])
    args = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=field):
        models.generate(model, tokens(0, (B, 3)), **args)


# ----------------------------------------------------------------------------
# Cache sizes


def test_kv_cache_bytes_match_attn_formula():
    for kind in ("mha", "mqa", "window", "global_tokens"):
        model = model_for(KINDS[kind])
        cache = init_cache(model)
        layer = model.config.layers[0]
        slots = cache.layers[0].k.shape[1]
        expected = attn.kv_cache_bytes(
            num_layers=2,
            num_kv_heads=layer.kv_heads,
            head_dim=layer.head_dim,
            dtype=jnp.float32,
            num_tokens=slots,
            batch=B,
        )
        assert models.cache_bytes(cache) == expected, kind
        # Bookkeeping: per-slot positions (int32) per layer plus the lengths.
        assert bookkeeping_bytes(cache) == 4 * (2 * B * slots + B)


def test_gqa_cache_is_n_over_k_times_smaller_than_mha():
    mha = models.cache_bytes(init_cache(model_for(("mha", "mha"))))
    gqa = models.cache_bytes(init_cache(model_for(("gqa", "gqa"))))
    mqa = models.cache_bytes(init_cache(model_for(("mqa", "mqa"))))
    layer = models.presets()["gqa"]
    assert mha == gqa * (layer.num_heads // layer.kv_heads)
    assert mha == mqa * layer.num_heads


def test_mla_cache_bytes_per_token():
    model = model_for(KINDS["mla"])
    layer = model.config.layers[0]
    R, Hr, L = layer.kv_rank, layer.rope_head_dim, 2
    per_token = attn.latent_cache_bytes(
        num_layers=L, kv_rank=R, rope_head_dim=Hr, dtype=jnp.float32
    )
    assert per_token == (R + Hr) * 4 * L
    assert models.cache_bytes(init_cache(model)) == per_token * MAX_LEN * B
    assert (
        attn.latent_cache_bytes(
            num_layers=L, kv_rank=R, rope_head_dim=Hr, dtype=jnp.bfloat16, num_tokens=10, batch=3
        )
        == (R + Hr) * 2 * L * 30
    )


def test_linear_state_bytes_do_not_grow():
    model = model_for(KINDS["linear"])
    layer = model.config.layers[0]
    expected = attn.linear_state_bytes(
        num_layers=2, num_heads=layer.num_heads, feature_dim=8, value_dim=8, batch=B
    )
    assert models.cache_bytes(model.init_cache(B, 4)) == expected
    assert models.cache_bytes(model.init_cache(B, 4000)) == expected


def test_hybrid_cache_bytes_add_up():
    model = model_for(KINDS["hybrid"])
    linear, mla, window = model.config.layers
    cache = init_cache(model)
    # Each layer's short conv keeps its last W-1 inputs [B,W-1,D] (float32).
    widths = [layer.short_conv for layer in model.config.layers]
    assert [c.shape for c in cache.conv] == [(B, w - 1, WIDTH) for w in widths]
    assert models.cache_bytes(model.init_cache(B, 4000)) > models.cache_bytes(cache)  # MLA grows
    expected = sum(B * (w - 1) * WIDTH * 4 for w in widths) + (
        attn.linear_state_bytes(
            num_layers=1, num_heads=linear.num_heads, feature_dim=8, value_dim=8, batch=B
        )
        + attn.latent_cache_bytes(
            num_layers=1,
            kv_rank=mla.kv_rank,
            rope_head_dim=mla.rope_head_dim,
            dtype=jnp.float32,
            num_tokens=MAX_LEN,
            batch=B,
        )
        + attn.kv_cache_bytes(
            num_layers=1,
            num_kv_heads=window.kv_heads,
            head_dim=window.head_dim,
            dtype=jnp.float32,
            num_tokens=window.initial_tokens + window.window,
            batch=B,
        )
    )
    assert models.cache_bytes(cache) == expected
    ring = window.initial_tokens + window.window
    assert bookkeeping_bytes(cache) == 4 * B * (MAX_LEN + ring + 1)  # pos and lengths
    # A cache without the convolution states (not from init_cache) is refused.
    bare = DecodeCache(cache.layers, cache.lengths)
    with pytest.raises(ValueError, match="cache: expected a cache holding the short-conv states"):
        model.prefill(tokens(0, (B, 3)), bare)


def test_bf16_cache_is_half():
    f32 = model_for(("gqa", "gqa"))
    bf16 = model_for(("gqa", "gqa"), dtype="bfloat16")
    assert models.cache_bytes(init_cache(f32)) == 2 * models.cache_bytes(init_cache(bf16))
    assert forward(bf16, tokens(0, (B, 4))).dtype == jnp.float32  # logits stay float32


@pytest.mark.parametrize(
    ("fn", "kwargs", "field"),
    [
        (attn.latent_cache_bytes, {"kv_rank": 0}, "kv_rank"),
        (attn.latent_cache_bytes, {"dtype": "nope"}, "dtype"),
        (attn.linear_state_bytes, {"feature_dim": 0}, "feature_dim"),
    ],
)
def test_size_helper_errors(fn, kwargs, field):
    base = (
        {"num_layers": 1, "kv_rank": 4, "rope_head_dim": 2, "dtype": jnp.float32}
        if fn is attn.latent_cache_bytes
        else {"num_layers": 1, "num_heads": 2, "feature_dim": 4, "value_dim": 4}
    )
    with pytest.raises(ValueError, match=field):
        fn(**{**base, **kwargs})


def test_decode_errors():
    model = model_for(KINDS["mha"])
    cache = init_cache(model)
    with pytest.raises(ValueError, match="lengths"):
        model.prefill(tokens(0, (B, 3)), cache, jnp.array([4, 1]))
    with pytest.raises(ValueError, match="cache"):
        model.prefill(tokens(0, (B + 1, 3)), cache)
    with pytest.raises(ValueError, match="token"):
        model.decode_step(tokens(0, (B, 2)), cache)
    with pytest.raises(ValueError, match="max_len"):
        model.init_cache(B, 0)
    with pytest.raises(ValueError, match="tokens"):
        model.prefill(jnp.zeros((B, 3)), cache)
    assert config_for(("mha",)).layers[0] == models.presets()["mha"]


def test_a_full_cache_refuses_positions_past_max_len():
    """A full cache never silently becomes a window: concrete lengths raise..."""
    model = model_for(KINDS["hybrid"])  # linear state, MLA latent cache, window ring
    cache = init_cache(model)
    _, cache = extend(model, tokens(1, (B, MAX_LEN)), cache, jnp.array([MAX_LEN, 10]))
    with pytest.raises(ValueError, match=rf"cache: .*full cache of {MAX_LEN} slots"):
        model.decode_step(tokens(2, (B,)), cache)
    with pytest.raises(ValueError, match=r"cache: .*up to 16"):
        model.prefill(tokens(3, (B, MAX_LEN + 1)), init_cache(model))
    # A window layer whose ring would be longer than max_len gets a plain full cache.
    window = model_for(STREAMING)
    small = window.init_cache(B, 4)
    assert not small.layers[0].ring and window.init_cache(B, 10_000).layers[0].ring
    with pytest.raises(ValueError, match="full cache of 4 slots"):
        window.prefill(tokens(4, (B, 5)), small)


def test_a_full_cache_overflowing_under_jit_gives_nan_logits():
    """...and under jit the rows that overflow get NaN logits, the others are untouched."""
    model = model_for(KINDS["hybrid"])
    seq = tokens(1, (B, MAX_LEN))
    _, cache = extend(model, seq, init_cache(model), jnp.array([MAX_LEN, 10]))
    logits, cache = extend(model, seq[:, :1], cache)
    assert bool(jnp.all(jnp.isnan(logits[0]))), "row 0 is past the cache"
    assert bool(jnp.all(jnp.isfinite(logits[1])))
    full = forward(model, jnp.concatenate([seq[1:, :10], seq[1:, :1]], 1))
    assert rel_err(logits[1, 0], full[0, 10]) <= RTOL


def test_generate_checks_the_cache_it_is_given():
    model = model_for(KINDS["mha"])
    prompt = tokens(7, (B, 8))
    with pytest.raises(ValueError, match=r"cache: .*at least 15 slots.*got 10 slots"):
        models.generate(model, prompt, 8, cache=model.init_cache(B, 10))


def test_token_ids_outside_the_vocabulary_are_refused_or_nan():
    model = model_for(KINDS["mha"])
    bad = tokens(8, (B, 3)).at[0, 1].set(VOCAB)
    with pytest.raises(ValueError, match=rf"tokens: expected token ids in \[0, {VOCAB}\)"):
        model.prefill(bad, init_cache(model))
    with pytest.raises(ValueError, match="prompt: expected token ids"):
        models.generate(model, bad.at[0, 1].set(-1), 2)
    # Under jit the values cannot be checked: the row's logits are NaN, never plausible.
    logits = forward(model, bad)
    assert bool(jnp.all(jnp.isnan(logits[0, 1:]))) and bool(jnp.all(jnp.isfinite(logits[1])))
    assert bool(jnp.all(jnp.isnan(forward(model, bad.at[0, 1].set(-1))[0, 1:])))
