"""Choosing the next token: greedy, or a sample filtered by top-k, top-p and min-p.

``generate`` and ``serve`` share it, and draw row b's t-th token with the key
``fold_in(fold_in(key, b), t)`` (``serve``: b is the request), so a request's
tokens do not depend on the rows beside it, and the two agree.

The filters apply in one order, to the distribution at the temperature:
``softmax(logits / temperature)``, then the ``top_k`` most likely tokens, then
the smallest set of those whose probability sums to at least ``top_p``
(nucleus sampling; Holtzman et al., "The curious case of neural text
degeneration", 2020), then the tokens at least ``min_p`` times as likely as
the most likely one (Nguyen et al., "Turning up the heat: min-p sampling",
2024); the sample is drawn from what remains, renormalized. At temperature 0
the token is the argmax, and a filter given with it is a ``ValueError`` (it
would change nothing). Every option is traced, so greedy and sampled
generation share one compiled program.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp

from attn.checks import fail

__all__ = ["NO_EOS", "Sampling", "sample", "sampling", "token_logprobs"]

NO_EOS = -1  # never a token id


class Sampling(NamedTuple):
    """The options as traced scalars (what the compiled programs take)."""

    temperature: jax.Array  # float32, 0 is greedy
    top_k: jax.Array  # int32, V is no filter
    top_p: jax.Array  # float32, 1 is no filter
    min_p: jax.Array  # float32, 0 is no filter
    eos_id: jax.Array  # int32, NO_EOS for none


def sampling(temperature, top_k, top_p, min_p, key, eos_id, V: int) -> Sampling:
    """The options of ``generate`` and ``serve``, checked against a vocabulary of V.

    Raises:
      ValueError: naming the option: a negative or non-finite temperature, a
        filter out of range or given at temperature 0 (greedy), no ``key`` to
        sample with, an ``eos_id`` outside the vocabulary.
    """
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, numbers.Real)
        or not 0 <= temperature < float("inf")
    ):
        fail("temperature", "a finite number >= 0", repr(temperature))
    if top_k is not None and (
        isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or not 1 <= top_k <= V
    ):
        fail("top_k", f"None or an int in [1, {V}]", repr(top_k))
    for name, value, low_open in (("top_p", top_p, True), ("min_p", min_p, False)):
        if value is None:
            continue
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        ok = ok and (0 < value <= 1 if low_open else 0 <= value < 1)
        if not ok:
            fail(name, "None or a number in " + ("(0, 1]" if low_open else "[0, 1)"), repr(value))
    given = [n for n, v in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)) if v is not None]
    if temperature == 0 and given:
        fail(given[0], "None at temperature 0 (greedy: the argmax, which no filter changes); "
             "give a temperature > 0 to sample", "a filter")  # fmt: skip
    if temperature > 0 and key is None:
        fail("key", "a jax.random key when temperature > 0", None)
    if eos_id is not None and (
        isinstance(eos_id, bool) or not isinstance(eos_id, numbers.Integral) or not 0 <= eos_id < V
    ):
        fail("eos_id", f"None or an int in [0, {V})", repr(eos_id))
    return Sampling(
        jnp.float32(temperature),
        jnp.int32(V if top_k is None else top_k),
        jnp.float32(1.0 if top_p is None else top_p),
        jnp.float32(0.0 if min_p is None else min_p),
        jnp.int32(NO_EOS if eos_id is None else eos_id),
    )


def sample(logits, keys, options: Sampling):
    """Tokens ``[B]`` int32 from float32 logits ``[B,V]``, row b drawn with ``keys[b]``."""
    greedy = jnp.argmax(logits, axis=-1)
    # The row's max comes off before the temperature divides: a tiny temperature then sends
    # the other logits to -inf, never to inf - inf (NaN probabilities, whose draw is token 0).
    shifted = logits - logits.max(axis=-1, keepdims=True)
    probs = jax.nn.softmax(shifted / jnp.where(options.temperature > 0, options.temperature, 1.0))
    V = logits.shape[-1]
    ranked = jnp.sort(probs, axis=-1)[:, ::-1]  # descending
    kth = jnp.take(ranked, options.top_k - 1, axis=-1)  # traced k: no lax.top_k
    keep = probs >= kth[:, None]
    # Nucleus over the top-k: a token stays if the mass of the tokens ranked above it is
    # below top_p (so the one that crosses it stays too, and the first always does).
    in_k = jnp.arange(V) < options.top_k
    ranked_k = jnp.where(in_k, ranked, 0.0)
    mass_above = jnp.cumsum(ranked_k, axis=-1) - ranked_k
    total = ranked_k.sum(-1, keepdims=True)
    nucleus = in_k & (mass_above < options.top_p * total)
    smallest = jnp.min(jnp.where(nucleus, ranked, jnp.inf), axis=-1)
    keep &= probs >= smallest[:, None]
    keep &= probs >= options.min_p * ranked[:, :1]
    filtered = jnp.where(keep, jnp.log(probs), -jnp.inf)
    sampled = jax.vmap(jax.random.categorical)(keys, filtered)
    return jnp.where(options.temperature > 0, sampled, greedy).astype(jnp.int32)


def token_logprobs(logits, tokens):
    """``[B]`` float32: the model's log-probability of ``tokens`` ``[B]`` under ``logits``
    ``[B,V]`` (before temperature and filters, as generation libraries report it)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
