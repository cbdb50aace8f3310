"""The forms of the families whose state is a model trained on the sequence (``attn.linear.ttt``:
TTT-Linear and TTT-MLP; ``attn.linear.titans``: Titans' memory), for one row and head.

An inner model is a tuple of arrays: ``"linear"``'s ``(W [H,H], b [H])`` with
``f_res(x) = x W + b``; ``"mlp"``'s ``(W1 [H,F], b1 [F], W2 [F,H], b2 [H])`` with
``f_res(x) = gelu(x W1 + b1) W2 + b2`` (GELU's tanh form, as TTT's authors'). The
model is ``f(x) = x + LN(f_res(x))``; a token's loss ``1/2 |f(k) - v|^2 =
1/2 |LN(f_res(k)) - (v - k)|^2``, its gradient ``g`` taken at the weights its
mini-batch started from.

A family is a ``Rule``: how its state trains the model. Within a mini-batch of b
tokens every rule reads, at position t, weights of one shape

    W_t = a_t W_0 - c_t D_0 - sum_{j <= t} C[t, j] grad_j

(``W_0`` and ``D_0`` two of its state's trees: TTT's start weights and gradient sums,
Titans' weights and momentum), so one dual form and one primal form serve every rule:
the dual one as the TTT paper's (section 2.5: per layer, matmuls, no ``W_t`` formed),
the primal one forming every ``W_t``. The state a mini-batch leaves is the same kind of
sum, ``u W_0 + d D_0 - sum_j w_j grad_j`` (``Block.ends``). The recurrent form takes
a token at a time (``Rule.token``), what the decoding steps do.

Every form takes q, k, v ``[T,H]``, the rule's per-token gates ``[T,G]`` and its
arrays (``hyper``), the LayerNorm's ``scale``, ``bias [H]``, the state ``(trees,
count)``, the model a segment restarts from and the row's segments as the form reads
them (``layout``), and returns ``(out [T,H], (trees, count))``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from attn.linear.forms import segsum

EPS = 1e-6  # the inner LayerNorm's, as TTT's authors'


def norm(z, scale, bias):
    """The inner model's LayerNorm over the last axis (none where ``scale`` is None)."""
    if scale is None:
        return z
    mean = z.mean(-1, keepdims=True)
    var = jnp.square(z - mean).mean(-1, keepdims=True)
    return (z - mean) * jax.lax.rsqrt(var + EPS) * scale + bias


def residual(params, x):
    """``f_res(x)``: the inner model without its norm and residual (``x [..., H]``)."""
    if len(params) == 2:
        W, b = params
        return x @ W + b
    W1, b1, W2, b2 = params
    return jax.nn.gelu(x @ W1 + b1, approximate=True) @ W2 + b2


def read(params, q, scale, bias):
    """``f(q) = q + LN(f_res(q))``."""
    return q + norm(residual(params, q), scale, bias)


def token_grads(params, k, v, scale, bias):
    """The gradient of one token's loss w.r.t. every weight (``k``, ``v`` ``[H]``)."""

    def loss(params):
        return 0.5 * jnp.sum(jnp.square(norm(residual(params, k), scale, bias) - (v - k)))

    return jax.grad(loss)(params)


def zeros(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def where(flag, a, b):
    return jax.tree.map(lambda x, y: jnp.where(flag, x, y), a, b)


def _along(x, tree_leaf):
    """``x [b]`` shaped to multiply a leaf ``[b, ...]``."""
    return x.reshape(-1, *[1] * (tree_leaf.ndim - 1))


class Block(NamedTuple):
    """One mini-batch as a rule reads it: its gradients at ``grad_at``, the read's terms
    ``W0``, ``D0`` and coefficients ``a [b]``, ``c [b]``, ``C [b,b]`` (lower triangular),
    and ``ends``: ``(u, d, w [b])`` of each tree ``u W0 + d D0 - sum_j w_j grad_j`` the
    rule's ``finish`` takes."""

    grad_at: tuple
    W0: tuple
    D0: tuple
    a: jax.Array
    c: jax.Array
    C: jax.Array
    ends: tuple


class Rule(NamedTuple):
    """How a family trains its inner model, for the forms.

    Attributes:
      restart: ``model -> trees``: a segment's first state.
      token: ``(trees, count, full, gates [G], hyper, grads) -> (trees, weights)``:
        one token (``grads(at)`` its gradients at the weights ``at``; ``full`` it ends a
        mini-batch), the weights its query reads.
      block: ``(trees, gates [b,G], hyper) -> Block``.
      finish: ``(trees, ends, whole, hyper) -> (next, kept)``: the next mini-batch's
        state, and the one a row ending in this mini-batch keeps (``whole``: it ends there).
    """

    restart: Callable
    token: Callable
    block: Callable
    finish: Callable


def recurrent(rule, q, k, v, gates, hyper, scale, bias, state, model, layout, *, static):
    """A token at a time. ``layout``: ``(real [T], start [T])`` bools: a padding token
    changes nothing, a segment's first token restarts from ``model`` (count 0)."""
    b_size = static[1]
    real, start = layout

    def step(carry, x):
        qt, kt, vt, gt, is_real, is_start = x
        trees, count = where(is_start, (rule.restart(model), 0), carry)
        full = count + 1 == b_size  # the mini-batch's last token

        def grads(at):
            return token_grads(at, kt, vt, scale, bias)

        trees, now = rule.token(trees, count, full, gt, hyper, grads)
        new = (trees, jnp.where(full, 0, count + 1))
        return where(is_real, new, carry), read(now, qt, scale, bias)

    final, out = jax.lax.scan(step, state, (q, k, v, gates, real, start))
    return out, final


def blocked(rule, q, k, v, gates, hyper, scale, bias, state, model, layout, *, static):
    """By mini-batches: the dual form, or the primal one (every position's weights formed).

    ``layout``: ``(slot [T], reset [L/b], end)`` (``attn.linear.ttt``'s ``grid``): the
    row's tokens are laid on a grid of L slots where every segment's mini-batches are whole
    blocks of the grid (the first segment's shifted by the state's count), padding off the
    grid; a block that begins a segment restarts from ``model``; ``end`` is the slot past
    the row's last token. Empty slots have gates that change nothing and are not read.
    """
    form, b_size, L = static
    H = q.shape[-1]
    slot, reset, end = layout

    def grid(x):
        x = jnp.zeros((L, *x.shape[1:]), x.dtype).at[slot].set(x, mode="drop")
        return x.reshape(L // b_size, b_size, *x.shape[1:])

    last, whole = (end - 1) // b_size, end % b_size == 0
    dual_or_primal = _dual if form == "dual" else _primal

    def block(carry, xs):
        Q, K, V, E, m, restart = xs
        trees, final = carry
        trees = where(restart, rule.restart(model), trees)
        spec = rule.block(trees, E, hyper)
        out, ends = dual_or_primal(spec, Q, K, V, scale, bias)
        new, kept = rule.finish(trees, ends, whole, hyper)
        return (new, where(m == last, kept, final)), out

    trees, _ = state
    xs = (*(grid(x) for x in (q, k, v, gates)), jnp.arange(L // b_size), reset)
    (_, final), out = jax.lax.scan(block, (trees, trees), xs)
    out = out.reshape(L, H)[jnp.minimum(slot, L - 1)]
    return out, (final, end % b_size)


def _primal(s: Block, Q, K, V, scale, bias):
    """One mini-batch with every position's weights formed: ``(out [b,H], ends)``."""
    grads = jax.vmap(token_grads, (None, 0, 0, None, None))(s.grad_at, K, V, scale, bias)

    def weights(u, d, w):  # u, d: [b] or scalars; w: [b, b] or [b]
        return jax.tree.map(
            lambda W, D, g: (_along(u, g) * W if jnp.ndim(u) else u * W)
            - (_along(d, g) * D if jnp.ndim(d) else d * D)
            - jnp.tensordot(w, g, axes=1),
            s.W0, s.D0, grads,
        )  # fmt: skip

    now = weights(s.a, s.c, s.C)
    out = Q + norm(jax.vmap(residual)(now, Q), scale, bias)
    return out, tuple(weights(u, -d, w) for u, d, w in s.ends)


def _dual(s: Block, Q, K, V, scale, bias):
    """One mini-batch in the dual form: each layer's read of ``W_t`` as ``a Q W_0`` minus
    attention-like sums over the keys' gradients, with no ``W_t`` formed."""
    a, c, C = s.a[:, None], s.c[:, None], s.C

    def layer(i, X, XQ, G):
        """``XQ W_t + b_t`` of layer i (weights ``2i``, ``2i+1``) at every position, and
        its part of each end."""
        W, b, dW, db = s.W0[2 * i], s.W0[2 * i + 1], s.D0[2 * i], s.D0[2 * i + 1]
        Z = a * (XQ @ W + b) - c * (XQ @ dW + db) - ((XQ @ X.T) * C) @ G - C @ G
        parts = [(u * W + d * dW - X.T @ (w[:, None] * G), u * b + d * db - w @ G)
                 for u, d, w in s.ends]  # fmt: skip
        return Z, parts

    def back_norm(Z):
        out, vjp = jax.vjp(lambda z: norm(z, scale, bias), Z)
        return vjp(out - (V - K))[0]

    if len(s.W0) == 2:
        W, b = s.grad_at
        Z, parts = layer(0, K, Q, back_norm(K @ W + b))
        return Q + norm(Z, scale, bias), tuple(parts)
    W1, b1, W2, b2 = s.grad_at
    Z1 = K @ W1 + b1
    X2, gelu_vjp = jax.vjp(lambda z: jax.nn.gelu(z, approximate=True), Z1)
    G2 = back_norm(X2 @ W2 + b2)
    G1 = gelu_vjp(G2 @ W2.T)[0]
    Z1q, first = layer(0, K, Q, G1)
    Z2q, second = layer(1, X2, jax.nn.gelu(Z1q, approximate=True), G2)
    return Q + norm(Z2q, scale, bias), tuple((*p, *r) for p, r in zip(first, second, strict=True))


# The rules -----------------------------------------------------------------------------


def _ttt_token(trees, count, full, gates, lr, grads):
    """TTT: the token's gradient (at the mini-batch's start) times its eta joins the sums;
    position ``count`` reads the start minus ``lr[count]`` times them."""
    params, sums = trees
    sums = jax.tree.map(lambda s, g: s + gates[0] * g, sums, grads(params))
    now = jax.tree.map(lambda p, s: p - lr[count] * s, params, sums)
    return where(full, (now, zeros(sums)), (params, sums)), now


def _ttt_block(trees, gates, lr):
    params, sums = trees
    eta = gates[:, 0]
    C = jnp.tril(lr[:, None] * eta[None, :])
    return Block(params, params, sums, jnp.ones_like(lr), lr, C, ((0.0, 1.0, -eta),))


def _ttt_finish(trees, ends, whole, lr):
    params, _ = trees
    (total,) = ends
    start = jax.tree.map(lambda p, s: p - lr[-1] * s, params, total)
    nxt = (start, zeros(total))
    return nxt, where(whole, nxt, (params, total))


TTT = Rule(lambda model: (model, zeros(model)), _ttt_token, _ttt_block, _ttt_finish)
"""TTT (trees: the mini-batch's start weights and its eta-weighted gradient sums; gates
``[eta]``; hyper: the per-position rates ``[b]``)."""


def _titans_token(trees, count, full, gates, _, grads):
    """Titans: momentum ``S = eta S - theta grad`` (the gradient at the mini-batch's start),
    then ``M = (1 - alpha) M + S``; the token reads M."""
    M, S, at = trees
    theta, log_eta, log_keep, _ = gates
    S = jax.tree.map(lambda s, g: jnp.exp(log_eta) * s - theta * g, S, grads(at))
    M = jax.tree.map(lambda m, s: jnp.exp(log_keep) * m + s, M, S)
    return (M, S, where(full, M, at)), M


def _titans_block(trees, gates, _):
    """The mini-batch's closed form: with ``beta_t`` the products of ``1 - alpha`` and
    ``m_t`` of eta from its start, ``S_t = m_t S_0 - sum_j N[t,j] grad_j`` (``N[t,j] =
    theta_j prod_{j<l<=t} eta_l``) and ``M_t = beta_t M_0 + f_t S_0 - sum_j (Da N)[t,j]
    grad_j`` (``Da[t,i] = beta_t / beta_i``, ``f = Da m``)."""
    M, S, at = trees
    theta, log_eta, log_keep, real = gates.T
    Da = jnp.exp(segsum(log_keep)) * real[None, :]  # an empty slot adds no momentum to M
    N = jnp.exp(segsum(log_eta)) * theta[None, :]
    beta, m = jnp.exp(jnp.cumsum(log_keep)), jnp.exp(jnp.cumsum(log_eta))
    f, G = Da @ m, Da @ N
    return Block(at, M, S, beta, -f, G, ((beta[-1], f[-1], G[-1]), (0.0, m[-1], N[-1])))


def _titans_finish(trees, ends, whole, _):
    M, S = ends
    return (M, S, M), (M, S, where(whole, M, trees[2]))


TITANS = Rule(lambda model: (model, zeros(model), model), _titans_token, _titans_block,
              _titans_finish)  # fmt: skip
"""Titans (trees: the memory M, its momentum S, and the weights its mini-batch started
from; gates ``[theta, log eta, log (1 - alpha), 1]``: the last 0 in an empty slot of the
blocked forms' grid, where the momentum must not move M)."""
