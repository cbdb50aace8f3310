"""Linear attention: softmax(q.k) replaced by a kernel phi(q).phi(k).

With a feature map ``phi: [..., H] -> [..., F]`` causal attention becomes

    out_t = phi(q_t) . S_t / (phi(q_t) . z_t + eps)
    S_t   = a_t S_{t-1} + phi(k_t) v_t^T          [F, E]
    z_t   = a_t z_{t-1} + phi(k_t)                [F]

where ``a_t`` is an optional decay in (0, 1] (a fixed per-head ``gamma`` as in
RetNet, a data-dependent gate ``exp(log_gate_t)`` as in Mamba-2 and gated linear
attention, or their product). Without the denominator (``normalize=False``) it
is the plain sum ``phi(q_t) . S_t``.

``linear_attention`` computes this function in three forms that are the same
function, tested to float32 precision (forward and gradients):

- ``"parallel"``: the materialized ``[T, S]`` matrix ``phi(Q) phi(K)^T`` times
  the decay matrix; quadratic in time and memory, the reference.
- ``"recurrent"``: a ``lax.scan`` over tokens carrying ``(S, z)``; linear time,
  constant state, sequential. The backward pass recomputes segments of about
  sqrt(T) steps (``jax.checkpoint``) instead of storing every state.
- ``"chunkwise"`` (the default): chunks of ``C`` tokens; inside a chunk the
  masked quadratic product, across chunks the state carried by a ``lax.scan``
  over chunks. Linear in T and made of matmuls: the form to train with.

Without ``causal`` there is no order: every query reads the global sums
``sum_s phi(k_s) v_s^T`` and ``sum_s phi(k_s)`` (decay is then an error).

``linear_attention_step`` advances the state by one token for decoding;
``init_linear_state`` makes the zero state it starts from and
``linear_feature_dim`` gives its F.

State convention. Decays and gates are per query head, and they act on the
state, so the state is kept per query head: ``LinearState(kv [B,N,F,E],
z [B,N,F])`` in float32 whatever the input dtype. Under GQA the queries are
reshaped to ``[B,T,K,G,H]`` and the K kv heads are read through that view,
never repeated in memory; only the state (G per kv head) is per query head.
``z`` is always tracked (it is 1/E of the state), so one state serves both
``normalize`` settings. The decay applies to ``z`` too, so a normalized output
stays a weighted average of the values.

Decay in log space. Products of decays ``prod_{r=s+1..t} a_r`` are computed as
``exp`` of segment sums ``sum_{r=s+1..t} log a_r`` accumulated directly (a
masked cumulative sum over a ``[C, C]`` or ``[T, S]`` square), not as
differences of running totals: those lose precision when the totals are large
and give ``-inf - -inf`` for a gate of exactly zero (``log_gate = -inf``, which
is allowed and erases the state). Positions above the diagonal are set to
``-inf`` before the ``exp``, and every decay ``exp`` has an argument <= 0, so
nothing overflows and no gradient is NaN.

Scale. ``q`` and ``k`` are each multiplied by ``sqrt(scale)`` before the feature
map. For ``"taylor"`` and ``"favor"``, which estimate ``exp(q.k)``, the default
``scale = 1/sqrt(H)`` makes them estimate softmax's ``exp(q.k / sqrt(H))``
(Based's ``x / H**0.25``); for the other maps the default is 1.

Precision. All statistics are float32. The recurrent form adds one token at a
time to its running sums, so their rounding error grows with T (up to about
T float32 roundoffs; 3e-5 relative measured at T = 64K with positive features);
the chunkwise form adds chunk sums and is more accurate at long T. FAVOR+
features ``exp(x W - |x|^2 / 2)`` are not stabilized by subtracting a maximum
(it would differ between forms and calls), so very large q or k overflow.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from attn._checks import fail, qkv_dims

__all__ = [
    "FEATURE_MAPS",
    "FORMS",
    "LinearState",
    "favor_projection",
    "init_linear_state",
    "linear_attention",
    "linear_attention_step",
    "linear_feature_dim",
]

FORMS = ("parallel", "recurrent", "chunkwise")

# Maps that approximate exp(scale * q.k) get this scale by default, as softmax does.
_EXP_KERNEL_MAPS = ("taylor", "favor")


class LinearState(NamedTuple):
    """Recurrent state of linear attention, float32.

    Attributes:
        kv: ``[B,N,F,E]``, the decayed sum of ``phi(k_s) v_s^T``.
        z: ``[B,N,F]``, the decayed sum of ``phi(k_s)`` (the normalizer).
    """

    kv: jax.Array
    z: jax.Array


# ----------------------------------------------------------------------------
# Feature maps: x [..., H] -> [..., F]


def identity(x):
    """phi(x) = x, F = H. Not positive: use with ``normalize=False``."""
    return x


def elu1(x):
    """phi(x) = elu(x) + 1 (Katharopoulos et al., 2020), positive, F = H."""
    # exp(x) on x <= 0 is elu(x) + 1 without expm1's extra cost; the inner
    # where keeps exp's argument <= 0, so its unused branch cannot overflow.
    return jnp.where(x > 0, x + 1.0, jnp.exp(jnp.where(x > 0, 0.0, x)))


def relu(x):
    """phi(x) = max(x, 0), non-negative, F = H."""
    return jax.nn.relu(x)


def taylor(x):
    """Second-order Taylor features (Based): ``[1, x, x (x) x / sqrt(2)]``, F = 1 + H + H^2.

    ``phi(q).phi(k) = 1 + q.k + (q.k)^2 / 2`` approximates ``exp(q.k)`` and is
    positive for every q, k.
    """
    # The outer product is formed on rows [M, H] (leading axes flattened, a free
    # reshape). Formed on the chunkwise layout [n,B,K,G,C,H] instead, its
    # backward pass is a rank-7 multiply-reduce that jaxlib 0.10.2's CPU backend
    # hands to YNNPACK, which segfaults on it when G == 1
    # (tools/repro_jaxlib_0_10_2_segfault.py).
    rows = x.reshape(-1, x.shape[-1])
    outer = (rows[:, :, None] * rows[:, None, :]).reshape(*x.shape[:-1], -1)
    one = jnp.ones((*x.shape[:-1], 1), x.dtype)
    return jnp.concatenate([one, x, outer * (1.0 / math.sqrt(2.0))], axis=-1)


def favor(x, *, projection):
    """Performer FAVOR+ positive random features, F = ``projection.shape[1]``.

    ``phi(x) = exp(x W - |x|^2 / 2) / sqrt(F)`` with ``W = projection [H, F]``
    gives ``E[phi(q).phi(k)] = exp(q.k)`` when the columns of W are Gaussian
    (or orthogonal with Gaussian norms, see ``favor_projection``).
    """
    num_features = projection.shape[-1]
    logits = x @ projection.astype(x.dtype) - 0.5 * jnp.sum(x * x, axis=-1, keepdims=True)
    return jnp.exp(logits) * (1.0 / math.sqrt(num_features))


FEATURE_MAPS: dict[str, Callable[..., jax.Array]] = {
    "identity": identity,
    "elu1": elu1,
    "relu": relu,
    "taylor": taylor,
    "favor": favor,  # also needs projection=[H, F]
}


def favor_projection(key, head_dim: int, num_features: int) -> jax.Array:
    """Orthogonal random features for ``"favor"`` (Performer's ORF).

    Columns come in blocks of ``head_dim`` mutually orthogonal directions (QR of
    a Gaussian matrix), each rescaled by the norm of an independent Gaussian
    vector so every column is marginally ``N(0, I_H)``: the estimator stays
    unbiased and orthogonality lowers its variance.

    Args:
        key: a ``jax.random`` key.
        head_dim: H.
        num_features: F.

    Returns:
        projection ``[H, F]`` float32.
    """
    if int(head_dim) < 1:
        fail("head_dim", "a positive int", head_dim)
    if int(num_features) < 1:
        fail("num_features", "a positive int", num_features)
    return _favor_projection(key, int(head_dim), int(num_features))


@partial(jax.jit, static_argnums=(1, 2))
def _favor_projection(key, H: int, F: int):
    num_blocks = -(-F // H)
    block_key, norm_key = jax.random.split(key)
    gaussian = jax.random.normal(block_key, (num_blocks, H, H), jnp.float32)
    orthonormal = jax.vmap(lambda m: jnp.linalg.qr(m)[0])(gaussian)  # columns orthonormal
    directions = jnp.moveaxis(orthonormal, 0, 1).reshape(H, num_blocks * H)[:, :F]
    norms = jnp.linalg.norm(jax.random.normal(norm_key, (F, H), jnp.float32), axis=-1)
    return directions * norms[None, :]


def _feature_fn(feature_map, projection, head_dim: int) -> Callable[[jax.Array], jax.Array]:
    """Validates ``feature_map``/``projection`` and returns x ``[...,H]`` -> ``[...,F]``."""
    if callable(feature_map):
        if projection is not None:
            fail("projection", "None unless feature_map='favor'", "an array")
        return feature_map
    if feature_map not in FEATURE_MAPS:
        fail("feature_map", f"one of {sorted(FEATURE_MAPS)} or a callable", repr(feature_map))
    if feature_map != "favor":
        if projection is not None:
            fail("projection", "None unless feature_map='favor'", "an array")
        return FEATURE_MAPS[feature_map]
    if projection is None:
        fail("projection", "an [H, F] array (see favor_projection) for feature_map='favor'", None)
    if getattr(projection, "ndim", None) != 2 or projection.shape[0] != head_dim:
        fail("projection", f"shape ({head_dim}, F)", f"shape {getattr(projection, 'shape', None)}")
    return partial(favor, projection=jnp.asarray(projection, jnp.float32))


def _sqrt_scale(scale, feature_map, head_dim: int) -> float:
    """Returns the factor applied to q and to k before the map (sqrt of ``scale``)."""
    if scale is None:
        scale = head_dim**-0.5 if feature_map in _EXP_KERNEL_MAPS else 1.0
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not scale > 0:
        fail("scale", "a positive Python number (static)", scale)
    return math.sqrt(float(scale))


def linear_feature_dim(feature_map="elu1", head_dim: int = 64, *, projection=None) -> int:
    """F, the feature dim of ``feature_map`` for head dim H (for ``init_linear_state``)."""
    phi = _feature_fn(feature_map, projection, head_dim)
    return jax.eval_shape(phi, jax.ShapeDtypeStruct((head_dim,), jnp.float32)).shape[-1]


def init_linear_state(batch: int, num_heads: int, feature_dim: int, value_dim: int) -> LinearState:
    """Zero state: kv ``[B,N,F,E]``, z ``[B,N,F]``, float32 (N = query heads)."""
    return LinearState(
        kv=jnp.zeros((batch, num_heads, feature_dim, value_dim), jnp.float32),
        z=jnp.zeros((batch, num_heads, feature_dim), jnp.float32),
    )


# ----------------------------------------------------------------------------
# Validation


def _concrete(x):
    """NumPy value of x, or None under a trace (then value checks are skipped)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check_decay(decay, log_gates, B: int, T: int, N: int, causal: bool, name="log_gates"):
    """Validates ``decay`` (gamma ``[N]`` or scalar) and ``log_gates`` ``[B,T,N]``."""
    if not causal and (decay is not None or log_gates is not None):
        arg = "decay" if decay is not None else name
        fail(arg, "None when causal=False (decay needs an order)", "an array")
    if decay is not None:
        shape = np.shape(decay)
        if shape not in ((), (N,)):
            fail("decay", f"shape () or ({N},) (one gamma per query head)", f"shape {shape}")
        value = _concrete(decay)
        if value is not None and not np.all((value > 0) & (value <= 1)):
            fail("decay", "values in (0, 1]", f"min {value.min()}, max {value.max()}")
    if log_gates is not None:
        shape = np.shape(log_gates)
        if shape != (B, T, N):
            fail(name, f"shape ({B}, {T}, {N}) = [B,T,N]", f"shape {shape}")
        value = _concrete(log_gates)
        if value is not None and np.any(value > 0):
            fail(name, "values <= 0 (log of gates in [0, 1])", f"max {value.max()}")


def _log_decay(decay, log_gates, B: int, T: int, N: int):
    """Combined log decay ``[B,T,N]`` float32 (<= 0), or None without decay."""
    if decay is None and log_gates is None:
        return None
    total = jnp.zeros((B, T, N), jnp.float32)
    if decay is not None:
        total = total + jnp.log(jnp.asarray(decay, jnp.float32))
    if log_gates is not None:
        total = total + jnp.asarray(log_gates, jnp.float32)
    return total


def _check_state(state, name: str, B: int, N: int, F: int, E: int):
    if not isinstance(state, tuple) or len(state) != 2:
        fail(name, "a LinearState(kv, z) (see init_linear_state)", type(state).__name__)
    kv_shape, z_shape = np.shape(state[0]), np.shape(state[1])
    if kv_shape != (B, N, F, E) or z_shape != (B, N, F):
        fail(name, f"kv {(B, N, F, E)} and z {(B, N, F)}", f"kv {kv_shape}, z {z_shape}")


def _check_eps(eps):
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or eps < 0:
        fail("eps", "a non-negative Python number", repr(eps))


def _check_options(form, chunk_size, eps):
    if form not in FORMS:
        fail("form", f"one of {FORMS}", repr(form))
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        fail("chunk_size", "a positive int", repr(chunk_size))
    _check_eps(eps)


# ----------------------------------------------------------------------------
# Decay helpers


def _segsum(log_a):
    """Segment sums of log decays: ``[..., C] -> [..., C, C]``.

    ``out[i, j] = sum_{r=j+1..i} log_a[r]`` for ``j <= i`` and ``-inf`` above the
    diagonal, so ``exp(out)`` is the causal decay matrix. Each entry is summed
    over its own segment (masked cumsum), never as a difference of totals.
    """
    C = log_a.shape[-1]
    i = jnp.arange(C)[:, None]
    j = jnp.arange(C)[None, :]
    terms = jnp.where(i > j, jnp.broadcast_to(log_a[..., :, None], (*log_a.shape, C)), 0.0)
    sums = jnp.cumsum(terms, axis=-2)
    return jnp.where(i >= j, sums, -jnp.inf)


def _weigh_causal(scores, log_a):
    """Applies the causal decay matrix to ``scores [..., C, C]``.

    Without decay (``log_a`` None) it is the causal mask, applied as a select
    that fuses into its neighbours (no ``[C, C]`` array is built); with log
    decays ``[..., C]`` it is ``exp(_segsum(log_a))``.

    Returns:
        ``(weighted scores, weights [..., C, C] or None)``.
    """
    C = scores.shape[-1]
    if log_a is None:
        causal = lax.broadcasted_iota(jnp.int32, (C, C), 0) >= lax.broadcasted_iota(
            jnp.int32, (C, C), 1
        )
        return jnp.where(causal, scores, 0.0), None
    weights = jnp.exp(_segsum(log_a))
    return scores * weights, weights


# ----------------------------------------------------------------------------
# The three forms. Each takes float32 inputs shaped for GQA and returns the
# numerator [B,T,K,G,E], the denominator [B,T,K,G] and the final state
# (kv [B,K,G,F,E], z [B,K,G,F]); normalization happens once, in the caller.


def _parallel(qf, kf, v, log_a, kv0, z0, causal: bool):
    """Materialized ``[T, S]`` form.

    qf ``[B,T,K,G,F]``, kf ``[B,S,K,F]``, v ``[B,S,K,E]``, log_a ``[B,T,K,G]`` or None.
    The products are batched matmuls over one leading axis ``x = (B,K)`` with
    the G query heads stacked as rows, as in ``_chunkwise``.
    """
    B, T, K, G, F = qf.shape
    S, E = v.shape[1], v.shape[-1]
    q_rows = qf.transpose(0, 2, 3, 1, 4).reshape(B * K, G * T, F)
    scores = jnp.einsum("xrf,xsf->xrs", q_rows, kf.transpose(0, 2, 1, 3).reshape(B * K, S, F))
    scores = scores.reshape(B, K, G, T, S)
    q_weight = None  # decay of the initial state seen by each query, [B,T,K,G]
    end_weight = None  # decay from each key to the end, [B,S,K,G]
    chain = 1.0  # decay of the initial state across the whole sequence
    if causal:
        log_a_t = None if log_a is None else log_a.transpose(0, 2, 3, 1)  # [B,K,G,T]
        scores, weights = _weigh_causal(scores, log_a_t)
        if log_a is not None:
            q_weight = jnp.exp(jnp.cumsum(log_a, axis=1))
            end_weight = jnp.moveaxis(weights[..., -1, :], -1, 1)
            chain = q_weight[:, -1][..., None]
    v_x = v.transpose(0, 2, 1, 3).reshape(B * K, S, E)
    num = jnp.einsum("xrs,xse->xre", scores.reshape(B * K, G * T, S), v_x)
    num = num.reshape(B, K, G, T, E).transpose(0, 3, 1, 2, 4)
    den = jnp.sum(scores, axis=-1).transpose(0, 3, 1, 2)
    q_init = qf if q_weight is None else qf * q_weight[..., None]
    num = num + jnp.einsum("btkgf,bkgfe->btkge", q_init, kv0)
    den = den + jnp.einsum("btkgf,bkgf->btkg", q_init, z0)
    if end_weight is None:
        kv = kv0 + jnp.einsum("bskf,bske->bkfe", kf, v)[:, :, None]
        z = z0 + jnp.sum(kf, axis=1)[:, :, None]
    else:
        kf_end = kf[:, :, :, None] * end_weight[..., None]  # [B,S,K,G,F]
        kv = chain[..., None] * kv0 + jnp.einsum("bskgf,bske->bkgfe", kf_end, v)
        z = chain * z0 + jnp.sum(kf_end, axis=1)
    return num, den, (kv, z)


def _global_sums(qf, kf, v, kv0, z0):
    """Non-causal form shared by "recurrent" and "chunkwise": one global state, read by all."""
    kv = kv0 + jnp.einsum("bskf,bske->bkfe", kf, v)[:, :, None]
    z = z0 + jnp.sum(kf, axis=1)[:, :, None]
    num = jnp.einsum("btkgf,bkgfe->btkge", qf, kv)
    den = jnp.einsum("btkgf,bkgf->btkg", qf, z)
    return num, den, (kv, z)


def _step(carry, q_t, k_t, v_t, log_a_t, phi, valid=None):
    """One token. q_t ``[B,K,G,H]``, k_t ``[B,K,H]``, v_t ``[B,K,E]``, log_a_t ``[B,K,G]``.

    Features are computed here rather than before the scan so the scan keeps
    H-sized inputs per step instead of F-sized ones (F = 1 + H + H^2 for taylor).
    ``valid`` (a scalar bool) zeroes the key of a padding step.
    """
    kv, z = carry
    qf = phi(q_t)
    kf = phi(k_t)
    if valid is not None:
        kf = jnp.where(valid, kf, 0.0)
    if log_a_t is not None:
        a = jnp.exp(log_a_t)
        kv = kv * a[..., None, None]
        z = z * a[..., None]
    kv = kv + jnp.einsum("bkf,bke->bkfe", kf, v_t)[:, :, None]
    z = z + kf[:, :, None]
    num = jnp.einsum("bkgf,bkgfe->bkge", qf, kv)
    den = jnp.einsum("bkgf,bkgf->bkg", qf, z)
    return (kv, z), (num, den)


def _recurrent(q, k, v, log_a, kv0, z0, phi):
    """Scan over tokens. q ``[B,T,K,G,H]``, k ``[B,T,K,H]``, v ``[B,T,K,E]`` float32.

    The tokens are split into about sqrt(T) segments of about sqrt(T) steps;
    the outer scan stores only the state at segment boundaries and each
    segment's inner scan is rematerialized in the backward pass, so backward
    memory is O(sqrt(T)) states instead of T.
    """
    T = q.shape[1]
    seg = math.isqrt(T - 1) + 1  # ceil(sqrt(T)) for T >= 1
    num_seg = -(-T // seg)
    pad = num_seg * seg - T

    def time_major(x):
        x = jnp.moveaxis(x, 1, 0)
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(num_seg, seg, *x.shape[1:])

    valid = None if pad == 0 else time_major(jnp.ones((1, T), bool))  # padding steps: False
    xs = (
        time_major(q),
        time_major(k),
        time_major(v),
        None if log_a is None else time_major(log_a),
        valid,
    )

    def one_step(carry, x):
        q_t, k_t, v_t, log_a_t, valid_t = x
        return _step(carry, q_t, k_t, v_t, log_a_t, phi, valid_t)

    @jax.checkpoint
    def segment(carry, xs_seg):
        return lax.scan(one_step, carry, xs_seg)

    state, (num, den) = lax.scan(segment, (kv0, z0), xs)
    num = jnp.moveaxis(num.reshape(num_seg * seg, *num.shape[2:])[:T], 0, 1)
    den = jnp.moveaxis(den.reshape(num_seg * seg, *den.shape[2:])[:T], 0, 1)
    return num, den, state


def _split_chunks(x, n: int, C: int):
    """``[B,T,...] -> [B,n,C,...]``, zero-padding T to n * C."""
    x = jnp.pad(x, [(0, 0), (0, n * C - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
    return x.reshape(x.shape[0], n, C, *x.shape[2:])


def _chunkwise(q, k, v, log_a, kv0, z0, phi, chunk_size: int):
    """Chunks of C tokens.

    q ``[B,T,K,G,H]``, k ``[B,T,K,H]``, v ``[B,T,K,E]`` float32, log_a
    ``[B,T,K,G]`` or None; kv0 ``[B,K,G,F,E]`` and z0 ``[B,K,G,F]``, or None for
    a zero state. The feature map is applied after the inputs are rearranged
    into chunks, so that it fuses with that copy (both are memory-bound).

    Inside a chunk: the masked quadratic product (matmuls over C x C). Across
    chunks: each chunk's contribution to the state is computed in parallel,
    then a scan over chunks (elementwise only) yields the state entering each
    chunk, which all its queries read with one more matmul.

    Layout: chunk-major ``[n,B,K,G,C,.]`` with n chunks, so the scan over
    chunks needs no transpose, and every product is a batched matmul over one
    flattened leading axis ``x = (n,B,K)`` with the G query heads of a kv head
    stacked as rows of one matrix (XLA's CPU backend runs that form several
    times faster than the same einsum with several batch axes).
    """
    B, T, K, G, _ = q.shape
    E = v.shape[-1]
    C = min(chunk_size, T)  # a chunk longer than T is the parallel form
    n = -(-T // C)
    X = n * B * K
    qf = phi(_split_chunks(q, n, C).transpose(1, 0, 3, 4, 2, 5))  # [n,B,K,G,C,F]
    kf = phi(_split_chunks(k, n, C).transpose(1, 0, 3, 2, 4))  # [n,B,K,C,F]
    F = kf.shape[-1]
    if n * C > T:
        # Padding keys get zero features (and log decay 0): states and real outputs
        # are unchanged. Padding queries compute rows that are sliced off.
        real = (jnp.arange(n)[:, None] * C + jnp.arange(C)[None, :]) < T  # [n,C]
        kf = jnp.where(real[:, None, None, :, None], kf, 0.0)
    v = _split_chunks(v, n, C).transpose(1, 0, 3, 2, 4)  # [n,B,K,C,E]
    if log_a is not None:
        log_a = _split_chunks(log_a, n, C).transpose(1, 0, 3, 4, 2)  # [n,B,K,G,C]
    scores = jnp.einsum("xrf,xjf->xrj", qf.reshape(X, G * C, F), kf.reshape(X, C, F))
    scores, weights = _weigh_causal(scores.reshape(n, B, K, G, C, C), log_a)
    num = jnp.einsum("xrj,xje->xre", scores.reshape(X, G * C, C), v.reshape(X, C, E))
    num = num.reshape(n, B, K, G, C, E)
    den = jnp.sum(scores, axis=-1)
    if log_a is None:
        num_in, den_in, (kv, z) = _chunk_inputs_shared(qf, kf, v, kv0, z0)
    else:
        if kv0 is None:
            kv0 = jnp.zeros((B, K, G, F, E), jnp.float32)
            z0 = jnp.zeros((B, K, G, F), jnp.float32)
        num_in, den_in, (kv, z) = _chunk_inputs_decayed(qf, kf, v, log_a, weights, kv0, z0)
    chex.assert_equal_shape([num, num_in])
    chex.assert_equal_shape([den, den_in])
    chex.assert_shape([kv, z], [(B, K, G, F, E), (B, K, G, F)])
    num = (num + num_in).transpose(1, 0, 4, 2, 3, 5).reshape(B, n * C, K, G, E)
    den = (den + den_in).transpose(1, 0, 4, 2, 3).reshape(B, n * C, K, G)
    return num[:, :T], den[:, :T], (kv, z)


def _chunk_inputs_shared(qf, kf, v, kv0, z0):
    """Without decay: what each chunk's queries read from the state entering the chunk.

    qf ``[n,B,K,G,C,F]``, kf ``[n,B,K,C,F]``, v ``[n,B,K,C,E]``. That state is
    the initial one plus the sum over earlier chunks, which is the same for the
    G query heads of a kv head: it is summed per kv head, and the initial
    state is read separately (skipped when None).
    """
    n, B, K, G, C, F = qf.shape
    E = v.shape[-1]
    X = n * B * K
    d_kv = jnp.einsum("xjf,xje->xfe", kf.reshape(X, C, F), v.reshape(X, C, E))
    d_kv = d_kv.reshape(n, B, K, F, E)
    d_z = jnp.sum(kf, axis=3)  # [n,B,K,F]

    def advance(total, d):
        return jax.tree.map(jnp.add, total, d), total

    zeros = (jnp.zeros((B, K, F, E), jnp.float32), jnp.zeros((B, K, F), jnp.float32))
    (kv, z), (kv_before, z_before) = lax.scan(advance, zeros, (d_kv, d_z))
    num_in = jnp.einsum("xrf,xfe->xre", qf.reshape(X, G * C, F), kv_before.reshape(X, F, E))
    num_in = num_in.reshape(n, B, K, G, C, E)
    den_in = jnp.einsum("nbkgif,nbkf->nbkgi", qf, z_before)
    kv = jnp.broadcast_to(kv[:, :, None], (B, K, G, F, E))
    z = jnp.broadcast_to(z[:, :, None], (B, K, G, F))
    if kv0 is not None:
        num_in = num_in + jnp.einsum("nbkgif,bkgfe->nbkgie", qf, kv0)
        den_in = den_in + jnp.einsum("nbkgif,bkgf->nbkgi", qf, z0)
        kv, z = kv0 + kv, z0 + z
    return num_in, den_in, (kv, z)


def _chunk_inputs_decayed(qf, kf, v, log_a, weights, kv0, z0):
    """With decay: what each chunk's queries read from the decayed state entering the chunk.

    qf ``[n,B,K,G,C,F]``, kf ``[n,B,K,C,F]``, v ``[n,B,K,C,E]``, log_a
    ``[n,B,K,G,C]``. ``weights[..., i, j]`` is the decay from key j to query i
    within the chunk, so its last row is the decay from each key to the
    chunk's end and its first column, times ``a_0``, the decay from the chunk's
    start through query i.
    """
    n, B, K, G, C, F = qf.shape
    E = v.shape[-1]
    X = n * B * K
    end_weight = weights[..., -1, :]  # [n,B,K,G,C]
    start_weight = weights[..., :, 0] * jnp.exp(log_a[..., :1])  # [n,B,K,G,C]
    kf_end = kf[:, :, :, None] * end_weight[..., None]  # [n,B,K,G,C,F]
    d_kv = jnp.einsum("xgjf,xje->xgfe", kf_end.reshape(X, G, C, F), v.reshape(X, C, E))
    d_kv = d_kv.reshape(n, B, K, G, F, E)
    d_z = jnp.sum(kf_end, axis=-2)  # [n,B,K,G,F]
    chunk_decay = start_weight[..., -1]  # [n,B,K,G]

    def advance(state, x):
        kv, z = state
        d_kv_c, d_z_c, decay_c = x
        new = (decay_c[..., None, None] * kv + d_kv_c, decay_c[..., None] * z + d_z_c)
        return new, state

    (kv, z), (kv_in, z_in) = lax.scan(advance, (kv0, z0), (d_kv, d_z, chunk_decay))
    q_in = qf * start_weight[..., None]
    num_in = jnp.einsum(
        "yif,yfe->yie", q_in.reshape(X * G, C, F), kv_in.reshape(X * G, F, E)
    ).reshape(n, B, K, G, C, E)
    den_in = jnp.einsum("nbkgif,nbkgf->nbkgi", q_in, z_in)
    return num_in, den_in, (kv, z)


# ----------------------------------------------------------------------------
# Public functions


def linear_attention(
    q,
    k,
    v,
    *,
    form: str = "chunkwise",
    feature_map: str | Callable[[jax.Array], jax.Array] = "elu1",
    causal: bool = True,
    normalize: bool = True,
    decay=None,
    log_gates=None,
    chunk_size: int = 64,
    initial_state: LinearState | None = None,
    return_state: bool = False,
    eps: float = 1e-6,
    scale: float | None = None,
    projection=None,
):
    """Linear attention ``phi(q).phi(k)`` in one of three equivalent forms.

    Args:
        q: queries ``[B,T,N,H]``.
        k: keys ``[B,S,K,H]`` (K kv heads, N % K == 0; GQA reads them through
            a ``[B,T,K,G,H]`` view of q, never repeating them).
        v: values ``[B,S,K,E]``.
        form: ``"parallel"`` (quadratic, the reference), ``"recurrent"``
            (scan over tokens) or ``"chunkwise"`` (default: linear in T, made of
            matmuls). All compute the same function.
        feature_map: a name in ``FEATURE_MAPS`` (``"identity"``, ``"elu1"``,
            ``"relu"``, ``"taylor"``, ``"favor"``) or a callable
            ``[..., H] -> [..., F]`` (applied in float32).
        causal: if True, token t sees keys s <= t (requires T == S). If False,
            every query sees every key (T may differ from S); no decay.
        normalize: divide by ``phi(q_t) . z_t + eps`` (Katharopoulos et al.).
            Meant for positive maps; with ``"identity"`` use False.
        decay: fixed per-query-head decay gamma in (0, 1], shape ``[N]`` or
            scalar (RetNet). Causal only.
        log_gates: per-token, per-query-head log decays ``[B,T,N]``, <= 0
            (Mamba-2 / GLA scalar gates; ``-inf`` is a gate of 0 that erases
            the state). Checked for sign only when concrete (not under jit).
            Combined with ``decay`` by multiplying the gates. Causal only.
        chunk_size: C for ``form="chunkwise"``; T need not be a multiple.
        initial_state: a ``LinearState`` (kv ``[B,N,F,E]``, z ``[B,N,F]``) the
            sequence continues from; zeros if None. All forms accept it.
        return_state: also return the final ``LinearState``.
        eps: added to the denominator when ``normalize``.
        scale: q and k are each multiplied by ``sqrt(scale)`` before the map,
            so exp-approximating maps estimate ``exp(scale q.k)``. Default
            ``1/sqrt(H)`` for ``"taylor"`` and ``"favor"`` (as softmax), else 1.
        projection: ``[H, F]`` random features for ``"favor"`` (see
            ``favor_projection``); passed explicitly so every form, and every
            call, sees the same features.

    Returns:
        out ``[B,T,N,E]`` in the input dtype, or ``(out, LinearState)`` if
        ``return_state`` (state float32, kv ``[B,N,F,E]``, z ``[B,N,F]``).
    """
    B, T, S, N, K, G, H, E = qkv_dims(q, k, v)
    _check_options(form, chunk_size, eps)
    if T == 0 or S == 0:
        fail("q/k", "at least one query and one key", f"T={T}, S={S}")
    if causal and T != S:
        fail("k", f"length S == T == {T} when causal=True", f"S={S}")
    phi = _feature_fn(feature_map, projection, H)
    root_scale = _sqrt_scale(scale, feature_map, H)
    F = jax.eval_shape(phi, jax.ShapeDtypeStruct((H,), jnp.float32)).shape[-1]
    _check_decay(decay, log_gates, B, T, N, causal)
    if initial_state is not None:
        _check_state(initial_state, "initial_state", B, N, F, E)
        kv0 = jnp.asarray(initial_state[0], jnp.float32).reshape(B, K, G, F, E)
        z0 = jnp.asarray(initial_state[1], jnp.float32).reshape(B, K, G, F)
    elif form == "chunkwise" and causal:
        kv0 = z0 = None  # the chunkwise form skips reading a zero state
    else:
        kv0 = jnp.zeros((B, K, G, F, E), jnp.float32)
        z0 = jnp.zeros((B, K, G, F), jnp.float32)
    log_a = _log_decay(decay, log_gates, B, T, N)
    out_dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
    qg = q.astype(jnp.float32).reshape(B, T, K, G, H) * root_scale
    kg = k.astype(jnp.float32) * root_scale
    v32 = v.astype(jnp.float32)
    log_a = None if log_a is None else log_a.reshape(B, T, K, G)

    if form == "recurrent" and causal:
        num, den, (kv, z) = _recurrent(qg, kg, v32, log_a, kv0, z0, phi)
    elif form == "chunkwise" and causal:
        num, den, (kv, z) = _chunkwise(qg, kg, v32, log_a, kv0, z0, phi, chunk_size)
    elif form == "parallel":
        num, den, (kv, z) = _parallel(phi(qg), phi(kg), v32, log_a, kv0, z0, causal)
    else:
        num, den, (kv, z) = _global_sums(phi(qg), phi(kg), v32, kv0, z0)
    out = num / (den[..., None] + eps) if normalize else num
    out = out.reshape(B, T, N, E).astype(out_dtype)
    if not return_state:
        return out
    return out, LinearState(kv.reshape(B, N, F, E), z.reshape(B, N, F))


def linear_attention_step(
    state: LinearState,
    q_t,
    k_t,
    v_t,
    *,
    feature_map: str | Callable[[jax.Array], jax.Array] = "elu1",
    normalize: bool = True,
    decay=None,
    log_gate=None,
    eps: float = 1e-6,
    scale: float | None = None,
    projection=None,
):
    """Advances causal linear attention by one token (decoding).

    Iterating it from ``init_linear_state`` computes ``linear_attention``
    (any form) token by token; the same keyword arguments mean the same.

    Args:
        state: ``LinearState`` (kv ``[B,N,F,E]``, z ``[B,N,F]``), e.g. from
            ``init_linear_state`` or ``linear_attention(..., return_state=True)``.
        q_t: query ``[B,N,H]``.
        k_t: key ``[B,K,H]``.
        v_t: value ``[B,K,E]``.
        feature_map, normalize, decay, eps, scale, projection: as in
            ``linear_attention``.
        log_gate: this token's log decay ``[B,N]`` (<= 0), or None.

    Returns:
        ``(out_t [B,N,E] in the input dtype, new LinearState)``.
    """
    for name, x in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
        if getattr(x, "ndim", None) != 3:
            fail(name, "a rank-3 array [B, heads, dim]", f"shape {getattr(x, 'shape', None)}")
    B, _, _, N, K, G, H, E = qkv_dims(q_t[:, None], k_t[:, None], v_t[:, None])
    _check_eps(eps)
    phi = _feature_fn(feature_map, projection, H)
    root_scale = _sqrt_scale(scale, feature_map, H)
    F = jax.eval_shape(phi, jax.ShapeDtypeStruct((H,), jnp.float32)).shape[-1]
    if log_gate is not None:
        if np.shape(log_gate) != (B, N):
            fail("log_gate", f"shape ({B}, {N}) = [B,N]", f"shape {np.shape(log_gate)}")
        log_gate = jnp.asarray(log_gate)[:, None]
    _check_decay(decay, log_gate, B, 1, N, causal=True, name="log_gate")
    _check_state(state, "state", B, N, F, E)
    log_a = _log_decay(decay, log_gate, B, 1, N)

    out_dtype = jnp.result_type(q_t.dtype, k_t.dtype, v_t.dtype)
    carry = (
        jnp.asarray(state[0], jnp.float32).reshape(B, K, G, F, E),
        jnp.asarray(state[1], jnp.float32).reshape(B, K, G, F),
    )
    (kv, z), (num, den) = _step(
        carry,
        q_t.astype(jnp.float32).reshape(B, K, G, H) * root_scale,
        k_t.astype(jnp.float32) * root_scale,
        v_t.astype(jnp.float32),
        None if log_a is None else log_a.reshape(B, K, G),
        phi,
    )
    out = num / (den[..., None] + eps) if normalize else num
    return out.reshape(B, N, E).astype(out_dtype), LinearState(
        kv.reshape(B, N, F, E), z.reshape(B, N, F)
    )
