"""DeltaProduct: several delta-rule steps per token (Siems et al., 2025).

Per token t and head, with ``n`` keys ``k_{t,1..n}``, values and betas, the
state takes ``n`` generalized Householder steps before it is read:

    S <- diag(exp(g_t)) S                                   once per token
    S <- (I - beta_{t,j} k_{t,j} k_{t,j}^T) S + beta_{t,j} k_{t,j} v_{t,j}^T    j = 1..n
    o_t = S^T (scale q_t)

so the state transition of one token is a product of ``n`` Householders, whose
eigenvalues (with beta in (0, 2), ``attn.delta_rule``'s negative-eigenvalue
range) need not be real or positive: what the paper shows lets a linear RNN
track non-commutative state, such as permutations. ``n = 1`` is the (gated)
delta rule.

It is computed by ``attn.delta_rule`` (either form) over the interleaved
sequence of ``T n`` steps: the gate at each token's first step (log gate 0 at
the others), the query at its last (zero at the others, whose outputs are
not read), segment ids repeated, then every ``n``-th output.
"""

from __future__ import annotations

from typing import Unpack

import jax.numpy as jnp
import numpy as np

from attn.checks import as_arrays, fail
from attn.linear import front
from attn.linear.delta import delta_rule, delta_rule_step
from attn.linear.front import SEGMENT_IDS, RecurrenceArgs

__all__ = ["delta_product", "delta_product_step"]


def _steps(q, k, v, beta, step: bool) -> int:
    """Checks k ``[B,(T,)n,K,H]``, v ``[B,(T,)n,N,E]``, beta ``[B,(T,)n,N]``; returns n."""
    t = "" if step else "T,"
    rank = q.ndim + 1
    if getattr(k, "ndim", None) != rank:
        fail("k", f"a rank-{rank} array [B,{t}n,K,H] (n steps per token)", np.shape(k))
    lead, n = tuple(q.shape[:-2]), k.shape[-3]
    if tuple(k.shape) != (*lead, n, *q.shape[-2:]):
        fail("k", f"shape {(*lead, 'n', *q.shape[-2:])} ([B,{t}n,K,H])", tuple(k.shape))
    if getattr(v, "ndim", None) != rank or tuple(v.shape[:-2]) != (*lead, n):
        fail("v", f"shape {(*lead, n, 'N', 'E')} ([B,{t}n,N,E])", np.shape(v))
    if np.shape(beta) != (*lead, n, v.shape[-2]):
        fail("beta", f"shape {(*lead, n, v.shape[-2])} ([B,{t}n,N])", np.shape(beta))
    if n < 1:
        fail("k", "at least one step per token (n >= 1)", f"n = {n}")
    return n


def _first(x, n: int, axis: int):
    """``x`` placed at step 0 of ``n`` along a new ``axis``, zeros at the others."""
    x = jnp.expand_dims(x, axis)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n - 1)
    return jnp.pad(x, pad)


@front.takes_recurrence_args
def delta_product(
    q,
    k,
    v,
    beta,
    *,
    log_gates=None,
    **front_args: Unpack[RecurrenceArgs],
):
    """The (gated) DeltaProduct over a causal sequence.

    Args:
        q: queries ``[B,T,K,H]``.
        k: keys ``[B,T,n,K,H]``, n Householder steps per token (unit norm).
        v: values ``[B,T,n,N,E]``, N a multiple of K.
        beta: ``[B,T,n,N]``, in [0, 1] or, for negative eigenvalues, [0, 2].
        log_gates: None, ``[B,T,N]`` or ``[B,T,N,H]``, once per token (<= 0).
        form, chunk_size, scale, initial_state, return_state, q_segment_ids,
            kv_segment_ids: as in ``attn.delta_rule`` (the chunk counts steps,
            n per token).

    Returns:
        out ``[B,T,N,E]``, or ``(out, state [B,N,H,E])`` with ``return_state``.
    """
    q, k, v, beta, log_gates = as_arrays(q, k, v, beta, log_gates)
    if getattr(q, "ndim", None) != 4:
        fail("q", "a rank-4 array [B,T,K,H]", np.shape(q))
    n = _steps(q, k, v, beta, step=False)
    B, T = q.shape[:2]

    def steps(x):  # [B,T,n,...] -> [B,T*n,...]
        return x.reshape(B, T * n, *x.shape[3:])

    def repeat(ids):
        return None if ids is None else jnp.repeat(jnp.asarray(ids), n, axis=1)

    q_steps = jnp.flip(_first(q, n, 2), axis=2)  # q at each token's last step
    gates = None if log_gates is None else steps(_first(log_gates, n, 2))
    result = delta_rule(
        steps(q_steps),
        steps(k),
        steps(v),
        steps(beta),
        log_gates=gates,
        **{**front_args, **{n: repeat(front_args.get(n)) for n in SEGMENT_IDS}},
    )
    return_state = front_args.get("return_state", False)
    out, state = result if return_state else (result, None)
    out = out.reshape(B, T, n, *out.shape[2:])[:, :, -1]
    return (out, state) if return_state else out


def delta_product_step(q, k, v, beta, state, *, log_gates=None, scale: float | None = None):
    """Advances DeltaProduct by one token (decoding); iterating it is ``delta_product``.

    Args:
        q: ``[B,K,H]``; k: ``[B,n,K,H]``; v: ``[B,n,N,E]``; beta: ``[B,n,N]``.
        state: ``[B,N,H,E]``.
        log_gates: None, ``[B,N]`` or ``[B,N,H]``, applied before the first step.
        scale: as in ``attn.delta_rule``.

    Returns:
        ``(out [B,N,E], state [B,N,H,E] float32)``.
    """
    q, k, v, beta, log_gates, state = as_arrays(q, k, v, beta, log_gates, state)
    if getattr(q, "ndim", None) != 3:
        fail("q", "a rank-3 array [B,K,H]", np.shape(q))
    n = _steps(q, k, v, beta, step=True)
    out = None
    for j in range(n):
        out, state = delta_rule_step(
            q if j == n - 1 else jnp.zeros_like(q),
            k[:, j],
            v[:, j],
            beta[:, j],
            state,
            log_gates=log_gates if j == 0 else None,
            scale=scale,
        )
    return out, state
