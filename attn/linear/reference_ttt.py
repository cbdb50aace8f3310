"""Float64 references of the families whose state is a model trained on the sequence (TTT,
Titans, MesaNet), written from their papers' equations; ``attn.linear.reference`` lifts them.

The inner model is ``f(x) = x + LN(f_res(x))`` (no LN where ``norm_scale`` is None):
a linear ``f_res = x W + b`` (``params = (W, b)``) or an MLP ``gelu(x W1 + b1) W2 + b2``
(``(W1, b1, W2, b2)``, GELU's tanh form). A token's loss is ``1/2 |f(k) - v|^2``; its
gradients, at the weights ``theta_0`` its mini-batch started from, in closed form: with
``z = f_res(k)``, ``xh = (z - mean z) / s``, ``s = sqrt(var z + eps)`` and ``u = gamma
(gamma xh + beta - (v - k))``, the gradient at ``z`` is ``g = (u - mean u - xh mean(u
xh)) / s`` (without LN: ``z - (v - k)``); a linear layer's ``x^T g`` and ``g``, and
through the GELU ``(g W2^T) gelu'(z1)``. q, k, v ``[B,T,N,H]``; weights ``[B,N,...]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

C_GELU = np.sqrt(2 / np.pi)


def _gelu(z):
    return 0.5 * z * (1 + jnp.tanh(C_GELU * (z + 0.044715 * z**3)))


def _gelu_grad(z):
    t = jnp.tanh(C_GELU * (z + 0.044715 * z**3))
    return 0.5 * (1 + t) + 0.5 * z * (1 - t**2) * C_GELU * (1 + 3 * 0.044715 * z**2)


def _dense(x, W, b):
    return jnp.einsum("bnh,bnhe->bne", x, W) + b


def _f_res(params, x):
    if len(params) == 2:
        return _dense(x, *params)
    return _dense(_gelu(_dense(x, *params[:2])), *params[2:])


class _Inner:
    """The inner model with its LayerNorm (``scale``, ``bias`` ``[N,H]``, or None)."""

    def __init__(self, scale, bias, eps: float):
        self.scale, self.bias, self.eps = scale, bias, eps

    def _norm(self, z):
        s = jnp.sqrt(z.var(-1, keepdims=True) + self.eps)
        xh = (z - z.mean(-1, keepdims=True)) / s
        return xh, s, self.scale * xh + self.bias

    def read(self, params, q):
        z = _f_res(params, q)
        return q + (z if self.scale is None else self._norm(z)[2])

    def grads(self, params, k, v):
        """Every weight's gradient of ``1/2 |f(k) - v|^2`` (the closed form above)."""
        z1 = _dense(k, *params[:2])
        z = z1 if len(params) == 2 else _dense(_gelu(z1), *params[2:])
        if self.scale is None:
            g = z - (v - k)
        else:
            xh, s, ln = self._norm(z)
            u = self.scale * (ln - (v - k))
            g = (u - u.mean(-1, keepdims=True) - xh * (u * xh).mean(-1, keepdims=True)) / s
        outer = lambda x, g: x[..., :, None] * g[..., None, :]  # noqa: E731
        if len(params) == 2:
            return outer(k, g), g
        g1 = jnp.einsum("bne,bnfe->bnf", g, params[2]) * _gelu_grad(z1)
        return outer(k, g1), g1, outer(_gelu(z1), g), g


def _per_row(x, leaf):
    """``x [B,N]`` shaped to multiply a leaf ``[B,N,...]``."""
    return x.reshape(*x.shape, *[1] * (leaf.ndim - 2))


def _scan(token, state, *arrays):
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in arrays)
    state, out = jax.lax.scan(token, state, xs)
    return jnp.moveaxis(out, 0, 1), state


def _trees(*trees):
    return tuple(tuple(map(jnp.asarray, t)) for t in trees)


def ttt(q, k, v, eta, norm_scale, norm_bias, position_lr, initial_state, *, mini_batch: int,
        eps: float = 1e-6):  # fmt: skip
    """TTT-Linear and TTT-MLP (Sun et al. 2024) a token at a time.

    Query i of a mini-batch reads ``theta_0 - lr_i sum_{j<=i} eta_j grad_j`` and outputs
    ``f(q_i)``; the mini-batch's last token's weights start the next. eta ``[B,T,N]``,
    ``position_lr [b]``; the state ``(params, sums, count)`` as
    ``attn.linear.ttt.TTTState``. Returns ``(out, state)``.
    """
    lrs, inner = jnp.asarray(position_lr), _Inner(norm_scale, norm_bias, eps)

    def token(state, x):
        params, sums, count = state
        qt, kt, vt, et = x
        sums = tuple(s + _per_row(et, s) * g
                     for s, g in zip(sums, inner.grads(params, kt, vt), strict=True))  # fmt: skip
        lr = lrs[count]
        now = tuple(p - lr.reshape(-1, *[1] * (p.ndim - 1)) * s
                    for p, s in zip(params, sums, strict=True))  # fmt: skip
        full = count + 1 == mini_batch
        keep = lambda a, b: jnp.where(full.reshape(-1, *[1] * (a.ndim - 1)), a, b)  # noqa: E731
        params = tuple(keep(n, p) for n, p in zip(now, params, strict=True))
        sums = tuple(keep(jnp.zeros_like(s), s) for s in sums)
        return (params, sums, jnp.where(full, 0, count + 1)), inner.read(now, qt)

    params, sums, count = initial_state
    return _scan(token, (*_trees(params, sums), jnp.asarray(count)), q, k, v, eta)


def titans(q, k, v, theta, log_momentum, log_decay, norm_scale, norm_bias, initial_state, *,
           mini_batch: int, eps: float = 1e-6):  # fmt: skip
    """Titans' neural memory (Behrouz et al. 2025) a token at a time, from its equations:

        S_t = eta_t S_{t-1} - theta_t grad l(M_{t'}; k_t, v_t)
        M_t = (1 - alpha_t) M_{t-1} + S_t,     y_t = f(q_t; M_t)

    with ``eta_t = exp(log_momentum)``, ``1 - alpha_t = exp(log_decay)`` and ``t'`` the
    start of t's mini-batch of ``mini_batch`` tokens (the paper's chunked training: the
    gradients at the chunk's first weights). theta, log_momentum, log_decay ``[B,T,N]``;
    the state ``(params, momentum, start, count)`` as ``attn.linear.titans.TitansState``.
    Returns ``(out, state)``.
    """
    inner = _Inner(norm_scale, norm_bias, eps)

    def token(state, x):
        M, S, start, count = state
        qt, kt, vt, th, le, la = x
        grads = inner.grads(start, kt, vt)
        S = tuple(_per_row(jnp.exp(le), s) * s - _per_row(th, s) * g
                  for s, g in zip(S, grads, strict=True))  # fmt: skip
        M = tuple(_per_row(jnp.exp(la), m) * m + s for m, s in zip(M, S, strict=True))
        full = count + 1 == mini_batch
        keep = lambda a, b: jnp.where(full.reshape(-1, *[1] * (a.ndim - 1)), a, b)  # noqa: E731
        start = tuple(keep(m, s) for m, s in zip(M, start, strict=True))
        return (M, S, start, jnp.where(full, 0, count + 1)), inner.read(M, qt)

    params, momentum, start, count = initial_state
    state = (*_trees(params, momentum, start), jnp.asarray(count))
    return _scan(token, state, q, k, v, theta, log_momentum, log_decay)


def mesa_net(q, k, v, beta, log_gates, lam, *, cg_steps=None, scale: float = 1.0,
             initial_state=None):  # fmt: skip
    """MesaNet (von Oswald et al. 2025) a token at a time, from its equations:
    ``G_t = gamma_t G_{t-1} + beta_t k_t k_t^T``, ``S_t = gamma_t S_{t-1} + beta_t k_t
    v_t^T``, ``o_t = S_t^T (G_t + diag(lambda))^{-1} (scale q_t)``: the solve exact
    (``cg_steps`` None) or ``cg_steps`` conjugate-gradient steps from zero with 1e-5 in
    both denominators and, as the authors' backward, the same steps on the cotangent for
    the gradient (the implicit one). q, k ``[B,T,N,H]``, v ``[B,T,N,E]``, beta and
    log_gates ``[B,T,N]`` (None: no decay), lam ``[N,H]``; the state ``(S [B,N,H,E], G
    [B,N,H,H])`` (zeros if None). Returns ``(out, (S, G))``."""
    B, T, N, H = q.shape
    E = v.shape[-1]
    if log_gates is None:
        log_gates = jnp.zeros((B, T, N), q.dtype)
    if initial_state is None:
        initial_state = (jnp.zeros((B, N, H, E), q.dtype), jnp.zeros((B, N, H, H), q.dtype))
    A_lam = jax.vmap(jnp.diag)(jnp.asarray(lam))  # [N,H,H]

    def cg(A, b):
        """The CG steps, and as the authors' backward the same steps on the cotangent (the
        implicit gradient of a solve, not the steps' own)."""
        return jax.lax.custom_linear_solve(
            lambda x: jnp.einsum("bnij,bnj->bni", A, x),
            b,
            lambda _, b: cg_steps_of(A, b),
            symmetric=True,
        )

    def cg_steps_of(A, b):
        x, r, p = jnp.zeros_like(b), b, b
        d = jnp.sum(r * r, -1, keepdims=True)
        for _ in range(cg_steps):
            w = jnp.einsum("bnij,bnj->bni", A, p)
            alpha = d / (jnp.sum(p * w, -1, keepdims=True) + 1e-5)
            x, r = x + alpha * p, r - alpha * w
            d_next = jnp.sum(r * r, -1, keepdims=True)
            p, d = r + d_next / (d + 1e-5) * p, d_next
        return x

    def token(state, x):
        S, G = state
        qt, kt, vt, bt, gt = x
        decay, b = jnp.exp(gt)[..., None, None], bt[..., None, None]
        G = decay * G + b * kt[..., :, None] * kt[..., None, :]
        S = decay * S + b * kt[..., :, None] * vt[..., None, :]
        A = G + A_lam
        if cg_steps is None:
            x_star = jnp.linalg.solve(A, (scale * qt)[..., None])[..., 0]
        else:
            x_star = cg(A, scale * qt)
        return (S, G), jnp.einsum("bnh,bnhe->bne", x_star, S)

    return _scan(token, tuple(map(jnp.asarray, initial_state)), q, k, v, beta, log_gates)
