"""Mamba-2's state-space layer (SSD), as the gated linear attention it is.

Mamba-2 (Dao and Gu, ICML 2024) runs, per head n with a state ``h [H, E]``
(state dim x head dim),

    a_t = exp(dt_t A)                       the decay, in (0, 1]
    h_t = a_t h_{t-1} + B_t (dt_t x_t)^T    the write
    y_t = h_t^T C_t + D x_t                 the read, plus a skip

with ``dt_t > 0`` (a softplus, in the layer), ``A < 0`` per head, ``B_t`` and
``C_t`` shared by the heads of a group and ``x_t`` per head. The paper's
state-space duality is that this is causal linear attention with queries C,
keys B, values ``dt x``, the identity feature map, no normalizer and the
scalar gate ``a_t`` per head and token: ``ssd`` is exactly that call of
``attn.linear_attention`` (whose three forms are then Mamba-2's recurrent
scan, its chunked SSD algorithm and its quadratic "attention" form), plus the
``D`` skip.

Negative eigenvalues (``negative_eigenvalues=True``): Grazzi et al. (ICLR
2025) widen the decay to ``a_t = 2 exp(dt_t A) - 1`` in (-1, 1], so that the
state can flip sign, which tracking parity needs. The gate's sign travels
beside the log of its magnitude (``linear_attention``'s ``negative_gates``).

Axes in the vocabulary of ``attn``: N heads, E head dim (Mamba's P), K groups
of B and C (Mamba's ``ngroups``; N % K == 0, heads ``k G .. k G + G - 1``
read group k, as in Mamba's reference code) and H the state dim (Mamba's
``d_state``). The argument B (the input matrices) is not the batch axis B.
B and C are repeated to the N heads before the call (``[B,T,N,H]`` each,
the size of x when H equals E): ``linear_attention`` shares keys between
query heads, not queries and keys between value heads.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from attn import checks
from attn.checks import as_arrays, fail
from attn.linear import front
from attn.linear.attention import LinearState, linear_attention, linear_attention_step
from attn.linear.front import CHUNK_SIZE
from attn.masks import drop_padding

__all__ = ["SSD_FORMS", "init_ssd_state", "ssd", "ssd_decay", "ssd_step"]

SSD_FORMS = ("recurrent", "chunkwise", "quadratic")
_LINEAR_FORM = {"recurrent": "recurrent", "chunkwise": "chunkwise", "quadratic": "parallel"}
# The smallest decay magnitude kept: a decay of exactly 0 (measure zero with
# negative eigenvalues) becomes exp(-69), so its log and gradient stay finite.
_TINY = 1e-30


def init_ssd_state(batch: int, num_heads: int, state_dim: int, head_dim: int):
    """Zero state ``[B,N,H,E]`` float32 (H the state dim, E the head dim)."""
    return jnp.zeros((batch, num_heads, state_dim, head_dim), jnp.float32)


def ssd_decay(dt, A, negative_eigenvalues: bool = False):
    """The per-token decay as ``(log of its magnitude, negative or None)``.

    ``dt`` ``[..., N]`` (> 0), ``A`` ``[N]`` (< 0). Without negative
    eigenvalues the decay is ``exp(dt A)`` (log ``dt A``); with them
    ``2 exp(dt A) - 1`` (Grazzi et al.), whose log magnitude is
    ``log1p(2 expm1(dt A))`` where it is positive (accurate near 1) and
    ``log(-1 - 2 expm1(dt A))`` where negative; both branches are evaluated on
    safe values so neither gives the other a NaN gradient.

    Returns:
        ``(log_a [..., N] float32 <= 0, neg [..., N] bool or None)``.
    """
    log_a = jnp.asarray(dt, jnp.float32) * jnp.asarray(A, jnp.float32)
    if not negative_eigenvalues:
        return log_a, None
    e = 2.0 * jnp.expm1(log_a)  # the decay minus 1, in [-2, 0]
    positive = e > -1.0
    log_pos = jnp.log1p(jnp.where(positive, e, 0.0))
    log_neg = jnp.log(jnp.maximum(-1.0 - jnp.where(positive, -2.0, e), _TINY))
    return jnp.where(positive, log_pos, log_neg), ~positive


def check_inputs(x, dt, A, B, C, D, step: bool, ids=None):
    """Shapes of x ``[B,(T,)N,E]``, dt ``[B,(T,)N]``, A, D ``[N]``, B, C ``[B,(T,)K,H]``, and
    the values of A and dt (dt's at real tokens: ``ids`` the segment ids, or None). The
    sharded form checks here too."""
    t = "" if step else "T,"
    rank = 3 if step else 4
    for name, arr, layout in (("x", x, f"[B,{t}N,E]"), ("B", B, f"[B,{t}K,H]")):
        if getattr(arr, "ndim", None) != rank or 0 in arr.shape:
            fail(name, f"a non-empty rank-{rank} array {layout}", f"shape {np.shape(arr)}")
    *lead, N, E = x.shape
    K, H = B.shape[-2:]
    if tuple(B.shape[:-2]) != tuple(lead) or N % K:
        want = f"shape {(*lead, 'K', 'H')} with K dividing the {N} heads of x"
        fail("B", want, f"shape {tuple(B.shape)}")
    if np.shape(C) != tuple(B.shape):
        fail("C", f"the shape of B {tuple(B.shape)}", f"shape {np.shape(C)}")
    if np.shape(dt) != (*lead, N):
        fail("dt", f"shape {(*lead, N)} (one step per head and token)", f"shape {np.shape(dt)}")
    if np.shape(A) != (N,):
        fail("A", f"shape ({N},) (one rate per head)", f"shape {np.shape(A)}")
    if D is not None and np.shape(D) != (N,):
        fail("D", f"shape ({N},) or None", f"shape {np.shape(D)}")
    # Non-finite values are refused: dt = 0 under A = -inf, or dt = inf under A = 0, make
    # dt * A NaN, and dt = inf scales the input to inf.
    ok = lambda a: np.isfinite(a) & (a <= 0)  # noqa: E731
    checks.check_values(A, ok, "A", "finite values <= 0 (Mamba's A = -exp(A_log))")
    ok = lambda t: np.isfinite(t) & (t >= 0)  # noqa: E731
    want = "finite values >= 0 (a softplus of the projection)"
    ids = None if ids is None else checks.segment_ids(ids, "segment_ids", *lead[:2])
    checks.check_values(dt, ok, "dt", want, ids)
    return lead[0], N, K, H, E


def _check_state(state, name: str, B: int, N: int, H: int, E: int):
    front.check_state(state, name, (B, N, H, E), "[B,N,H,E]")


def _skip(y, x, D):
    """``y + D x`` in float32 (D ``[N]`` per head), or y without D."""
    if D is None:
        return y
    return y + jnp.asarray(D, jnp.float32)[:, None] * x.astype(jnp.float32)


def ssd(
    x,
    dt,
    A,
    B,
    C,
    *,
    D=None,
    negative_eigenvalues: bool = False,
    form: str = "chunkwise",
    chunk_size: int = CHUNK_SIZE,
    initial_state=None,
    return_state: bool = False,
    segment_ids=None,
):
    """Mamba-2's SSD over a causal sequence, in one of ``SSD_FORMS``.

    Args:
        x: inputs ``[B,T,N,E]`` (N heads of dim E).
        dt: time steps ``[B,T,N]``, >= 0 (the layer's ``softplus(. + dt_bias)``).
        A: decay rates ``[N]``, <= 0 (``-exp(A_log)``).
        B: input matrices ``[B,T,K,H]`` (K groups, H the state dim).
        C: output matrices ``[B,T,K,H]``.
        D: skip ``[N]`` or None.
        negative_eigenvalues: decays ``2 exp(dt A) - 1`` in (-1, 1] instead of
            ``exp(dt A)`` in (0, 1] (``ssd_decay``).
        form: ``"recurrent"`` (a scan over tokens), ``"chunkwise"`` (the SSD
            algorithm: chunks of ``chunk_size``) or ``"quadratic"`` (the
            materialized ``[T, T]`` attention form); the same function.
        chunk_size: C for ``"chunkwise"``; T need not be a multiple of it.
        initial_state: ``[B,N,H,E]`` the sequence continues from (zeros if None).
        return_state: also return the final state ``[B,N,H,E]`` float32.
        segment_ids: ``[B,T]`` ints or None: packing and padding (id 0), as
            in ``attn.linear_attention`` (a new segment starts from a zero
            state; padding neither writes nor decays, and outputs 0).

    Returns:
        y ``[B,T,N,E]`` in x's dtype, or ``(y, state)`` with ``return_state``.
    """
    x, dt, A, B, C, D, initial_state = as_arrays(x, dt, A, B, C, D, initial_state)
    batch, N, K, H, E = check_inputs(x, dt, A, B, C, D, step=False, ids=segment_ids)
    front.check_form(form, SSD_FORMS)
    front.check_chunk(chunk_size)
    seg = checks.segment_ids(segment_ids, "segment_ids", batch, x.shape[1])
    x, dt = drop_padding(x, seg), drop_padding(dt, seg)
    state = None
    if initial_state is not None:
        _check_state(initial_state, "initial_state", batch, N, H, E)
        zeros = jnp.zeros((batch, N, H), jnp.float32)
        state = LinearState(jnp.asarray(initial_state, jnp.float32), zeros)
    log_a, neg = ssd_decay(dt, A, negative_eigenvalues)
    x32 = x.astype(jnp.float32)
    y, final = linear_attention(
        jnp.repeat(C, N // K, axis=2),
        jnp.repeat(B, N // K, axis=2),
        x32 * dt.astype(jnp.float32)[..., None],
        form=_LINEAR_FORM[form],
        feature_map="identity",
        normalize=False,
        log_gates=log_a,
        negative_gates=neg,
        chunk_size=chunk_size,
        scale=1.0,
        initial_state=state,
        return_state=True,
        q_segment_ids=seg,
        kv_segment_ids=seg,
    )
    y = _skip(y, x32, D).astype(x.dtype)
    return (y, final.kv) if return_state else y


def ssd_step(state, x, dt, A, B, C, *, D=None, negative_eigenvalues: bool = False):
    """Advances SSD by one token (decoding); iterating it is ``ssd``.

    Args:
        state: ``[B,N,H,E]`` (``init_ssd_state`` or an ``ssd`` final state).
        x: ``[B,N,E]``; dt: ``[B,N]``; A, D: ``[N]``; B, C: ``[B,K,H]``.
        negative_eigenvalues: as in ``ssd``.

    Returns:
        ``(y [B,N,E] in x's dtype, state [B,N,H,E] float32)``.
    """
    state, x, dt, A, B, C, D = as_arrays(state, x, dt, A, B, C, D)
    batch, N, K, H, E = check_inputs(x, dt, A, B, C, D, step=True)
    _check_state(state, "state", batch, N, H, E)
    log_a, neg = ssd_decay(dt, A, negative_eigenvalues)
    x32 = x.astype(jnp.float32)
    y, new = linear_attention_step(
        LinearState(jnp.asarray(state, jnp.float32), jnp.zeros((batch, N, H), jnp.float32)),
        jnp.repeat(C, N // K, axis=1),
        jnp.repeat(B, N // K, axis=1),
        x32 * dt.astype(jnp.float32)[..., None],
        feature_map="identity",
        normalize=False,
        log_gate=log_a,
        negative_gate=neg,
        scale=1.0,
    )
    return _skip(y, x32, D).astype(x.dtype), new.kv
