"""Next-token losses of a stream fed token by token through a model's decode cache.

``stream_nll`` runs ``Decoder.decode_step`` in a ``lax.scan`` over the stream,
so each position sees exactly what the model's cache keeps (a full cache, a
ring-buffer window, pinned initial tokens). With ``renumber`` the positions
inside a cache of initial tokens plus a window are renumbered as StreamingLLM
(Xiao et al. 2023) does: the cached tokens are numbered by their slots, not by
where they stood in the stream.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import attn
from attn.checks import fail

__all__ = ["renumber_shift", "stream_nll"]


def renumber_shift(t, num_initial: int, window: int):
    """How far StreamingLLM's numbering moves the initial tokens' keys at query position t.

    StreamingLLM numbers the cached tokens by their slots: the ``n`` initial
    tokens 0..n-1, the ``w`` latest n..n+w-1, the query last. With RoPE only
    differences count, and the window keys' differences to the query are
    their absolute ones; the initial tokens' shrink from ``t - i`` to
    ``n + w - 1 - i``: their keys move ``max(0, t - (n + w - 1))`` positions on.
    """
    return jnp.maximum(0, t - (num_initial + window - 1))


def _renumbered(cache, originals, shift, layers):
    """``cache`` with each layer's pinned keys at their original positions + ``shift``.

    ``originals``: per layer, the pinned keys ``[B,n,K,H]`` as first written (at
    positions 0..n-1). RoPE's rotations compose, so rotating those keys by
    ``shift`` places them at ``i + shift``; the stored positions, which the mask
    reads, stay as they are.
    """
    new = []
    for layer, cfg, orig in zip(cache.layers, layers, originals, strict=True):
        n = orig.shape[1]
        moved = attn.apply_rope(
            orig,
            jnp.full((n,), shift, jnp.float32),
            base=cfg.rope_base,
            rotary_dim=getattr(cfg, "rotary_dim", None),
        )
        new.append(layer.replace(k=layer.k.at[:, :n].set(moved.astype(layer.k.dtype))))
    return cache.replace(layers=tuple(new))


@functools.partial(jax.jit, static_argnames=("graphdef", "renumber"))
def _stream_nll(graphdef, state, tokens, targets, cache, renumber=None):
    """Per-position NLL ``[B,S]`` of tokens fed one at a time through ``cache``.

    ``renumber``: None, or ``(n, w)`` to renumber positions as StreamingLLM
    does for a cache of ``n`` initial tokens and a window of ``w``.
    """
    model = nnx.merge(graphdef, state)
    layers = model.config.layers

    def step(carry, xs):
        cache, originals = carry
        t, token, target = xs
        if renumber is not None:
            shift = renumber_shift(t, *renumber)
            # Until the first move the pinned slots hold the keys as written.
            n = renumber[0]
            originals = tuple(
                jnp.where(shift == 0, layer.k[:, :n], orig)
                for layer, orig in zip(cache.layers, originals, strict=True)
            )
            cache = _renumbered(cache, originals, shift, layers)
        logits, cache = model.decode_step(token, cache)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, target)
        return (cache, originals), nll

    n = renumber[0] if renumber is not None else 0
    originals = tuple(layer.k[:, :n] for layer in cache.layers)
    steps = jnp.arange(tokens.shape[1])
    _, nll = jax.lax.scan(step, (cache, originals), (steps, tokens.T, targets.T))
    return nll.T


def stream_nll(
    model: nnx.Module, tokens, targets, renumber: tuple[int, int] | None = None
) -> np.ndarray:
    """Next-token NLL ``[B,S]`` of streaming ``tokens [B,S]`` through the model's decode cache.

    Args:
      renumber: ``(n, w)``: the model's layers keep ``n`` initial tokens and a
        window of ``w`` (with RoPE); positions are renumbered inside the cache as
        StreamingLLM does (``renumber_shift``). None: absolute positions.

    Raises:
      ValueError: naming ``renumber``, unless every layer is a RoPE layer with
        exactly that window and those initial tokens.
    """
    if renumber is not None:
        n, w = renumber
        layers = [
            (getattr(a, "window", None), getattr(a, "initial_tokens", 0), getattr(a, "rope", False))
            for a in model.config.layers
        ]
        if any(layer != (w, n, True) for layer in layers):
            fail(
                "renumber",
                f"(n, w) = {renumber} of layers with RoPE, window w and n initial tokens",
                f"layers with (window, initial_tokens, rope) {layers}",
            )
    tokens, targets = jnp.asarray(tokens, jnp.int32), jnp.asarray(targets, jnp.int32)
    cache = model.init_cache(tokens.shape[0], tokens.shape[1])
    graphdef, state = nnx.split(model)
    nll = _stream_nll(graphdef, state, tokens, targets, cache, renumber=renumber)
    return np.asarray(nll, np.float64)
