"""TTT-Linear and TTT-MLP: a model trained at test time on the sequence, a mini-batch at a time.

TTT (Sun et al. 2024, "Learning to (Learn at Test Time): RNNs with Expressive
Hidden States") keeps per head an inner model ``f(x) = x + LN(f_res(x))`` with a
LayerNorm of its own (``norm_scale``, ``norm_bias``, eps 1e-6): TTT-Linear's
``f_res(x) = x W + b`` (``W [H,H]``), TTT-MLP's ``gelu(x W1 + b1) W2 + b2``
(``W1 [H,F]``, ``W2 [F,H]``, F = 4H by default). It trains the model on the keys
to reconstruct the values: token j's loss is ``1/2 |LN(f_res(k_j)) - (v_j - k_j)|^2``,
its gradient taken at the weights the token's mini-batch started from. Within a
mini-batch of ``mini_batch`` tokens, the query at position i reads the weights

    theta_i = theta_0 - lr_i sum_{j <= i} eta_j grad_theta loss_j
    o_i = q_i + LN(f_res(q_i; theta_i))

and the next mini-batch starts from the last position's weights. So the
rate of token j's gradient for query i is ``position_lr[i] * eta[j]``, as in
the authors' code (ttt-lm-jax): ``eta`` is the per-token learnable rate (the
layer's ``base_lr * sigmoid(x theta) / H``), ``position_lr`` the per-position
factor (``1 / (i + 1)`` by default; learnable in the layer).

Forms, all the same function: ``"dual"`` (the paper's dual form: per
mini-batch, matmuls and no ``theta_i`` formed), ``"primal"`` (every ``theta_i``
formed, ``attn.linear.ttt_forms``) and ``"recurrent"`` (a token at a time, what
``ttt_linear_step`` and ``ttt_mlp_step`` do). T need
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
from attn.linear import front, ttt_forms

__all__ = [
    "TTT_FORMS",
    "TTTState",
    "ttt_linear",
    "ttt_linear_step",
    "ttt_mlp",
    "ttt_mlp_step",
    "ttt_zero_state",
]

TTT_FORMS = ("dual", "primal", "recurrent")
MINI_BATCH = 16  # the paper's b


class TTTState(NamedTuple):
    """Per row and head, where a sequence's inner model is, in float32.

    Attributes:
      params: the weights the current mini-batch started from: TTT-Linear's
        ``(W [B,N,H,H], b [B,N,H])``, TTT-MLP's ``(W1 [B,N,H,F], b1 [B,N,F],
        W2 [B,N,F,H], b2 [B,N,H])``.
      sums: the mini-batch's gradients so far, each times its token's eta (``params``'
        shapes).
      count: ``[B]`` int32, the mini-batch's tokens so far (0 at a boundary).
    """

    params: tuple
    sums: tuple
    count: jax.Array


def ttt_zero_state(B: int, N: int, H: int, *, mlp: bool = False, hidden: int | None = None,
                   params=None) -> TTTState:  # fmt: skip
    """The state of a sequence's start, at a mini-batch boundary: ``params`` (a layer's
    learned initial model, per head ``[N,...]`` and the same for every row; zeros if None)
    of TTT-Linear, or of TTT-MLP with ``mlp`` (``hidden`` F, default 4H)."""
    if params is None:
        F = 4 * H if hidden is None else hidden
        shapes = [(N, H, F), (N, F), (N, F, H), (N, H)] if mlp else [(N, H, H), (N, H)]
        params = tuple(jnp.zeros(s) for s in shapes)
    params = tuple(jnp.broadcast_to(jnp.asarray(x, jnp.float32), (B, *np.shape(x)))
                   for x in params)  # fmt: skip
    sums = tuple(jnp.zeros_like(x) for x in params)
    return TTTState(params, sums, jnp.zeros((B,), jnp.int32))


def ttt_linear(q, k, v, eta, *, norm_scale, norm_bias, position_lr=None,
               mini_batch: int = MINI_BATCH, form: str = "dual", initial_state=None,
               return_state: bool = False):  # fmt: skip
    """TTT-Linear over a sequence (module docstring).

    Args:
      q, k, v: ``[B,T,N,H]``.
      eta: ``[B,T,N]`` each token's gradient rate.
      norm_scale, norm_bias: ``[N,H]`` the inner LayerNorm's; both None for a model
        without one (``f(x) = x + f_res(x)``: the regression view's special case).
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
    return _ttt(False, q, k, v, eta, norm_scale, norm_bias, position_lr, mini_batch, form,
                initial_state, return_state)  # fmt: skip


def ttt_mlp(q, k, v, eta, *, norm_scale, norm_bias, position_lr=None,
            mini_batch: int = MINI_BATCH, form: str = "dual", initial_state=None,
            return_state: bool = False):  # fmt: skip
    """TTT-MLP over a sequence: ``ttt_linear``'s arguments, the inner model a two-layer MLP
    (its width F from ``initial_state``; ``ttt_zero_state(..., mlp=True)``'s 4H if None)."""
    return _ttt(True, q, k, v, eta, norm_scale, norm_bias, position_lr, mini_batch, form,
                initial_state, return_state)  # fmt: skip


def ttt_linear_step(q, k, v, eta, state: TTTState, *, norm_scale, norm_bias, position_lr=None,
                    mini_batch: int = MINI_BATCH):  # fmt: skip
    """One token of ``ttt_linear``: q, k, v ``[B,N,H]``, eta ``[B,N]``; returns
    ``(out [B,N,H], state)`` (the recurrent form on one token)."""
    return _step(ttt_linear, q, k, v, eta, state, norm_scale, norm_bias, position_lr, mini_batch)


def ttt_mlp_step(q, k, v, eta, state: TTTState, *, norm_scale, norm_bias, position_lr=None,
                 mini_batch: int = MINI_BATCH):  # fmt: skip
    """One token of ``ttt_mlp`` (as ``ttt_linear_step``)."""
    return _step(ttt_mlp, q, k, v, eta, state, norm_scale, norm_bias, position_lr, mini_batch)


def _step(fn, q, k, v, eta, state, norm_scale, norm_bias, position_lr, mini_batch):
    _check(q, k, v, eta, norm_scale, norm_bias, step=True)
    add = lambda x: x[:, None]  # noqa: E731
    out, state = fn(add(q), add(k), add(v), add(eta), norm_scale=norm_scale,
                    norm_bias=norm_bias, position_lr=position_lr, mini_batch=mini_batch,
                    form="recurrent", initial_state=state, return_state=True)  # fmt: skip
    return out[:, 0], state


def _ttt(mlp, q, k, v, eta, norm_scale, norm_bias, position_lr, mini_batch, form,
         initial_state, return_state):  # fmt: skip
    B, _, N, H = _check(q, k, v, eta, norm_scale, norm_bias, step=False)
    if form not in TTT_FORMS:
        fail("form", f"one of {TTT_FORMS}", repr(form))
    b_size = checks.positive_int(mini_batch, "mini_batch")
    lr = _position_lr(position_lr, b_size)
    state = _state(initial_state, B, N, H, mlp)
    heads = [jnp.moveaxis(x.astype(jnp.float32), 2, 1) for x in (q, k, v)]  # [B,N,T,H]
    rates = jnp.moveaxis(eta.astype(jnp.float32), 2, 1)  # [B,N,T]
    count = jnp.broadcast_to(state.count[:, None], (B, N))
    # Without a state every row starts at a mini-batch boundary: no room for a shift.
    static = (form, b_size, initial_state is None)
    run = ttt_forms.recurrent if form == "recurrent" else ttt_forms.blocked
    run = functools.partial(run, static=static)
    per_head = jax.vmap(jax.vmap(run, (0, 0, 0, 0, None, 0, 0, 0)),
                        (0, 0, 0, 0, None, None, None, 0))  # fmt: skip
    out, (params, sums, counts) = per_head(
        *heads, rates, lr, *(None if x is None else jnp.asarray(x, jnp.float32)
                             for x in (norm_scale, norm_bias)),
        (state.params, state.sums, count),
    )  # fmt: skip
    out = jnp.moveaxis(out, 1, 2).astype(jnp.result_type(q, k, v))
    return (out, TTTState(params, sums, counts[:, 0])) if return_state else out


def _check(q, k, v, eta, norm_scale, norm_bias, step: bool):
    """The heads as every family checks them (``front.check_heads``), one width and one head
    count for q, k and v (the target is ``v - k``), and the LayerNorm's ``[N,H]``."""
    B, T, _, N, H, _ = front.check_heads(q, k, v, step, {"eta": eta})
    if v.shape != q.shape:
        fail("v", f"the shape of q and k {tuple(q.shape)} (the target is v - k)",
             f"shape {tuple(v.shape)}")  # fmt: skip
    if (norm_scale is None) != (norm_bias is None):
        fail("norm_scale, norm_bias", "both arrays or both None (no LayerNorm)",
             f"{type(norm_scale).__name__}, {type(norm_bias).__name__}")  # fmt: skip
    for name, x in (("norm_scale", norm_scale), ("norm_bias", norm_bias)):
        if x is not None and np.shape(x) != (N, H):
            fail(name, f"shape {(N, H)} = [N,H]", f"shape {np.shape(x)}")
    return B, T, N, H


def _position_lr(position_lr, b_size: int):
    if position_lr is None:
        return 1.0 / jnp.arange(1, b_size + 1, dtype=jnp.float32)
    if np.shape(position_lr) != (b_size,):
        fail("position_lr", f"shape ({b_size},) = [mini_batch]", f"shape {np.shape(position_lr)}")
    return jnp.asarray(position_lr, jnp.float32)


def _state(state, B: int, N: int, H: int, mlp: bool) -> TTTState:
    if state is None:
        return ttt_zero_state(B, N, H, mlp=mlp)
    if not isinstance(state, TTTState):
        fail("initial_state", "a TTTState (ttt_zero_state, or a returned state)",
             type(state).__name__)  # fmt: skip
    if len(state.params) != (4 if mlp else 2) or len(state.sums) != len(state.params):
        want = "TTT-MLP's 4 arrays (W1, b1, W2, b2)" if mlp else "TTT-Linear's 2 arrays (W, b)"
        fail("initial_state.params", f"{want}, and sums of the same", f"{len(state.params)}")
    F = np.shape(state.params[0])[-1] if mlp else H
    linear = [(B, N, H, H), (B, N, H)]
    shapes = [(B, N, H, F), (B, N, F), (B, N, F, H), (B, N, H)] if mlp else linear
    for field in ("params", "sums"):
        for i, (x, shape) in enumerate(zip(getattr(state, field), shapes, strict=True)):
            if np.shape(x) != shape:
                fail(f"initial_state.{field}[{i}]", f"shape {shape}", f"shape {np.shape(x)}")
    if np.shape(state.count) != (B,):
        fail("initial_state.count", f"shape ({B},)", f"shape {np.shape(state.count)}")
    as32 = lambda xs: tuple(jnp.asarray(x, jnp.float32) for x in xs)  # noqa: E731
    return TTTState(as32(state.params), as32(state.sums), jnp.asarray(state.count, jnp.int32))
