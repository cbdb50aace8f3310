"""Autoregressive generation under ``jit``: prefill, then a ``lax.scan`` of decode steps."""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attn.checks import fail, positive_int
from attn.paged import PageTable, pages_for
from models.cache import DecodeCache, cache_overflow, full_cache_slots, set_block_tables
from models.inputs import check_lengths, check_tokens, pad_prompts


def generate(
    model,
    prompt,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    key=None,
    eos_id: int | None = None,
    prompt_lengths=None,
    cache: DecodeCache | None = None,
    page_size: int | None = None,
):
    """Generates ``max_new_tokens`` tokens per row after a prompt.

    The model is split into a graph definition (static) and its state (traced),
    so one compiled program serves every model of the same architecture and
    every call with the same shapes and options.

    Args:
      model: a ``Decoder`` (or ``EncoderDecoder`` with ``cache`` from its
        ``init_cache(..., src=...)``).
      prompt: ``[B,T]`` ints, right-padded where rows differ in length; or a
        list of B 1-D prompts of any lengths (padded here, ``prompt_lengths``
        then taken from them).
      max_new_tokens: how many tokens to generate (>= 1).
      temperature: 0 is greedy (argmax); otherwise sample from
        ``softmax(logits / temperature)``.
      top_k: sample among the k most likely tokens only (None: all).
      key: a ``jax.random`` key, required when ``temperature > 0``.
      eos_id: once a row emits it, the row's later tokens are ``eos_id``.
      prompt_lengths: ``[B]`` real prompt tokens per row (default T).
      cache: an empty ``DecodeCache`` to use; default ``model.init_cache(B, T +
        max_new_tokens)``. Its full (non-window) layer caches must hold the
        ``T + max_new_tokens - 1`` positions that are fed back (the last token
        generated is not); a smaller one is a ``ValueError``, and so is a paged
        one whose block tables lack a page for one of those positions of a row.
      page_size: instead of ``cache``, a paged cache (``Decoder.init_cache``)
        whose pool holds exactly the pages each row needs, ``prompt_lengths[b]
        + max_new_tokens - 1`` tokens rounded up to a page: a ragged batch
        pays for its tokens, not ``B x (T + max_new_tokens)``.

    Returns:
      ``[B, max_new_tokens]`` int32 tokens.
    """
    if isinstance(prompt, list | tuple):
        if prompt_lengths is not None:
            fail("prompt_lengths", "None with a list of prompts (their lengths)", "lengths")
        prompt, prompt_lengths = pad_prompts(prompt)
    prompt = check_tokens(prompt, "prompt", vocab=model.config.vocab_size)
    B, T = prompt.shape
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
        fail("max_new_tokens", "a positive int", repr(max_new_tokens))
    if max_new_tokens < 1:
        fail("max_new_tokens", "a positive int", repr(max_new_tokens))
    V = model.config.vocab_size
    check_sampling(temperature, top_k, key, eos_id, V)
    lengths = check_lengths(prompt_lengths, B, T, "prompt_lengths", minimum=1)
    if lengths is None:
        lengths = jnp.full((B,), T, jnp.int32)
    if cache is None and hasattr(model, "encoder_blocks"):
        fail("cache", "model.init_cache(B, max_len, src=...) for an EncoderDecoder", None)
    if page_size is not None:
        if cache is not None:
            fail("page_size", "None when a cache is given", page_size)
        cache = _paged_cache(model, lengths + int(max_new_tokens) - 1, T + int(max_new_tokens),
                             page_size)  # fmt: skip
    if cache is not None:
        _check_room(cache, T + int(max_new_tokens) - 1)
        cache_overflow(cache, lengths + int(max_new_tokens) - 1)  # each row's pages, if paged
    key = jax.random.PRNGKey(0) if key is None else key
    graphdef, state = nnx.split(model)
    # Only shapes are static: sampling options are traced, so greedy, sampled
    # and EOS-stopped generation share one compiled program.
    return _generate(
        graphdef,
        state,
        prompt,
        lengths,
        key,
        cache,
        jnp.float32(temperature),
        jnp.int32(V if top_k is None else top_k),
        jnp.int32(NO_EOS if eos_id is None else eos_id),
        max_new_tokens=int(max_new_tokens),
    )


NO_EOS = -1  # never a token id


def check_sampling(temperature, top_k, key, eos_id, V: int) -> None:
    """The sampling options of ``generate`` and ``serve``, checked against a vocabulary of V."""
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, numbers.Real)
        or not temperature >= 0
    ):
        fail("temperature", "a number >= 0", repr(temperature))
    if top_k is not None and (
        isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or not 1 <= top_k <= V
    ):
        fail("top_k", f"None or an int in [1, {V}]", repr(top_k))
    if temperature > 0 and key is None:
        fail("key", "a jax.random key when temperature > 0", None)
    if eos_id is not None and (
        isinstance(eos_id, bool) or not isinstance(eos_id, numbers.Integral) or not 0 <= eos_id < V
    ):
        fail("eos_id", f"None or an int in [0, {V})", repr(eos_id))


def _paged_cache(model, fed, max_len: int, page_size) -> DecodeCache:
    """An empty paged cache whose rows hold the pages for ``fed[b]`` tokens, and no more."""
    page_size = positive_int(page_size, "page_size")
    fed = np.asarray(fed)
    table = PageTable(max(int(sum(pages_for(n, page_size) for n in fed)), 1), page_size,
                      len(fed), pages_for(max_len, page_size))  # fmt: skip
    for b, n in enumerate(fed):
        table.grow(b, int(n))
    cache = model.init_cache(len(fed), max_len, page_size=page_size, num_pages=table.num_pages)
    return set_block_tables(cache, table.tables)


def _check_room(cache, needed: int):
    """Shapes are static here, so a full layer cache too small for the run is refused now."""
    if not isinstance(cache, DecodeCache):
        fail("cache", "a DecodeCache (see model.init_cache)", type(cache).__name__)
    slots = full_cache_slots(cache)
    if slots is not None and slots < needed:
        fail(
            "cache",
            f"full layer caches of at least {needed} slots (prompt + max_new_tokens - 1)",
            f"{slots} slots",
        )


def sample(logits, key, temperature, top_k):
    """Tokens ``[B]`` from float32 logits ``[B,V]``: argmax if ``temperature == 0``, else a
    sample from ``softmax(logits / temperature)`` restricted to the ``top_k`` largest."""
    greedy = jnp.argmax(logits, axis=-1)
    sampling = temperature > 0
    scaled = logits / jnp.where(sampling, temperature, 1.0)
    # The k-th largest logit by sorting, so k can be traced (lax.top_k needs it static).
    kth = jnp.take(jnp.sort(scaled, axis=-1), logits.shape[-1] - top_k, axis=-1)
    scaled = jnp.where(scaled < kth[:, None], -jnp.inf, scaled)
    sampled = jax.random.categorical(key, scaled, axis=-1)
    return jnp.where(sampling, sampled, greedy).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens"))
def _generate(
    graphdef, state, prompt, lengths, key, cache, temperature, top_k, eos_id, *, max_new_tokens
):
    model = nnx.merge(graphdef, state)
    B, T = prompt.shape
    if cache is None:
        cache = model.init_cache(B, T + max_new_tokens)
    logits, cache = model.prefill(prompt, cache, lengths)
    last = logits[jnp.arange(B), lengths - 1]  # each row's next-token logits
    first = sample(last, jax.random.fold_in(key, 0), temperature, top_k)
    done = first == eos_id

    def step(carry, i):
        token, cache, done = carry
        logits, cache = model.decode_step(token, cache)
        nxt = sample(logits, jax.random.fold_in(key, i), temperature, top_k)
        nxt = jnp.where(done, eos_id, nxt)  # finished rows repeat EOS
        return (nxt, cache, done | (nxt == eos_id)), nxt

    _, rest = jax.lax.scan(step, (first, cache, done), jnp.arange(1, max_new_tokens))
    return jnp.concatenate([first[:, None], rest.T], axis=1)
