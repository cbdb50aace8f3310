"""The delta rule: DeltaNet, Gated DeltaNet and Kimi Delta Attention.

A linear-attention state that is written by error correction instead of by
addition (DeltaNet: Schlag et al. 2021, parallelized by Yang et al. 2024).
Per head, with a state ``S [H, E]`` (key dim x value dim), token t does

    S   <- diag(exp(g_t)) S                 decay (optional)
    u_t  = beta_t (v_t - S^T k_t)           what the state gets wrong about v_t
    S   <- S + k_t u_t^T                    the write
    o_t  = S^T (scale q_t)                  the read

The gate ``g_t`` is absent for DeltaNet, one log gate per head for Gated
DeltaNet (Yang, Kautz and Hatamizadeh, ICLR 2025) and one per key channel for
Kimi Delta Attention (KDA, the Kimi Linear report, 2025). With unit-norm keys
and ``beta`` in [0, 1] the write is a generalized Householder reflection
``S <- (I - beta k k^T) S + beta k v^T``, whose eigenvalues lie in [1 - beta, 1]:
the state stays bounded whatever T (beta up to 2 keeps it bounded too).

Forms (``DELTA_FORMS``), the same function tested to float32 precision against
a float64 loop, forward and gradients:

- ``"recurrent"``: a ``lax.scan`` over tokens; the backward pass recomputes
  pieces of about sqrt(T) steps, keeping O(sqrt(T)) states.
- ``"chunkwise"`` (the default): chunks of C tokens in the WY representation
  (the UT transform of Yang et al. 2024): the writes of a chunk are
  ``U = U' - W S`` for the state S entering it, with ``W`` and ``U'`` from one
  unit-lower-triangular solve per chunk, all chunks at once; a scan over chunks
  then carries S (see ``attn.linear.delta_forms``). Made of matmuls; the form
  to train with. Backward memory: autodiff of that scan keeps the state
  entering each chunk (T / C states) and per-token sized residuals (W, U',
  the writes u); the chunk-parallel part keeps ``[C, C]`` decay and product
  matrices per chunk (C floats per token, C H per token with per-channel
  gates). All of it is linear in T, and no per-token state ``[H, E]`` is ever
  stored (the bench measures it).

Grouped value heads (Gated DeltaNet as in Qwen3-Next): q and k have K heads,
v, beta, the gates, the state and the output have ``N = K G`` heads; value
heads ``k G .. k G + G - 1`` read and write with query/key head k, each with
its own state. K == N is the usual one-to-one case. (The roles are GQA's
reversed: there queries outnumber the shared keys and values; here values,
with their states, outnumber the shared queries and keys.)

Decays in log space, as ``attn.linear``: every decay is ``exp`` of a range sum
of log gates (<= 0), so a gate of exactly 0 (``log_gates = -inf``) erases the
state without NaN, forward or backward.

Packing and padding are segment ids as in ``attn.linear_attention`` (causal
only; ``q_segment_ids`` and ``kv_segment_ids`` are the same ids): id 0 is
padding, which writes nothing (beta 0), does not decay the state and outputs
0, whatever its q, k, v and beta hold (NaN and Inf are selected away where
they enter); a segment is a run of equal non-zero ids and the state is erased where the
next one starts (a gate of 0 on all channels), so packed segments compute what
each computes alone. The initial state is the first segment's past, the final
state the last segment's.

The state is float32 whatever the input dtype; the output has the inputs' dtype.
"""

from __future__ import annotations

from typing import Unpack

import jax.numpy as jnp
import numpy as np

from attn import checks
from attn.checks import as_arrays, fail
from attn.linear import delta_forms, front, segments
from attn.linear.front import RecurrenceArgs
from attn.masks import drop_padding

__all__ = ["DELTA_FORMS", "delta_rule", "delta_rule_step", "init_delta_state"]

DELTA_FORMS = ("recurrent", "chunkwise")


def init_delta_state(batch: int, num_heads: int, head_dim: int, value_dim: int):
    """Zero state ``[B,N,H,E]`` float32 (N value heads)."""
    return jnp.zeros((batch, num_heads, head_dim, value_dim), jnp.float32)


# ----------------------------------------------------------------------------
# Validation


def _dims(q, k, v, beta, step: bool):
    """Checks q, k ``[B,(T,)K,H]``, v ``[B,(T,)N,E]``, beta ``[B,(T,)N]``.

    Returns B, T, K, N, H, E (T = 1 for a step).
    """
    return front.check_heads(q, k, v, step, {"beta": beta})


def check_values(beta, log_gates, lead: tuple, N: int, H: int, ids=None) -> None:
    """The per-token values of the delta family, at real tokens (``ids``, the kv segment
    ids, or None): finite ``beta``; ``log_gates`` per head ``[*lead, N]`` or per key channel
    ``[*lead, N, H]``, values <= 0 (``-inf`` erases the state). Its sharded forms check here too.
    """
    checks.check_values(beta, np.isfinite, "beta", "finite values (a write strength)", ids)
    if log_gates is None:
        return
    shape = np.shape(log_gates)
    if shape not in ((*lead, N), (*lead, N, H)):
        want = f"shape {(*lead, N)} (per head) or {(*lead, N, H)} (per key channel)"
        fail("log_gates", want, shape)
    ok = lambda g: g <= 0  # noqa: E731  -inf (a gate of 0) erases the state; NaN is refused
    checks.check_values(log_gates, ok, "log_gates", "values <= 0 (logs of gates in [0, 1])", ids)


def grouped_state(state, B: int, K: int, G: int, H: int, E: int):
    """An initial state ``[B,N,H,E]`` (checked) as float32 ``[B,K,G,H,E]``, or None."""
    if state is None:
        return None
    check_state(state, "initial_state", B, K * G, H, E)
    return state.astype(jnp.float32).reshape(B, K, G, H, E)


def check_state(state, name: str, B: int, N: int, H: int, E: int):
    """Refuses a state unless it is a float ``[B,N,H,E]`` (the DPLR delta rule's too)."""
    front.check_state(state, name, (B, N, H, E), "[B,N,H,E]")


# ----------------------------------------------------------------------------
# Public functions


@front.takes_recurrence_args
def delta_rule(
    q,
    k,
    v,
    beta,
    *,
    log_gates=None,
    **front_args: Unpack[RecurrenceArgs],
):
    """The (gated) delta rule over a causal sequence, in one of ``DELTA_FORMS``.

    Args:
        q: queries ``[B,T,K,H]``; for the bounded state the papers use, L2-normalized.
        k: keys ``[B,T,K,H]``, likewise.
        v: values ``[B,T,N,E]``, N a multiple of K (grouped value heads, see
            the module docstring).
        beta: write strengths ``[B,T,N]``, usually ``sigmoid`` of a projection.
        log_gates: None (DeltaNet), ``[B,T,N]`` (Gated DeltaNet: one log decay
            per head and token) or ``[B,T,N,H]`` (KDA: one per key channel);
            values <= 0, ``-inf`` erases the state. Checked for sign only
            when concrete (not under jit).
        form, chunk_size, scale, initial_state, return_state, q_segment_ids,
            kv_segment_ids: ``attn.linear.front.RecurrenceArgs`` (forms ``DELTA_FORMS``;
            states ``[B,N,H,E]``). Per-channel gates cost ``C H`` floats per token and
            head in the chunkwise form.

    Returns:
        out ``[B,T,N,E]`` in the inputs' dtype, or ``(out, state)`` with
        ``return_state``.
    """
    q, k, v, beta, log_gates = as_arrays(q, k, v, beta, log_gates)
    B, T, K, N, H, E = _dims(q, k, v, beta, step=False)
    G = N // K
    args = front.check_front(DELTA_FORMS, batch=B, length=T, head_dim=H, **front_args)
    initial_state = args.initial_state
    q_seg, kv_seg = args.q_seg, args.kv_seg
    check_values(beta, log_gates, (B, T), N, H, kv_seg)
    # Padding holds anything, NaN included: selected away where it enters.
    q, k, v, beta = drop_padding(q, q_seg), *(drop_padding(x, kv_seg) for x in (k, v, beta))
    initial_state = grouped_state(initial_state, B, K, G, H, E)
    dtype = front.out_dtype(q, k, v)

    q32 = q.astype(jnp.float32) * args.scale
    k32 = k.astype(jnp.float32)
    v32 = v.astype(jnp.float32).reshape(B, T, K, G, E)
    beta32 = beta.astype(jnp.float32).reshape(B, T, K, G)
    log_g = None if log_gates is None else log_gates.astype(jnp.float32)
    q_read = None
    if q_seg is not None:
        log_g, q_read = _apply_segments(q_seg, kv_seg, log_g, N)
    if log_g is not None:
        log_g = log_g.reshape(B, T, K, G, *log_g.shape[3:])

    if args.form == "recurrent":
        out, state = delta_forms.recurrent(q32, k32, v32, beta32, log_g, initial_state)
    else:
        chunk = args.chunk_size
        out, state = delta_forms.chunkwise(q32, k32, v32, beta32, log_g, initial_state, chunk)
    out = out.reshape(B, T, N, E)
    if q_read is not None:
        out = jnp.where(q_read[:, :, None, None], out, 0.0)
    return front.returned(out.astype(dtype), state.reshape(B, N, H, E), args.return_state)


def _apply_segments(q_seg, kv_seg, log_g, N: int):
    """Segment ids as gates and reads (``attn.linear.segments.causal``).

    Padding keys (whose k, v and beta ``drop_padding`` has zeroed: they write
    nothing) do not decay the state (gate 0 in log space); a segment's first
    key erases the state (log gate ``-inf`` on every channel); a query reads
    only the segment the state holds. Returns ``(log_g [B,T,N(,H)], q_read [B,T])``.
    """
    rules = segments.causal(q_seg, kv_seg, None, 1)
    real, starts = rules.key_real, jnp.isneginf(rules.log_a[..., 0])  # [B,T]
    B, T = real.shape
    if log_g is None:
        log_g = jnp.zeros((B, T, N), jnp.float32)
    extra = (None,) * (log_g.ndim - 2)
    log_g = jnp.where(real[(..., *extra)], log_g, 0.0)
    log_g = jnp.where(starts[(..., *extra)], -jnp.inf, log_g)
    return log_g, rules.q_read


def delta_rule_step(q, k, v, beta, state, *, log_gates=None, scale: float | None = None):
    """Advances the delta rule by one token (decoding); iterating it is ``delta_rule``.

    Args:
        q, k: ``[B,K,H]``; v: ``[B,N,E]``; beta: ``[B,N]``.
        state: ``[B,N,H,E]`` (``init_delta_state`` or a ``delta_rule`` final state).
        log_gates: None, ``[B,N]`` or ``[B,N,H]``, as in ``delta_rule``.
        scale: as in ``delta_rule``.

    Returns:
        ``(out [B,N,E] in the inputs' dtype, state [B,N,H,E] float32)``.
    """
    q, k, v, beta, log_gates, state = as_arrays(q, k, v, beta, log_gates, state)
    B, _, K, N, H, E = _dims(q, k, v, beta, step=True)
    G = N // K
    check_values(beta, log_gates, (B,), N, H)
    check_state(state, "state", B, N, H, E)
    log_g = None if log_gates is None else log_gates.astype(jnp.float32)
    new, out = delta_forms.step(
        state.astype(jnp.float32).reshape(B, K, G, H, E),
        q.astype(jnp.float32) * checks.query_scale(scale, H),
        k.astype(jnp.float32),
        v.astype(jnp.float32).reshape(B, K, G, E),
        beta.astype(jnp.float32).reshape(B, K, G),
        None if log_g is None else log_g.reshape(B, K, G, *log_g.shape[2:]),
    )
    out_dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
    return out.reshape(B, N, E).astype(out_dtype), new.reshape(B, N, H, E)
