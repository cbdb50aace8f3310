"""MLA (``attn.latent_attention``) against oracles written from DeepSeek-V2's equations.

Two float64 oracles, neither built from ``attn``:

* ``np_mla``: NumPy, one query and one head at a time, from hidden states ``h``
  and the paper's matrices (its eqs. 9-19 without query compression):
  ``c_KV = W_DKV h``, ``k_C = W_UK c_KV``, ``v_C = W_UV c_KV``,
  ``k_R = RoPE(W_KR h)`` shared by the heads, ``q_C = W_UQ h``,
  ``q_R = RoPE(W_QR h)`` per head, ``k = [k_C; k_R]``, ``q = [q_C; q_R]``,
  ``o_i = sum_j softmax_j(q_i . k_j / sqrt(d_h + d_h^R)) v_C,j`` over the
  visible keys, heads concatenated. Its RoPE is a rotation matrix per position
  in the half-split convention of ``attn.apply_rope``'s default layout.
* ``jnp_mla``: the same equations vectorized in float64 ``jax.numpy``, checked
  against ``np_mla`` and differentiated with ``jax.grad`` for the gradients.

The paper's matrices map column vectors (``k_C = W_UK c``, ``W_UK [N*Hn,R]``,
heads stacked along the rows); ``latent_attention`` takes ``w_uk [R,N,Hn]``,
i.e. ``W_UK.T`` split by head, so the test also pins that layout.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import masks
from tests.util import rel_err

B, D, N, Hn, Hr, R, E = 2, 8, 3, 4, 2, 5, 3  # Hr != Hn, R != N * Hn, E != Hn
ROPE_BASE = 10000.0


# ----------------------------------------------------------------------------
# float64 oracles


def np_rope(x, pos):
    """``x [..., d]`` rotated by position ``pos`` (scalar): channel i pairs with i + d/2."""
    d = x.shape[-1]
    rot = np.zeros((d, d))
    for i in range(d // 2):
        angle = pos * ROPE_BASE ** (-2.0 * i / d)
        c, s = np.cos(angle), np.sin(angle)
        rot[i, i], rot[i, i + d // 2] = c, -s
        rot[i + d // 2, i], rot[i + d // 2, i + d // 2] = s, c
    return x @ rot.T


def visible(rule, q_pos, k_pos):
    """Is key position ``k_pos`` visible to query position ``q_pos``."""
    kind, w = rule
    if kind == "causal":
        return k_pos <= q_pos
    return q_pos - w < k_pos <= q_pos  # sliding window of w positions, itself included


def np_projections(h, W, pos):
    """The paper's per-token vectors in float64 from ``h [B,S,D]`` at positions ``pos [S]``."""
    h = np.asarray(h, np.float64)
    c_kv = h @ W["DKV"].T  # [B,S,R]
    k_r = np.stack([np_rope(h[:, j] @ W["KR"].T, p) for j, p in enumerate(pos)], 1)  # [B,S,Hr]
    q_c = (h @ W["UQ"].T).reshape(*h.shape[:2], N, Hn)
    q_r = (h @ W["QR"].T).reshape(*h.shape[:2], N, Hr)
    q_r = np.stack([np_rope(q_r[:, j], p) for j, p in enumerate(pos)], 1)  # [B,S,N,Hr]
    return q_c, q_r, c_kv, k_r


def np_mla(h, W, pos, rule, n_queries):
    """Heads concatenated ``[B,T,N*E]`` and weights ``[B,N,T,S]`` of the last
    ``n_queries`` tokens of ``h [B,S,D]``, computed per query and per head."""
    q_c, q_r, c_kv, k_r = np_projections(h, W, pos)
    S = h.shape[1]
    out = np.zeros((B, n_queries, N * E))
    weights = np.zeros((B, N, n_queries, S))
    for b in range(B):
        k_c = c_kv[b] @ W["UK"].T  # [S, N*Hn]
        v_c = c_kv[b] @ W["UV"].T  # [S, N*E]
        for t in range(n_queries):
            qt = S - n_queries + t
            seen = [j for j in range(S) if visible(rule, pos[qt], pos[j])]
            for i in range(N):
                q = np.concatenate([q_c[b, qt, i], q_r[b, qt, i]])
                k = [np.concatenate([k_c[j, i * Hn : (i + 1) * Hn], k_r[b, j]]) for j in seen]
                logits = np.array([q @ kj for kj in k]) / np.sqrt(Hn + Hr)
                p = np.exp(logits - logits.max())
                p /= p.sum()
                weights[b, i, t, seen] = p
                out[b, t, i * E : (i + 1) * E] = p @ v_c[seen][:, i * E : (i + 1) * E]
    return out, weights


def jnp_mla(q_c, q_r, c_kv, k_r, W_UK, W_UV, allowed):
    """The equations vectorized, float64: ``q_c [B,T,N,Hn]``, ``q_r [B,T,N,Hr]``,
    ``c_kv [B,S,R]``, ``k_r [B,S,Hr]``, paper matrices, ``allowed [B,T,S]``.
    Returns ``[B,T,N*E]``."""
    S = c_kv.shape[1]
    k_c = jnp.einsum("BSR,MR->BSM", c_kv, W_UK).reshape(B, S, N, Hn)
    v_c = jnp.einsum("BSR,MR->BSM", c_kv, W_UV).reshape(B, S, N, E)
    k = jnp.concatenate([k_c, jnp.broadcast_to(k_r[:, :, None], (B, S, N, Hr))], -1)
    q = jnp.concatenate([q_c, q_r], -1)
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) / jnp.sqrt(Hn + Hr)
    logits = jnp.where(allowed[:, None], logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("BNTS,BSNE->BTNE", p, v_c)
    return out.reshape(*out.shape[:2], N * E)


# ----------------------------------------------------------------------------
# cases


@dataclasses.dataclass(frozen=True)
class Case:
    S: int  # tokens in the sequence (the latent cache)
    T: int  # queries: the last T tokens
    rule: tuple  # ("causal", None) or ("window", w)
    cache_order: bool  # store the cache slots shuffled, with explicit positions


CASES = {
    "causal_prefill": Case(S=6, T=6, rule=("causal", None), cache_order=False),
    "causal_decode": Case(S=7, T=3, rule=("causal", None), cache_order=True),
    "window_decode": Case(S=8, T=2, rule=("window", 3), cache_order=True),
}


def paper_weights(rng):
    """The paper's matrices, mapping column vectors (``y = W x``)."""
    shapes = {
        "DKV": (R, D),
        "UK": (N * Hn, R),
        "UV": (N * E, R),
        "KR": (Hr, D),
        "UQ": (N * Hn, D),
        "QR": (N * Hr, D),
    }
    return {k: rng.standard_normal(s) / np.sqrt(s[1]) for k, s in shapes.items()}


@jax.jit
def jax_projections(h, W, pos):
    """The arguments of ``latent_attention`` in float32: projections and our RoPE."""
    S = h.shape[1]
    c_kv = h @ W["DKV"].T
    k_rope = attn.apply_rope((h @ W["KR"].T)[:, :, None], pos, base=ROPE_BASE)[:, :, 0]
    q_nope = (h @ W["UQ"].T).reshape(B, S, N, Hn)
    q_rope = attn.apply_rope((h @ W["QR"].T).reshape(B, S, N, Hr), pos, base=ROPE_BASE)
    return q_nope, q_rope, c_kv, k_rope


def inputs(case: Case, seed: int):
    """Oracle inputs and the float32 arguments of ``latent_attention`` for one case."""
    rng = np.random.default_rng(seed)
    W = paper_weights(rng)
    h = rng.standard_normal((B, case.S, D)).astype(np.float32)
    pos = np.arange(case.S)
    f32 = {k: jnp.asarray(v, jnp.float32) for k, v in W.items()}
    q_nope, q_rope, c_kv, k_rope = jax_projections(jnp.asarray(h), f32, pos)
    q_nope, q_rope = q_nope[:, -case.T :], q_rope[:, -case.T :]
    kw = {}
    q_pos, kv_pos = np.broadcast_to(pos[-case.T :], (B, case.T)), np.broadcast_to(pos, (B, case.S))
    if case.cache_order:
        # A ring-buffer-like cache: slots in another order per row; positions say where.
        kv_pos = np.stack([rng.permutation(case.S) for _ in range(B)])
        take = jnp.asarray(kv_pos)
        c_kv = jnp.take_along_axis(c_kv, take[:, :, None], 1)
        k_rope = jnp.take_along_axis(k_rope, take[:, :, None], 1)
        kw = dict(q_positions=jnp.asarray(q_pos), kv_positions=jnp.asarray(kv_pos))
    args = dict(
        q_nope=q_nope,
        q_rope=q_rope,
        c_kv=c_kv,
        k_rope=k_rope,
        w_uk=f32["UK"].T.reshape(R, N, Hn),
        w_uv=f32["UV"].T.reshape(R, N, E),
    )
    allowed = np.array(
        [[[visible(case.rule, q, k) for k in kv_pos[b]] for q in q_pos[b]] for b in range(B)]
    )
    mask = masks.causal() if case.rule[0] == "causal" else masks.sliding_window(case.rule[1])
    return h, W, args, kw, mask, allowed, kv_pos


ARGS = ("q_nope", "q_rope", "c_kv", "k_rope", "w_uk", "w_uv")


@pytest.mark.parametrize("form", attn.LATENT_FORMS)
@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_gradients_match_the_paper_equations(name, form):
    case = CASES[name]
    h, W, args, kw, mask, allowed, kv_pos = inputs(case, seed=len(name))
    out_np, w_np = np_mla(h, W, np.arange(case.S), case.rule, case.T)

    # Jitted so each case compiles once rather than op by op (CI time).
    forward = jax.jit(
        functools.partial(
            attn.latent_attention, form=form, mask=mask, impl="dense", return_weights=True
        )
    )
    out, w = forward(**args, **kw)
    assert out.shape == (B, case.T, N, E) and w.shape == (B, N, case.T, case.S)
    assert rel_err(out.reshape(B, case.T, N * E), out_np) <= 1e-5
    # The cache slots are shuffled; put the weights back in position order.
    w_by_pos = np.take_along_axis(np.asarray(w), np.argsort(kv_pos)[:, None, None], -1)
    assert rel_err(w_by_pos, w_np) <= 1e-5

    g = np.random.default_rng(1).standard_normal((B, case.T, N * E))

    def loss(*xs):
        o = attn.latent_attention(*xs, form=form, mask=mask, **kw)
        return (o.reshape(B, case.T, N * E) * g.astype(np.float32)).sum()

    grads = jax.jit(jax.grad(loss, argnums=range(6)))(*(args[a] for a in ARGS))

    with jax.enable_x64(True):
        x64 = {a: jnp.asarray(np.asarray(args[a]), jnp.float64) for a in ARGS}
        paper = dict(  # w_uk [R,N,Hn] is W_UK.T split by head
            q_c=x64["q_nope"],
            q_r=x64["q_rope"],
            c_kv=x64["c_kv"],
            k_r=x64["k_rope"],
            W_UK=x64["w_uk"].reshape(R, N * Hn).T,
            W_UV=x64["w_uv"].reshape(R, N * E).T,
        )
        ok = jnp.asarray(allowed)
        oracle = jax.jit(jnp_mla)(**paper, allowed=ok)
        # The vectorized oracle is the per-head NumPy one at the same point.
        assert rel_err(oracle, out_np) <= 1e-5
        assert rel_err(oracle, out.reshape(B, case.T, N * E)) <= 1e-5

        def oracle_loss(*xs):
            return (jnp_mla(*xs, allowed=ok) * jnp.asarray(g)).sum()

        want = jax.jit(jax.grad(oracle_loss, argnums=range(6)))(*paper.values())
        want = [np.asarray(x) for x in want]
    want[4] = want[4].T.reshape(R, N, Hn)
    want[5] = want[5].T.reshape(R, N, E)
    for arg, got, ref in zip(ARGS, grads, want, strict=True):
        assert rel_err(got, ref) <= 1e-5, arg


def test_the_two_oracles_agree_at_float64():
    """The NumPy oracle and the vectorized one agree to float64 rounding on float64
    intermediates, so the 1e-5 above measures float32, not the oracles."""
    case = CASES["window_decode"]
    rng = np.random.default_rng(3)
    W = paper_weights(rng)
    h = rng.standard_normal((B, case.S, D))
    pos = np.arange(case.S)
    out_np, _ = np_mla(h, W, pos, case.rule, case.T)
    q_c, q_r, c_kv, k_r = np_projections(h, W, pos)
    allowed = np.array([[visible(case.rule, q, k) for k in pos] for q in pos[-case.T :]])
    with jax.enable_x64(True):
        oracle = jnp_mla(
            jnp.asarray(q_c[:, -case.T :]),
            jnp.asarray(q_r[:, -case.T :]),
            jnp.asarray(c_kv),
            jnp.asarray(k_r),
            jnp.asarray(W["UK"]),
            jnp.asarray(W["UV"]),
            jnp.asarray(np.broadcast_to(allowed, (B, case.T, case.S))),
        )
        assert rel_err(oracle, out_np) <= 1e-12


@pytest.mark.parametrize(
    "bad, arg",
    [
        (dict(form="fast"), "form"),
        (dict(q_rope=np.zeros((B, 2, N))), "q_rope"),
        (dict(q_rope=np.zeros((B, 2, N + 1, Hr))), "q_rope"),
        (dict(c_kv=np.zeros((B + 1, 5, R))), "c_kv"),
        (dict(k_rope=np.zeros((B, 5, Hr + 2))), "k_rope"),
        (dict(w_uk=np.zeros((R, N, Hn + 1))), "w_uk"),
        (dict(w_uv=np.zeros((R + 1, N, E))), "w_uv"),
    ],
)
def test_bad_shapes_raise_naming_the_argument(bad, arg):
    good = dict(
        q_nope=np.zeros((B, 2, N, Hn)),
        q_rope=np.zeros((B, 2, N, Hr)),
        c_kv=np.zeros((B, 5, R)),
        k_rope=np.zeros((B, 5, Hr)),
        w_uk=np.zeros((R, N, Hn)),
        w_uv=np.zeros((R, N, E)),
    )
    with pytest.raises(ValueError, match=f"^{arg}: expected"):
        attn.latent_attention(**{**good, **bad})
