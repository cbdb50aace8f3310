"""PaTH attention: both forms against float64 products of the H matrices, forward and gradients.

The oracle is the library's reference (``attn.softmax.reference.path_attention``,
written from the definition in ``attn.softmax.path``'s docstring: logit ``scale *
q_i^T H_i ... H_{j+1} k_j + sum_{l=j+1..i} log f_l``, ``H_s = I - beta_s w_s
w_s^T``, a masked softmax) run in float64 for outputs and log-sum-exps; its
``jax.grad`` is the gradient oracle. A segment is a run of equal non-zero ids
(``seen`` below spells the rule out). Compiles dominate the time, so the fast
cases build few programs: one case carries GQA, FoX, packing with NaN in the
padding and a length that is a multiple of no block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import masks, scores
from attn.linear.reference import segment_runs
from attn.softmax import (
    path_attention,
    path_transform_keys,
    path_transform_queries,
    path_update_keys,
    reference,
)
from tests.util import rel_err

RTOL = 1e-5  # outputs, float32 against float64
GRAD_RTOL = 1e-4
B, K, G, H, E = 2, 2, 2, 8, 6
N = K * G
C = 8  # the block size of the fast cases
T_ODD = 29  # a multiple of no block size tried
NAMES = ("q", "k", "v", "w", "beta", "log_forget")
# Row 0: two packed segments then padding; row 1: left padding, one segment with a
# padding gap inside it, padding, then id 2 again after id 3 (a new segment).
IDS = np.array(
    [[1] * 11 + [2] * 12 + [0] * 6,
     [0] * 3 + [3] * 5 + [0] * 2 + [3] * 7 + [0] * 2 + [2] * 6 + [3] * 4],
    np.int32,
)  # fmt: skip


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def make_inputs(seed, T, *, b=B, k_heads=K, fox=True, beta_max=1.95):
    """q ``[B,T,N,H]``, k ``[B,T,K,H]``, v ``[B,T,K,E]``, unit w ``[B,T,K,H]``, beta ``[B,T,K]``
    in (0.05, beta_max), log forget gates ``[B,T,N]`` or None; float32 NumPy."""
    rng = np.random.default_rng(seed)
    f = np.float32
    q = rng.standard_normal((b, T, N, H)).astype(f)
    k = rng.standard_normal((b, T, k_heads, H)).astype(f)
    v = rng.standard_normal((b, T, k_heads, E)).astype(f)
    w = unit(rng.standard_normal((b, T, k_heads, H))).astype(f)
    beta = rng.uniform(0.05, beta_max, (b, T, k_heads)).astype(f)
    g = (-rng.uniform(0.0, 0.5, (b, T, N))).astype(f) if fox else None
    return [q, k, v, w, beta, g]


def with_nan_padding(args, ids):
    """The inputs with every padding token's entries NaN (they must reach nothing)."""
    pad = ids == 0
    return [None if x is None else np.where(pad.reshape(pad.shape + (1,) * (x.ndim - 2)), np.nan, x)
            for x in args]  # fmt: skip


# ----------------------------------------------------------------------------
# float64 oracles


def seen(T, ids=None, allowed=lambda i, j: j <= i):
    """``[B,T,T]`` bool: query i sees key j. Without ids: the mask. With ids: the mask, the
    same non-zero id, and no real token of another id between them (segments are runs)."""
    b = 1 if ids is None else ids.shape[0]
    out = np.zeros((b, T, T), bool)
    for r in range(b):
        for i in range(T):
            for j in range(T):
                ok = allowed(i, j)
                if ids is not None:
                    between = ids[r, j : i + 1]
                    ok = (
                        ok
                        and ids[r, i] == ids[r, j] != 0
                        and set(between[between != 0]) == {ids[r, i]}
                    )
                out[r, i, j] = ok
    return out


def ref_path(q, k, v, w, beta, g, vis, scale=H**-0.5):
    """The reference over the keys ``vis [B|1,T,T]`` shows, outputs and lse. A padding token
    (no key seen, seen by no query) is the identity with no gate: beta and g 0 there."""
    vis = np.broadcast_to(vis, (q.shape[0], *vis.shape[1:]))
    real = (vis.any(1) | vis.any(2))[..., None]
    g = None if g is None else jnp.where(real, g, 0.0)
    return reference.path_attention(q, k, v, w, jnp.where(real, beta, 0.0), g, scale=scale,
                                    ok=vis[:, None], return_lse=True)  # fmt: skip


def np_oracle(q, k, v, w, beta, g, vis):
    """``ref_path``'s float64 outputs ``[B,T,N,E]`` and lse ``[B,T,N]`` as NumPy."""
    with jax.enable_x64(True):
        x64 = [None if x is None else jnp.asarray(x, jnp.float64) for x in (q, k, v, w, beta, g)]
        return tuple(np.asarray(x) for x in jax.jit(functools.partial(ref_path, vis=vis))(*x64))


def loss_of(out, lse, do, dl):
    """``<out, do> + <lse, dl>`` over rows with a finite lse (padding rows' is -inf)."""
    return jnp.sum(out * do) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * dl)


def oracle_grads(args, vis, cotangents, scale=H**-0.5):
    with jax.enable_x64(True):
        xs = [None if a is None else jnp.asarray(np.nan_to_num(a), jnp.float64) for a in args]
        do, dl = (jnp.asarray(c, jnp.float64) for c in cotangents)
        argnums = tuple(i for i, a in enumerate(xs) if a is not None)

        def loss(*xs):
            out, lse = ref_path(*xs, vis, scale)
            return loss_of(out, lse, do, dl), (out, lse)

        grads, (out, lse) = jax.jit(jax.grad(loss, argnums, has_aux=True))(*xs)
        return (np.asarray(out), np.asarray(lse)), dict(zip(argnums, map(np.asarray, grads),
                                                             strict=True))  # fmt: skip


@functools.cache
def grads_program(form, block_size, mask, segments):
    """Jitted ``(grads, (out, lse))`` of ``loss_of`` for one form and static setting (cached:
    the tests that share shapes share the program); the segment ids are traced."""

    def loss(q, k, v, w, beta, g, ids, do, dl):
        segs = {"q_segment_ids": ids, "kv_segment_ids": ids} if segments else {}
        out, lse = path_attention(q, k, v, w, beta, log_forget=g, form=form, mask=mask,
                                  block_size=block_size, return_lse=True, **segs)  # fmt: skip
        return loss_of(out, lse, do, dl), (out, lse)

    return jax.jit(jax.grad(loss, tuple(range(6)), has_aux=True))


def ours_with_grads(args, cotangents, *, form, block_size, mask=None, ids=None):
    mask = masks.causal() if mask is None else mask
    program = grads_program(form, block_size, mask, ids is not None)
    grads, primals = program(*args, ids, *cotangents)
    return primals, {i: g for i, g in enumerate(grads) if g is not None}


def cotangents_for(args):
    rng = np.random.default_rng(7)
    b, T = args[0].shape[:2]
    return (rng.standard_normal((b, T, N, E)).astype(np.float32),
            rng.standard_normal((b, T, N)).astype(np.float32))  # fmt: skip


def check_against_oracle(args, vis, forms, *, ids=None, **kw):
    """Both forms' outputs, lse and gradients against the float64 oracles; returns errors."""
    cotangents = cotangents_for(args)
    (want_out, want_lse), want_grads = oracle_grads(args, vis, cotangents)
    errors = {}
    for form in forms:
        (out, lse), grads = ours_with_grads(args, cotangents, form=form, ids=ids, **kw)
        assert rel_err(out, want_out) < RTOL, form
        finite = np.isfinite(want_lse)
        np.testing.assert_array_equal(np.isfinite(lse), finite)
        assert rel_err(np.asarray(lse)[finite], want_lse[finite]) < RTOL, form
        errors[form] = {"out": rel_err(out, want_out)}
        for i, g in grads.items():
            assert np.isfinite(np.asarray(g)).all(), (form, NAMES[i])
            err = rel_err(g, want_grads[i])
            assert err < GRAD_RTOL, (form, NAMES[i], err)
            errors[form][NAMES[i]] = err
            if ids is not None:  # padding gets exactly zero gradients
                assert not np.asarray(g)[ids == 0].any(), (form, NAMES[i])
        if ids is not None:
            assert not np.asarray(out)[ids == 0].any()
    return errors


# ----------------------------------------------------------------------------
# Tests


def test_forms_match_float64_packed_gqa_fox_nan_padding():
    """The fast case: GQA, FoX, two packed rows with NaN padding, T a multiple of no block."""
    args = with_nan_padding(make_inputs(0, T_ODD), IDS)
    check_against_oracle(args, seen(T_ODD, IDS), ("blockwise", "naive"), ids=IDS, block_size=C)


def test_packed_equals_each_segment_alone():
    """The oracle's packing rule: each segment of the packed rows computes what it computes
    alone (so the forms, equal to the oracle, do too)."""
    args = make_inputs(1, T_ODD)
    out, _ = np_oracle(*args, seen(T_ODD, IDS))
    for r in range(B):
        for tokens in segment_runs(IDS[r]):
            alone = [None if x is None else x[r : r + 1, tokens] for x in args]
            want, _ = np_oracle(*alone, seen(len(tokens)))
            np.testing.assert_allclose(out[r, tokens], want[0], rtol=1e-12, atol=1e-12)


@pytest.mark.integration
@pytest.mark.parametrize(
    "T, block, k_heads, fox",
    [(37, 8, 1, False), (40, 64, 4, True)],
    ids=["T37-C8-mqa", "T40-C64-mha-fox"],
)
def test_forms_match_float64(T, block, k_heads, fox):
    """MQA without FoX, T beside the block; MHA with FoX, T below it (the fast tier has GQA
    with FoX and T beside the block)."""
    args = make_inputs(2, T, k_heads=k_heads, fox=fox)
    check_against_oracle(args, seen(T), ("blockwise", "naive"), block_size=block)


@pytest.mark.integration
def test_windowed_mask_and_packing_without_fox():
    window = masks.causal() & (masks.sliding_window(5) | masks.initial_tokens(2))
    allowed = lambda i, j: j <= i and (i - j < 5 or j < 2)  # noqa: E731
    args = with_nan_padding(make_inputs(3, T_ODD, fox=False, beta_max=1.0), IDS)
    check_against_oracle(args, seen(T_ODD, IDS, allowed), ("blockwise", "naive"), ids=IDS,
                         block_size=C, mask=window)  # fmt: skip


def test_beta_zero_is_softmax_attention_without_position_encoding():
    """beta = 0: every H is I, and PaTH-FoX is FoX (attn.dot_product_attention with the
    forgetting modifier; each segment's run given its own id). The fast case's program."""
    args = with_nan_padding(make_inputs(4, T_ODD), IDS)
    args[4] = 0 * args[4]
    q, k, v, _, _, g = args
    runs = IDS.copy()
    runs[1, -10:] = [4] * 6 + [5] * 4  # the second row's last two segments
    fox = scores.forgetting(np.nan_to_num(g))
    want = attn.dot_product_attention(q, k, v, mask=masks.causal(), score_mod=fox,
                                      q_segment_ids=runs, kv_segment_ids=runs)  # fmt: skip
    for form in ("blockwise", "naive"):
        (ours, _), _ = ours_with_grads(args, cotangents_for(args), form=form, block_size=C, ids=IDS)
        assert rel_err(ours, want) < RTOL, form


def test_decode_equals_forward():
    """Prefill 11 tokens (path_transform_keys), then decode token by token
    (path_update_keys, then plain softmax over the cache with FoX's running sums),
    or 6 tokens as one chunk (path_transform_queries): the forward pass's outputs
    (the float64 oracle's, which both forms equal)."""
    T, P = 24, 11
    args = make_inputs(5, T)
    want, _ = np_oracle(*args, seen(T))

    @jax.jit
    def decode(q, k, v, w, beta, g):
        c = jnp.cumsum(g, axis=1)
        prefill = path_transform_keys(k[:, :P], w[:, :P], beta[:, :P], block_size=4)

        def step(cache, t):
            cache = path_update_keys(cache, w[:, t], beta[:, t])
            k_t = jax.lax.dynamic_slice_in_dim(k, t, 1, 1)
            cache = jax.lax.dynamic_update_slice_in_dim(cache, k_t, t, axis=1)
            fox = scores.Forgetting(jax.lax.dynamic_slice_in_dim(c, t, 1, 1), c)
            q_t = jax.lax.dynamic_slice_in_dim(q, t, 1, 1)
            out = attn.dot_product_attention(q_t, cache, v, mask=masks.causal(), score_mod=fox,
                                             q_positions=t[None])  # fmt: skip
            return cache, out[:, 0]

        cache = jnp.zeros_like(k).at[:, :P].set(prefill)
        outs = jax.lax.scan(step, cache, jnp.arange(P, T))[1]
        # A chunk of tokens at once is the tokens one by one: the prefill's keys after 6 more.
        chunk = path_update_keys(prefill, w[:, P : P + 6], beta[:, P : P + 6])
        longer = path_transform_keys(k[:, : P + 6], w[:, : P + 6], beta[:, : P + 6], block_size=4)
        # Padding (id 0, NaN in w, beta and k) transforms nothing.
        nan = jnp.full_like(w[:, 0], jnp.nan)
        frozen = path_update_keys(prefill, nan, nan[..., 0], segment_ids=jnp.zeros(B, jnp.int32))
        ids = jnp.asarray([1] * P + [0] * 6)[None].repeat(B, 0)
        padded = [jnp.where(ids[..., None, None] > 0, x[:, : P + 6], jnp.nan) for x in (k, w)]
        beta_nan = jnp.where(ids[..., None] > 0, beta[:, : P + 6], jnp.nan)
        padded = path_transform_keys(*padded, beta_nan, block_size=4, segment_ids=ids)
        # The same 6 tokens as one chunk over the prefill's cache: queries carried back to
        # the chunk's start read the cache, path_attention the chunk, merged by their lse.
        part = [x[:, P : P + 6] for x in (q, k, v, w, beta, g)]
        q_back = path_transform_queries(part[0], part[3], part[4])
        fox = scores.Forgetting(c[:, P : P + 6], c[:, :P])
        old = attn.dot_product_attention(q_back, prefill, v[:, :P], score_mod=fox, return_lse=True)
        own = path_attention(*part[:5], log_forget=part[5], block_size=4, return_lse=True)
        merged = attn.merge_attention(*old, *own)[0]
        return jnp.moveaxis(outs, 0, 1), merged, chunk, longer[:, :P], prefill, frozen, padded

    outs, merged, chunk, longer, prefill, frozen, padded = decode(*args)
    assert rel_err(outs, want[:, P:]) < RTOL
    assert rel_err(merged, want[:, P : P + 6]) < RTOL
    assert rel_err(chunk, longer) < RTOL
    np.testing.assert_array_equal(frozen, prefill)
    np.testing.assert_array_equal(padded[:, P:], 0)
    assert rel_err(padded[:, :P], prefill) < RTOL


def test_queries_carried_back_and_their_gradients_are_the_products_of_householders():
    """``path_transform_queries`` (the compact form) against its definition, ``q'_i = H_0 ...
    H_i q_i`` with every ``[H,H]`` matrix multiplied out in float64 (a ``lax.scan``, whose
    ``jax.grad`` is the gradient oracle): outputs and the gradients of q, w and beta, with a
    padding token (the identity) inside the chunk and at its end."""
    C, ids = 7, np.array([[1, 1, 1, 0, 1, 1, 0]], np.int32)  # padding: the identity
    q, _, _, w, beta, _ = make_inputs(11, C, b=1)
    q, w, beta = (x.astype(np.float64) for x in (q, w, beta))

    def products(q, w, beta):  # the definition: q'_i = H_0 ... H_i q_i, H_s = I - b w w^T
        real = jnp.asarray(ids[0] > 0)
        eye = jnp.eye(H, dtype=q.dtype)

        def step(m, x):  # m [K,H,H]: H_0 ... H_{t-1}
            w_t, b_t, r = x
            h = eye - jnp.where(r, b_t, 0.0)[:, None, None] * w_t[:, :, None] * w_t[:, None, :]
            m = jnp.einsum("kij,kjl->kil", m, h)
            return m, m

        m = jax.lax.scan(step, jnp.broadcast_to(eye, (K, H, H)), (w[0], beta[0], real))[1]
        return jnp.einsum("tkij,tkgj->tkgi", m, q[0].reshape(C, K, G, H)).reshape(1, C, N, H)

    cot = np.random.default_rng(12).standard_normal((1, C, N, H))
    with jax.enable_x64():
        want_grads = jax.grad(lambda *a: jnp.sum(products(*a) * cot), argnums=(0, 1, 2))(
            jnp.asarray(q), jnp.asarray(w), jnp.asarray(beta)
        )
        want_out = products(jnp.asarray(q), jnp.asarray(w), jnp.asarray(beta))

    def ours(q, w, beta):
        return path_transform_queries(q, w, beta, segment_ids=ids)

    f32 = [jnp.asarray(x, jnp.float32) for x in (q, w, beta)]
    out = jax.jit(ours)(*f32)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(ours(*a) * cot), argnums=(0, 1, 2)))(*f32)
    assert rel_err(out, want_out) < RTOL
    for name, g, g64 in zip(("q", "w", "beta"), grads, want_grads, strict=True):
        assert rel_err(g, g64) < GRAD_RTOL, name


def test_bad_input_is_named():
    q, k, v, w, beta, g = make_inputs(6, 12)
    ok = dict(block_size=C)
    cases = {
        "mask": dict(mask=masks.full()),
        "form": dict(form="chunkwise"),
        "block_size": dict(block_size=0),
        "beta": dict(beta=beta + 2.5),
        "log_forget": dict(log_forget=-g),
        "w": dict(w=w[..., :4]),
        "k": dict(k=k[:, :6], v=v[:, :6], w=w[:, :6], beta=beta[:, :6]),
        "q_segment_ids": dict(q_segment_ids=-IDS[:, :12], kv_segment_ids=IDS[:, :12]),
    }
    base = dict(q=q, k=k, v=v, w=w, beta=beta)
    for name, change in cases.items():
        a = {**base, **ok, **change}
        with pytest.raises(ValueError, match=rf"^{name}: expected"):
            path_attention(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("w"), a.pop("beta"), **a)
    for bad in (masks.bidirectional_window(2), masks.causal() | masks.initial_tokens(3),
                masks.band(2, 1), masks.chunked(4)):  # fmt: skip
        with pytest.raises(ValueError, match=r"^mask: expected a causal"):
            path_attention(q, k, v, w, beta, mask=bad)
    with pytest.raises(ValueError, match=r"^w: expected"):
        path_update_keys(k, w[:, 0, :, :3], beta[:, 0])
    with pytest.raises(ValueError, match=r"^beta: expected"):
        path_transform_keys(k, w, -beta)
    with pytest.raises(ValueError, match=r"^w: expected"):
        path_transform_queries(q, w[:, :, :1].repeat(3, 2), beta)  # K = 3 does not divide N
    with pytest.raises(ValueError, match=r"^segment_ids: expected"):
        path_transform_queries(q, w, beta, segment_ids=IDS[:, :5])


@pytest.mark.integration
def test_blockwise_backward_memory_is_linear_in_T():
    """XLA's temporary memory for the gradient: doubling T doubles the blockwise form's
    (the naive form's, the control, quadruples)."""

    def temp(T, form):
        x = jax.ShapeDtypeStruct((1, T, 1, 16), jnp.float32)
        b = jax.ShapeDtypeStruct((1, T, 1), jnp.float32)

        def loss(q, k, v, w, beta):
            return path_attention(q, k, v, w, beta, form=form, block_size=32).sum()

        program = jax.jit(jax.grad(loss, tuple(range(5)))).lower(x, x, x, x, b).compile()
        return program.memory_analysis().temp_size_in_bytes

    small, large = temp(256, "blockwise"), temp(512, "blockwise")
    assert large < 2.2 * small, (small, large)
    small, large = temp(64, "naive"), temp(128, "naive")
    assert large > 3.5 * small, (small, large)
