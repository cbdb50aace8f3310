"""Our attention where other libraries call theirs.

``flax_attention_fn`` is an ``attention_fn`` for Flax's attention layers
(``flax.nnx.MultiHeadAttention(attention_fn=...)``): any ``impl`` of
``attn.attention`` behind Flax's projections. (``attn.attention`` itself takes
``jax.nn.dot_product_attention``'s arguments, so it replaces that call as it is.)
Nothing here imports Flax.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from attn.checks import fail
from attn.dispatch import attention


def flax_attention_fn(impl: str = "auto", **options):
    """An ``attention_fn`` for Flax attention layers that runs ``attn.attention(impl=impl)``.

    Flax's function masks with its most negative number, so a row that sees
    nothing outputs the mean of V; this one does too (``empty_rows="mean"``),
    so a layer's outputs equal Flax's default. Attention dropout and sown
    weights (``module``) are not computed by a fused kernel: a
    ``ValueError`` asks for ``deterministic=True`` or Flax's own function.

    Args:
      impl: an implementation of ``attn.attention`` (``IMPLS``).
      **options: more keyword arguments of ``attn.attention`` (``block_q``, ``score_mod``, ...).

    Returns:
      ``fn(query, key, value, bias=None, mask=None, **flax_keywords)`` over inputs
      ``[batch..., T, N, H]`` (any number of batch axes, flattened for the call)
      and ``bias``/``mask`` broadcastable to ``[batch..., N, T, S]``.
    """

    def fn(query, key, value, bias=None, mask=None, *, dropout_rate=0.0, deterministic=True,
           dtype=None, module=None, is_causal=False, **_flax):  # fmt: skip
        if dropout_rate and not deterministic:
            fail("dropout_rate", "0.0 or deterministic=True (no attention dropout)", dropout_rate)
        if module is not None:
            fail("module", "None (no weights to sow: use Flax's own)", type(module).__name__)
        if dtype is not None:
            query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
        lead = query.shape[:-3]
        q, k, v = (x.reshape(math.prod(lead), *x.shape[-3:]) for x in (query, key, value))
        bias, mask = _flat_pairs(bias, lead), _flat_pairs(mask, lead)
        mask = None if mask is None else mask.astype(bool)  # Flax's: nonzero is visible
        out = attention(q, k, v, impl=impl, bias=bias, mask=mask, is_causal=is_causal,
                        empty_rows="mean", **options)  # fmt: skip
        return out.reshape(*lead, *out.shape[1:])

    return fn


def _flat_pairs(x, lead: tuple):
    """``[batch..., N, T, S]`` (broadcastable) -> ``[prod(batch), N|1, T|1, S|1]``."""
    if x is None:
        return None
    x = jnp.asarray(x)
    x = x.reshape((1,) * (len(lead) + 3 - x.ndim) + x.shape)
    x = jnp.broadcast_to(x, (*lead, *x.shape[-3:]))
    return x.reshape(math.prod(lead), *x.shape[-3:])
