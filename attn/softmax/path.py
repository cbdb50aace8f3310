"""PaTH attention: softmax attention positioned by accumulated Householder-like transforms.

PaTH (Yang et al. 2025, "PaTH Attention: Position Encoding via Accumulating
Householder Transformations") replaces RoPE's fixed rotations by transforms
computed from the data. Token s carries ``H_s = I - beta_s w_s w_s^T`` (``w_s``
unit-norm in the paper, ``beta_s`` in (0, 2): ``H_s`` is then symmetric with
eigenvalues 1 and ``1 - beta_s``, so no product of them grows), and the logit
of query i on key j <= i is

    s_ij = scale * q_i^T (H_i H_{i-1} ... H_{j+1}) k_j        (+ c_i - c_j with FoX)

key j passes through the transforms of the tokens after it, up to and
including the query's own (``j = i`` is the plain ``q_i . k_i``). The paper
writes it ``k_j^T (prod_{s=j+1}^{i} H_s) q_i`` with the product in increasing
s, the transpose of the same number (each ``H_s`` is symmetric). Then causal
softmax attention: float32 statistics, a row that sees no key gives zeros.
With FoX's forget gate (PaTH-FoX), ``c`` is the running sum of per-token log
gates and ``c_i - c_j = sum_{l=j+1..i} log f_l`` joins the scaled logit
(``attn.scores.forgetting``, the modifier every softmax implementation takes).
The gates' sums are added unscaled, as FoX adds them; fla's PaTH kernel adds
them inside the scale (``scale * (q . k~ + c_i - c_j)``): pass
``log_forget * scale`` for its convention (``models.PathAttention`` does).

Forms (``PATH_FORMS``), the same function, tested against a float64 product
of the ``H`` matrices on outputs and every gradient:

- ``"naive"``: the product written out. A scan over tokens t carries every
  key through ``H_t`` once t is past it, and row t of the logits is ``q_t``
  against those keys; then one masked softmax. ``O(T^2 H)`` memory in the
  backward: the reference, for tests and small T.
- ``"blockwise"`` (the default): the paper's algorithm. Tokens are cut into
  blocks of C; within a block the product of its transforms has the compact
  (UT) form ``H_C ... H_1 = I - W^T X`` with ``X = (I + diag(beta)
  strict_lower(W W^T))^{-1} diag(beta) W`` (one unit-lower-triangular solve per
  block), every prefix ``H_t ... H_1`` being ``I - sum_{s<=t} w_s x_s^T``. The
  same solve gives, for each key, its path through the rest of its block, and
  for each query its path back to the start of its block, so the diagonal
  block's logits are two matmuls and each key leaves its block as one vector
  ``k~_j``. A query block then visits the earlier key blocks from the nearest
  to the farthest: its logits against block d are ``q' . k~_j`` and it moves
  past block d by ``q' <- q' (I - W_d^T X_d)`` (two matmuls), the scores
  merging into an online float32 softmax (``attn.merge.merge_unnormalized``).
  Every earlier block is visited, even one the mask hides (a window): the
  query must still pass its transforms. Backward: autodiff of a ``lax.scan``
  over query blocks whose body is rematerialized (``jax.checkpoint``): the
  forward keeps only the scan's inputs, O(H + C) floats per token and head
  (the carried queries and keys, X, the key paths D, the diagonal block's
  logits), and the backward recomputes one query block at a time, keeping the
  residuals of its visits (``q'`` and a ``[C,C]`` tile per key block: O(T (H +
  C)) per head) for that block only. Memory is linear in T (the tests check
  XLA's temporary bytes double when T does); the compute is the T^2 / 2 tiles
  of causal attention, about twice the matmuls of plain blockwise softmax.
  The blocks' triangular inverses are matmuls (``attn.linear.delta_forms.
  unit_lower_inverse``): LAPACK's triangular solve deadlocks jaxlib 0.10.1's
  CPU runtime in this backward (``tools/repro_jaxlib_0_10_1_path_deadlock.py``).

Grouped-query attention: ``w`` and ``beta`` belong to the K kv heads (they
transform keys, so a kv head and the G query heads that read it share one
path); q has N = K G heads; FoX's gates are per query head ``[B,T,N]``, as
``attn.scores.forgetting`` takes them.

Masks: PaTH is causal (a key's path runs forward to the query), so ``mask``
must allow no key after its query: ``masks.causal()``, a sliding window, or
any mask the algebra makes causal (``causal() & m``, ``band(l, 0)``, an ``|``
of causal masks); any other is refused naming ``mask``. Positions are the
token indices ``arange(T)``.

Packing and padding: ``q_segment_ids`` and ``kv_segment_ids`` ``[B,T]``, the
ids of the same tokens (both or neither). Id 0 is padding: its q, k, v, w,
beta and log gate are selected away where they enter (NaN and Inf there
reach nothing, forward or backward), its transform is the identity and it
outputs 0. A segment is a run of equal non-zero ids (padding inside it
skipped): a query sees the keys of its own run only, so the product of
transforms between them never crosses a segment boundary, and packed
segments compute what each computes alone (an id that comes back after
another segment starts a new segment, as in ``attn.delta_rule``).

Decoding (``attn.softmax.path_decode``) keeps the cache's keys transformed as
tokens arrive (``path_update_keys``): a cached key j holds ``H_{t-1} ... H_{j+1} k_j``, token
t applies ``H_t`` to every cached key and is stored as it is, and plain
softmax attention of ``q_t`` over the cache (``attn.attention``,
``attn.decode_attention``) is PaTH's row t. ``path_transform_keys`` gives the
cache after a prefill. A chunk of tokens over such a cache: its queries
carried back to the chunk's start (``path_transform_queries``) attend to the
cache with plain softmax, ``path_attention`` gives the chunk's own part, and
``attn.merge_attention`` joins the two (``models.path``).

Everything is float32 inside whatever the input dtype (the transforms too);
the output has q's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from attn import checks, masks, scores
from attn.checks import as_arrays, fail
from attn.linear.delta_forms import unit_lower_inverse
from attn.masks import PADDING, And, Band, Causal, Mask, Or, SlidingWindow, drop_padding
from attn.merge import merge_unnormalized
from attn.softmax.call import MASKED, check_call, visible

__all__ = ["PATH_FORMS", "path_attention"]

PATH_FORMS = ("blockwise", "naive")


# ----------------------------------------------------------------------------
# Checks


def is_causal(mask: Mask) -> bool:
    """Whether the mask algebra shows that ``mask`` allows no key after its query."""
    if isinstance(mask, Causal | SlidingWindow):
        return True
    if isinstance(mask, Band):
        return mask.right == 0
    if isinstance(mask, And):
        return is_causal(mask.a) or is_causal(mask.b)
    if isinstance(mask, Or):
        return is_causal(mask.a) and is_causal(mask.b)
    return False


def _check_mask(mask) -> Mask:
    expected = "a causal attn.masks.Mask (causal(), sliding_window(w), causal() & m, ...)"
    if not isinstance(mask, Mask):
        fail("mask", expected, type(mask).__name__)
    if not is_causal(mask):
        fail("mask", f"{expected}: PaTH's transforms run forward from key to query", repr(mask))
    return mask


def check_float(x, name: str, shape: tuple, layout: str):
    if getattr(x, "ndim", None) is None:
        fail(name, f"an array {layout}", type(x).__name__)
    if tuple(x.shape) != tuple(shape):
        fail(name, f"shape {tuple(shape)} = {layout}", f"shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        fail(name, "a real floating-point array", f"dtype {x.dtype}")


def check_beta(beta, ids=None):
    ok = lambda b: (b >= 0) & (b <= 2)  # noqa: E731  NaN is refused too
    expected = "values in [0, 2] (H = I - beta w w^T; 2 with a unit w is a reflection)"
    checks.check_values(beta, ok, "beta", expected, ids)


# ----------------------------------------------------------------------------
# The compact form of a block's transforms


def ut(w, beta, k=None):
    """The UT form of one block's transforms ``H_1 .. H_C`` (the block's tokens in order).

    Args:
      w: ``[..., C, H]``; beta: ``[..., C]``; k: ``[..., C, H]`` or None.

    Returns:
      ``X [..., C, H]``: ``H_t ... H_1 = I - sum_{s<=t} w_s x_s^T`` for every t, so
      the block's product is ``I - W^T X``; and with keys ``D [..., C(t), C(j)]``:
      ``H_C ... H_{j+1} k_j = k_j - sum_t D_tj w_t`` and, for i >= j,
      ``H_i ... H_{j+1} k_j = k_j - sum_{t<=i} D_tj w_t`` (``D_tj = 0`` for t <= j).

    Both solve ``(I + diag(beta) strict_lower(W W^T)) Y = R``: X with
    ``R = diag(beta) W`` (from ``x_t = beta_t (H_{t-1} ... H_1)^T w_t``), D with
    ``R_tj = beta_t w_t . k_j`` for t > j, else 0 (the coefficients of key j's
    path through ``H_{j+1}, H_{j+2}, ...``).
    """
    C, H = w.shape[-2:]
    strict = np.tril(np.ones((C, C), bool), -1)
    bw = beta[..., None] * w
    # The inverse as matmuls, not LAPACK's triangular solve: under jaxlib 0.10.1 that kernel
    # deadlocks the CPU runtime in this backward (tools/repro_jaxlib_0_10_1_path_deadlock.py).
    inverse = unit_lower_inverse(jnp.where(strict, jnp.einsum("...th,...sh->...ts", bw, w), 0))
    rhs = [bw]
    if k is not None:
        rhs.append(jnp.where(strict, jnp.einsum("...th,...jh->...tj", bw, k), 0))
    y = jnp.einsum("...ts,...sr->...tr", inverse, jnp.concatenate(rhs, -1))
    return y[..., :H], (y[..., H:] if k is not None else None)


def pass_block(x, w, xt):
    """Rows ``x [..., R, H]`` times the block product ``I - W^T X`` (rows r: ``x_r^T P``)."""
    return x - jnp.einsum("...rs,...sh->...rh", jnp.einsum("...rh,...sh->...rs", x, w), xt)


# ----------------------------------------------------------------------------
# Softmax pieces


def _tile(s, ok, v):
    """The unnormalized softmax partial ``(m, l, acc)`` of logits ``s [B,K,G,R,S]`` where
    ``ok`` (broadcastable) allows, over values ``v [B,K,S,E]``; m is not differentiated
    (the result does not depend on it). A key past a gate of 0 (logit ``-inf``) weighs 0,
    even in a tile that has only such keys (its max is then kept at ``MASKED``)."""
    s = jnp.where(ok, s, MASKED)
    m = lax.stop_gradient(jnp.maximum(s.max(-1), MASKED))
    p = jnp.where(ok, jnp.exp(s - m[..., None]), 0.0)
    return m, p.sum(-1), jnp.einsum("bkgrs,bkse->bkgre", p, v)


def _finish(m, l, acc):
    """``(out, lse)`` from a partial; a row that sees no key gives zeros and ``-inf``."""
    seen = l > 0
    safe = jnp.where(seen, l, 1.0)
    return acc / safe[..., None], jnp.where(seen, m + jnp.log(safe), -jnp.inf)


def _runs(kv_seg):
    """``[B,T]`` int32: the index of the segment (run of equal non-zero ids) held at t.

    A run starts at a real token whose id differs from the last real token's
    before it; padding continues the run before it.
    """
    T = kv_seg.shape[1]
    real = kv_seg != PADDING
    last = lax.cummax(jnp.where(real, jnp.arange(T), -1), axis=1)
    held = jnp.where(last >= 0, jnp.take_along_axis(kv_seg, jnp.maximum(last, 0), 1), PADDING)
    before = jnp.pad(held[:, :-1], ((0, 0), (1, 0)), constant_values=PADDING)
    return jnp.cumsum(real & (kv_seg != before), axis=1).astype(jnp.int32)


def _visible(mask, q_pos, k_pos, seg):
    """Boolean ``[B|1,1,1,R,S]``: the mask on positions ``[R]``, ``[S]``; with ``seg``
    ``(q_seg [B,R], kv_seg [B,S], q_run [B,R], kv_run [B,S])`` within one segment's run."""
    if seg is None:
        return mask.allowed(q_pos, k_pos)[None, None, None]
    q_seg, kv_seg, q_run, kv_run = seg
    ok = visible(mask, q_pos, k_pos, q_seg, kv_seg) & (q_run[:, :, None] == kv_run[:, None, :])
    return ok[:, None, None]


def _fox(s, cq, ck):
    """FoX's modifier on logits ``[B,K,G,R,S]`` from ``scores.GateSums`` ``cq`` of
    ``[B,K,G,R]`` and ``ck`` of ``[B,K,G,S]`` (None: no gate)."""
    if cq is None:
        return s
    q, kv = (
        jax.tree.map(lambda x, at=at: jnp.expand_dims(x, at), c) for c, at in ((cq, -1), (ck, -2))
    )
    return scores.Forgetting.between(q, kv).apply(s, None, None)


# ----------------------------------------------------------------------------
# The forms. Arrays: q [B,T,K,G,H], k and w [B,T,K,H], v [B,T,K,E], beta [B,T,K],
# c GateSums of [B,T,K,G] or None (FoX), seg None or (q_seg, kv_seg, run, run) [B,T].


def _naive(q, k, v, w, beta, c, seg, mask, scale):
    order = jnp.arange(q.shape[1])

    def step(keys, x):  # keys [B,S,K,H]: key j carried through H_{j+1} .. H_{t-1}
        t, q_t, w_t, b_t = x
        proj = jnp.einsum("bskh,bkh->bsk", keys, w_t)
        moved = keys - (b_t[:, None] * proj)[..., None] * w_t[:, None]
        keys = jnp.where((order < t)[None, :, None, None], moved, keys)  # H_t acts on j < t
        return keys, jnp.einsum("bkgh,bskh->bkgs", q_t, keys)

    xs = (order, *(jnp.moveaxis(x, 1, 0) for x in (q, w, beta)))
    s = jnp.moveaxis(lax.scan(step, k, xs)[1], 0, 3) * scale  # [B,K,G,T,S]
    c = None if c is None else jax.tree.map(lambda x: jnp.moveaxis(x, 1, -1), c)
    s = _fox(s, c, c)
    out, lse = _finish(*_tile(s, _visible(mask, order, order, seg), jnp.moveaxis(v, 1, 2)))
    return jnp.moveaxis(out, 3, 1), jnp.moveaxis(lse, 3, 1)


def blocks(x, n: int, C: int, heads: int):
    """``[B,T,...]`` padded to ``n C`` tokens as ``[n,B,...,C,rest]``: the block axis first,
    the ``heads`` axes after T moved before the block's C tokens."""
    B, T = x.shape[:2]
    x = jnp.pad(x, [(0, 0), (0, n * C - T)] + [(0, 0)] * (x.ndim - 2))
    x = jnp.moveaxis(x.reshape(B, n, C, *x.shape[2:]), 1, 0)  # [n,B,C,...]
    return jnp.moveaxis(x, 2, 2 + heads)


def unblock(x, axis: int):
    """The inverse of ``blocks``: ``[n,B,...]`` with the block's tokens at ``axis`` as
    ``[B, n C, ...]`` (padding included)."""
    x = jnp.moveaxis(jnp.moveaxis(x, 0, 1), axis, 2)  # [B,n,C,...]
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _blockwise(q, k, v, w, beta, c, seg, mask, scale, C: int):
    T = q.shape[1]
    n = -(-T // C)
    qb = blocks(q, n, C, 2)  # [n,B,K,G,C,H]
    kb, wb, vb = (blocks(x, n, C, 1) for x in (k, w, v))  # [n,B,K,C,H|E]
    xb, d = ut(wb, blocks(beta, n, C, 1), kb)  # X [n,B,K,C,H], D [n,B,K,C,C]
    incl = np.tril(np.ones((C, C), bool))
    qw = jnp.where(incl, jnp.einsum("nbkgih,nbkth->nbkgit", qb, wb), 0)  # q_i . w_t, t <= i
    # Each query carried back to its block's start, each key to its block's end.
    q_start = qb - jnp.einsum("nbkgit,nbkth->nbkgih", qw, xb)
    k_end = kb - jnp.einsum("nbktj,nbkth->nbkjh", d, wb)
    # The diagonal block: q_i^T H_i ... H_{j+1} k_j for j <= i (the mask hides j > i).
    s_diag = jnp.einsum("nbkgih,nbkjh->nbkgij", qb, kb) - jnp.einsum("nbkgit,nbktj->nbkgij", qw, d)
    cb = None if c is None else jax.tree.map(lambda x: blocks(x, n, C, 2), c)  # [n,B,K,G,C]
    sb = None if seg is None else tuple(blocks(x, n, C, 0) for x in seg)  # [n,B,C]
    pos = jnp.arange(n * C).reshape(n, C)
    index = jnp.arange(n)

    # Key blocks from the last to the first; a query block visits those before it.
    rev = jax.tree.map(lambda a: a[::-1], (index, k_end, vb, wb, xb, pos, cb, sb))

    @jax.checkpoint
    def query_block(_, x):
        i, q_i, s_i, v_i, pos_i, c_i, seg_i = x
        s = _fox(s_i * scale, c_i, c_i)
        state = (q_i, *_tile(s, _visible(mask, pos_i, pos_i, seg_i), v_i))

        def key_block(state, y):
            j, k_j, v_j, w_j, x_j, pos_j, c_j, seg_j = y

            def visit(state):
                q_c, m, l, acc = state
                s = _fox(jnp.einsum("bkgrh,bksh->bkgrs", q_c, k_j) * scale, c_i, c_j)
                ids = None if seg_i is None else (seg_i[0], seg_j[1], seg_i[2], seg_j[3])
                part = _tile(s, _visible(mask, pos_i, pos_j, ids), v_j)
                return (pass_block(q_c, w_j[:, :, None], x_j[:, :, None]),
                        *merge_unnormalized(m, l, acc, *part))  # fmt: skip

            return lax.cond(j < i, visit, lambda state: state, state), None

        state = lax.scan(key_block, state, rev)[0]
        return None, _finish(*state[1:])

    xs = (index, q_start, s_diag, vb, pos, cb, sb)
    out, lse = lax.scan(query_block, None, xs)[1]  # [n,B,K,G,C,E], [n,B,K,G,C]
    return unblock(out, 4)[:, :T], unblock(lse, 4)[:, :T]


# ----------------------------------------------------------------------------
# Public functions


def path_attention(
    q,
    k,
    v,
    w,
    beta,
    *,
    form: str = "blockwise",
    block_size: int = 64,
    log_forget=None,
    mask: Mask = masks.causal(),  # noqa: B008  (masks are immutable, hashable values)
    scale: float | None = None,
    q_segment_ids=None,
    kv_segment_ids=None,
    return_lse: bool = False,
):
    """PaTH attention (causal self-attention), in one of ``PATH_FORMS``.

    ``out_i = sum_j softmax_j(s_ij) v_j`` over the keys j <= i that the mask and
    the segment ids let query i see, with ``s_ij = scale * q_i^T (H_i ... H_{j+1})
    k_j`` (+ ``sum_{l=j+1..i} log f_l`` with ``log_forget``) and ``H_s = I -
    beta_s w_s w_s^T`` (see the module docstring).

    Args:
      q: queries ``[B,T,N,H]``.
      k: keys ``[B,T,K,H]`` (the same T tokens), N a multiple of K.
      v: values ``[B,T,K,E]``.
      w: the transforms' directions ``[B,T,K,H]``, one per token and kv head; unit
        norm in the paper (used as given: normalize them before).
      beta: their strengths ``[B,T,K]``, values in [0, 2] (checked where concrete);
        0 is the identity (no position encoding from that token).
      form: ``"blockwise"`` (default) or ``"naive"``; the same function.
      block_size: C for ``"blockwise"``; T need not be a multiple of it.
      log_forget: FoX's per-token log forget gates ``[B,T,N]`` (values <= 0,
        checked where concrete), or None for PaTH without a gate.
      mask: a causal ``attn.masks.Mask`` on the token indices (default ``causal()``).
      scale: the logit scale, default ``1/sqrt(H)``.
      q_segment_ids, kv_segment_ids: ``[B,T]`` ints, both or neither, the ids of the
        same tokens: packing, and padding (id 0, holding anything).
      return_lse: also return the float32 log-sum-exp ``[B,T,N]`` of each row's
        logits (``-inf`` for a row that sees no key).

    Returns:
      ``out [B,T,N,E]`` in q's dtype, or ``(out, lse)`` with ``return_lse``.
    """
    q, k, v, w, beta, log_forget = as_arrays(q, k, v, w, beta, log_forget)
    d = checks.qkv_dims(q, k, v)
    if d.S != d.T:
        want = f"length T={d.T} like q (PaTH is self-attention over one sequence)"
        fail("k", want, f"shape {tuple(k.shape)}")
    check_float(w, "w", k.shape, "[B,T,K,H] like k")
    check_float(beta, "beta", (d.B, d.T, d.K), "[B,T,K], one per token and kv head")
    if form not in PATH_FORMS:
        fail("form", f"one of {PATH_FORMS}", repr(form))
    block_size = checks.positive_int(block_size, "block_size")
    mask = _check_mask(mask)
    checks.same_token_segment_ids(q_segment_ids, kv_segment_ids, d.B, d.T)
    call = check_call(q, k, v, mask=mask, scale=scale, q_segment_ids=q_segment_ids,
                      kv_segment_ids=kv_segment_ids)  # fmt: skip
    q_seg, kv_seg = call.q_segment_ids, call.kv_segment_ids
    check_beta(beta, kv_seg)
    c = None
    if log_forget is not None:
        check_float(log_forget, "log_forget", (d.B, d.T, d.N), "[B,T,N], one per query head")
        ok = lambda g: g <= 0  # noqa: E731  NaN is refused too
        checks.check_values(log_forget, ok, "log_forget", "values <= 0 (logs of gates)", kv_seg)
        sums = scores.gate_sums(drop_padding(log_forget, kv_seg))  # padding forgets nothing
        c = jax.tree.map(lambda x: x.reshape(d.B, d.T, d.K, d.G), sums)
    # Padding holds anything, NaN included: selected away where it enters.
    q, k, v = call.isolate(q, k, v)
    w, beta = drop_padding(w, kv_seg), drop_padding(beta, kv_seg)
    f32 = jnp.float32
    q32 = q.astype(f32).reshape(d.B, d.T, d.K, d.G, d.H)
    k32, v32, w32, b32 = (x.astype(f32) for x in (k, v, w, beta))
    seg = None
    if q_seg is not None:
        run = _runs(kv_seg)
        seg = (q_seg, kv_seg, run, run)
    if form == "naive":
        out, lse = _naive(q32, k32, v32, w32, b32, c, seg, mask, call.scale)
    else:
        out, lse = _blockwise(q32, k32, v32, w32, b32, c, seg, mask, call.scale, block_size)
    out = out.reshape(d.B, d.T, d.N, d.E).astype(q.dtype)
    return (out, lse.reshape(d.B, d.T, d.N)) if return_lse else out
