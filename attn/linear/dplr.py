"""The DPLR delta rule: a diagonal-plus-low-rank state transition, as RWKV-7 uses.

The generalized delta rule of RWKV-7 "Goose" (Peng et al. 2025) in the DPLR
(diagonal plus low rank) form of fla's ``generalized_delta_rule``. Per value
head, with a state ``S [H, E]`` (key dim x value dim, as ``attn.linear.delta``),
token t does

    S   <- (diag(w_t) + b_t a_t^T) S + k_t v_t^T    the transition, then the write
    o_t  = S^T (scale q_t)                          the read

that is ``S <- diag(w_t) S + b_t (a_t^T S) + k_t v_t^T``: ``a_t`` reads the
state (``a_t^T S``, E values) and ``b_t`` writes what it read back along
itself; ``w_t = exp(log_w_t)`` is a decay per key channel in [0, 1]. This is
fla's ``S_t = S_{t-1} (diag(w_t) + a_t b_t^T) + v_t k_t^T`` with its state
``[E, H]`` transposed.

RWKV-7 (the paper's state is ``[E, H]`` too, ``S_t = S_{t-1} (diag(w_t) -
kappa_t^T (a_t * kappa_t)) + v_t^T k_t``) is ``a = -kappa`` and
``b = kappa * a_in``: the normalized removal key ``kappa`` reads what the state
holds along it, and that is removed in proportion to the in-context learning
rate ``a_in`` in [0, 1] per channel; q is its receptance r and ``scale=1.0``
(RWKV-7 does not scale r). ``w_t = exp(-e^{-1/2} sigmoid(.))`` there, so
``log_w`` lies in (-0.61, 0). The delta rule is the case ``a = -beta (w * k)``,
``b = k``, values ``beta v`` (``S <- (I - beta k k^T) diag(w) S + beta k v^T``),
tested.

Forms (``DPLR_FORMS``), the same function tested to float32 precision against
a float64 loop, forward and gradients:

- ``"recurrent"``: a ``lax.scan`` over tokens; the backward pass recomputes
  pieces of about sqrt(T) steps, keeping O(sqrt(T)) states.
- ``"chunkwise"`` (the default): chunks of C tokens in a WY form: the reads
  ``a_t^T S_{t-1}`` of a chunk are ``R' + W S`` for the state S entering it,
  from one unit-lower-triangular inverse per chunk, all chunks at once, so a
  chunk is the affine map ``S <- M S + S'`` and a scan over chunks carries S
  (see ``attn.linear.dplr_forms``). Made of matmuls; the form to train with.
  Decays are never ``exp`` of a positive sum: the chunk's per-channel
  decayed products are halved recursively, each off-diagonal block one
  matmul of factors at most 1 (split at its first query), so nothing
  overflows whatever the decays (``log_w = -inf`` included). Backward memory
  is linear in T: one state per chunk, ``[C, C]`` products, ``4 H`` floats per
  token and halving level; never a state per token nor a ``[C, C, H]`` array.

Grouped value heads (as the delta rule's): q and k have K heads; v, log_w,
the state and the output have ``N = K G`` heads, and value heads
``k G .. k G + G - 1`` read and write with query/key head k, each with its own
state. ``a`` and ``b`` either have K heads (shared by the group, as RWKV-7's
kappa would be) or N (one per value head: the transition is the state's own,
and the delta rule's ``a = -beta k`` has a beta per value head). RWKV-7 itself
has K == N.

Decays in log space: ``log_w <= 0``, checked where concrete; NaN is refused;
``-inf`` (w = 0) zeroes that channel's diagonal, so ``-inf`` on every channel
leaves the rank-one part ``b a^T`` alone as the transition.

Packing and padding are segment ids as in ``attn.delta_rule`` (causal only;
``q_segment_ids`` and ``kv_segment_ids`` are the same ids): id 0 is padding,
which writes nothing, does not decay the state (its transition is the
identity: ``a``, ``b``, k and v zeroed, ``log_w`` 0) and outputs 0, whatever
its inputs hold (NaN and Inf are selected away where they enter); a segment is
a run of equal non-zero ids, and where the next one starts the state is erased
(``log_w = -inf`` on every channel and ``a = 0`` there, so the rank-one part
reads nothing of the previous segment), so packed segments compute what each
computes alone. The initial state is the first segment's past, the final
state the last segment's.

The state is float32 whatever the input dtype; the output has the inputs' dtype.
With the sequence sharded over a mesh axis: ``attn.sharded_dplr_delta_rule``.
"""

from __future__ import annotations

from typing import Unpack

import jax.numpy as jnp
import numpy as np

from attn import checks
from attn.checks import as_arrays, fail
from attn.linear import dplr_forms, front, segments
from attn.linear.delta import check_state, grouped_state
from attn.linear.front import RecurrenceArgs
from attn.masks import drop_padding

__all__ = ["DPLR_FORMS", "dplr_delta_rule", "dplr_delta_rule_step"]

DPLR_FORMS = ("recurrent", "chunkwise")


# ----------------------------------------------------------------------------
# Validation


def _dims(q, k, v, a, b, log_w, step: bool):
    """Checks q, k ``[B,(T,)K,H]``, v ``[B,(T,)N,E]``, a, b ``[B,(T,)K|N,H]``,
    log_w ``[B,(T,)N,H]``. Returns B, T, K, N, H, E (T = 1 for a step)."""
    B, T, K, N, H, E = front.check_heads(q, k, v, step)
    t = "" if step else "T,"
    lead = q.shape[:-2]
    for x, name, layout in (
        (a, "a", f"[B,{t}K,H] or [B,{t}N,H]"),
        (b, "b", f"[B,{t}K,H] or [B,{t}N,H]"),
        (log_w, "log_w", f"[B,{t}N,H]"),
    ):
        checks.float_array(x, name, q.ndim, layout)
    for x, name in ((a, "a"), (b, "b")):
        if x.shape not in ((*lead, K, H), (*lead, N, H)):
            want = f"shape {(*lead, K, H)} (per query/key head) or {(*lead, N, H)} (per value head)"
            fail(name, want, f"shape {tuple(x.shape)}")
    if log_w.shape != (*lead, N, H):
        fail("log_w", f"shape {(*lead, N, H)} = [B,{t}N,H] (per value head and key channel)",
             f"shape {tuple(log_w.shape)}")  # fmt: skip
    return B, T, K, N, H, E


def check_values(a, b, log_w, ids=None) -> None:
    """The per-token values of the DPLR delta rule, at real tokens (``ids``, the kv segment
    ids, or None): finite ``a`` and ``b``; ``log_w`` <= 0 (``-inf`` zeroes a channel's decay,
    NaN is refused). Shapes are checked before this; its sharded form checks here too.
    """
    for x, name in ((a, "a"), (b, "b")):
        checks.check_values(x, np.isfinite, name, "finite values (the rank-one transition)", ids)
    ok = lambda g: g <= 0  # noqa: E731  -inf (a decay of 0) is allowed; NaN is refused
    checks.check_values(log_w, ok, "log_w", "values <= 0 (logs of decays in [0, 1])", ids)


def _per_value_head(x, K: int, G: int):
    """``a`` or ``b`` ``[B,(T,)K|N,H]`` as float32 ``[B,(T,)K,G,H]``."""
    x = x.astype(jnp.float32)
    *lead, heads, H = x.shape
    if heads == K * G:
        return x.reshape(*lead, K, G, H)
    return jnp.broadcast_to(x[..., None, :], (*lead, K, G, H))


# ----------------------------------------------------------------------------
# Public functions


@front.takes_recurrence_args
def dplr_delta_rule(
    q,
    k,
    v,
    a,
    b,
    log_w,
    **front_args: Unpack[RecurrenceArgs],
):
    """The DPLR delta rule over a causal sequence, in one of ``DPLR_FORMS``.

    Args:
        q: queries ``[B,T,K,H]`` (RWKV-7's receptance r).
        k: keys ``[B,T,K,H]``, the direction each token writes its value along.
        v: values ``[B,T,N,E]``, N a multiple of K (grouped value heads, see
            the module docstring).
        a: ``[B,T,K,H]`` or ``[B,T,N,H]``, reads the state: ``a_t^T S`` (RWKV-7:
            ``-kappa``, the normalized removal key).
        b: ``[B,T,K,H]`` or ``[B,T,N,H]``, writes that read back: ``S += b_t (a_t^T S)``
            (RWKV-7: ``kappa * a_in``). Both finite (checked where concrete).
        log_w: log decays ``[B,T,N,H]``, one per value head and key channel;
            values <= 0, ``-inf`` zeroes that channel's diagonal. Checked when
            concrete (not under jit).
        form, chunk_size, scale, initial_state, return_state, q_segment_ids,
            kv_segment_ids: ``attn.linear.front.RecurrenceArgs`` (forms ``DPLR_FORMS``;
            states ``[B,N,H,E]``; RWKV-7 uses ``scale=1.0``).

    Returns:
        out ``[B,T,N,E]`` in the inputs' dtype, or ``(out, state)`` with
        ``return_state``.
    """
    q, k, v, a, b, log_w = as_arrays(q, k, v, a, b, log_w)
    B, T, K, N, H, E = _dims(q, k, v, a, b, log_w, step=False)
    G = N // K
    args = front.check_front(DPLR_FORMS, batch=B, length=T, head_dim=H, **front_args)
    initial_state = args.initial_state
    q_seg, kv_seg = args.q_seg, args.kv_seg
    check_values(a, b, log_w, kv_seg)
    # Padding holds anything, NaN included: selected away where it enters.
    q = drop_padding(q, q_seg)
    k, v, a, b = (drop_padding(x, kv_seg) for x in (k, v, a, b))
    initial_state = grouped_state(initial_state, B, K, G, H, E)
    dtype = front.out_dtype(q, k, v)

    q32 = q.astype(jnp.float32) * args.scale
    k32 = k.astype(jnp.float32)
    v32 = v.astype(jnp.float32).reshape(B, T, K, G, E)
    a32, b32 = _per_value_head(a, K, G), _per_value_head(b, K, G)
    log_w32 = log_w.astype(jnp.float32).reshape(B, T, K, G, H)
    q_read = None
    if q_seg is not None:
        a32, log_w32, q_read = _apply_segments(q_seg, kv_seg, a32, log_w32)

    arrays = (q32, k32, v32, a32, b32, log_w32, initial_state)
    if args.form == "recurrent":
        out, state = dplr_forms.recurrent(*arrays)
    else:
        out, state = dplr_forms.chunkwise(*arrays, args.chunk_size)
    out = out.reshape(B, T, N, E)
    if q_read is not None:
        out = jnp.where(q_read[:, :, None, None], out, 0.0)
    return front.returned(out.astype(dtype), state.reshape(B, N, H, E), args.return_state)


def _apply_segments(q_seg, kv_seg, a, log_w):
    """Segment ids as decays, reads and erasures (``attn.linear.segments.causal``).

    Padding keys (whose k, v, a and b ``drop_padding`` has zeroed: no write, no
    rank-one part) do not decay the state (log decay 0); a segment's first key
    erases the state: log decay ``-inf`` on every channel, and ``a = 0`` so its
    rank-one part reads nothing of the previous segment. A query reads only the
    segment the state holds. a, log_w ``[B,T,K,G,H]``; returns
    ``(a, log_w, q_read [B,T])``.
    """
    rules = segments.causal(q_seg, kv_seg, None, 1)
    real, starts = rules.key_real, jnp.isneginf(rules.log_a[..., 0])  # [B,T]
    at = (..., None, None, None)
    log_w = jnp.where(real[at], log_w, 0.0)
    log_w = jnp.where(starts[at], -jnp.inf, log_w)
    a = jnp.where(starts[at], 0.0, a)
    return a, log_w, rules.q_read


def dplr_delta_rule_step(q, k, v, a, b, log_w, state, *, scale: float | None = None):
    """Advances the DPLR delta rule by one token (decoding); iterating it is ``dplr_delta_rule``.

    Args:
        q, k: ``[B,K,H]``; v: ``[B,N,E]``; a, b: ``[B,K,H]`` or ``[B,N,H]``;
            log_w: ``[B,N,H]``, as in ``dplr_delta_rule``.
        state: ``[B,N,H,E]`` (``attn.init_delta_state`` or a final state).
        scale: as in ``dplr_delta_rule``.

    Returns:
        ``(out [B,N,E] in the inputs' dtype, state [B,N,H,E] float32)``.
    """
    q, k, v, a, b, log_w, state = as_arrays(q, k, v, a, b, log_w, state)
    B, _, K, N, H, E = _dims(q, k, v, a, b, log_w, step=True)
    G = N // K
    check_values(a, b, log_w)
    check_state(state, "state", B, N, H, E)
    new, out = dplr_forms.step(
        state.astype(jnp.float32).reshape(B, K, G, H, E),
        q.astype(jnp.float32) * checks.query_scale(scale, H),
        k.astype(jnp.float32),
        v.astype(jnp.float32).reshape(B, K, G, E),
        _per_value_head(a, K, G),
        _per_value_head(b, K, G),
        log_w.astype(jnp.float32).reshape(B, K, G, H),
    )
    out_dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
    return out.reshape(B, N, E).astype(out_dtype), new.reshape(B, N, H, E)
