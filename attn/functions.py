"""Attention functions beside softmax: how a query's logits become weights on the values.

Each is a plain function of the call every softmax implementation takes
(``attn.softmax.call.CallArgs``: masks, positions, segment ids, score
modifiers, bias and mask arrays), materialized like ``attn.dot_product_attention``
(float32 weights ``[B,N,T,S]``; GQA without repeating K/V) and of the signature
a layer kind is declared from (``models.attention_kind``). A query that sees no
key outputs 0, and padding (segment id 0) reaches nothing (``Call.isolate``).

* ``sigmoid_attention`` (Ramapuram et al. 2024, "Theory, Analysis, and Best
  Practices for Sigmoid Self-Attention"): each weight is ``sigmoid(s + b)`` on
  its own, with no normalization across keys; the bias ``b = -log(n)`` keeps
  the output's norm from growing with the number of keys n (their analysis).
* ``softpick_attention`` (Zuhri et al. 2025, "Softpick: No Attention Sink, No
  Massive Activations with Rectified Softmax"): ``relu(e^s - 1)`` normalized by
  ``sum |e^s - 1|`` over the visible keys, so weights need not sum to one and
  may all be 0 (no sink).
"""

from __future__ import annotations

import functools
from typing import Unpack

import jax
import jax.numpy as jnp

from attn.checks import as_arrays, fail
from attn.softmax.call import Call, CallArgs, check_call, takes_call_args
from attn.softmax.dense import logits

# softpick's epsilon in its denominator (the paper's default).
SOFTPICK_EPS = 1e-6


@takes_call_args
def sigmoid_attention(q, k, v, *, return_weights: bool = False, kv_length=None,
                      **call_args: Unpack[CallArgs]):  # fmt: skip
    """Sigmoid attention: ``out_t = sum_s sigmoid(s_ts - log n_t) v_s`` over the visible keys.

    ``n_t`` is the number of keys query t sees (at least 1). In a bidirectional
    row without padding that is the sequence length, the paper's n; in a
    causal row it is the prefix the query attends over, so a token's output
    does not depend on how many tokens follow it, and decoding from any cache
    (contiguous, ring buffer, paged) equals the forward pass: n never counts
    empty slots or padding.

    Args:
      q, k, v: ``[B,T,N,H]``, ``[B,S,K,H]``, ``[B,S,K,E]``.
      return_weights: also return the float32 weights ``[B,N,T,S]``.
      kv_length: ``[B,T]``, per query the keys its sequence holds up to it (the layer
        kinds' argument, ``models.functions``); unused, since ``n_t`` is counted per
        query from the visibility.
      **call_args: the call (``CallArgs``); learned sink logits are refused (they
        belong to softmax's denominator).

    Returns:
      ``out [B,T,N,E]`` in q's dtype (and the weights).
    """
    del kv_length  # n is counted per query from the visibility, which knows more
    call = _checked(q, k, v, call_args, "sigmoid_attention")
    return _run(_sigmoid, call, *as_arrays(q, k, v), return_weights)


@takes_call_args
def softpick_attention(q, k, v, *, return_weights: bool = False, kv_length=None,
                       **call_args: Unpack[CallArgs]):  # fmt: skip
    """Softpick: ``w_ts = relu(e^{s_ts} - 1) / (sum_s' |e^{s_ts'} - 1| + eps)`` over visible keys.

    Computed as ``(e^{s - m} - e^{-m})`` over the same with ``m = max(0, max_s s_ts)``
    (numerator and denominator times ``e^{-m}``), so no exponential overflows.
    Arguments and returns as ``sigmoid_attention``'s (``kv_length`` unused).
    """
    del kv_length
    call = _checked(q, k, v, call_args, "softpick_attention")
    return _run(_softpick, call, *as_arrays(q, k, v), return_weights)


def _checked(q, k, v, call_args, name) -> Call:
    q, k, v = as_arrays(q, k, v)
    call = check_call(q, k, v, **call_args)
    if call.sink_logits is not None:
        fail("sink_logits", f"None for {name} (they join softmax's denominator)", "an array")
    return call


def _sigmoid(s, ok):
    """Weights ``[B,K,G,T,S]`` from logits and visibility."""
    n = jnp.maximum(ok.sum(-1, keepdims=True), 1).astype(jnp.float32)
    return jnp.where(ok, jax.nn.sigmoid(s - jnp.log(n)), 0.0)


def _softpick(s, ok):
    s = jnp.where(ok, s, 0.0)  # exp() of a hidden logit never runs
    m = jax.lax.stop_gradient(jnp.maximum(s.max(-1, keepdims=True), 0.0))
    e = jnp.where(ok, jnp.exp(s - m) - jnp.exp(-m), 0.0)
    return jax.nn.relu(e) / (jnp.abs(e).sum(-1, keepdims=True) + SOFTPICK_EPS * jnp.exp(-m))


@functools.partial(jax.jit, static_argnums=(0, 5))
def _run(weigh, c: Call, q, k, v, return_weights: bool):
    B, T, S, N, *_, E = c.dims
    q, k, v = c.isolate(q, k, v)
    s, ok = logits(c, q, k)
    w = weigh(s, ok)
    out = jnp.einsum("BKGTS,BSKE->BTKGE", w, v.astype(jnp.float32)).reshape(B, T, N, E)
    out = out.astype(q.dtype)
    return (out, w.reshape(B, N, T, S)) if return_weights else out
