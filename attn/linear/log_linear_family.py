"""Log-linear attention and its delta rule as family records (``attn.linear.family``).

Their Fenwick levels span the sequence, so their transitions admit no exchange
(``kind="none"``, no sharded form); the records give what the rest of the
library reads of a family: the function and step, the forms, how a span runs,
the zero state, the float64 reference and the inputs the benchmarks draw.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from attn.linear import reference, sharded  # noqa: F401  (sharded: its six records first)
from attn.linear.family import FAMILIES, Family, normal, uniform, unit
from attn.linear.log_linear import (
    LOG_LINEAR_DELTA_FORMS,
    LOG_LINEAR_FORMS,
    init_log_linear_state,
    log_linear_attention,
    log_linear_attention_step,
    log_linear_delta_rule,
    log_linear_delta_rule_step,
)

__all__ = ["LogLinearTokens"]


class LogLinearTokens(NamedTuple):
    """Both families' tokens: log-linear attention's, or with ``beta`` its delta rule's
    (``log_a`` then its log gates)."""

    q: jax.Array  # [B,T,K,H]
    k: jax.Array  # [B,T,K,H]
    v: jax.Array  # [B,T,N,E]
    log_a: jax.Array  # [B,T,N]
    level_weights: jax.Array  # [B,T,N,L]
    beta: jax.Array | None = None  # [B,T,N]


class NoParams(NamedTuple):
    pass


def _args(t):
    """The function's positional arrays and keywords."""
    if t.beta is None:
        return (t.q, t.k, t.v, t.log_a, t.level_weights), {}
    return (t.q, t.k, t.v, t.beta, t.level_weights), dict(log_gates=t.log_a)


def _run(fn, t, _, ids, state, options):
    args, gates = _args(t)
    return fn(*args, **gates, initial_state=state, return_state=True,
              q_segment_ids=ids.q_seg, kv_segment_ids=ids.kv_seg, **options)  # fmt: skip


def _zeros(t, _, options):
    B, _, N, E = t.v.shape
    return init_log_linear_state(B, N, t.q.shape[-1], E, t.level_weights.shape[-1])


def _examples(rng, z, delta: bool):
    B, T, K, N, H, L = (z[n] for n in ("B", "T", "K", "N", "H", "levels"))
    draw = unit if delta else normal
    q, k, v = draw(rng, B, T, K, H), draw(rng, B, T, K, H), normal(rng, B, T, N, H)
    log_a, lam = -uniform(rng, 0.0, 0.2, B, T, N), uniform(rng, 0.1, 1.5, B, T, N, L)
    if delta:
        beta = uniform(rng, 0.05, 0.95, B, T, N)
        return {"gdn": (LogLinearTokens(q, k, v, log_a, lam, beta), NoParams(), {})}
    return {"mamba2": (LogLinearTokens(q, k, v, log_a, lam), NoParams(), {})}


def _reference(t, _, options):
    scale = options.get("scale") or t.q.shape[-1] ** -0.5
    if t.beta is None:
        return reference.log_linear_attention(*t[:5], scale=scale)
    return reference.log_linear_delta_rule(t.q, t.k, t.v, t.beta, t.level_weights, t.log_a,
                                           scale=scale)  # fmt: skip


for _name, _fn, _step, _forms, _delta in (
    ("log_linear_attention", log_linear_attention, log_linear_attention_step, LOG_LINEAR_FORMS,
     False),
    ("log_linear_delta_rule", log_linear_delta_rule, log_linear_delta_rule_step,
     LOG_LINEAR_DELTA_FORMS, True),
):  # fmt: skip
    FAMILIES.add(_name, Family(
        _name, _fn, _step, _forms, _run, _zeros, "none", None, None,
        reference=_reference, examples=lambda rng, z, d=_delta: _examples(rng, z, d),
        data=("q", "k", "v"),
    ))  # fmt: skip
