"""Multi-head latent attention (MLA, DeepSeek-V2): the attention math, without parameters.

Keys and values of all N heads come from one latent ``c_kv [B,S,R]`` per token:
head n's key is ``[c_kv W_uk[:, n], k_rope]`` and its value ``c_kv W_uv[:, n]``,
where ``k_rope [B,S,Hr]`` is a decoupled RoPE key shared by all heads (RoPE
cannot pass through ``W_uk``, so positions get their own channels). Queries
are ``[q_nope, q_rope]`` per head. Projections, norms and RoPE belong to the
caller (``models.LatentAttention``); this module computes attention from their
results, in two forms of the same function:

* ``"naive"``: up-project per-head keys ``[B,S,N,Hn+Hr]`` and values
  ``[B,S,N,E]``, then multi-head attention.
* ``"absorbed"``: ``q_nope . (c_kv W_uk) = (q_nope W_uk^T) . c_kv``, so ``W_uk``
  moves into the query and the scores are MQA over one shared key
  ``[c_kv, k_rope]`` of width ``R + Hr`` with value ``c_kv``; ``W_uv`` then maps
  the latent output ``[B,T,N,R]`` to ``[B,T,N,E]``. Nothing per head is ever
  formed over S, which is why decoding from a latent cache uses it.

Masks, positions, segment ids, soft-cap and learned sink logits are those of
``attn.attention``, which both forms call.
"""

from __future__ import annotations

import chex
import jax.numpy as jnp

from attn.checks import fail
from attn.dispatch import attention

LATENT_FORMS = ("naive", "absorbed")


def latent_attention(
    q_nope,
    q_rope,
    c_kv,
    k_rope,
    w_uk,
    w_uv,
    *,
    form: str = "naive",
    impl: str = "auto",
    mask=None,
    scale: float | None = None,
    **kwargs,
):
    """MLA scores ``scale * (q_nope . c_kv W_uk + q_rope . k_rope)``, values ``c_kv W_uv``.

    Args:
      q_nope: ``[B,T,N,Hn]`` position-free query part.
      q_rope: ``[B,T,N,Hr]`` query part for the shared RoPE key, already rotated.
      c_kv: ``[B,S,R]`` key/value latent (the latent cache).
      k_rope: ``[B,S,Hr]`` decoupled RoPE key shared by all heads, already rotated.
      w_uk: ``[R,N,Hn]`` key up-projection.
      w_uv: ``[R,N,E]`` value up-projection.
      form: ``"naive"`` (per-head keys and values, MHA) or ``"absorbed"``
        (``W_uk`` folded into the query, MQA in latent space, ``W_uv`` on the
        output); the same function up to float rounding.
      impl: the ``attn.attention`` implementation.
      mask: an ``attn.masks.Mask`` on absolute positions; None is bidirectional.
      scale: logit scale, default ``1/sqrt(Hn + Hr)`` in both forms (the head
        dim of the naive keys, as in DeepSeek-V2), not the ``1/sqrt(R + Hr)``
        the absorbed MQA call would default to.
      **kwargs: the other keyword arguments of ``attn.attention`` (softcap,
        sink_logits, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
        bias, return_weights, return_lse, block_q, block_k), with their meaning there.

    Returns:
      ``out [B,T,N,E]`` in the queries' dtype; then, if asked, the float32
      weights ``[B,N,T,S]`` and/or log-sum-exp ``[B,T,N]``, equal in both forms.
    """
    _check(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, form)
    if scale is None:
        scale = (q_nope.shape[3] + q_rope.shape[3]) ** -0.5
    call = dict(kwargs, impl=impl, mask=mask, scale=scale)
    if form == "naive":
        return _naive(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, **call)
    return _absorbed(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, **call)


def _naive(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, **call):
    """Per-head keys ``[B,S,N,Hn+Hr]`` and values ``[B,S,N,E]`` materialized; MHA."""
    B, S, _ = c_kv.shape
    N, Hr = q_rope.shape[2], q_rope.shape[3]
    k_nope = jnp.einsum("BSR,RNH->BSNH", c_kv, w_uk)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None], (B, S, N, Hr))], -1)
    v = jnp.einsum("BSR,RNE->BSNE", c_kv, w_uv)
    q = jnp.concatenate([q_nope, q_rope], -1)
    return attention(q, k, v, **call)


def _absorbed(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, **call):
    """Scores in latent space: MQA over ``[c_kv, k_rope]``, then ``W_uv`` on the output."""
    B, T, N, _ = q_nope.shape
    R = c_kv.shape[2]
    q_latent = jnp.einsum("BTNH,RNH->BTNR", q_nope, w_uk)  # W_uk absorbed into the query
    q = jnp.concatenate([q_latent, q_rope], -1)  # [B,T,N,R+Hr]
    k = jnp.concatenate([c_kv, k_rope], -1)[:, :, None]  # [B,S,1,R+Hr]: one kv head
    v = c_kv[:, :, None]  # [B,S,1,R]
    chex.assert_equal_shape_suffix([q, k], 1)  # the query scores the latent key directly
    result = attention(q, k, v, **call)
    out_latent, extras = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
    chex.assert_shape(out_latent, (B, T, N, R))
    out = jnp.einsum("BTNR,RNE->BTNE", out_latent, w_uv).astype(q.dtype)  # W_uv on the output
    return (out, *extras) if extras else out


def _check(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, form) -> None:
    """Raises ``ValueError`` naming the first argument whose shape disagrees with the others."""
    if form not in LATENT_FORMS:
        fail("form", f"one of {LATENT_FORMS}", repr(form))
    ranks = (("q_nope", q_nope, "[B,T,N,Hn]"), ("q_rope", q_rope, "[B,T,N,Hr]"))
    ranks += (("c_kv", c_kv, "[B,S,R]"), ("k_rope", k_rope, "[B,S,Hr]"))
    ranks += (("w_uk", w_uk, "[R,N,Hn]"), ("w_uv", w_uv, "[R,N,E]"))
    for name, x, layout in ranks:
        if getattr(x, "ndim", None) != len(layout.split(",")):
            fail(name, f"a rank-{len(layout.split(','))} array {layout}", _shape(x))
    B, T, N, Hn = q_nope.shape
    Hr = q_rope.shape[3]
    S, R = c_kv.shape[1], c_kv.shape[2]
    if q_rope.shape[:3] != (B, T, N):
        fail("q_rope", f"shape ({B}, {T}, {N}, Hr) like q_nope {q_nope.shape}", q_rope.shape)
    if c_kv.shape[0] != B:
        fail("c_kv", f"batch {B} like q_nope {q_nope.shape}", c_kv.shape)
    if k_rope.shape != (B, S, Hr):
        fail(
            "k_rope",
            f"shape ({B}, {S}, {Hr}): c_kv's batch and length, q_rope's head dim",
            k_rope.shape,
        )
    if w_uk.shape != (R, N, Hn):
        fail("w_uk", f"shape ({R}, {N}, {Hn}): c_kv's rank, q_nope's heads and dim", w_uk.shape)
    if w_uv.shape[:2] != (R, N):
        fail("w_uv", f"shape ({R}, {N}, E): c_kv's rank and q_nope's heads", w_uv.shape)


def _shape(x):
    return f"shape {x.shape}" if hasattr(x, "shape") else type(x).__name__
