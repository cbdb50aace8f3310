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

from attn import checks, masks
from attn.checks import fail
from attn.linear import front, segments, ttt_forms

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
        params = _zero_model(N, H, mlp, hidden)
    params = tuple(jnp.broadcast_to(jnp.asarray(x, jnp.float32), (B, *np.shape(x)))
                   for x in params)  # fmt: skip
    sums = tuple(jnp.zeros_like(x) for x in params)
    return TTTState(params, sums, jnp.zeros((B,), jnp.int32))


def _zero_model(N: int, H: int, mlp: bool, hidden: int | None):
    F = 4 * H if hidden is None else hidden
    shapes = [(N, H, F), (N, F), (N, F, H), (N, H)] if mlp else [(N, H, H), (N, H)]
    return tuple(jnp.zeros(s, jnp.float32) for s in shapes)


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
    _check(q, k, v, eta, norm_scale, norm_bias, step=True)
    add = lambda x: x[:, None]  # noqa: E731
    out, state = fn(add(q), add(k), add(v), add(eta), norm_scale=norm_scale,
                    norm_bias=norm_bias, position_lr=position_lr, mini_batch=mini_batch,
                    form="recurrent", initial_state=state, return_state=True)  # fmt: skip
    return out[:, 0], state


def _ttt(mlp, q, k, v, eta, a):
    """The checked call of either model (``a``: the public function's keywords)."""
    B, T, N, H = _check(q, k, v, eta, a["norm_scale"], a["norm_bias"], step=False)
    form = front.check_form(a["form"], TTT_FORMS)
    b_size = checks.positive_int(a["mini_batch"], "mini_batch")
    lr = _position_lr(a["position_lr"], b_size)
    q_seg, kv_seg = checks.same_token_segment_ids(a["q_segment_ids"], a["kv_segment_ids"], B, T)
    given = a["initial_state"]
    model = _model(a["model"], given, N, H, mlp)
    state = ttt_zero_state(B, N, H, params=model) if given is None else _state(given, model, B)
    q = masks.drop_padding(q, q_seg)
    k, v, eta = (masks.drop_padding(x, kv_seg) for x in (k, v, eta))
    heads = [jnp.moveaxis(x.astype(jnp.float32), 2, 1) for x in (q, k, v)]  # [B,N,T,H]
    rates = jnp.moveaxis(eta.astype(jnp.float32), 2, 1)  # [B,N,T]
    real, start, q_read = _segments(q_seg, kv_seg, B, T)
    norms = tuple(None if x is None else jnp.asarray(x, jnp.float32)
                  for x in (a["norm_scale"], a["norm_bias"]))  # fmt: skip
    count = jnp.broadcast_to(state.count[:, None], (B, N))

    def run(fn, static, layout):
        per_head = jax.vmap(jax.vmap(functools.partial(fn, static=static),
                                     (0, 0, 0, 0, None, 0, 0, 0, 0, None)),
                            (0, 0, 0, 0, None, None, None, 0, None, 0))  # fmt: skip
        return per_head(*heads, rates, lr, *norms, (state.params, state.sums, count), model,
                        layout)  # fmt: skip

    recurrent = functools.partial(run, ttt_forms.recurrent, (form, b_size), (real, start))
    if form == "recurrent":
        out, final = recurrent()
    else:
        # Room for a count's shift (none without a state), and, with segment ids, for a
        # few segments' partial last mini-batches; rows that need more run token by token.
        extra = 0 if q_seg is None else -(-T // (4 * b_size))
        L = (-(-(T + (0 if given is None else b_size - 1)) // b_size) + extra) * b_size
        layout, fits = _grid(real, start, state.count, b_size, L)
        blocked = functools.partial(run, ttt_forms.blocked, (form, b_size, L), layout)
        out, final = blocked() if q_seg is None else jax.lax.cond(fits, blocked, recurrent)
    out = jnp.moveaxis(out, 1, 2)
    if q_read is not None:
        out = jnp.where(q_read[:, :, None, None], out, 0.0)
    out = out.astype(front.out_dtype(q, k, v))
    params, sums, counts = final
    return front.returned(out, TTTState(params, sums, counts[:, 0]), a["return_state"])


def _segments(q_seg, kv_seg, B: int, T: int):
    """``(real, start, q_read)`` ``[B,T]`` bools (``q_read`` None without ids): the tokens
    that train the model, the first tokens of segments after a row's first, and the
    queries that read (``attn.linear.segments.causal``'s rules, which every family's)."""
    if kv_seg is None:
        return jnp.ones((B, T), bool), jnp.zeros((B, T), bool), None
    rules = segments.causal(q_seg, kv_seg, None, 1)
    return rules.key_real, jnp.isneginf(rules.log_a[..., 0]), rules.q_read


def _grid(real, start, count, b_size: int, L: int):
    """Where each token sits on the blocked forms' grid of L slots: ``((slot [B,T], reset
    [B,L/b], end [B]), fits)``.

    A row's segments follow each other in whole blocks of ``b_size`` slots: segment s
    takes ``ceil((offset_s + length_s) / b)`` blocks, its tokens (padding left out) at
    ``offset_s`` on, the first segment's offset the state's count, the others' 0. A block
    that begins a segment after the first restarts the model (``reset``); ``end`` is the
    slot past the row's last token (the count, without one). ``fits``: every row's tokens
    are within the L slots.
    """
    T = real.shape[1]

    def row(real, start, count):
        seg = jnp.cumsum(start)  # the token's segment in the row
        before = jnp.cumsum(real) - real  # real tokens before it
        at = lambda x: jnp.zeros(T, jnp.int32).at[seg].add(x)  # noqa: E731  per segment
        base, length = at(jnp.where(start, before, 0)), at(real.astype(jnp.int32))
        offset = jnp.where(jnp.arange(T) == 0, count, 0)
        blocks = (offset + length + b_size - 1) // b_size
        first = b_size * (jnp.cumsum(blocks) - blocks)  # the slot each segment starts at
        slot = jnp.where(real, first[seg] + offset[seg] + before - base[seg], L)
        end = jnp.where(real.any(), jnp.max(jnp.where(real, slot, -1)) + 1, count)
        begins = jnp.where((jnp.arange(T) > 0) & (length > 0), first // b_size, L)
        reset = jnp.zeros(L // b_size, bool).at[begins].set(True, mode="drop")
        return (slot, reset, end), end <= L

    layout, fits = jax.vmap(row)(real, start, count)
    return layout, fits.all()


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


def _model(model, state, N: int, H: int, mlp: bool):
    """The per-head model ``[N,...]`` float32 segments restart from: ``model`` checked, or
    zeros of the state's width (TTT-MLP's F: the state's, else 4H)."""
    want = "TTT-MLP's 4 arrays (W1, b1, W2, b2)" if mlp else "TTT-Linear's 2 arrays (W, b)"
    for name, x in (("model", model), ("initial_state", state)):
        if x is None:
            continue
        arrays = x.params if name == "initial_state" and isinstance(x, TTTState) else x
        if not isinstance(arrays, tuple | list) or len(arrays) != (4 if mlp else 2):
            field = "initial_state.params" if name == "initial_state" else name
            if name == "initial_state" and not isinstance(x, TTTState):
                fail(name, "a TTTState (ttt_zero_state, or a returned state)", type(x).__name__)
            fail(field, want, f"{type(arrays).__name__} of {len(arrays)}")
    hidden = None
    if mlp and model is not None:
        hidden = np.shape(model[0])[-1]
    elif mlp and state is not None:
        hidden = np.shape(state.params[0])[-1]
    zero = _zero_model(N, H, mlp, hidden)
    if model is None:
        return zero
    for i, (x, z) in enumerate(zip(model, zero, strict=True)):
        front.check_state(x, f"model[{i}]", z.shape, "[N,...] (per head)")
    return tuple(jnp.asarray(x, jnp.float32) for x in model)


def _state(state: TTTState, model, B: int) -> TTTState:
    """``state`` checked against the model's shapes (per row), in float32."""
    for field in ("params", "sums"):
        arrays = getattr(state, field)
        if len(arrays) != len(model):
            fail(f"initial_state.{field}", f"{len(model)} arrays, as params", len(arrays))
        for i, (x, m) in enumerate(zip(arrays, model, strict=True)):
            front.check_state(x, f"initial_state.{field}[{i}]", (B, *m.shape), "[B,N,...]")
    if np.shape(state.count) != (B,):
        fail("initial_state.count", f"shape ({B},)", f"shape {np.shape(state.count)}")
    as32 = lambda xs: tuple(jnp.asarray(x, jnp.float32) for x in xs)  # noqa: E731
    return TTTState(as32(state.params), as32(state.sums), jnp.asarray(state.count, jnp.int32))
