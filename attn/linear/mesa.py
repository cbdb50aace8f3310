"""MesaNet: a state that solves the in-context least-squares problem at every token.

MesaNet (von Oswald et al. 2025, "MesaNet: Sequence Modeling by Locally Optimal
Test-Time Training") keeps per head two gated sums, the keys' second moment and the
keys' products with the values,

    G_t = gamma_t G_{t-1} + beta_t k_t k_t^T          [H,H]
    S_t = gamma_t S_{t-1} + beta_t k_t v_t^T          [H,E]

and reads with the minimizer of the regularized, forgetting least-squares loss
``sum_s (prod gamma) beta_s |W^T k_s - v_s|^2 + |W|^2_Lambda`` over W, applied to q_t:

    q*_t = (G_t + diag(lambda))^{-1} q_t,      o_t = S_t^T q*_t

(``lambda [N,H]`` > 0, per head and key channel). The solve is exact
(``cg_steps=None``: a Cholesky solve per token) or ``cg_steps`` steps of conjugate
gradients from zero, as the authors' code (fla's ``mesa_net``) runs them, their
absolute 1e-5 in each step's two denominators included; either way its gradient is
the implicit one (the same solve applied to the cotangent: ``lax.custom_linear_solve``,
as fla's backward). ``G`` and ``S`` are gated linear recurrences, so the state is
affine in its past and the family has a sharded form (``sharded_mesa_net``).

Forms, the same function: ``"recurrent"`` (a token at a time) and ``"chunkwise"``
(per chunk of C tokens: every token's solve at once, its products with ``G_t``
through the chunk's start state and a masked ``[C,C]`` sum, as fla's kernel; the
output a gated linear attention with query ``q*``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Unpack

import jax
import jax.numpy as jnp
import numpy as np

from attn import checks
from attn.checks import as_arrays, fail
from attn.linear import front, reference, segments, sharded  # noqa: F401  (sharded: its six records first)
from attn.linear.family import FAMILIES, Family, Ids, normal, run_sharded, uniform, unit, widen
from attn.linear.forms import segsum
from attn.linear.front import RecurrenceArgs
from attn.masks import drop_padding

__all__ = [
    "MESA_FORMS",
    "MesaState",
    "init_mesa_state",
    "mesa_net",
    "mesa_net_step",
    "sharded_mesa_net",
]

MESA_FORMS = ("recurrent", "chunkwise")
CG_EPS = 1e-5  # fla's, added to both denominators of a CG step


class MesaState(NamedTuple):
    """Per row and head, float32: ``S [B,N,H,E]`` (keys times values; first: its value
    columns carry the sharded driver's transition) and ``G [B,N,H,H]`` (keys' moment)."""

    S: jax.Array
    G: jax.Array


def init_mesa_state(B: int, N: int, H: int, E: int) -> MesaState:
    return MesaState(jnp.zeros((B, N, H, E), jnp.float32), jnp.zeros((B, N, H, H), jnp.float32))


@front.takes_recurrence_args
def mesa_net(q, k, v, beta, lam, *, log_gates=None, cg_steps: int | None = None,
             **front_args: Unpack[RecurrenceArgs]):  # fmt: skip
    """MesaNet over a causal sequence (module docstring).

    Args:
      q, k: ``[B,T,N,H]`` (one key per head), usually L2-normalized.
      v: ``[B,T,N,E]``.
      beta: ``[B,T,N]`` input gates (``sigmoid`` of a projection in the layer).
      lam: ``[N,H]`` the regularizer, > 0.
      log_gates: ``[B,T,N]`` log gamma, <= 0 (``-inf`` erases both sums), or None (none).
      cg_steps: None (the exact solve) or a positive int (conjugate gradient steps).
      form, chunk_size, scale, initial_state, return_state, q_segment_ids,
        kv_segment_ids: ``attn.linear.front.RecurrenceArgs`` (forms ``MESA_FORMS``; scale 1
        by default, as the authors'; states ``MesaState``).

    Returns:
      out ``[B,T,N,E]`` in the inputs' dtype, or ``(out, MesaState)`` with ``return_state``.
    """
    q, k, v, beta, lam, log_gates = as_arrays(q, k, v, beta, lam, log_gates)
    B, T, N, H, E = _check(q, k, v, beta, lam, log_gates, step=False)
    steps = _steps(cg_steps)
    args = front.check_front(MESA_FORMS, batch=B, length=T, head_dim=H, default_scale=1.0,
                             **front_args)  # fmt: skip
    q_seg, kv_seg = args.q_seg, args.kv_seg
    checks.check_values(beta, np.isfinite, "beta", "finite values (an input gate)", kv_seg)
    if log_gates is not None:
        checks.check_values(log_gates, lambda g: g <= 0, "log_gates",
                            "values <= 0 (logs of gates in [0, 1])", kv_seg)  # fmt: skip
    state = _state(args.initial_state, B, N, H, E)
    q = drop_padding(q, q_seg)
    k, v, beta = (drop_padding(x, kv_seg) for x in (k, v, beta))
    log_a = None if log_gates is None else log_gates.astype(jnp.float32)
    q_read = None
    if q_seg is not None:
        rules = segments.causal(q_seg, kv_seg, log_a, N)
        log_a, q_read = rules.log_a, rules.q_read
    if log_a is None:
        log_a = jnp.zeros((B, T, N), jnp.float32)
    heads = lambda x: jnp.moveaxis(x.astype(jnp.float32), 2, 1)  # noqa: E731  [B,N,T,...]
    inputs = (heads(q) * args.scale, heads(k), heads(v), heads(beta), heads(log_a))
    lam32 = jnp.asarray(lam, jnp.float32)
    if args.form == "recurrent":
        run = functools.partial(_recurrent, steps=steps)
    else:
        run = functools.partial(_chunkwise, steps=steps, C=args.chunk_size)
    per_head = jax.vmap(jax.vmap(run, (0, 0, 0, 0, 0, 0, 0, 0)), (0, 0, 0, 0, 0, None, 0, 0))
    out, (S, G) = per_head(*inputs, lam32, state.S, state.G)
    out = jnp.moveaxis(out, 1, 2)
    if q_read is not None:
        out = jnp.where(q_read[:, :, None, None], out, 0.0)
    return front.returned(out.astype(front.out_dtype(q, k, v)), MesaState(S, G),
                          args.return_state)  # fmt: skip


def mesa_net_step(q, k, v, beta, lam, state: MesaState, *, log_gates=None,
                  cg_steps: int | None = None, scale: float | None = None):  # fmt: skip
    """One token: q, k ``[B,N,H]``, v ``[B,N,E]``, beta and log_gates ``[B,N]``; returns
    ``(out [B,N,E], state)``, the recurrent form on one token (the same solve as the
    forward pass, so decoding equals it; fla's decoding kernel starts its CG from a Jacobi
    guess instead, which differs before convergence)."""
    _check(q, k, v, beta, lam, log_gates, step=True)
    add = lambda x: None if x is None else x[:, None]  # noqa: E731
    out, state = mesa_net(add(q), add(k), add(v), add(beta), lam, log_gates=add(log_gates),
                          cg_steps=cg_steps, scale=scale, form="recurrent",
                          initial_state=state, return_state=True)  # fmt: skip
    return out[:, 0], state


def _check(q, k, v, beta, lam, log_gates, step: bool):
    B, T, K, N, H, E = front.check_heads(q, k, v, step, {"beta": beta, "log_gates": log_gates})
    if K != N:
        fail("v", f"{K} heads, one per key head (MesaNet's gates and states are per head)",
             f"shape {tuple(v.shape)}")  # fmt: skip
    if np.shape(lam) != (N, H):
        fail("lam", f"shape {(N, H)} = [N,H]", f"shape {np.shape(lam)}")
    checks.check_values(lam, lambda x: x > 0, "lam", "values > 0 (a regularizer)")
    return B, T, N, H, E


def _steps(cg_steps):
    if cg_steps is None:
        return None
    return checks.positive_int(cg_steps, "cg_steps")


def _state(state, B: int, N: int, H: int, E: int) -> MesaState:
    if state is None:
        return init_mesa_state(B, N, H, E)
    if not isinstance(state, MesaState):
        fail("initial_state", "a MesaState (init_mesa_state, or a returned state)",
             type(state).__name__)  # fmt: skip
    front.check_state(state.S, "initial_state.S", (B, N, H, E), "[B,N,H,E]")
    front.check_state(state.G, "initial_state.G", (B, N, H, H), "[B,N,H,H]")
    return MesaState(*(jnp.asarray(x, jnp.float32) for x in state))


# The forms, per row and head -------------------------------------------------------------


def cg(matvec, b, steps: int):
    """``steps`` conjugate-gradient steps from zero for ``matvec(x) = b``, row by row (each
    row of ``b [..., H]`` its own system), as fla's: no early exit, 1e-5 in both
    denominators."""

    def step(_, carry):
        x, r, p, d = carry
        w = matvec(p)
        alpha = d / (jnp.sum(p * w, -1, keepdims=True) + CG_EPS)
        x, r = x + alpha * p, r - alpha * w
        d_next = jnp.sum(r * r, -1, keepdims=True)
        return x, r, r + d_next / (d + CG_EPS) * p, d_next

    start = (jnp.zeros_like(b), b, b, jnp.sum(b * b, -1, keepdims=True))
    return jax.lax.fori_loop(0, steps, step, start)[0]


def solve(matvec, A, b, steps):
    """``(A)^{-1} b`` for symmetric positive definite ``A [..., H, H]`` (rows of ``b``), by
    Cholesky (``steps`` None) or CG through ``matvec``; the implicit gradient either way."""

    def exact(_, b):
        factor = jax.scipy.linalg.cho_factor(A, lower=True)
        return jax.scipy.linalg.cho_solve(factor, b[..., None])[..., 0]

    inverse = exact if steps is None else lambda mv, b: cg(mv, b, steps)
    return jax.lax.custom_linear_solve(matvec, b, inverse, symmetric=True)


def _recurrent(q, k, v, beta, log_a, lam, S, G, *, steps):
    """A token at a time: q, k ``[T,H]``, v ``[T,E]``, beta, log_a ``[T]``."""

    def step(carry, x):
        S, G = carry
        qt, kt, vt, bt, at = x
        decay = jnp.exp(at)
        G = decay * G + bt * jnp.outer(kt, kt)
        S = decay * S + bt * jnp.outer(kt, vt)
        A = G + jnp.diag(lam)
        x_star = solve(lambda x: A @ x, A if steps is None else None, qt, steps)
        return (S, G), x_star @ S

    (S, G), out = jax.lax.scan(step, (S, G), (q, k, v, beta, log_a))
    return out, (S, G)


CHUNKS_AT_ONCE = 8  # chunks whose solves run together: parallel work that stays in cache


def _chunkwise(q, k, v, beta, log_a, lam, S, G, *, steps, C: int):
    """By chunks of C tokens (T padded with tokens that change nothing): first every chunk's
    start states (a scan over chunks, one rank-C update each), then the chunks' solves and
    outputs, ``CHUNKS_AT_ONCE`` at a time, as fla's kernels split the work (a solve's steps
    then run over several chunks together, not one chunk after another)."""
    T = q.shape[0]
    pad = -T % C

    def grid(x):  # [T,...] -> [T/C, C, ...]
        return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(-1, C, *x.shape[1:])

    Q, K, V, b, a = (grid(x) for x in (q, k, v, beta, log_a))
    within = jnp.exp(segsum(a)) * b[:, None, :]  # [n,t,s]: beta_s prod_{s<r<=t} gamma_r
    start = jnp.exp(jnp.cumsum(a, -1))[..., None]  # [n,t,1]: prod_{r<=t} gamma_r
    last = within[:, -1, :, None] * K  # [n,s,H]: beta_s prod_{s<r<=C} gamma_r k_s

    def chunk(carry, xs):  # the states at each chunk's start, and after the last
        S, G = carry
        gamma, writes, K, V = xs
        return (gamma * S + writes.T @ V, gamma * G + writes.T @ K), (S, G)

    (S, G), starts = jax.lax.scan(chunk, (S, G), (start[:, -1], last, K, V))

    def read(xs):  # one chunk: every row's solve, then its read of the values
        Q, K, V, within, start, (S, G) = xs

        def matvec(P):  # every row t times G_t + diag(lambda)
            return ((P @ K.T) * within) @ K + start * (P @ G.T) + P * lam

        A = None
        if steps is None:
            A = start[..., None] * G + jnp.einsum("ts,sh,sj->thj", within, K, K) + jnp.diag(lam)
        X = solve(matvec, A, Q, steps)
        return ((X @ K.T) * within) @ V + start * (X @ S)

    out = jax.lax.map(read, (Q, K, V, within, start, starts), batch_size=CHUNKS_AT_ONCE)
    return out.reshape(-1, out.shape[-1])[:T], (S, G)


# The family record: the sharded driver runs ``mesa_net`` itself on each span; the state's
# two sums decay by the same scalar gates, so its transition is read as a scalar's.


class MesaTokens(NamedTuple):
    q: jax.Array  # [B,T,N,H]
    k: jax.Array  # [B,T,N,H]
    v: jax.Array  # [B,T,N,E]
    beta: jax.Array  # [B,T,N]
    log_gates: jax.Array | None = None  # [B,T,N]


class MesaParams(NamedTuple):
    lam: jax.Array  # [N,H]


def _run(fn, t, p, ids, state, options):
    return fn(t.q, t.k, t.v, t.beta, p.lam, log_gates=t.log_gates, initial_state=state,
              return_state=True, q_segment_ids=ids.q_seg, kv_segment_ids=ids.kv_seg,
              **options)  # fmt: skip


def _zeros(t, _, options):
    B, _, N, E = t.v.shape
    return init_mesa_state(B, N, t.q.shape[-1], E)


def _values(t, p, ids):
    _check(t.q, t.k, t.v, t.beta, p.lam, t.log_gates, step=False)
    checks.check_values(t.beta, np.isfinite, "beta", "finite values (an input gate)", ids.kv_seg)
    if t.log_gates is not None:
        checks.check_values(t.log_gates, lambda g: g <= 0, "log_gates",
                            "values <= 0 (logs of gates in [0, 1])", ids.kv_seg)  # fmt: skip


def sharded_mesa_net(
    q, k, v, beta, lam, *, log_gates=None, q_segment_ids=None, kv_segment_ids=None,
    initial_state=None, return_state: bool = False, axis_name: str, **options,
):  # fmt: skip
    """``mesa_net`` with T sharded over the mesh axis ``axis_name``: both sums are affine in
    the state a span starts from (the outputs are not, and need not be: each device runs
    its span again from its true state, and takes its gradient there).

    Args:
      q, k, v, beta, lam, log_gates, q_segment_ids, kv_segment_ids, initial_state,
        return_state: as in ``mesa_net``, whole arrays.
      axis_name, and in ``**options`` mesh, batch_axes, exchange:
        ``attn.linear.family.MeshArgs``; besides those ``form``, ``chunk_size``, ``scale``,
        ``cg_steps``.

    Returns:
      out ``[B,T,N,E]``, or ``(out, MesaState)`` with ``return_state``.
    """
    tokens, ids = MesaTokens(q, k, v, beta, log_gates), Ids(q_segment_ids, kv_segment_ids)
    return run_sharded(FAMILIES["mesa_net"], tokens, MesaParams(lam), ids, initial_state,
                       return_state, axis_name, options)  # fmt: skip


def _examples(rng, z):
    """Unit keys and queries, the layer's gates and regularizer; the exact solve and CG."""
    B, T, N, H = (z[n] for n in "BTNH")
    tokens = MesaTokens(
        unit(rng, B, T, N, H),
        unit(rng, B, T, N, H),
        normal(rng, B, T, N, H),
        uniform(rng, 0.05, 0.95, B, T, N),
        -uniform(rng, 0.0, 0.2, B, T, N),
    )
    params = MesaParams(uniform(rng, 0.5, 1.5, N, H))
    return {"exact": (tokens, params, {}), "cg8": (tokens, params, {"cg_steps": 8})}


def _reference(t, p, options):
    out, (S, G) = reference.mesa_net(t.q, t.k, t.v, t.beta, t.log_gates, p.lam,
                                     cg_steps=options.get("cg_steps"))  # fmt: skip
    return out, MesaState(S, G)


FAMILIES.add("mesa_net", Family(
    "mesa_net", mesa_net, mesa_net_step, MESA_FORMS, _run, _zeros, "scalar",
    lambda t, p, extra: (t._replace(v=widen(t.v, extra)), p), _values, sharded=sharded_mesa_net,
    reference=_reference, examples=_examples, data=("q", "k", "v"),
))  # fmt: skip
