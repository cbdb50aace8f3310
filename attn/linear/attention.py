"""Linear attention: softmax(q.k) replaced by a kernel phi(q).phi(k).

With a feature map ``phi: [..., H] -> [..., F]`` (``attn.linear.features``) causal
attention becomes

    out_t = phi(q_t) . S_t / (phi(q_t) . z_t + eps)
    S_t   = a_t S_{t-1} + phi(k_t) v_t^T          [F, E]
    z_t   = a_t z_{t-1} + phi(k_t)                [F]

where ``a_t`` is an optional decay in (0, 1] (a fixed per-head ``gamma`` as in
RetNet, a data-dependent gate ``exp(log_gate_t)`` as in Mamba-2 and gated linear
attention, or their product), or in [-1, 1] with ``negative_gates``: the
gate is then ``-exp(log_gate_t)`` where that flag is set, the negative
eigenvalues Grazzi et al. (ICLR 2025) show a linear RNN needs to track
parity. Without the denominator (``normalize=False``) it
is the plain sum ``phi(q_t) . S_t``.

``linear_attention`` computes this function in three forms that are the same
function, tested to float32 precision (forward and gradients), in
``attn.linear.forms``:

- ``"parallel"``: the materialized ``[T, S]`` matrix ``phi(Q) phi(K)^T`` times
  the decay matrix; quadratic in time and memory, the reference.
- ``"recurrent"``: a ``lax.scan`` over tokens carrying ``(S, z)``; linear time,
  constant state, sequential. The backward pass recomputes pieces of about
  sqrt(T) steps (``jax.checkpoint``) instead of storing every state.
- ``"chunkwise"`` (the default): chunks of ``C`` tokens; inside a chunk the
  masked quadratic product, across chunks the state carried by a ``lax.scan``
  over chunks. Linear in T and made of matmuls: the form to train with.

Without ``causal`` there is no order: every query reads the global sums
``sum_s phi(k_s) v_s^T`` and ``sum_s phi(k_s)`` (over its segment with segment
ids; decay is then an error).

``linear_attention_step`` advances the state by one token for decoding;
``init_linear_state`` makes the zero state it starts from and
``linear_feature_dim`` gives its F.

Packing and padding are segment ids, as in ``attn.dot_product_attention``
(``q_segment_ids [B,T]``, ``kv_segment_ids [B,S]``, both or neither): a query
sees only keys with its id. Id 0 is padding (``masks.segment_ids_from_lengths``
gives 1 for tokens, 0 for padding): a padding key adds nothing to any state
and does not decay it, a padding query outputs 0 with zero gradients. Padding
may hold anything, NaN and Inf included: its q, k, v (and gates) are selected
away where they enter, so nothing reaches a real token (a NaN in a real key
reaches every later query of its segment, as the recurrence says). Causal: a segment is a run
of equal non-zero ids (padding inside it skipped), the state resets where the
next one starts (a log decay of ``-inf``), and decays inside a segment are
those of the segment run alone; so packed segments must be contiguous (an id
that comes back after another segment starts a new one). The initial state is
the first segment's past, the final state the last segment's. Not causal:
equal ids anywhere see each other, exactly as in dense attention; "recurrent"
and "chunkwise" then sort keys and queries by id into one causal sequence of
``S + T`` tokens (linear time plus a sort).

State convention. Decays and gates are per query head, and they act on the
state, so the state is kept per query head: ``LinearState(kv [B,N,F,E],
z [B,N,F])`` in float32 whatever the input dtype. Under GQA the queries are
reshaped to ``[B,T,K,G,H]`` and the K kv heads are read through that view,
never repeated in memory; only the state (G per kv head) is per query head.
``z`` is always tracked (it is 1/E of the state), so one state serves both
``normalize`` settings. The decay applies to ``z`` too, so a normalized output
stays a weighted average of the values.

Decay in log space. Products of decays ``prod_{r=s+1..t} a_r`` are computed as
``exp`` of range sums ``sum_{r=s+1..t} log a_r`` accumulated directly (a
masked cumulative sum over a ``[C, C]`` or ``[T, S]`` square), not as
differences of running totals: those lose precision when the totals are large
and give ``-inf - -inf`` for a gate of exactly zero (``log_gate = -inf``, which
is allowed and erases the state; a segment boundary is such a gate). Positions
above the diagonal are set to ``-inf`` before the ``exp``, and every decay
``exp`` has an argument <= 0, so nothing overflows and no gradient is NaN.
A signed gate has no logarithm, so its sign travels beside the log of its
magnitude: a product over a range is ``exp`` of the range's log sum times
``(-1)`` to the number of negative gates in it, counted by the same masked
cumulative sum (whole numbers, exact in float32); the chunkwise form carries
each chunk's signed product across chunks as it is (``forms.decay_matrix``).

Scale. ``q`` and ``k`` are each multiplied by ``sqrt(scale)`` before the feature
map. For ``"taylor"`` and ``"favor"``, which estimate ``exp(q.k)``, the default
``scale = 1/sqrt(H)`` makes them estimate softmax's ``exp(q.k / sqrt(H))``
(Based's ``x / H**0.25``); for the other maps the default is 1.

Precision. All statistics are float32. The recurrent form adds one token at a
time to its running sums, so their rounding error grows with T (up to about
T float32 roundoffs; 3e-5 relative measured at T = 64K with positive features);
the chunkwise form adds chunk sums and is more accurate at long T. FAVOR+
features ``exp(x W - |x|^2 / 2)`` are not stabilized by subtracting a maximum
(it would differ between forms and calls), so very large q or k overflow.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attn import checks
from attn.checks import as_arrays, concrete, fail, qkv_dims
from attn.linear import forms, front, segments
from attn.linear.features import output_dim, resolve, root_scale
from attn.linear.front import CHUNK_SIZE, check_chunk, check_form, check_state
from attn.masks import drop_padding

__all__ = [
    "LINEAR_FORMS",
    "LinearState",
    "init_linear_state",
    "linear_attention",
    "linear_attention_step",
]

LINEAR_FORMS = ("parallel", "recurrent", "chunkwise")


class LinearState(NamedTuple):
    """Recurrent state of linear attention, float32.

    Attributes:
        kv: ``[B,N,F,E]``, the decayed sum of ``phi(k_s) v_s^T``.
        z: ``[B,N,F]``, the decayed sum of ``phi(k_s)`` (the normalizer).
    """

    kv: jax.Array
    z: jax.Array


def init_linear_state(batch: int, num_heads: int, feature_dim: int, value_dim: int) -> LinearState:
    """Zero state: kv ``[B,N,F,E]``, z ``[B,N,F]``, float32 (N = query heads)."""
    return LinearState(
        kv=jnp.zeros((batch, num_heads, feature_dim, value_dim), jnp.float32),
        z=jnp.zeros((batch, num_heads, feature_dim), jnp.float32),
    )


# ----------------------------------------------------------------------------
# Validation


def check_decay(decay, log_gates, B: int, T: int, N: int, causal: bool, name="log_gates",
                ids=None):  # fmt: skip
    """Validates ``decay`` (gamma ``[N]`` or scalar) and ``log_gates`` ``[B,T,N]`` (its values
    at real tokens: ``ids`` the kv segment ids, or None). The sharded form checks here too."""
    if not causal and (decay is not None or log_gates is not None):
        arg = "decay" if decay is not None else name
        fail(arg, "None when causal=False (decay needs an order)", "an array")
    if decay is not None:
        shape = np.shape(decay)
        if shape not in ((), (N,)):
            fail("decay", f"shape () or ({N},) (one gamma per query head)", f"shape {shape}")
        value = concrete(decay)
        if value is not None and not np.all((value > 0) & (value <= 1)):
            fail("decay", "values in (0, 1]", f"min {value.min()}, max {value.max()}")
    if log_gates is not None:
        shape = np.shape(log_gates)
        if shape != (B, T, N):
            fail(name, f"shape ({B}, {T}, {N}) = [B,T,N]", f"shape {shape}")
        ok = lambda g: g <= 0  # noqa: E731  -inf (a gate of 0) resets the state; NaN is refused
        checks.check_values(log_gates, ok, name, "values <= 0 (log of gates in [0, 1])", ids)


def _check_signs(negative_gates, B: int, T: int, N: int, causal: bool, name="negative_gates"):
    """``negative_gates`` ``[B,T,N]`` bool, causal only; returns it as float32 0/1 (or None)."""
    if negative_gates is None:
        return None
    if not causal:
        fail(name, "None when causal=False (gates need an order)", "an array")
    shape = np.shape(negative_gates)
    if shape != (B, T, N):
        fail(name, f"shape ({B}, {T}, {N}) = [B,T,N]", f"shape {shape}")
    dtype = jnp.result_type(negative_gates)
    if dtype != jnp.bool_:
        fail(name, "a bool array (True where the gate is negative)", f"dtype {dtype}")
    return jnp.asarray(negative_gates).astype(jnp.float32)


def _log_decay(decay, log_gates, B: int, T: int, N: int):
    """Combined log decay ``[B,T,N]`` float32 (<= 0), or None without decay."""
    if decay is None and log_gates is None:
        return None
    total = jnp.zeros((B, T, N), jnp.float32)
    if decay is not None:
        total = total + jnp.log(jnp.asarray(decay, jnp.float32))
    if log_gates is not None:
        total = total + jnp.asarray(log_gates, jnp.float32)
    return total


def _check_state(state, name: str, B: int, N: int, F: int, E: int):
    if not isinstance(state, tuple) or len(state) != 2:
        fail(name, "a LinearState(kv, z) (see init_linear_state)", type(state).__name__)
    kv_shape, z_shape = np.shape(state[0]), np.shape(state[1])
    if kv_shape != (B, N, F, E) or z_shape != (B, N, F):
        fail(name, f"kv {(B, N, F, E)} and z {(B, N, F)}", f"kv {kv_shape}, z {z_shape}")
    check_state(state[0], f"{name}.kv", (B, N, F, E), "[B,N,F,E]")
    check_state(state[1], f"{name}.z", (B, N, F), "[B,N,F]")


def _check_eps(eps):
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or eps < 0:
        fail("eps", "a non-negative Python number", repr(eps))


def _check_segments(q_segment_ids, kv_segment_ids, B, T, S, causal, initial_state, return_state):
    """Segment ids ``([B,T], [B,S])`` int32, or ``(None, None)``; causal, those of one set
    of tokens (``checks.same_token_segment_ids``)."""
    if causal:
        return checks.same_token_segment_ids(q_segment_ids, kv_segment_ids, B, T)
    q_seg = checks.segment_ids(q_segment_ids, "q_segment_ids", B, T)
    kv_seg = checks.segment_ids(kv_segment_ids, "kv_segment_ids", B, S)
    if (q_seg is None) != (kv_seg is None):
        fail("q_segment_ids/kv_segment_ids", "both or neither", "only one of them")
    if q_seg is not None and not causal and (initial_state is not None or return_state):
        # Without an order there is no last segment to hand a state to (or to
        # take one from): a state belongs to one sequence.
        arg, got = (
            ("initial_state", "a state") if initial_state is not None else ("return_state", True)
        )
        fail(arg, "None/False with segment ids and causal=False", got)
    return q_seg, kv_seg


def _finish(num, den, q_read, normalize: bool, eps: float):
    """Output ``num / (den + eps)`` (or ``num``), zero where ``q_read`` ``[B,T]`` is False.

    The denominator is replaced by 1 on those rows before dividing, so a
    padding row's 0 / 0 can produce neither a NaN nor a NaN gradient.
    """
    if q_read is None:
        return num / (den[..., None] + eps) if normalize else num
    read = q_read[:, :, None, None]
    if normalize:
        num = num / jnp.where(read, den + eps, 1.0)[..., None]
    return jnp.where(read[..., None], num, 0.0)


# ----------------------------------------------------------------------------
# Public functions


def linear_attention(
    q,
    k,
    v,
    *,
    form: str = "chunkwise",
    feature_map: str | Callable[[jax.Array], jax.Array] = "elu1",
    causal: bool = True,
    normalize: bool = True,
    decay=None,
    log_gates=None,
    chunk_size: int = CHUNK_SIZE,
    initial_state: LinearState | None = None,
    return_state: bool = False,
    eps: float = 1e-6,
    scale: float | None = None,
    projection=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    negative_gates=None,
):
    """Linear attention ``phi(q).phi(k)`` in one of three equivalent forms.

    Args:
        q: queries ``[B,T,N,H]``.
        k: keys ``[B,S,K,H]`` (K kv heads, N % K == 0; GQA reads them through
            a ``[B,T,K,G,H]`` view of q, never repeating them).
        v: values ``[B,S,K,E]``.
        form: ``"parallel"`` (quadratic, the reference), ``"recurrent"``
            (scan over tokens) or ``"chunkwise"`` (default: linear in T, made of
            matmuls). All compute the same function.
        feature_map: a name in ``FEATURE_MAPS`` (``"identity"``, ``"elu1"``,
            ``"relu"``, ``"taylor"``, ``"favor"``) or a callable
            ``[..., H] -> [..., F]`` (applied in float32).
        causal: if True, token t sees keys s <= t (requires T == S). If False,
            every query sees every key (T may differ from S); no decay.
        normalize: divide by ``phi(q_t) . z_t + eps`` (Katharopoulos et al.).
            Meant for positive maps; with ``"identity"`` use False.
        decay: fixed per-query-head decay gamma in (0, 1], shape ``[N]`` or
            scalar (RetNet). Causal only.
        log_gates: per-token, per-query-head log decays ``[B,T,N]``, <= 0
            (Mamba-2 / GLA scalar gates; ``-inf`` is a gate of 0 that erases
            the state). Checked for sign only when concrete (not under jit).
            Combined with ``decay`` by multiplying the gates. Causal only.
        chunk_size: C for ``form="chunkwise"``; T need not be a multiple.
        initial_state: a ``LinearState`` (kv ``[B,N,F,E]``, z ``[B,N,F]``) the
            sequence continues from; zeros if None. All forms accept it. With
            segment ids it is the past of the first segment (causal only).
        return_state: also return the final ``LinearState``: with segment ids,
            that of the last segment (padding leaves it as it was; causal only).
        eps: added to the denominator when ``normalize``.
        scale: q and k are each multiplied by ``sqrt(scale)`` before the map,
            so exp-approximating maps estimate ``exp(scale q.k)``. Default
            ``1/sqrt(H)`` for ``"taylor"`` and ``"favor"`` (as softmax), else 1.
        projection: ``[H, F]`` random features for ``"favor"`` (see
            ``favor_projection``); passed explicitly so every form, and every
            call, sees the same features.
        q_segment_ids, kv_segment_ids: ``[B,T]``, ``[B,S]`` ints, both or
            neither (causal: the same ids, as q and k are the same tokens).
            Queries see only keys with the same id; id 0 is padding, which
            adds nothing to any state and outputs 0. See the module docstring.
        negative_gates: ``[B,T,N]`` bool or None: where True, that token's
            gate (the product of ``decay`` and ``exp(log_gates)``, 1 without
            either) is negated, so gates range over [-1, 1]. Causal only.

    Returns:
        out ``[B,T,N,E]`` in the input dtype, or ``(out, LinearState)`` if
        ``return_state`` (state float32, kv ``[B,N,F,E]``, z ``[B,N,F]``).
    """
    q, k, v = as_arrays(q, k, v)
    B, T, S, N, K, G, H, E = qkv_dims(q, k, v)
    check_form(form, LINEAR_FORMS)
    check_chunk(chunk_size)
    _check_eps(eps)
    if causal and T != S:
        fail("k", f"length S == T == {T} when causal=True", f"S={S}")
    phi = resolve(feature_map, projection, H)
    root = root_scale(scale, feature_map, H)
    F = output_dim(phi, H)
    q_seg, kv_seg = _check_segments(
        q_segment_ids, kv_segment_ids, B, T, S, causal, initial_state, return_state
    )
    check_decay(decay, log_gates, B, T, N, causal, ids=kv_seg)
    neg = _check_signs(negative_gates, B, T, N, causal)
    # Padding holds anything, NaN included: selected away where it enters.
    q, k, v = drop_padding(q, q_seg), drop_padding(k, kv_seg), drop_padding(v, kv_seg)
    if initial_state is not None:
        _check_state(initial_state, "initial_state", B, N, F, E)
        kv0 = jnp.asarray(initial_state[0], jnp.float32).reshape(B, K, G, F, E)
        z0 = jnp.asarray(initial_state[1], jnp.float32).reshape(B, K, G, F)
    elif form == "chunkwise" and (causal or q_seg is not None):
        kv0 = z0 = None  # the chunkwise form skips reading a zero state
    else:
        kv0 = jnp.zeros((B, K, G, F, E), jnp.float32)
        z0 = jnp.zeros((B, K, G, F), jnp.float32)
    log_a = _log_decay(decay, log_gates, B, T, N)
    out_dtype = front.out_dtype(q, k, v)
    qg = q.astype(jnp.float32).reshape(B, T, K, G, H) * root
    kg = k.astype(jnp.float32) * root
    v32 = v.astype(jnp.float32)

    key_real = q_read = visible = merged = None
    if q_seg is not None and not causal:
        if form == "parallel":
            visible = segments.visible(q_seg, kv_seg)
            q_read = jnp.any(visible, axis=-1)  # a row that sees no key outputs 0
        else:  # per-segment sums: one recurrence over keys and queries sorted by id
            merged = segments.merge(qg, kg, v32, q_seg, kv_seg)
            qg, kg, v32, q_seg, kv_seg = merged[:5]
    ordered = causal or merged is not None  # a recurrence over the (merged) tokens
    if neg is not None and log_a is None:
        log_a = jnp.zeros((B, T, N), jnp.float32)  # gates of magnitude 1: -1 where negative
    if q_seg is not None and ordered:
        key_real, log_a, q_read = segments.causal(q_seg, kv_seg, log_a, N)
        if neg is not None:  # padding does not decay the state, nor flip it
            neg = jnp.where(key_real[..., None], neg, 0.0)
    log_a = None if log_a is None else log_a.reshape(*log_a.shape[:2], K, G)
    neg = None if neg is None else neg.reshape(B, T, K, G)

    if form == "recurrent" and ordered:
        num, den, (kv, z) = forms.recurrent(qg, kg, v32, log_a, kv0, z0, phi, key_real, neg)
    elif form == "chunkwise" and ordered:
        args = (qg, kg, v32, log_a, kv0, z0, phi, chunk_size, key_real, neg)
        num, den, (kv, z) = forms.chunkwise(*args)
    elif form == "parallel":
        args = (phi(qg), phi(kg), v32, log_a, kv0, z0, causal, key_real, visible, neg)
        num, den, (kv, z) = forms.parallel(*args)
    else:
        num, den, (kv, z) = forms.global_sums(phi(qg), phi(kg), v32, kv0, z0)
    if merged is not None:
        num, den, q_read = (segments.unmerge(x, merged) for x in (num, den, q_read))
    out = _finish(num, den, q_read, normalize, eps)
    out = out.reshape(B, T, N, E).astype(out_dtype)
    if not return_state:
        return out
    return out, LinearState(kv.reshape(B, N, F, E), z.reshape(B, N, F))


def linear_attention_step(
    state: LinearState,
    q_t,
    k_t,
    v_t,
    *,
    feature_map: str | Callable[[jax.Array], jax.Array] = "elu1",
    normalize: bool = True,
    decay=None,
    log_gate=None,
    eps: float = 1e-6,
    scale: float | None = None,
    projection=None,
    segment_id=None,
    negative_gate=None,
):
    """Advances causal linear attention by one token (decoding).

    Iterating it from ``init_linear_state`` computes ``linear_attention``
    (any form) token by token; the same keyword arguments mean the same.

    The state belongs to one sequence and a step continues it: there is no
    reset (start a new sequence from ``init_linear_state``). A padding step
    (``segment_id`` 0) leaves the state exactly as it was, decay included, and
    outputs 0, like a padding token of ``linear_attention``.

    Args:
        state: ``LinearState`` (kv ``[B,N,F,E]``, z ``[B,N,F]``), e.g. from
            ``init_linear_state`` or ``linear_attention(..., return_state=True)``.
        q_t: query ``[B,N,H]``.
        k_t: key ``[B,K,H]``.
        v_t: value ``[B,K,E]``.
        feature_map, normalize, decay, eps, scale, projection: as in
            ``linear_attention``.
        log_gate: this token's log decay ``[B,N]`` (<= 0), or None.
        segment_id: ``[B]`` ints or None (all real): 0 marks a padding step;
            any other id continues the state's sequence.
        negative_gate: ``[B,N]`` bool or None: negates this token's gate, as
            ``linear_attention``'s ``negative_gates``.

    Returns:
        ``(out_t [B,N,E] in the input dtype, new LinearState)``.
    """
    for name, x in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
        if getattr(x, "ndim", None) != 3:
            fail(name, "a rank-3 array [B, heads, dim]", f"shape {getattr(x, 'shape', None)}")
    B, _, _, N, K, G, H, E = qkv_dims(q_t[:, None], k_t[:, None], v_t[:, None])
    _check_eps(eps)
    phi = resolve(feature_map, projection, H)
    root = root_scale(scale, feature_map, H)
    F = output_dim(phi, H)
    if log_gate is not None:
        if np.shape(log_gate) != (B, N):
            fail("log_gate", f"shape ({B}, {N}) = [B,N]", f"shape {np.shape(log_gate)}")
        log_gate = jnp.asarray(log_gate)[:, None]
    check_decay(decay, log_gate, B, 1, N, causal=True, name="log_gate")
    if negative_gate is not None:
        if np.shape(negative_gate) != (B, N):
            fail("negative_gate", f"shape ({B}, {N}) = [B,N]", f"shape {np.shape(negative_gate)}")
        negative_gate = jnp.asarray(negative_gate)[:, None]
    neg = _check_signs(negative_gate, B, 1, N, True, name="negative_gate")
    _check_state(state, "state", B, N, F, E)
    seg = checks.segment_ids(segment_id, "segment_id", B)
    real = None if seg is None else seg != segments.PADDING
    q_t, k_t, v_t = (drop_padding(x, seg) for x in (q_t, k_t, v_t))
    log_a = _log_decay(decay, log_gate, B, 1, N)
    if neg is not None:
        log_a = jnp.zeros((B, 1, N), jnp.float32) if log_a is None else log_a
        if real is not None:
            neg = jnp.where(real[:, None, None], neg, 0.0)
    if log_a is not None and real is not None:
        log_a = jnp.where(real[:, None, None], log_a, 0.0)  # padding does not decay

    out_dtype = jnp.result_type(q_t.dtype, k_t.dtype, v_t.dtype)
    carry = (
        jnp.asarray(state[0], jnp.float32).reshape(B, K, G, F, E),
        jnp.asarray(state[1], jnp.float32).reshape(B, K, G, F),
    )
    (kv, z), (num, den) = forms.step(
        carry,
        q_t.astype(jnp.float32).reshape(B, K, G, H) * root,
        k_t.astype(jnp.float32) * root,
        v_t.astype(jnp.float32),
        None if log_a is None else log_a.reshape(B, K, G),
        phi,
        real,
        None if neg is None else neg.reshape(B, K, G),
    )
    q_read = None if real is None else real[:, None]
    out = _finish(num[:, None], den[:, None], q_read, normalize, eps)[:, 0]
    return out.reshape(B, N, E).astype(out_dtype), LinearState(
        kv.reshape(B, N, F, E), z.reshape(B, N, F)
    )
