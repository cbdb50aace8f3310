"""Titans' neural long-term memory: a model trained on the sequence by gradient descent with
momentum and weight decay.

Titans (Behrouz, Zhong and Mirrokni 2025, "Titans: Learning to Memorize at Test
Time") keeps per head a memory ``M``, a model of the keys: here the inner model
the TTT family uses (``attn.linear.ttt_forms``: ``f(x) = x + LN(f_res(x))``, a
linear ``f_res`` or a two-layer MLP, the LayerNorm optional). Each token's loss is
the memory's associative error ``1/2 |f(k_t) - v_t|^2``, and the memory learns

    S_t = eta_t S_{t-1} - theta_t grad l(M_{t'}; k_t, v_t)      (momentum: the surprise)
    M_t = (1 - alpha_t) M_{t-1} + S_t                          (weight decay: forgetting)
    y_t = f(q_t; M_t)

with data-dependent gates per token and head: ``theta_t >= 0`` the step,
``eta_t = exp(log_momentum)`` and ``1 - alpha_t = exp(log_decay)`` in [0, 1]. As in
the paper's parallel training, gradients are taken at the weights the token's
mini-batch (of ``mini_batch`` tokens, its b) started from: ``t'`` the mini-batch's
start. With ``mini_batch=1`` each token's gradient is at the previous memory, the
paper's recurrence; with no momentum and a linear memory it is a delta rule with a
decay (``docs/families.md``, the regression view).

Forms, all the same function: ``"dual"`` (a mini-batch's memories read through
attention-like sums, none formed), ``"primal"`` (each memory formed) and
``"recurrent"`` (a token at a time: ``titans_step``). Arrays: q, k, v ``[B,T,N,H]``;
theta, log_momentum, log_decay ``[B,T,N]``; norm_scale, norm_bias ``[N,H]``. Not
linear in its state: no sharded form.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attn import checks
from attn.checks import fail
from attn.linear import front, inner, ttt_forms

__all__ = ["TITANS_FORMS", "TitansState", "titans", "titans_step", "titans_zero_state"]

TITANS_FORMS = ("dual", "primal", "recurrent")
MINI_BATCH = 16


class TitansState(NamedTuple):
    """Per row and head, where a sequence's memory is, in float32.

    Attributes:
      params: the memory M's weights now (``inner.model_shapes`` per row: ``[B,N,...]``).
      momentum: S, of the same shapes.
      start: the weights the current mini-batch's gradients are taken at.
      count: ``[B]`` int32, the mini-batch's tokens so far (0 at a boundary).
    """

    params: tuple
    momentum: tuple
    start: tuple
    count: jax.Array


def titans_zero_state(B: int, N: int, H: int, *, memory: str = "linear",
                      hidden: int | None = None, params=None) -> TitansState:  # fmt: skip
    """A sequence's start: the memory ``params`` (per head ``[N,...]``, the same for every
    row; zeros if None) of a ``memory`` in ``inner.MEMORIES`` (an MLP's ``hidden`` F, default
    4H), no momentum, at a mini-batch boundary."""
    if memory not in inner.MEMORIES:
        fail("memory", f"one of {inner.MEMORIES}", repr(memory))
    if params is None:
        params = inner.zero_model(memory, N, H, hidden)
    params = tuple(jnp.broadcast_to(jnp.asarray(x, jnp.float32), (B, *np.shape(x)))
                   for x in params)  # fmt: skip
    zeros = tuple(jnp.zeros_like(x) for x in params)
    return TitansState(params, zeros, params, jnp.zeros((B,), jnp.int32))


def titans(q, k, v, theta, log_momentum, log_decay, *, norm_scale=None, norm_bias=None,
           memory: str = "linear", mini_batch: int = MINI_BATCH, form: str = "dual",
           model=None, initial_state=None, return_state: bool = False, q_segment_ids=None,
           kv_segment_ids=None):  # fmt: skip
    """Titans' memory over a sequence (module docstring).

    Args:
      q, k, v: ``[B,T,N,H]``.
      theta: ``[B,T,N]`` the step of each token's gradient, >= 0.
      log_momentum: ``[B,T,N]`` log eta, <= 0 (``-inf``: no momentum).
      log_decay: ``[B,T,N]`` log (1 - alpha), <= 0 (0: no weight decay).
      norm_scale, norm_bias: ``[N,H]`` the memory's LayerNorm, or both None (none).
      memory: ``"linear"`` or ``"mlp"`` (``inner.MEMORIES``).
      mini_batch: b, the tokens whose gradients share their weights (a positive int).
      form: one of ``TITANS_FORMS``.
      model: the memory a sequence starts from, per head (``(W [N,H,H], b [N,H])``, or an
        MLP's four arrays); zeros if None. A packed segment restarts from it.
      initial_state: a ``TitansState``: the first segment's past (possibly inside a
        mini-batch).
      return_state: also return the final ``TitansState``.
      q_segment_ids, kv_segment_ids: ``[B,T]`` ints, both or neither
        (``attn.linear.front.RecurrenceArgs``): a segment starts from ``model`` with its own
        mini-batch grid; padding (id 0) trains nothing and reads nothing.

    Returns:
      ``out [B,T,N,H]`` in the inputs' dtype (and the state).
    """
    norms = (norm_scale, norm_bias)
    gates = {"theta": theta, "log_momentum": log_momentum, "log_decay": log_decay}
    B, T, N, H = inner.check_heads(q, k, v, gates, *norms, step=False)
    form, b_size, q_seg, kv_seg = inner.check_options(
        form, TITANS_FORMS, mini_batch, q_segment_ids, kv_segment_ids, B, T)  # fmt: skip
    if memory not in inner.MEMORIES:
        fail("memory", f"one of {inner.MEMORIES}", repr(memory))
    _check_gates(gates, kv_seg)
    given = initial_state
    if given is not None and not isinstance(given, TitansState):
        fail("initial_state", "a TitansState (titans_zero_state, or a returned state)",
             type(given).__name__)  # fmt: skip
    model = inner.check_model(model, None if given is None else given.params, memory, N, H)
    state = titans_zero_state(B, N, H, params=model) if given is None else given
    trees, count = inner.check_trees(state, ("params", "momentum", "start"), model, B)
    real = jnp.ones(jnp.shape(theta), jnp.float32)  # 0 in the grid's empty slots
    stacked = jnp.stack([*(jnp.asarray(x, jnp.float32) for x in gates.values()), real], -1)
    out, ((params, momentum, start), count) = inner.run(
        ttt_forms.TITANS, q, k, v, stacked, None, norms, trees, count, model, form=form,
        b_size=b_size, aligned=given is None, q_seg=q_seg, kv_seg=kv_seg)  # fmt: skip
    out = out.astype(front.out_dtype(q, k, v))
    return front.returned(out, TitansState(params, momentum, start, count), return_state)


def titans_step(q, k, v, theta, log_momentum, log_decay, state: TitansState, *,
                norm_scale=None, norm_bias=None, mini_batch: int = MINI_BATCH):  # fmt: skip
    """One token of ``titans``: q, k, v ``[B,N,H]``, the gates ``[B,N]``; returns
    ``(out [B,N,H], state)`` (the recurrent form on one token; the memory's kind is the
    state's)."""
    gates = {"theta": theta, "log_momentum": log_momentum, "log_decay": log_decay}
    inner.check_heads(q, k, v, gates, norm_scale, norm_bias, step=True)
    if not isinstance(state, TitansState):
        fail("state", "a TitansState (titans_zero_state, or a returned state)",
             type(state).__name__)  # fmt: skip
    add = lambda x: x[:, None]  # noqa: E731
    out, state = titans(add(q), add(k), add(v), *(add(x) for x in gates.values()),
                        norm_scale=norm_scale, norm_bias=norm_bias, form="recurrent",
                        memory="mlp" if len(state.params) == 4 else "linear",
                        mini_batch=mini_batch, initial_state=state, return_state=True)  # fmt: skip
    return out[:, 0], state


def _check_gates(gates: dict, kv_seg) -> None:
    """theta >= 0, the log gates <= 0, at real tokens where the values are known (under a
    trace nothing is)."""
    checks.check_values(gates["theta"], lambda x: x >= 0, "theta", "values >= 0 (a step)",
                        kv_seg)  # fmt: skip
    for name in ("log_momentum", "log_decay"):
        checks.check_values(gates[name], lambda x: x <= 0, name, "values <= 0 (log gates)",
                            kv_seg)  # fmt: skip
