"""Materialized softmax attention: the reference every other implementation is tested against.

It reads the call contract of ``attn.softmax.call`` (argument checks, the
visibility rule, logit shaping) like every other implementation, so all agree
on semantics by construction.
"""

from __future__ import annotations

import functools
from typing import Unpack

import chex
import jax
import jax.numpy as jnp

from attn import scores
from attn.checks import as_arrays, fail
from attn.softmax.call import MASKED, Call, CallArgs, check_call, takes_call_args, visible
from attn.softmax.jax_nn import EMPTY_ROWS, mean_where_empty
from attn.softmax.pairs import grouped


@takes_call_args
def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    implementation: str | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
    return_residual: bool = False,
    empty_rows: str = "zero",
    **call_args: Unpack[CallArgs],
):
    """Softmax attention with the ``[T,S]`` weights materialized.

    ``out[b,t,n] = sum_s w[b,n,t,s] v[b,s,n//G]`` with
    ``w = softmax_s(mod(cap(scale * q.k)) + bias)`` over the keys the mask, the
    positions and the segment ids make visible. A query with no visible key
    gets zeros (and zero gradients), unlike ``jax.nn.dot_product_attention``,
    which returns the mean of V (``empty_rows="mean"`` gives its). Statistics
    are float32 for every input dtype.

    Takes every argument of ``jax.nn.dot_product_attention`` with its meaning
    (``attn.softmax.jax_nn``), in its order (query, key, value, bias, mask), and
    rank-3 ``[T,N,H]`` inputs as it does.

    Args:
      query: ``[B,T,N,H]`` queries (or ``[T,N,H]``).
      key: ``[B,S,K,H]`` keys, ``N % K == 0`` (MHA, GQA, MQA).
      value: ``[B,S,K,E]`` values.
      bias, mask: the call's (``CallArgs``): a bias and a ``Mask`` or boolean array.
      implementation: ``jax.nn``'s: None or ``"xla"`` (this is XLA's materialized
        attention); ``"cudnn"`` is ``attn.attention(impl="cudnn")``'s.
      return_weights: also return the float32 weights ``[B,N,T,S]``.
      return_lse: also return the float32 log-sum-exp ``[B,T,N]`` of the visible
        logits (and sink); ``-inf`` for a row that sees nothing.
      return_residual: ``jax.nn``'s: also return the lse ``[B,T,N]`` in the keys' dtype,
        without a gradient (``-inf`` on rows that see nothing, where ``jax.nn``'s
        is a large negative number); ``return_lse`` gives a differentiable one.
      empty_rows: ``"zero"`` (ours) or ``"mean"`` (``jax.nn``'s): what a real
        query that sees no key outputs.
      **call_args: the call's keyword arguments, those of every softmax
        implementation (``attn.softmax.call.CallArgs``): ``mask`` (a
        ``Mask`` or a boolean array), ``bias``, ``scale``, ``softcap``,
        ``score_mod``, ``sink_logits``, positions, segment ids, and
        ``jax.nn``'s ``is_causal``, ``local_window_size``, ``query_seq_lengths``
        and ``key_value_seq_lengths``.

    Returns:
      ``out [B,T,N,E]`` in q's dtype, then the weights and/or the lse if asked.
    """

    if implementation not in (None, "xla"):
        fail("implementation", "None or 'xla' (use attn.attention(impl='cudnn') for cuDNN)",
             repr(implementation))  # fmt: skip

    def run(call, q, k, v, empty_rows, residual=False, **returns):
        return with_empty_rows(attend, call, q, k, v, empty_rows, **returns)

    call_args = dict(call_args, bias=bias, mask=mask)
    return batched(run, query, key, value, call_args, empty_rows, return_residual,
                   return_weights=return_weights, return_lse=return_lse)  # fmt: skip


def batched(attend_fn, q, k, v, call_args, empty_rows, residual, **returns):
    """``attend_fn(call, q, k, v, empty_rows, **returns)`` on rank-4 or rank-3 inputs.

    The entry points' shared front: the call checked once; rank-3 ``[T,N,H]``
    inputs (as ``jax.nn`` takes them) given a batch axis of 1 that every output
    loses again; ``jax.nn``'s residual (``residual``) asked for as the lse
    (``attend_fn`` gets ``residual=True`` with it) and returned without a
    gradient in the keys' dtype.
    """
    q, k, v = as_arrays(q, k, v)
    if empty_rows not in EMPTY_ROWS:
        fail("empty_rows", f"one of {EMPTY_ROWS}", repr(empty_rows))
    if residual and any(returns.values()):
        fail("return_residual", "False with return_weights or return_lse (return_lse is the "
             "same lse, differentiable)", True)  # fmt: skip
    if residual:
        returns = dict(returns, return_lse=True, residual=True)
    rank3 = getattr(q, "ndim", None) == 3
    if getattr(q, "ndim", None) not in (3, 4):  # the shared check would say rank 4 only
        fail("q", "a rank-4 array [B,T,N,H] (or rank 3 [T,N,H]: one sequence)",
             f"shape {getattr(q, 'shape', type(q).__name__)}")  # fmt: skip
    for name, x in (("k", k), ("v", v)):
        if rank3 and getattr(x, "ndim", None) != 3:
            fail(name, "rank 3 like q (rank-3 q, k, v are one sequence)", getattr(x, "shape", x))
    if rank3:
        q, k, v = (jnp.asarray(x)[None] for x in (q, k, v))
        call_args = {
            n: (jnp.asarray(x)[None] if n.endswith("segment_ids") and x is not None else x)
            for n, x in call_args.items()
        }
    result = attend_fn(check_call(q, k, v, **call_args), q, k, v, empty_rows, **returns)
    if residual:
        out, lse = result
        result = out, jax.lax.stop_gradient(lse).astype(k.dtype)
    if rank3:
        result = tuple(x[0] for x in result) if isinstance(result, tuple) else result[0]
    return result


def with_empty_rows(attend_fn, call, q, k, v, empty_rows, **returns):
    """``attend_fn(call, q, k, v, **returns)``, with ``jax.nn``'s mean of V on empty rows
    where ``empty_rows == "mean"`` (found from the lse, asked for if not already)."""
    if empty_rows == "zero":
        return attend_fn(call, q, k, v, **returns)
    result = attend_fn(call, q, k, v, **dict(returns, return_lse=True))
    out, *rest = result
    out = mean_where_empty(call, out, rest[-1], v)
    rest = rest if returns.get("return_lse") else rest[:-1]
    return (out, *rest) if rest else out


def attend(call: Call, q, k, v, *, return_weights=False, return_lse=False):
    """``dot_product_attention`` of a checked call (see there)."""
    return _dense(call, q, k, v, return_weights=bool(return_weights),
                  return_lse=bool(return_lse))  # fmt: skip


# Jitted at the boundary so eager callers compile once per shape instead of
# dispatching op by op; inside a caller's jit it is inlined.
@functools.partial(jax.jit, static_argnames=("return_weights", "return_lse"))
def _dense(c: Call, q, k, v, *, return_weights, return_lse):
    B, T, S, N, K, G, _, E = c.dims
    q, k, v = c.isolate(q, k, v)
    s, ok = logits(c, q, k)
    s = jnp.where(ok, s, MASKED)

    m = s.max(-1, keepdims=True)
    if c.sink_logits is not None:
        m = jnp.maximum(m, c.sink_logits[None, :, :, None, None])
    # The max only stabilizes exp(); softmax does not depend on it.
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.where(ok, jnp.exp(_at_most_zero(s - m)), 0.0)
    denom = p.sum(-1, keepdims=True)
    if c.sink_logits is not None:
        denom = denom + jnp.exp(_at_most_zero(c.sink_logits[None, :, :, None, None] - m))
    w = p / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("BKGTS,BSKE->BTKGE", w, v.astype(jnp.float32))
    out = out.reshape(B, T, N, E).astype(q.dtype)
    chex.assert_shape(w, (B, K, G, T, S))

    extras = []
    if return_weights:
        extras.append(w.reshape(B, N, T, S))
    if return_lse:
        lse = jnp.where(denom > 0, m + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
        extras.append(lse[..., 0].reshape(B, N, T).transpose(0, 2, 1))
    return (out, *extras) if extras else out


def logits(c: Call, q, k):
    """``(s, ok)``: a call's float32 logits ``[B,K,G,T,S]`` (scaled, through the modifier,
    plus the bias) and which are visible, boolean ``[B,1|K,1|G,T,S]`` (the mask on the
    positions, the segments, the mask array). The materialized front of every dense
    attention function (``attn.functions`` too)."""
    B, T, S, _, K, G, H, _ = c.dims
    qg = q.reshape(B, T, K, G, H)
    s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32)
    chex.assert_shape(s, (B, K, G, T, S))
    s = _modified(c, s * c.scale)
    if c.bias is not None:
        s = s + grouped(c.bias, K, G).astype(jnp.float32)
    ok = visible(c.mask, c.q_positions, c.kv_positions, c.q_segment_ids, c.kv_segment_ids)
    ok = ok[:, None, None]  # [B,1,1,T,S]
    if c.keep is not None:
        ok = ok & grouped(c.keep, K, G)
    return s, ok


def modifier_bias(c):
    """The call's additive modifier materialized: float32 ``[B,N,T,S]`` (for jax.nn's bias)."""
    B, T, S, N, K, G, *_ = c.dims
    return _modified(c, jnp.zeros((B, K, G, T, S), jnp.float32)).reshape(B, N, T, S)


def _modified(c: Call, s):
    """``s [B,K,G,T,S]`` through the call's modifier (soft-cap included)."""
    structure, leaves = scores.split(c.score)
    if structure is None:
        return s
    B, T, S, _, K, G, *_ = c.dims

    def view(role, x):
        if role == "head":  # [N, ...] -> [1,K,G,1,1, ...]
            return x.reshape(1, K, G, 1, 1, *x.shape[1:])
        length = T if role == "q" else S
        x = x.reshape(B, length, K, G).transpose(0, 2, 3, 1)  # [B,K,G,L]
        return x[..., None] if role == "q" else x[..., None, :]

    views = {role: [view(role, x) for x in xs] for role, xs in structure.by_role(leaves).items()}
    q_pos, k_pos = c.q_positions[:, None, None, :, None], c.kv_positions[:, None, None, None, :]
    return structure.apply(s, q_pos, k_pos, views)


def _at_most_zero(x):
    """``min(x, 0)`` in value, ``x`` in gradient.

    ``s - max(s) <= 0``, but XLA may compute the s in the max and the s in the
    difference in two roundings (fusing the scale into the dot in one of them):
    at logits of 1e9 and more they differ by ulps of thousands, and exp() of
    that overflows. The guard moves the value only: ``jnp.minimum`` (or a
    select) would halve or cut the gradient wherever rounding lands at or
    above 0, i.e. at the max itself.
    """
    return x - jax.lax.stop_gradient(jnp.maximum(x, 0.0))
