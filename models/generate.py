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
from models.inputs import bucket, check_lengths, check_tokens, pad_prompts, pad_to
from models.sampling import sample, sampling, token_logprobs


def generate(
    model,
    prompt,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    key=None,
    eos_id: int | None = None,
    prompt_lengths=None,
    cache: DecodeCache | None = None,
    page_size: int | None = None,
    return_logprobs: bool = False,
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
        ``softmax(logits / temperature)``, filtered (``models.sampling``).
      top_k: sample among the k most likely tokens only (None: all).
      top_p: then among the smallest set whose probability reaches it (None: all).
      min_p: then among the tokens at least this fraction as likely as the
        most likely one (None: all). A filter at temperature 0 is a ``ValueError``.
      key: a ``jax.random`` key, required when ``temperature > 0``; row b's
        t-th token is drawn with ``fold_in(fold_in(key, b), t)`` (as ``serve``
        draws request b's). Or ``[B]`` keys, one per row: row b's with
        ``fold_in(key[b], t)``.
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
      return_logprobs: also return each token's log-probability under the
        model (``[B, max_new_tokens]`` float32, before temperature and filters;
        0 for the EOS a finished row repeats).

    Returns:
      ``[B, max_new_tokens]`` int32 tokens, and the log-probabilities if asked.

    Prompts are right-padded to a bucket's width (``models.inputs.bucket``: a power
    of two from 16, within a given cache's room), so one compile serves every
    prompt length of a bucket; a default cache has that width's room.
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
    options = sampling(temperature, top_k, top_p, min_p, key, eos_id, V)
    lengths = check_lengths(prompt_lengths, B, T, "prompt_lengths", minimum=1)
    if lengths is None:
        lengths = jnp.full((B,), T, jnp.int32)
    if cache is None and hasattr(model, "encoder_blocks"):
        fail("cache", "model.init_cache(B, max_len, src=...) for an EncoderDecoder", None)
    # Padded to its bucket's width (as much as a given cache has room for): one compiled
    # program serves every prompt length of the bucket.
    slots = None if not isinstance(cache, DecodeCache) else full_cache_slots(cache)
    width = bucket(T, None if slots is None else slots - int(max_new_tokens) + 1)
    prompt, T = pad_to(prompt, width), width
    if page_size is not None:
        if cache is not None:
            fail("page_size", "None when a cache is given", page_size)
        cache = _paged_cache(model, lengths + int(max_new_tokens) - 1, T + int(max_new_tokens),
                             page_size)  # fmt: skip
    if cache is not None:
        _check_room(cache, T + int(max_new_tokens) - 1)
        cache_overflow(cache, lengths + int(max_new_tokens) - 1)  # each row's pages, if paged
    keys = _row_keys(jax.random.PRNGKey(0) if key is None else key, B)
    graphdef, state = nnx.split(model)
    # Only shapes are static: sampling options are traced, so greedy, sampled
    # and EOS-stopped generation share one compiled program.
    tokens, logprobs = _generate(
        graphdef, state, prompt, lengths, keys, cache, options,
        max_new_tokens=int(max_new_tokens),
    )  # fmt: skip
    return (tokens, logprobs) if return_logprobs else tokens


def _row_keys(key, B: int):
    """``[B]`` keys, one per row: ``fold_in(key, b)``, or ``key`` itself if it holds B."""
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    one = key.shape == (() if typed else (2,))
    if one:
        return jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(B))
    if key.shape[:1] != (B,) or key.shape[1:] != (() if typed else (2,)):
        fail("key", f"a jax.random key or {B} of them (one per row)", f"shape {key.shape}")
    return key


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


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens"))
def _generate(graphdef, state, prompt, lengths, keys, cache, options, *, max_new_tokens):
    model = nnx.merge(graphdef, state)
    B, T = prompt.shape
    if cache is None:
        cache = model.init_cache(B, T + max_new_tokens)
    logits, cache = model.prefill(prompt, cache, lengths)
    last = logits[jnp.arange(B), lengths - 1]  # each row's next-token logits

    def draw(logits, i):
        step_keys = jax.vmap(lambda k: jax.random.fold_in(k, i))(keys)
        token = sample(logits, step_keys, options)
        return token, token_logprobs(logits, token)

    first, first_logp = draw(last, 0)
    done = first == options.eos_id

    def step(carry, i):
        token, cache, done = carry
        logits, cache = model.decode_step(token, cache)
        nxt, logp = draw(logits, i)
        nxt = jnp.where(done, options.eos_id, nxt)  # finished rows repeat EOS
        logp = jnp.where(done, 0.0, logp)
        return (nxt, cache, done | (nxt == options.eos_id)), (nxt, logp)

    _, (rest, rest_logp) = jax.lax.scan(step, (first, cache, done), jnp.arange(1, max_new_tokens))
    tokens = jnp.concatenate([first[:, None], rest.T], axis=1)
    return tokens, jnp.concatenate([first_logp[:, None], rest_logp.T], axis=1)
