"""Log-linear attention and log-linear Gated DeltaNet: a Fenwick tree of states.

Log-linear attention (Guo, Yang, Goel, Xing, Dao and Kim, 2025) replaces the
one state of a gated linear-attention layer by a Fenwick-tree partition of the
prefix, each part read with a weight of its own. Per value head, with a scalar
decay ``a_r = exp(log_a_r)`` and level weights ``lambda_t^(l) >= 0``:

    o_t = sum_{s <= t} lambda_t^(level(t, s)) * prod_{r=s+1..t} a_r * (q_t . k_s) v_s

Log-linear Mamba-2 is this with ``q = C``, ``k = B``, ``v = dt x`` and
``log_a = dt A`` (``attn.ssd``'s names; ``scale=1``, plus its ``D x``).

Levels (the paper's Fenwick partition, fla's ``construct_level_mask``). For
query position t the keys ``s < t`` split into buckets: at level ``l >= 1``,
with ``t'`` the position t with its lowest ``l - 1`` bits cleared, the bucket
is ``[t' - 2^(l-1), t')``, present when bit ``l - 1`` of t is set; level 0 is
``s = t`` alone. Equivalently ``level(t, s) = bit_length(t XOR s)``: 0 for
``s = t``, else one plus the highest bit where t and s differ. A query reads
``popcount(t) + 1`` buckets, at most ``bit_length(t) + 1``. With
``level_weights`` of L levels, levels at or above ``L - 1`` share the top
weight (the top level holds everything older); ``L >= bit_length(T - 1) + 1``
gives every level its own weight over T tokens, and all-ones weights give
plain gated linear attention (``attn.ssd``) for any L.

Forms (``LOG_LINEAR_FORMS``), the same function tested to float32 precision
against a float64 loop from the equations, outputs and every gradient:

- ``"quadratic"``: the masked ``[T, T]`` form, the reference; O(T^2).
- ``"recurrent"``: a scan over tokens carrying the L level states
  ``[L, H, E]`` and merging them as a Fenwick counter does (``attn.linear.
  log_linear_forms.merge``); O(T L H E).
- ``"chunkwise"`` (default): chunks of ``chunk_size`` (a power of 2) tokens;
  the levels inside a chunk by a masked quadratic product, the levels across
  chunks by block states built bottom-up, each odd block of ``2^(j-1)``
  chunks reading its even sibling in one matmul
  (``attn.linear.log_linear_forms.chunkwise``); O(T C (H + E) + T H E log(T/C)).

Grouped value heads, as ``attn.delta_rule`` (and Mamba-2's groups): q and k
have K heads; v, log_a, the level weights, the states and the output have
``N = K G`` heads, and value heads ``k G .. k G + G - 1`` read and write with
query/key head k.

Segments (packing, padding), causal, ``q_segment_ids`` and ``kv_segment_ids``
the same ids: id 0 is padding, which writes nothing, does not decay and outputs
0, whatever its inputs hold (NaN and Inf are selected away where they enter).
A segment is a run of equal non-zero ids (padding inside it skipped) and
starts a fresh tree: the levels count positions from the segment's start
(its real tokens ``0, 1, ...``), so packed segments compute what each computes
alone. The chunkwise form needs positions aligned with its chunks, so with
segment ids it lays each segment out at an offset that is a multiple of its
length rounded up to a power of 2 (segments sorted by that size, largest
first, which aligns every offset), in a buffer of ``2T - 1`` tokens: up to
twice the work of the unsegmented call.

Decoding: ``log_linear_attention_step`` advances a ``LogLinearState`` (levels
``[B,N,L,H,E]`` and the segment's length so far); after t tokens
``popcount(t - 1) + 1 <= floor(log2 t) + 2`` levels are non-zero.
``return_state`` hands the forward's last segment to it.

Log-linear Gated DeltaNet (``log_linear_delta_rule``, forms
``LOG_LINEAR_DELTA_FORMS``, and ``log_linear_delta_rule_step``): the same tree
over the delta rule. With Gated DeltaNet's transition ``A_r = a_r (I - beta_r
k_r k_r^T)`` and ``Phi(s -> t) = A_t ... A_{s+1}``,

    o_t = sum_{s <= t} lambda_t^(level(t, s)) (q_t^T Phi(s -> t) k_s) beta_s v_s

(the paper's ``O = ((Q K^T * decay) (I + tril(diag(beta) K K^T * decay, -1))^-1
diag(beta) * M^H) V``): every level takes every transition, the writes go to
level 0. Its forms: a scan over tokens, and chunks in the WY form with a scan
over chunks carrying one state per chunk level (``attn.linear.
log_linear_delta_forms``). Same layout, segments, states and decoding.

The states are float32 whatever the input dtype; the output has the inputs'
dtype. ``initial_state`` continues a sequence (a chunked prefill) in the
recurrent form only: the first segment's tokens take positions from the
state's ``length`` on, so the Fenwick merges are the step function's, and its
levels start from the state's; a later segment in the call starts a fresh
tree, and a row without real tokens keeps the state. The quadratic and
chunkwise forms refuse it (their level tables need the segment to start at
position 0 of the call).
"""

from __future__ import annotations

from typing import NamedTuple, Unpack

import jax
import jax.numpy as jnp
import numpy as np

from attn import checks
from attn.checks import as_arrays, fail
from attn.linear import front
from attn.linear import log_linear_delta_forms as delta_forms
from attn.linear import log_linear_forms as forms
from attn.linear import log_linear_segments as layout
from attn.linear.front import RecurrenceArgs
from attn.masks import PADDING, drop_padding

__all__ = [
    "LOG_LINEAR_DELTA_FORMS",
    "LOG_LINEAR_FORMS",
    "LogLinearState",
    "init_log_linear_state",
    "log_linear_attention",
    "log_linear_attention_step",
    "log_linear_delta_rule",
    "log_linear_delta_rule_step",
]

LOG_LINEAR_FORMS = ("quadratic", "recurrent", "chunkwise")
LOG_LINEAR_DELTA_FORMS = ("recurrent", "chunkwise")


class LogLinearState(NamedTuple):
    """The Fenwick states of one sequence per batch row, float32.

    Attributes:
        levels: ``[B,N,L,H,E]``; level l holds the sum of ``k_s v_s^T`` over its
            bucket, each decayed to the last token (level 0: that token alone).
        length: ``[B]`` int32, the tokens of the segment so far (the position of
            the next token).
    """

    levels: jax.Array
    length: jax.Array


def init_log_linear_state(
    batch: int, num_heads: int, head_dim: int, value_dim: int, num_levels: int
) -> LogLinearState:
    """The empty state: levels ``[B,N,L,H,E]`` zeros (float32), length 0."""
    return LogLinearState(
        jnp.zeros((batch, num_heads, num_levels, head_dim, value_dim), jnp.float32),
        jnp.zeros((batch,), jnp.int32),
    )


# ----------------------------------------------------------------------------
# Validation


def _dims(q, k, v, per_head: dict, level_weights, step: bool):
    """Checks q, k ``[B,(T,)K,H]``, v ``[B,(T,)N,E]``, the ``per_head`` arrays ``[B,(T,)N]``
    (by name; None passes), level_weights ``[B,(T,)N,L]``. Returns B, T, K, N, H, E, L
    (T = 1 for a step)."""
    B, T, K, N, H, E = front.check_heads(q, k, v, step, per_head)
    t, lead = ("", (B,)) if step else ("T,", (B, T))
    shape = np.shape(level_weights)
    if len(shape) != q.ndim or tuple(shape[:-1]) != (*lead, N) or shape[-1] < 1:
        want = f"shape {(*lead, N, 'L')} = [B,{t}N,L] with L >= 1 levels"
        fail("level_weights", want, shape)
    if not jnp.issubdtype(jnp.result_type(level_weights), jnp.floating):  # as DPLR's gates
        fail(
            "level_weights",
            "real floating-point weights",
            f"dtype {jnp.result_type(level_weights)}",
        )
    return B, T, K, N, H, E, shape[-1]


def _check_values(log_a, level_weights, ids, name="log_a") -> None:
    """``log_a <= 0`` (``-inf``, a gate of 0, allowed; NaN refused; None passes) and finite
    level weights >= 0, at real tokens (``ids`` the kv segment ids, or None: all)."""
    ok = lambda g: g <= 0  # noqa: E731
    if log_a is not None:
        checks.check_values(log_a, ok, name, "values <= 0 (logs of decays in [0, 1])", ids)
    ok = lambda w: np.isfinite(w) & (w >= 0)  # noqa: E731
    want = "finite values >= 0 (one weight per level)"
    checks.check_values(level_weights, ok, "level_weights", want, ids)


def _initial(initial_state, form: str, B: int, K: int, G: int, L: int, H: int, E: int):
    """``(levels [B,K,G,L,H,E] float32, length [B] int32)`` of ``initial_state``, or
    ``(None, None)``; only the recurrent form continues a state."""
    if initial_state is None:
        return None, None
    if form != "recurrent":
        why = "its levels need the sequence to start at position 0"
        fail("initial_state", f"None for form={form!r} ({why}); use form='recurrent'", "a state")
    _check_state(initial_state, B, K * G, L, H, E, "initial_state")
    levels = jnp.asarray(initial_state[0], jnp.float32).reshape(B, K, G, L, H, E)
    return levels, jnp.asarray(initial_state[1], jnp.int32)


def _finish(out, levels, sequence: layout.Sequence, dtype, return_state: bool):
    """``out [B,T,K,G,E]`` to ``[B,T,N,E]`` in ``dtype`` (zero where not read), with the state."""
    B, T, K, G, E = out.shape
    out = out.reshape(B, T, K * G, E)
    if sequence.q_read is not None:
        out = jnp.where(sequence.q_read[:, :, None, None], out, 0.0)
    out = out.astype(dtype)
    if not return_state:
        return out
    return out, LogLinearState(levels.reshape(B, K * G, *levels.shape[3:]), sequence.length)


def _check_state(state, B: int, N: int, L: int, H: int, E: int, name: str = "state") -> None:
    if not isinstance(state, tuple) or len(state) != 2:
        fail(name, "a LogLinearState(levels, length) (see init_log_linear_state)", type(state))
    if np.shape(state[0]) != (B, N, L, H, E) or np.shape(state[1]) != (B,):
        want = f"levels {(B, N, L, H, E)} = [B,N,L,H,E] and length ({B},)"
        fail(name, want, f"levels {np.shape(state[0])}, length {np.shape(state[1])}")
    front.check_state(state[0], f"{name}.levels", (B, N, L, H, E), "[B,N,L,H,E]")
    if not jnp.issubdtype(jnp.result_type(state[1]), jnp.integer):
        fail(f"{name}.length", "integer token counts", f"dtype {jnp.result_type(state[1])}")
    checks.check_values(state[1], lambda n: n >= 0, f"{name}.length", "counts >= 0 (tokens seen)")


# ----------------------------------------------------------------------------
# Public functions


@front.takes_recurrence_args
def log_linear_attention(
    q,
    k,
    v,
    log_a,
    level_weights,
    **front_args: Unpack[RecurrenceArgs],
):
    """Log-linear attention over a causal sequence, in one of ``LOG_LINEAR_FORMS``.

    Args:
        q: queries ``[B,T,K,H]`` (log-linear Mamba-2: C).
        k: keys ``[B,T,K,H]`` (B).
        v: values ``[B,T,N,E]``, N a multiple of K (``dt x``).
        log_a: log decays ``[B,T,N]``, <= 0 (``dt A``); ``-inf`` erases the states.
        level_weights: ``[B,T,N,L]`` >= 0, the weight of each level for each
            query (levels from L - 1 up share the last one).
        form: ``"quadratic"``, ``"recurrent"`` or ``"chunkwise"`` (default); the
            same function.
        chunk_size: C for ``"chunkwise"``, a power of 2; T need not be a multiple.
        scale: multiplies q; default ``1/sqrt(H)`` (Mamba-2 uses 1).
        return_state: also return the ``LogLinearState`` after the last
            segment's last real token, for ``log_linear_attention_step``.
        q_segment_ids, kv_segment_ids: ``[B,T]`` ints, both or neither, the same
            ids: packing and padding (id 0); see the module docstring.
        initial_state: None, or a ``LogLinearState`` to continue
            (``form="recurrent"`` only): the first segment's tokens take
            positions from its ``length`` on, its levels as the tree so far;
            later segments start fresh. The same as iterating
            ``log_linear_attention_step`` from it.

    Returns:
        out ``[B,T,N,E]`` in the inputs' dtype, or ``(out, LogLinearState)``.
    """
    q, k, v, log_a, level_weights = as_arrays(q, k, v, log_a, level_weights)
    B, T, K, N, H, E, L = _dims(q, k, v, {"log_a": log_a}, level_weights, step=False)
    G = N // K
    args = front.check_front(LOG_LINEAR_FORMS, batch=B, length=T, head_dim=H, power_of_two=True,
                             **front_args)  # fmt: skip
    q_seg, kv_seg, form, chunk_size = args.q_seg, args.kv_seg, args.form, args.chunk_size
    _check_values(log_a, level_weights, kv_seg)
    init, start = _initial(args.initial_state, form, B, K, G, L, H, E)
    root = args.scale
    out_dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
    # Padding holds anything, NaN included: selected away where it enters.
    q = drop_padding(q, q_seg)
    k, v, log_a, level_weights = (drop_padding(x, kv_seg) for x in (k, v, log_a, level_weights))
    sequence = layout.sequence(q_seg, kv_seg, log_a.astype(jnp.float32), B, T, N, start)
    q32 = q.astype(jnp.float32) * root
    k32 = k.astype(jnp.float32)
    v32 = v.astype(jnp.float32).reshape(B, T, K, G, E)
    la = sequence.log_a.reshape(B, T, K, G)
    lam = level_weights.astype(jnp.float32).reshape(B, T, K, G, L)
    pos, key_real = sequence.pos, sequence.key_real
    last = sequence.last if args.return_state else None
    top = (T - 1).bit_length()  # the highest level over T tokens (or in any segment)

    if form == "quadratic":
        out, levels = forms.quadratic(q32, k32, v32, la, lam, pos, key_real, last)
    elif form == "recurrent":
        out, levels = forms.recurrent(q32, k32, v32, la, lam, pos, key_real, init)
    elif sequence.seg is None:
        out, levels = forms.chunkwise(q32, k32, v32, la, lam, chunk_size, top, None, last)
    else:

        def run(*xs):
            return forms.chunkwise(*xs[:5], chunk_size, top, *xs[5:])

        arrays = (q32, k32, v32, la, lam)
        out, levels = layout.on_aligned_layout(run, arrays, 3, sequence.seg, last)
    return _finish(out, levels, sequence, out_dtype, args.return_state)


def log_linear_attention_step(
    q, k, v, log_a, level_weights, state: LogLinearState, *, scale=None, segment_id=None
):
    """Advances log-linear attention by one token (decoding); iterating it is the forward.

    The token's position is ``state.length``: the Fenwick states merge as that
    count's bits say (the levels below its lowest set bit join the level
    above), decay, take the token at level 0 and are read with its weights.

    Args:
        q, k: ``[B,K,H]``; v: ``[B,N,E]``; log_a: ``[B,N]``; level_weights: ``[B,N,L]``.
        state: a ``LogLinearState`` with levels ``[B,N,L,H,E]`` (from
            ``init_log_linear_state`` or ``log_linear_attention(..., return_state=True)``).
        scale: as in ``log_linear_attention``.
        segment_id: ``[B]`` ints or None: 0 marks a padding step, which leaves
            the state exactly as it was and outputs 0; any other id continues
            the state's sequence (start a new one from ``init_log_linear_state``).

    Returns:
        ``(out [B,N,E] in the inputs' dtype, LogLinearState)``.
    """
    q, k, v, log_a, level_weights = as_arrays(q, k, v, log_a, level_weights)
    B, _, _, N, H, E, L = _dims(q, k, v, {"log_a": log_a}, level_weights, step=True)
    _check_state(state, B, N, L, H, E)
    seg = checks.segment_ids(segment_id, "segment_id", B)
    _check_values(log_a, level_weights, seg)
    return _advance(forms.step, state, q, k, v, (log_a,), level_weights, seg, scale)


@front.takes_recurrence_args
def log_linear_delta_rule(
    q,
    k,
    v,
    beta,
    level_weights,
    *,
    log_gates=None,
    **front_args: Unpack[RecurrenceArgs],
):
    """Log-linear Gated DeltaNet over a causal sequence, in one of ``LOG_LINEAR_DELTA_FORMS``.

    With the transition ``A_r = exp(g_r) (I - beta_r k_r k_r^T)`` of Gated
    DeltaNet (``attn.delta_rule``) and ``Phi(s -> t) = A_t ... A_{s+1}``:

        o_t = sum_{s <= t} lambda_t^(level(t, s)) (q_t^T Phi(s -> t) k_s) beta_s v_s

    (the paper's ``((Q K^T * decay) (I + tril(diag(beta) K K^T * decay, -1))^-1
    diag(beta) * M^H) V``): each Fenwick level holds the delta-rule state of its
    bucket run alone, carried to t by the transitions; the writes go to level
    0. All weights 1 is ``attn.delta_rule``.

    Args:
        q, k: ``[B,T,K,H]``, for a bounded state L2-normalized.
        v: ``[B,T,N,E]``, N a multiple of K (grouped value heads).
        beta: write strengths ``[B,T,N]``, finite.
        level_weights: ``[B,T,N,L]`` >= 0, as in ``log_linear_attention``.
        log_gates: None (DeltaNet) or ``[B,T,N]`` <= 0 (one per head).
        form: ``"recurrent"`` or ``"chunkwise"`` (default); the same function.
        chunk_size: a power of 2; T need not be a multiple. The chunk's inverse
            costs C^2 per token, as the delta rule's.
        scale: multiplies q; default ``1/sqrt(H)``.
        return_state, q_segment_ids, kv_segment_ids, initial_state: as in
            ``log_linear_attention`` (an initial state: ``form="recurrent"`` only).

    Returns:
        out ``[B,T,N,E]`` in the inputs' dtype, or ``(out, LogLinearState)``.
    """
    q, k, v, beta, level_weights, log_gates = as_arrays(q, k, v, beta, level_weights, log_gates)
    per_head = {"beta": beta, "log_gates": log_gates}
    B, T, K, N, H, E, L = _dims(q, k, v, per_head, level_weights, step=False)
    G = N // K
    args = front.check_front(LOG_LINEAR_DELTA_FORMS, batch=B, length=T, head_dim=H,
                             power_of_two=True, **front_args)  # fmt: skip
    q_seg, kv_seg, form, chunk_size = args.q_seg, args.kv_seg, args.form, args.chunk_size
    checks.check_values(beta, np.isfinite, "beta", "finite values (a write strength)", kv_seg)
    _check_values(log_gates, level_weights, kv_seg, name="log_gates")
    init, start = _initial(args.initial_state, form, B, K, G, L, H, E)
    root = args.scale
    out_dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
    if log_gates is None:
        log_gates = jnp.zeros((B, T, N), jnp.float32)
    q = drop_padding(q, q_seg)
    k, v, beta, log_gates, level_weights = (
        drop_padding(x, kv_seg) for x in (k, v, beta, log_gates, level_weights)
    )
    sequence = layout.sequence(q_seg, kv_seg, log_gates.astype(jnp.float32), B, T, N, start)
    q32 = q.astype(jnp.float32) * root
    k32 = k.astype(jnp.float32)
    v32 = v.astype(jnp.float32).reshape(B, T, K, G, E)
    beta32 = beta.astype(jnp.float32).reshape(B, T, K, G)
    log_g = sequence.log_a.reshape(B, T, K, G)
    lam = level_weights.astype(jnp.float32).reshape(B, T, K, G, L)
    last = sequence.last if args.return_state else None
    arrays = (q32, k32, v32, beta32, log_g, lam)

    if form == "recurrent":
        out, levels = delta_forms.recurrent(*arrays, sequence.pos, sequence.key_real, init)
    elif sequence.seg is None:
        out, levels = delta_forms.chunkwise(*arrays, chunk_size, last)
    else:

        def run(*xs):  # the empty slots hold beta 0 and k 0: they write nothing
            return delta_forms.chunkwise(*xs[:6], chunk_size, xs[7])

        out, levels = layout.on_aligned_layout(run, arrays, 4, sequence.seg, last)
    return _finish(out, levels, sequence, out_dtype, args.return_state)


def log_linear_delta_rule_step(
    q,
    k,
    v,
    beta,
    level_weights,
    state: LogLinearState,
    *,
    log_gates=None,
    scale=None,
    segment_id=None,
):
    """Advances log-linear Gated DeltaNet by one token; iterating it is the forward.

    Args:
        q, k: ``[B,K,H]``; v: ``[B,N,E]``; beta: ``[B,N]``; level_weights: ``[B,N,L]``.
        state: a ``LogLinearState`` (``init_log_linear_state`` or
            ``log_linear_delta_rule(..., return_state=True)``).
        log_gates: None or ``[B,N]``; scale, segment_id: as in
            ``log_linear_attention_step``.

    Returns:
        ``(out [B,N,E] in the inputs' dtype, LogLinearState)``.
    """
    q, k, v, beta, level_weights, log_gates = as_arrays(q, k, v, beta, level_weights, log_gates)
    per_head = {"beta": beta, "log_gates": log_gates}
    B, _, _, N, H, E, L = _dims(q, k, v, per_head, level_weights, step=True)
    _check_state(state, B, N, L, H, E)
    seg = checks.segment_ids(segment_id, "segment_id", B)
    checks.check_values(beta, np.isfinite, "beta", "finite values (a write strength)", seg)
    _check_values(log_gates, level_weights, seg, name="log_gates")
    if log_gates is None:
        log_gates = jnp.zeros((B, N), jnp.float32)
    return _advance(delta_forms.step, state, q, k, v, (beta, log_gates), level_weights, seg, scale)


def _advance(step, state, q, k, v, per_head: tuple, level_weights, seg, scale):
    """One token through a form's ``step`` (both step functions' shared part): padding
    dropped, the inputs float32 in ``[B,K,G,...]`` (``per_head`` ``[B,N]`` arrays in the
    order ``step`` takes them), the length advanced by the real tokens."""
    B, K, H = q.shape
    N, E = v.shape[1:]
    G, L = N // K, level_weights.shape[-1]
    real = None if seg is None else seg != PADDING
    q = drop_padding(q, seg)
    k, v, level_weights = (drop_padding(x, seg) for x in (k, v, level_weights))
    per_head = [drop_padding(x, seg).astype(jnp.float32).reshape(B, K, G) for x in per_head]
    length = jnp.asarray(state[1], jnp.int32)
    levels, out = step(
        jnp.asarray(state[0], jnp.float32).reshape(B, K, G, L, H, E),
        q.astype(jnp.float32) * checks.query_scale(scale, H),
        k.astype(jnp.float32),
        v.astype(jnp.float32).reshape(B, K, G, E),
        *per_head,
        level_weights.astype(jnp.float32).reshape(B, K, G, L),
        length,
        real,
    )
    length = length + (1 if real is None else real.astype(jnp.int32))
    out_dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
    new = LogLinearState(levels.reshape(B, N, L, H, E), length)
    return out.reshape(B, N, E).astype(out_dtype), new
