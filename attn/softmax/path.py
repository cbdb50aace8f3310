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

Decoding keeps the cache's keys transformed as tokens arrive
(``path_update_keys``): a cached key j holds ``H_{t-1} ... H_{j+1} k_j``, token
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

__all__ = [
    "PATH_FORMS",
    "path_attention",
    "path_transform_keys",
    "path_transform_queries",
    "path_update_keys",
]

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


def _check_float(x, name: str, shape: tuple, layout: str):
    if getattr(x, "ndim", None) is None:
        fail(name, f"an array {layout}", type(x).__name__)
    if tuple(x.shape) != tuple(shape):
        fail(name, f"shape {tuple(shape)} = {layout}", f"shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        fail(name, "a real floating-point array", f"dtype {x.dtype}")


def _check_beta(beta, ids=None):
    ok = lambda b: (b >= 0) & (b <= 2)  # noqa: E731  NaN is refused too
    expected = "values in [0, 2] (H = I - beta w w^T; 2 with a unit w is a reflection)"
    checks.check_values(beta, ok, "beta", expected, ids)


# ----------------------------------------------------------------------------
# The compact form of a block's transforms


def _ut(w, beta, k=None):
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


def _pass_block(x, w, xt):
    """Rows ``x [..., R, H]`` times the block product ``I - W^T X`` (rows r: ``x_r^T P``)."""
    return x - jnp.einsum("...rs,...sh->...rh", jnp.einsum("...rh,...sh->...rs", x, w), xt)


# ----------------------------------------------------------------------------
# Softmax pieces


def _tile(s, ok, v):
    """The unnormalized softmax partial ``(m, l, acc)`` of logits ``s [B,K,G,R,S]`` where
    ``ok`` (broadcastable) allows, over values ``v [B,K,S,E]``; m is not differentiated
    (the result does not depend on it)."""
    s = jnp.where(ok, s, MASKED)
    m = lax.stop_gradient(s.max(-1))
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
    """FoX's modifier on logits ``[B,K,G,R,S]`` from running sums ``cq [B,K,G,R]``,
    ``ck [B,K,G,S]`` (None: no gate)."""
    if cq is None:
        return s
    return scores.Forgetting(cq[..., :, None], ck[..., None, :]).apply(s, None, None)


# ----------------------------------------------------------------------------
# The forms. Arrays: q [B,T,K,G,H], k and w [B,T,K,H], v [B,T,K,E], beta [B,T,K],
# c [B,T,K,G] or None (FoX's running sums), seg None or (q_seg, kv_seg, run, run) [B,T].


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
    c = None if c is None else jnp.moveaxis(c, 1, -1)
    s = _fox(s, c, c)
    out, lse = _finish(*_tile(s, _visible(mask, order, order, seg), jnp.moveaxis(v, 1, 2)))
    return jnp.moveaxis(out, 3, 1), jnp.moveaxis(lse, 3, 1)


def _blocks(x, n: int, C: int, heads: int):
    """``[B,T,...]`` padded to ``n C`` tokens as ``[n,B,...,C,rest]``: the block axis first,
    the ``heads`` axes after T moved before the block's C tokens."""
    B, T = x.shape[:2]
    x = jnp.pad(x, [(0, 0), (0, n * C - T)] + [(0, 0)] * (x.ndim - 2))
    x = jnp.moveaxis(x.reshape(B, n, C, *x.shape[2:]), 1, 0)  # [n,B,C,...]
    return jnp.moveaxis(x, 2, 2 + heads)


def _unblock(x, axis: int):
    """The inverse of ``_blocks``: ``[n,B,...]`` with the block's tokens at ``axis`` as
    ``[B, n C, ...]`` (padding included)."""
    x = jnp.moveaxis(jnp.moveaxis(x, 0, 1), axis, 2)  # [B,n,C,...]
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _blockwise(q, k, v, w, beta, c, seg, mask, scale, C: int):
    T = q.shape[1]
    n = -(-T // C)
    qb = _blocks(q, n, C, 2)  # [n,B,K,G,C,H]
    kb, wb, vb = (_blocks(x, n, C, 1) for x in (k, w, v))  # [n,B,K,C,H|E]
    xb, d = _ut(wb, _blocks(beta, n, C, 1), kb)  # X [n,B,K,C,H], D [n,B,K,C,C]
    incl = np.tril(np.ones((C, C), bool))
    qw = jnp.where(incl, jnp.einsum("nbkgih,nbkth->nbkgit", qb, wb), 0)  # q_i . w_t, t <= i
    # Each query carried back to its block's start, each key to its block's end.
    q_start = qb - jnp.einsum("nbkgit,nbkth->nbkgih", qw, xb)
    k_end = kb - jnp.einsum("nbktj,nbkth->nbkjh", d, wb)
    # The diagonal block: q_i^T H_i ... H_{j+1} k_j for j <= i (the mask hides j > i).
    s_diag = jnp.einsum("nbkgih,nbkjh->nbkgij", qb, kb) - jnp.einsum("nbkgit,nbktj->nbkgij", qw, d)
    cb = None if c is None else _blocks(c, n, C, 2)  # [n,B,K,G,C]
    sb = None if seg is None else tuple(_blocks(x, n, C, 0) for x in seg)  # [n,B,C]
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
                return (_pass_block(q_c, w_j[:, :, None], x_j[:, :, None]),
                        *merge_unnormalized(m, l, acc, *part))  # fmt: skip

            return lax.cond(j < i, visit, lambda state: state, state), None

        state = lax.scan(key_block, state, rev)[0]
        return None, _finish(*state[1:])

    xs = (index, q_start, s_diag, vb, pos, cb, sb)
    out, lse = lax.scan(query_block, None, xs)[1]  # [n,B,K,G,C,E], [n,B,K,G,C]
    return _unblock(out, 4)[:, :T], _unblock(lse, 4)[:, :T]


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
    _check_float(w, "w", k.shape, "[B,T,K,H] like k")
    _check_float(beta, "beta", (d.B, d.T, d.K), "[B,T,K], one per token and kv head")
    if form not in PATH_FORMS:
        fail("form", f"one of {PATH_FORMS}", repr(form))
    block_size = checks.positive_int(block_size, "block_size")
    mask = _check_mask(mask)
    checks.same_token_segment_ids(q_segment_ids, kv_segment_ids, d.B, d.T)
    call = check_call(q, k, v, mask=mask, scale=scale, q_segment_ids=q_segment_ids,
                      kv_segment_ids=kv_segment_ids)  # fmt: skip
    q_seg, kv_seg = call.q_segment_ids, call.kv_segment_ids
    _check_beta(beta, kv_seg)
    c = None
    if log_forget is not None:
        _check_float(log_forget, "log_forget", (d.B, d.T, d.N), "[B,T,N], one per query head")
        ok = lambda g: g <= 0  # noqa: E731  NaN is refused too
        checks.check_values(log_forget, ok, "log_forget", "values <= 0 (logs of gates)", kv_seg)
        fox = scores.forgetting(drop_padding(log_forget, kv_seg))  # padding forgets nothing
        c = fox.q_cumulative.reshape(d.B, d.T, d.K, d.G)
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


def path_update_keys(k_cache, w, beta, *, segment_ids=None):
    """Cached keys carried through the transforms of arriving tokens (PaTH's decoding).

    A cache of keys ``k_cache [B,S,K,H]`` whose key j holds ``H_{t-1} ... H_{j+1} k_j``
    (each key carried up to the last token that arrived, t - 1) becomes ``H_t
    ... H_{j+1} k_j`` for token t's ``w [B,K,H]``, ``beta [B,K]``: every slot is
    transformed (a slot is one key: what unused slots hold stays in them).
    Decoding token t: update the cache, store ``k_t`` as it is, and attend with
    plain softmax (``attn.attention`` or ``attn.decode_attention``, FoX as
    ``scores.Forgetting`` over the running gate sums): the logits are PaTH's.

    Several tokens at once (a chunk, in order): ``w [B,C,K,H]``, ``beta [B,C,K]``
    apply ``H_{t+C-1} ... H_t`` (the compact form: one C x C triangular solve).

    Args:
      k_cache: ``[B,S,K,H]``.
      w, beta: one token's ``[B,K,H]``, ``[B,K]`` or a chunk's ``[B,C,K,H]``, ``[B,C,K]``.
      segment_ids: None, or ``[B]`` (one token) / ``[B,C]`` ints: id 0 marks a
        padding token, whose transform is the identity (its w and beta may hold
        anything).

    Returns:
      The cache in its dtype (computed in float32).
    """
    k_cache, w, beta, segment_ids = as_arrays(k_cache, w, beta, segment_ids)
    if getattr(k_cache, "ndim", None) != 4 or not jnp.issubdtype(k_cache.dtype, jnp.floating):
        got = f"{getattr(k_cache, 'dtype', type(k_cache).__name__)} {np.shape(k_cache)}"
        fail("k_cache", "a floating-point array [B,S,K,H]", got)
    B, _, K, H = k_cache.shape
    one = getattr(w, "ndim", None) == 3
    lead = (B,) if one else (B, np.shape(w)[1] if getattr(w, "ndim", 0) == 4 else 0)
    layout = "[B,K,H] (one token) or [B,C,K,H] (a chunk)"
    if getattr(w, "ndim", None) not in (3, 4):
        fail("w", layout, f"shape {np.shape(w)}")
    _check_float(w, "w", (*lead, K, H), layout)
    _check_float(beta, "beta", (*lead, K), "[B,K] or [B,C,K] like w")
    ids = None
    if segment_ids is not None:
        ids = checks.segment_ids(segment_ids, "segment_ids", B, None if one else lead[1])
    _check_beta(beta, ids)
    if one:  # one token as a chunk of one
        w, beta, ids = w[:, None], beta[:, None], None if ids is None else ids[:, None]
    w32 = drop_padding(w, ids).astype(jnp.float32)
    b32 = drop_padding(beta, ids).astype(jnp.float32)
    w32, b32 = jnp.moveaxis(w32, 1, 2), jnp.moveaxis(b32, 1, 2)  # [B,K,C,H], [B,K,C]
    x, _ = _ut(w32, b32)
    keys = k_cache.astype(jnp.float32)  # [B,S,K,H]; (I - W^T X) k = k - sum_s (x_s . k) w_s
    keys = keys - jnp.einsum("bksc,bkch->bskh", jnp.einsum("bskh,bkch->bksc", keys, x), w32)
    return keys.astype(k_cache.dtype)


def path_transform_keys(k, w, beta, *, block_size: int = 64, segment_ids=None):
    """Each key carried through the transforms of every later token: ``H_{T-1} ...
    H_{j+1} k_j`` ``[B,T,K,H]``, what a PaTH cache holds after a prefill of T tokens
    (``path_update_keys`` then continues it).

    Blocks of ``block_size`` in the compact form of ``path_attention``'s blockwise
    form: a key leaves its block in one solve, then a scan from the last block
    to the first carries the product of the blocks after it (``[H,H]`` per head).

    Args:
      k, w: ``[B,T,K,H]``; beta: ``[B,T,K]`` in [0, 2].
      block_size: the blocks' length.
      segment_ids: None or ``[B,T]`` ints: id 0 marks padding, whose transform is the
        identity and whose key is 0 (w, beta and k there may hold anything).

    Returns:
      ``[B,T,K,H]`` in k's dtype.
    """
    k, w, beta, segment_ids = as_arrays(k, w, beta, segment_ids)
    if getattr(k, "ndim", None) != 4 or not jnp.issubdtype(k.dtype, jnp.floating):
        got = f"{getattr(k, 'dtype', type(k).__name__)} {np.shape(k)}"
        fail("k", "a floating-point array [B,T,K,H]", got)
    B, T, K, H = k.shape
    _check_float(w, "w", k.shape, "[B,T,K,H] like k")
    _check_float(beta, "beta", (B, T, K), "[B,T,K]")
    C = checks.positive_int(block_size, "block_size")
    ids = checks.segment_ids(segment_ids, "segment_ids", B, T)
    _check_beta(beta, ids)
    k32, w32, b32 = (drop_padding(x, ids).astype(jnp.float32) for x in (k, w, beta))
    n = -(-T // C)
    kb, wb = (_blocks(x, n, C, 1) for x in (k32, w32))  # [n,B,K,C,H]
    xb, d = _ut(wb, _blocks(b32, n, C, 1), kb)
    k_end = kb - jnp.einsum("nbktj,nbkth->nbkjh", d, wb)

    def block(m, x):  # m [B,K,H,H]: the product of the blocks after this one
        k_j, w_j, x_j = x
        out = jnp.einsum("bkjh,bkgh->bkjg", k_j, m)
        return _pass_block(m, w_j, x_j), out  # rows of m: m P_j

    eye = jnp.broadcast_to(jnp.eye(H, dtype=jnp.float32), (B, K, H, H))
    out = lax.scan(block, eye, (k_end, wb, xb), reverse=True)[1]  # [n,B,K,C,H]
    return _unblock(out, 3)[:, :T].astype(k.dtype)


def path_transform_queries(q, w, beta, *, segment_ids=None):
    """Each query of a chunk carried back to the chunk's start: ``(H_i ... H_0)^T q_i``.

    Query i of a chunk of tokens ``0 .. C-1`` (in order, following a cache whose
    keys are carried up to the token before the chunk, ``path_update_keys``)
    reaches a cached key through its chunk's transforms up to its own,
    ``q_i^T H_i ... H_0 k~_j``: the returned ``q'_i = H_0 ... H_i q_i`` (each
    ``H`` is symmetric) against the cached keys gives PaTH's logits. The compact
    form: ``H_i ... H_0 = I - sum_{s<=i} w_s x_s^T`` (one C x C triangular solve).

    Args:
      q: queries ``[B,C,N,H]``, N a multiple of K.
      w, beta: the chunk's ``[B,C,K,H]``, ``[B,C,K]`` (beta in [0, 2]).
      segment_ids: None, or ``[B,C]`` ints: id 0 marks a padding token, whose
        transform is the identity (its w and beta may hold anything).

    Returns:
      ``[B,C,N,H]`` in q's dtype (computed in float32).
    """
    q, w, beta, segment_ids = as_arrays(q, w, beta, segment_ids)
    if getattr(q, "ndim", None) != 4 or not jnp.issubdtype(q.dtype, jnp.floating):
        got = f"{getattr(q, 'dtype', type(q).__name__)} {np.shape(q)}"
        fail("q", "a floating-point array [B,C,N,H]", got)
    B, C, N, H = q.shape
    K = np.shape(w)[2] if getattr(w, "ndim", None) == 4 else 0
    if not K or N % K:
        fail("w", f"shape [B,C,K,H] = ({B}, {C}, K, {H}) with K dividing N={N}", np.shape(w))
    _check_float(w, "w", (B, C, K, H), "[B,C,K,H]")
    _check_float(beta, "beta", (B, C, K), "[B,C,K]")
    ids = checks.segment_ids(segment_ids, "segment_ids", B, C)
    _check_beta(beta, ids)
    w32, b32 = (jnp.moveaxis(drop_padding(x, ids).astype(jnp.float32), 1, 2) for x in (w, beta))
    x, _ = _ut(w32, b32)  # [B,K,C,H]
    q32 = q.astype(jnp.float32).reshape(B, C, K, N // K, H)
    incl = np.tril(np.ones((C, C), bool))
    qw = jnp.where(incl, jnp.einsum("bikgh,bkth->bkgit", q32, w32), 0)  # q_i . w_t, t <= i
    out = q32 - jnp.einsum("bkgit,bkth->bikgh", qw, x)
    return out.reshape(B, C, N, H).astype(q.dtype)
