"""TTT-Linear: a linear model trained at test time on the sequence, one mini-batch at a time.

TTT-Linear (Sun et al. 2024, "Learning to (Learn at Test Time): RNNs with
Expressive Hidden States") keeps per head an inner model
``f(x) = x + LN(x W + b)``, with ``W [H, H]``, ``b [H]`` and a LayerNorm of its
own (``norm_scale``, ``norm_bias``, eps 1e-6), and trains it on the keys to
reconstruct the values: token j's loss is ``1/2 |LN(k_j W + b) - (v_j - k_j)|^2``
and its gradient ``g_j`` (w.r.t. ``z = k_j W + b``) is taken at the weights the
token's mini-batch started from. Within a mini-batch of ``mini_batch`` tokens,
the query at position i of the mini-batch reads

    W_i = W_0 - lr_i sum_{j <= i} eta_j k_j^T g_j,   b_i = b_0 - lr_i sum_{j <= i} eta_j g_j
    o_i = q_i + LN(q_i W_i + b_i)

and the next mini-batch starts from the last position's ``W``, ``b``. So the
rate of token j's gradient for query i is ``position_lr[i] * eta[j]``, as in
the authors' code (ttt-lm-jax): ``eta`` is the per-token learnable rate (the
layer's ``base_lr * sigmoid(x theta) / H``), ``position_lr`` the per-position
factor (``1 / (i + 1)`` by default; learnable in the layer).

Forms, all the same function: ``"dual"`` (the paper's dual form: per
mini-batch, matmuls and no ``W_i`` formed), ``"primal"`` (every ``W_i`` formed)
and ``"recurrent"`` (a token at a time, what ``ttt_linear_step`` does). T need
not be a multiple of the mini-batch: a sequence's last mini-batch may be
partial, and the state (``TTTState``) then holds the mini-batch's start weights,
its sums so far and its count, so a later call or step continues it exactly.

Arrays: q, k, v ``[B,T,N,H]`` (keys and values of one width: the target is
``v - k``); eta ``[B,T,N]``; norm_scale, norm_bias ``[N,H]``; position_lr
``[mini_batch]``. TTT is not linear in its state, so it has no sharded form (a
sequence's spans cannot exchange transitions).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attn import checks
from attn.checks import fail

__all__ = ["TTT_FORMS", "TTTState", "ttt_linear", "ttt_linear_step", "ttt_zero_state"]

TTT_FORMS = ("dual", "primal", "recurrent")
MINI_BATCH = 16  # the paper's b
EPS = 1e-6  # the inner LayerNorm's, as the authors'


class TTTState(NamedTuple):
    """Per row and head, where a sequence's inner model is, in float32.

    Attributes:
      W: ``[B,N,H,H]`` the weights the current mini-batch started from.
      b: ``[B,N,H]`` its bias.
      dW: ``[B,N,H,H]`` the mini-batch's gradients so far, each times its token's eta.
      db: ``[B,N,H]`` likewise for the bias.
      count: ``[B]`` int32, the mini-batch's tokens so far (0 at a boundary).
    """

    W: jax.Array
    b: jax.Array
    dW: jax.Array
    db: jax.Array
    count: jax.Array


def ttt_zero_state(B: int, N: int, H: int, W=None, b=None) -> TTTState:
    """The state of a sequence's start: ``W [N,H,H]`` and ``b [N,H]`` (a layer's learned
    initial model, the same for every row; zeros if None) at a mini-batch boundary."""
    W = jnp.zeros((N, H, H)) if W is None else jnp.asarray(W)
    b = jnp.zeros((N, H)) if b is None else jnp.asarray(b)
    W, b = (jnp.broadcast_to(x.astype(jnp.float32), (B, *x.shape)) for x in (W, b))
    return TTTState(W, b, jnp.zeros_like(W), jnp.zeros_like(b), jnp.zeros((B,), jnp.int32))


def ttt_linear(q, k, v, eta, *, norm_scale, norm_bias, position_lr=None,
               mini_batch: int = MINI_BATCH, form: str = "dual", initial_state=None,
               return_state: bool = False):  # fmt: skip
    """TTT-Linear over a sequence (module docstring).

    Args:
      q, k, v: ``[B,T,N,H]``.
      eta: ``[B,T,N]`` each token's gradient rate.
      norm_scale, norm_bias: ``[N,H]`` the inner LayerNorm's.
      position_lr: ``[mini_batch]`` the rate's factor at each position of a mini-batch;
        None is ``1 / (i + 1)``.
      mini_batch: tokens per mini-batch (the paper's b), a positive int.
      form: one of ``TTT_FORMS``.
      initial_state: a ``TTTState`` (``ttt_zero_state``: zeros if None), possibly inside
        a mini-batch (a previous call's final state).
      return_state: also return the final ``TTTState``.

    Returns:
      ``out [B,T,N,H]`` in the inputs' dtype (and the state).
    """
    B, _, N, H = _check(q, k, v, eta, norm_scale, norm_bias, step=False)
    if form not in TTT_FORMS:
        fail("form", f"one of {TTT_FORMS}", repr(form))
    b_size = checks.positive_int(mini_batch, "mini_batch")
    lr = _position_lr(position_lr, b_size)
    state = _state(initial_state, B, N, H)
    heads = [jnp.moveaxis(x.astype(jnp.float32), 2, 1) for x in (q, k, v)]  # [B,N,T,H]
    rates = jnp.moveaxis(eta.astype(jnp.float32), 2, 1)  # [B,N,T]
    count = jnp.broadcast_to(state.count[:, None], (B, N))
    # Without a state every row starts at a mini-batch boundary: no room for a shift.
    static = (form, b_size, initial_state is None)
    run = functools.partial(_recurrent if form == "recurrent" else _blocked, static=static)
    per_head = jax.vmap(jax.vmap(run, (0, 0, 0, 0, None, 0, 0, 0)),
                        (0, 0, 0, 0, None, None, None, 0))  # fmt: skip
    out, final = per_head(*heads, rates, lr, norm_scale.astype(jnp.float32),
                          norm_bias.astype(jnp.float32), (*state[:4], count))  # fmt: skip
    out = jnp.moveaxis(out, 1, 2).astype(jnp.result_type(q, k, v))
    final = TTTState(*final[:4], final[4][:, 0])
    return (out, final) if return_state else out


def ttt_linear_step(q, k, v, eta, state: TTTState, *, norm_scale, norm_bias, position_lr=None,
                    mini_batch: int = MINI_BATCH):  # fmt: skip
    """One token of ``ttt_linear``: q, k, v ``[B,N,H]``, eta ``[B,N]``; returns
    ``(out [B,N,H], state)`` (the recurrent form on one token)."""
    _check(q, k, v, eta, norm_scale, norm_bias, step=True)
    add = lambda x: x[:, None]  # noqa: E731
    out, state = ttt_linear(add(q), add(k), add(v), add(eta), norm_scale=norm_scale,
                            norm_bias=norm_bias, position_lr=position_lr, mini_batch=mini_batch,
                            form="recurrent", initial_state=state, return_state=True)  # fmt: skip
    return out[:, 0], state


def _check(q, k, v, eta, norm_scale, norm_bias, step: bool):
    layout = "[B,N,H]" if step else "[B,T,N,H]"
    for name, x in (("q", q), ("k", k), ("v", v)):
        checks.float_array(x, name, 3 if step else 4, layout)
    if not q.shape == k.shape == v.shape:
        fail("q, k, v", f"one shape {layout} (the target is v - k)",
             f"{q.shape}, {k.shape}, {v.shape}")  # fmt: skip
    *lead, N, H = q.shape
    checks.float_array(eta, "eta", len(lead) + 1, "[B,N]" if step else "[B,T,N]")
    if eta.shape != (*lead, N):
        fail("eta", f"shape {(*lead, N)}", f"shape {eta.shape}")
    for name, x in (("norm_scale", norm_scale), ("norm_bias", norm_bias)):
        if np.shape(x) != (N, H):
            fail(name, f"shape {(N, H)} = [N,H]", f"shape {np.shape(x)}")
    return (lead[0], 1, N, H) if step else (*lead, N, H)


def _position_lr(position_lr, b_size: int):
    if position_lr is None:
        return 1.0 / jnp.arange(1, b_size + 1, dtype=jnp.float32)
    if np.shape(position_lr) != (b_size,):
        fail("position_lr", f"shape ({b_size},) = [mini_batch]", f"shape {np.shape(position_lr)}")
    return jnp.asarray(position_lr, jnp.float32)


def _state(state, B: int, N: int, H: int) -> TTTState:
    if state is None:
        return ttt_zero_state(B, N, H)
    if not isinstance(state, TTTState):
        fail("initial_state", "a TTTState (ttt_zero_state, or a returned state)",
             type(state).__name__)  # fmt: skip
    shapes = TTTState((B, N, H, H), (B, N, H), (B, N, H, H), (B, N, H), (B,))
    for name, x, shape in zip(TTTState._fields, state, shapes, strict=True):
        if np.shape(x) != shape:
            fail(f"initial_state.{name}", f"shape {shape}", f"shape {np.shape(x)}")
    return TTTState(*(x.astype(jnp.float32) for x in state[:4]), state.count.astype(jnp.int32))


def _norm(z, scale, bias):
    """The inner model's LayerNorm over the last axis."""
    mean = z.mean(-1, keepdims=True)
    var = jnp.square(z - mean).mean(-1, keepdims=True)
    return (z - mean) * jax.lax.rsqrt(var + EPS) * scale + bias


def _grads(k, v, W, b, scale, bias):
    """``g [.., H]``: each key's loss gradient w.r.t. ``z = k W + b`` (target ``v - k``)."""
    z = k @ W + b
    out, back = jax.vjp(lambda z: _norm(z, scale, bias), z)
    return back(out - (v - k))[0]


def _recurrent(q, k, v, eta, lr, scale, bias, state, *, static):
    """One row and head, a token at a time: q, k, v ``[T,H]``, eta ``[T]``."""
    _, b_size, _ = static

    def step(carry, x):
        W, b, dW, db, count = carry
        qt, kt, vt, et = x
        g = _grads(kt, vt, W, b, scale, bias)
        dW, db = dW + et * jnp.outer(kt, g), db + et * g
        Wt, bt = W - lr[count] * dW, b - lr[count] * db
        out = qt + _norm(qt @ Wt + bt, scale, bias)
        full = count + 1 == b_size  # the mini-batch's last token: its weights are the next start
        zero = jnp.zeros_like
        carry = (jnp.where(full, Wt, W), jnp.where(full, bt, b), jnp.where(full, zero(dW), dW),
                 jnp.where(full, zero(db), db), jnp.where(full, 0, count + 1))  # fmt: skip
        return carry, out

    final, out = jax.lax.scan(step, tuple(state), (q, k, v, eta))
    return out, final


def _blocked(q, k, v, eta, lr, scale, bias, state, *, static):
    """One row and head by mini-batches (the dual or the primal form).

    The row's tokens are laid on the mini-batch grid: shifted right by the state's count
    (the first tokens finish its mini-batch) and padded to whole mini-batches, pads
    having eta 0 (they change nothing) and outputs dropped.
    """
    form, b_size, aligned = static
    T, H = q.shape
    count = state[4]
    L = -(-(T + (0 if aligned else b_size - 1)) // b_size) * b_size  # room for any count
    idx = jnp.arange(L) - count
    real = (idx >= 0) & (idx < T)

    def grid(x):
        x = jnp.where(real.reshape(-1, *([1] * (x.ndim - 1))), x[jnp.clip(idx, 0, T - 1)], 0)
        return x.reshape(L // b_size, b_size, *x.shape[1:])

    end = count + T  # the grid index past the row's last token
    last = (end - 1) // b_size  # its mini-batch
    tril = jnp.tril(jnp.ones((b_size, b_size), jnp.float32))

    def block(carry, xs):
        W, b, dW0, db0, final = carry
        Q, K, V, E, m = xs
        G = _grads(K, V, W, b, scale, bias)  # [b,H]
        EG = E[:, None] * G
        dW, db = dW0 + K.T @ EG, db0 + EG.sum(0)
        if form == "dual":
            sums_b = db0 + (tril * E) @ G  # [b,H]: row i is sum_{j<=i} eta_j g_j, with the carry
            qdW = Q @ dW0 + (jnp.tril(Q @ K.T) * E) @ G
            Z = Q @ W + b - lr[:, None] * (qdW + sums_b)
        else:
            Ws = W - lr[:, None, None] * (dW0 + jnp.cumsum(K[:, :, None] * EG[:, None, :], 0))
            bs = b - lr[:, None] * (db0 + jnp.cumsum(EG, 0))
            Z = jnp.einsum("ih,ihe->ie", Q, Ws) + bs
        out = Q + _norm(Z, scale, bias)
        W1, b1 = W - lr[-1] * dW, b - lr[-1] * db
        here = m == last  # the row's last mini-batch: its state, whole or part
        whole = end % b_size == 0
        kept = (jnp.where(whole, W1, W), jnp.where(whole, b1, b), jnp.where(whole, 0.0, dW),
                jnp.where(whole, 0.0, db))  # fmt: skip
        final = jax.tree.map(lambda a, f: jnp.where(here, a, f), kept, final)
        return (W1, b1, jnp.zeros_like(dW), jnp.zeros_like(db), final), out

    xs = (*(grid(x) for x in (q, k, v, eta)), jnp.arange(L // b_size))
    init = (*state[:4], tuple(state[:4]))
    (_, _, _, _, final), out = jax.lax.scan(block, init, xs)
    out = out.reshape(L, H)[jnp.clip(jnp.arange(T) + count, 0, L - 1)]
    return out, (*final, end % b_size)
