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

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attn.checks import fail
from attn.linear import front, inner, ttt_forms

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
        params = inner.zero_model("mlp" if mlp else "linear", N, H, hidden)
    params = tuple(jnp.broadcast_to(jnp.asarray(x, jnp.float32), (B, *np.shape(x)))
                   for x in params)  # fmt: skip
    sums = tuple(jnp.zeros_like(x) for x in params)
    return TTTState(params, sums, jnp.zeros((B,), jnp.int32))


def ttt_linear(q, k, v, eta, *, norm_scale, norm_bias, position_lr=None,
               mini_batch: int = MINI_BATCH, form: str = "dual", model=None,
               initial_state=None, return_state: bool = False, q_segment_ids=None,
               kv_segment_ids=None):  # fmt: skip
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
      model: the inner model a sequence starts from, per head: ``(W [N,H,H], b [N,H])``
        (a layer's learned initial weights; zeros if None). A packed segment restarts
        from it, and so does a row without ``initial_state``.
      initial_state: a ``TTTState`` (``ttt_zero_state``), possibly inside a mini-batch
        (a previous call's final state): the first segment's past.
      return_state: also return the final ``TTTState`` (the last segment's).
      q_segment_ids, kv_segment_ids: ``[B,T]`` ints, both or neither, as every
        fixed-state family takes them (``attn.linear.front.RecurrenceArgs``): a segment
        starts from ``model`` with its own mini-batch grid; padding (id 0) trains nothing,
        moves no mini-batch and reads nothing.

    Returns:
      ``out [B,T,N,H]`` in the inputs' dtype (and the state).
    """
    return _ttt(False, q, k, v, eta, locals())


def ttt_mlp(q, k, v, eta, *, norm_scale, norm_bias, position_lr=None,
            mini_batch: int = MINI_BATCH, form: str = "dual", model=None, initial_state=None,
            return_state: bool = False, q_segment_ids=None, kv_segment_ids=None):  # fmt: skip
    """TTT-MLP over a sequence: ``ttt_linear``'s arguments, the inner model a two-layer MLP
    (``model``: ``(W1 [N,H,F], b1 [N,F], W2 [N,F,H], b2 [N,H])``; its width F from
    ``model`` or ``initial_state``, else 4H)."""
    return _ttt(True, q, k, v, eta, locals())


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
    inner.check_heads(q, k, v, {"eta": eta}, norm_scale, norm_bias, step=True)
    add = lambda x: x[:, None]  # noqa: E731
    out, state = fn(add(q), add(k), add(v), add(eta), norm_scale=norm_scale,
                    norm_bias=norm_bias, position_lr=position_lr, mini_batch=mini_batch,
                    form="recurrent", initial_state=state, return_state=True)  # fmt: skip
    return out[:, 0], state


def _ttt(mlp, q, k, v, eta, a):
    """The checked call of either model (``a``: the public function's keywords)."""
    norms = (a["norm_scale"], a["norm_bias"])
    B, T, N, H = inner.check_heads(q, k, v, {"eta": eta}, *norms, step=False)
    form, b_size, q_seg, kv_seg = inner.check_options(
        a["form"], TTT_FORMS, a["mini_batch"], a["q_segment_ids"], a["kv_segment_ids"], B, T
    )
    lr = _position_lr(a["position_lr"], b_size)
    given = a["initial_state"]
    if given is not None and not isinstance(given, TTTState):
        fail("initial_state", "a TTTState (ttt_zero_state, or a returned state)",
             type(given).__name__)  # fmt: skip
    memory = "mlp" if mlp else "linear"
    model = inner.check_model(a["model"], None if given is None else given.params, memory, N, H)
    if given is None:
        state = ttt_zero_state(B, N, H, params=model)
        trees, count = (state.params, state.sums), state.count
    else:
        trees, count = inner.check_trees(given, ("params", "sums"), model, B)
    out, ((params, sums), count) = inner.run(
        ttt_forms.TTT, q, k, v, eta[..., None], lr, norms, trees, count, model, form=form,
        b_size=b_size, aligned=given is None, q_seg=q_seg, kv_seg=kv_seg)  # fmt: skip
    out = out.astype(front.out_dtype(q, k, v))
    return front.returned(out, TTTState(params, sums, count), a["return_state"])


def _position_lr(position_lr, b_size: int):
    if position_lr is None:
        return 1.0 / jnp.arange(1, b_size + 1, dtype=jnp.float32)
    if np.shape(position_lr) != (b_size,):
        fail("position_lr", f"shape ({b_size},) = [mini_batch]", f"shape {np.shape(position_lr)}")
    return jnp.asarray(position_lr, jnp.float32)
