"""The forms of TTT (``attn.linear.ttt``), for one row and head; the inner models.

An inner model is a tuple of arrays: ``"linear"``'s ``(W [H,H], b [H])`` with
``f_res(x) = x W + b``; ``"mlp"``'s ``(W1 [H,F], b1 [F], W2 [F,H], b2 [H])`` with
``f_res(x) = gelu(x W1 + b1) W2 + b2`` (GELU's tanh form, as the authors'). The
model is ``f(x) = x + LN(f_res(x))``; a token's loss
``1/2 |LN(f_res(k)) - (v - k)|^2``. ``sums`` has the model's structure: the current
mini-batch's gradients, each times its token's rate.

Every form takes q, k, v ``[T,H]``, eta ``[T]``, the per-position rates ``lr [b]``,
the LayerNorm's ``scale``, ``bias [H]``, the state ``(params, sums, count)``, the
model a segment restarts from and the row's segments as the form reads them
(``layout``), and returns ``(out [T,H], (params, sums, count))``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

EPS = 1e-6  # the inner LayerNorm's, as the authors'


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


def token_grads(params, k, v, scale, bias):
    """The gradient of one token's loss w.r.t. every weight (``k``, ``v`` ``[H]``)."""

    def loss(params):
        return 0.5 * jnp.sum(jnp.square(norm(residual(params, k), scale, bias) - (v - k)))

    return jax.grad(loss)(params)


def recurrent(q, k, v, eta, lr, scale, bias, state, model, layout, *, static):
    """A token at a time: its gradient at the mini-batch's start, the sums, its read.

    ``layout``: ``(real [T], start [T])`` bools: a padding token changes nothing, a
    segment's first token restarts from ``model`` (zero sums, count 0).
    """
    b_size = static[1]
    real, start = layout

    def step(carry, x):
        qt, kt, vt, et, is_real, is_start = x
        params, sums, count = jax.tree.map(
            lambda m, c: jnp.where(is_start, m, c), (model, zeros(model), 0), carry
        )
        grads = token_grads(params, kt, vt, scale, bias)
        sums = jax.tree.map(lambda s, g: s + et * g, sums, grads)
        now = jax.tree.map(lambda p, s: p - lr[count] * s, params, sums)
        out = qt + norm(residual(now, qt), scale, bias)
        full = count + 1 == b_size  # the mini-batch's last token: its weights start the next
        params = jax.tree.map(lambda p, n: jnp.where(full, n, p), params, now)
        sums = jax.tree.map(lambda s: jnp.where(full, 0.0, s), sums)
        new = (params, sums, jnp.where(full, 0, count + 1))
        return jax.tree.map(lambda n, c: jnp.where(is_real, n, c), new, carry), out

    final, out = jax.lax.scan(step, state, (q, k, v, eta, real, start))
    return out, final


def zeros(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def blocked(q, k, v, eta, lr, scale, bias, state, model, layout, *, static):
    """By mini-batches: the dual form, or the primal one (every position's weights formed).

    ``layout``: ``(slot [T], reset [L/b], end)`` (``attn.linear.ttt``'s ``_grid``): the
    row's tokens are laid on a grid of L slots where every segment's mini-batches are whole
    blocks of the grid (the first segment's shifted by the state's count), padding off the
    grid; a block that begins a segment restarts from ``model``; ``end`` is the slot past
    the row's last token. Empty slots have eta 0: they change nothing, and are not read.
    """
    form, b_size, L = static
    H = q.shape[-1]
    slot, reset, end = layout

    def grid(x):
        x = jnp.zeros((L, *x.shape[1:]), x.dtype).at[slot].set(x, mode="drop")
        return x.reshape(L // b_size, b_size, *x.shape[1:])

    last, whole = (end - 1) // b_size, end % b_size == 0
    read = _dual if form == "dual" else _primal

    def block(carry, xs):
        Q, K, V, E, m, restart = xs
        params, carried = jax.tree.map(lambda a, c: jnp.where(restart, a, c),
                                       (model, zeros(model)), carry[:2])  # fmt: skip
        out, total = read(params, carried, Q, K, V, E, lr, scale, bias)
        start = jax.tree.map(lambda p, s: p - lr[-1] * s, params, total)
        # The row's last mini-batch leaves the state: its end if whole, else its start and sums.
        kept = (jax.tree.map(lambda a, b: jnp.where(whole, a, b), start, params),
                jax.tree.map(lambda s: jnp.where(whole, 0.0, s), total))  # fmt: skip
        final = jax.tree.map(lambda a, f: jnp.where(m == last, a, f), kept, carry[2])
        return (start, zeros(total), final), out

    params, sums, _ = state
    xs = (*(grid(x) for x in (q, k, v, eta)), jnp.arange(L // b_size), reset)
    (_, _, final), out = jax.lax.scan(block, (params, sums, (params, sums)), xs)
    out = out.reshape(L, H)[jnp.minimum(slot, L - 1)]
    return out, (*final, end % b_size)


def _primal(params, carried, Q, K, V, E, lr, scale, bias):
    """One mini-batch with every position's weights: ``(out [b,H], the gradient sums)``."""
    grads = jax.vmap(token_grads, (None, 0, 0, None, None))(params, K, V, scale, bias)
    cum = jax.tree.map(lambda c, g: c + jnp.cumsum(E.reshape(-1, *[1] * (g.ndim - 1)) * g, 0),
                       carried, grads)  # fmt: skip
    now = jax.tree.map(lambda p, c: p - lr.reshape(-1, *[1] * p.ndim) * c, params, cum)
    out = Q + norm(jax.vmap(residual)(now, Q), scale, bias)
    return out, jax.tree.map(lambda c: c[-1], cum)


def _dual(params, carried, Q, K, V, E, lr, scale, bias):
    """One mini-batch in the dual form (Sun et al. 2024, section 2.5): each layer's read of
    ``W_i`` as ``Q W_0`` minus attention-like sums over the keys' gradients."""
    tril = jnp.tril(jnp.ones((Q.shape[0], Q.shape[0]), Q.dtype)) * E  # [i,j]: eta_j, j <= i
    rate = lr[:, None]

    def layer(W, b, dW, db, X, XQ, G):
        """``XQ W_i + b_i`` for every position, and the layer's sums at the end."""
        Z = XQ @ W + b - rate * (XQ @ dW + (jnp.tril(XQ @ X.T) * E) @ G + db + tril @ G)
        EG = E[:, None] * G
        return Z, (dW + X.T @ EG, db + EG.sum(0))

    def back_norm(Z):
        out, vjp = jax.vjp(lambda z: norm(z, scale, bias), Z)
        return vjp(out - (V - K))[0]

    if len(params) == 2:
        (W, b), (dW, db) = params, carried
        G = back_norm(K @ W + b)
        Z, total = layer(W, b, dW, db, K, Q, G)
        return Q + norm(Z, scale, bias), total
    (W1, b1, W2, b2), (dW1, db1, dW2, db2) = params, carried
    Z1 = K @ W1 + b1
    X2, gelu_vjp = jax.vjp(lambda z: jax.nn.gelu(z, approximate=True), Z1)
    G2 = back_norm(X2 @ W2 + b2)
    G1 = gelu_vjp(G2 @ W2.T)[0]
    Z1q, (tW1, tb1) = layer(W1, b1, dW1, db1, K, Q, G1)
    Z2q, (tW2, tb2) = layer(W2, b2, dW2, db2, X2, jax.nn.gelu(Z1q, approximate=True), G2)
    return Q + norm(Z2q, scale, bias), (tW1, tb1, tW2, tb2)
