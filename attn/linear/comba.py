"""Comba: the delta rule with closed-loop control, computed as the DPLR rule it is.

Comba (Hu et al. 2025, "Comba: Improving Bilinear RNNs with Closed-loop
Control") corrects the state with a feedback key ``p`` read from the state
before it decays. Per value head, with a state ``S [H, E]`` (key dim x value
dim, as ``attn.delta_rule``), token t does

    u_t = v_t - S^T p_t                        the error, read with p from S_{t-1}
    S   <- alpha_t S + beta_t k_t u_t^T         decay, then the write
    o_t  = S^T (scale q_t)

(fla's ``fused_recurrent_comba``: the error is read before the decay, unlike
Gated DeltaNet's ``alpha (I - beta k k^T)``). So the transition is
``alpha_t I - beta_t k_t p_t^T``, diagonal plus rank one: the DPLR rule
(``attn.dplr_delta_rule``) with ``log_w = log alpha`` on every key channel,
``a = -p``, ``b = beta k`` and values ``beta v``. Comba's forms, decoding step,
packing, gates of 0 and sharded form are the DPLR rule's, on those arrays; the
float64 reference (``attn.linear.reference.comba``) is the three lines above.

Arrays: q, k, p ``[B,T,K,H]``; v ``[B,T,N,E]``; beta ``[B,T,N]`` (any finite
value; the paper's is in (0, 1)); log_gates ``[B,T,N]`` (or per key channel
``[B,T,N,H]``), ``log alpha <= 0``, or None (alpha = 1). Value heads
``k G .. k G + G - 1`` read and write with query/key head k. Segment ids,
states, dtypes: as ``attn.dplr_delta_rule``. With the sequence sharded over a
mesh axis: ``attn.sharded_comba``.
"""

from __future__ import annotations

from typing import NamedTuple, Unpack

import jax
import jax.numpy as jnp
import numpy as np

from attn import checks
from attn.checks import as_arrays, fail
from attn.linear import delta, front, reference
from attn.linear.dplr import DPLR_FORMS, dplr_delta_rule, dplr_delta_rule_step
from attn.linear.family import FAMILIES, Family, Ids, normal, run_sharded, uniform, unit, widen
from attn.linear.front import RecurrenceArgs

__all__ = ["COMBA_FORMS", "comba", "comba_step", "sharded_comba"]

COMBA_FORMS = DPLR_FORMS


def _as_dplr(q, k, v, p, beta, log_gates, ids=None):
    """Comba's arrays as the DPLR rule's ``(q, k, v, a, b, log_w)`` (float32 where derived),
    after checking them by Comba's names (``ids``: the kv segment ids, for the values)."""
    step = getattr(q, "ndim", 0) == 3
    t = "" if step else "T,"
    B, T, K, N, H, _ = front.check_heads(q, k, v, step, {"beta": beta})
    lead = (B,) if step else (B, T)
    checks.float_array(p, "p", q.ndim, f"[B,{t}K,H] like k")
    checks.float_array(beta, "beta", q.ndim - 1, f"[B,{t}N]")
    if p.shape != q.shape:
        fail("p", f"the shape of q and k {tuple(q.shape)}", f"shape {tuple(p.shape)}")
    delta.check_values(beta, log_gates, tuple(lead), N, H, ids)
    beta = beta.astype(jnp.float32)
    if log_gates is None:
        log_w = jnp.zeros((*lead, N, H), jnp.float32)
    else:
        log_gates = log_gates.astype(jnp.float32)
        per_head = log_gates.ndim == beta.ndim
        log_w = jnp.broadcast_to(log_gates[..., None] if per_head else log_gates, (*lead, N, H))
    b = jnp.repeat(k.astype(jnp.float32), N // K, axis=-2) * beta[..., None]
    return q, k, v.astype(jnp.float32) * beta[..., None], -p, b, log_w


def _dtype(q, k, v):
    return jnp.result_type(q.dtype, k.dtype, v.dtype)


@front.takes_recurrence_args
def comba(q, k, v, p, beta, *, log_gates=None, **front_args: Unpack[RecurrenceArgs]):
    """Comba over a causal sequence, in one of ``COMBA_FORMS`` (the DPLR rule's).

    Args:
      q, k, p: ``[B,T,K,H]`` (the paper L2-normalizes them; any values work).
      v: ``[B,T,N,E]``, N a multiple of K.
      beta: ``[B,T,N]``; log_gates: ``[B,T,N]``, ``[B,T,N,H]`` or None.
      form, chunk_size, scale, initial_state, return_state, q_segment_ids,
        kv_segment_ids: as ``attn.dplr_delta_rule``'s.

    Returns:
      ``out [B,T,N,E]`` in the inputs' dtype, or ``(out, state [B,N,H,E] float32)``.
    """
    q, k, v, p, beta, log_gates = as_arrays(q, k, v, p, beta, log_gates)
    ids = front_args.get("kv_segment_ids", front_args.get("q_segment_ids"))
    out = dplr_delta_rule(*_as_dplr(q, k, v, p, beta, log_gates, ids), **front_args)
    if front_args.get("return_state", False):
        return out[0].astype(_dtype(q, k, v)), out[1]
    return out.astype(_dtype(q, k, v))


def comba_step(q, k, v, p, beta, state, *, log_gates=None, scale: float | None = None):
    """Advances Comba by one token (decoding); iterating it is ``comba``.

    Args:
      q, k, p: ``[B,K,H]``; v: ``[B,N,E]``; beta: ``[B,N]``; log_gates: ``[B,N]``,
        ``[B,N,H]`` or None; state: ``[B,N,H,E]``; scale: as in ``comba``.

    Returns:
      ``(out [B,N,E] in the inputs' dtype, state [B,N,H,E] float32)``.
    """
    q, k, v, p, beta, log_gates = as_arrays(q, k, v, p, beta, log_gates)
    out, state = dplr_delta_rule_step(*_as_dplr(q, k, v, p, beta, log_gates), state, scale=scale)
    return out.astype(_dtype(q, k, v)), state


# ----------------------------------------------------------------------------
# The family record: the sharded driver runs ``comba`` itself on each span


class CombaTokens(NamedTuple):
    q: jax.Array  # [B,T,K,H]
    k: jax.Array  # [B,T,K,H]
    v: jax.Array  # [B,T,N,E]
    p: jax.Array  # [B,T,K,H]
    beta: jax.Array  # [B,T,N]
    log_gates: jax.Array | None = None  # [B,T,N] or [B,T,N,H]


class NoParams(NamedTuple):
    pass


def _run(fn, t, _, ids, state, options):
    return fn(*t[:5], log_gates=t.log_gates, initial_state=state, return_state=True,
              q_segment_ids=ids.q_seg, kv_segment_ids=ids.kv_seg, **options)  # fmt: skip


def _zeros(t, _, options):
    B, _, N, E = t.v.shape
    return jnp.zeros((B, N, t.q.shape[-1], E), jnp.float32)


def _values(t, _, ids):
    delta.check_values(t.beta, t.log_gates, t.q.shape[:2], t.v.shape[-2], t.q.shape[-1],
                       ids.kv_seg)  # fmt: skip


def sharded_comba(
    q, k, v, p, beta, *, log_gates=None, q_segment_ids=None, kv_segment_ids=None,
    initial_state=None, return_state: bool = False, axis_name: str, **options,
):  # fmt: skip
    """``comba`` with T sharded over the mesh axis ``axis_name`` (its transition, the DPLR
    rule's, read as the delta rule's: ``attn.linear.family``).

    Args:
      q, k, v, p, beta, log_gates, q_segment_ids, kv_segment_ids, initial_state,
        return_state: as in ``comba``, whole arrays.
      axis_name, and in ``**options`` mesh, batch_axes, exchange:
        ``attn.linear.family.MeshArgs``; besides those ``form``, ``chunk_size``, ``scale``.

    Returns:
      out ``[B,T,N,E]``, or ``(out, state [B,N,H,E])`` with ``return_state``.
    """
    tokens, ids = CombaTokens(q, k, v, p, beta, log_gates), Ids(q_segment_ids, kv_segment_ids)
    return run_sharded(FAMILIES["comba"], tokens, NoParams(), ids, initial_state, return_state,
                       axis_name, options)  # fmt: skip


def _examples(rng, z):
    B, T, K, N, H = (z[n] for n in "BTKNH")
    q, k = unit(rng, B, T, K, H), unit(rng, B, T, K, H)
    p = unit(rng, B, T, K, H) * 0.3 + k
    p = p / np.linalg.norm(p, axis=-1, keepdims=True)
    tokens = CombaTokens(q, k, normal(rng, B, T, N, H), p, uniform(rng, 0.05, 0.95, B, T, N),
                         -uniform(rng, 0.0, 0.2, B, T, N))  # fmt: skip
    return {"gated": (tokens, NoParams(), {})}


def _reference(t, _, options):
    return reference.comba(*t, scale=t.q.shape[-1] ** -0.5)


FAMILIES.add("comba", Family(
    "comba", comba, comba_step, COMBA_FORMS, _run, _zeros, "matrix",
    lambda t, p, extra: (t._replace(v=widen(t.v, extra)), p), _values, sharded=sharded_comba,
    reference=_reference, examples=_examples, data=("q", "k", "v", "p"),
))  # fmt: skip
