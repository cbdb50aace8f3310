"""The fast checks of ``python -m analysis.claims``: claims 1 to 9, measured with our library.

Each check is a function of no arguments returning a ``Check``: the measured
value as a short string, the criterion it is judged by, and whether it holds.
Every number comes from ``attn`` (attention, RoPE, blockwise, linear
attention, cache sizes) or ``models`` (claim 5's decoder); only the claimed
values are written down, as what to compare with. Criteria are fixed here,
before any measurement: where a check compares two computations of the same
function the tolerance is float32 rounding, and where a claim gives rounded
numbers the measured value must round to them. Each check runs in seconds
on a 2-core CPU (the shapes are tiny; compiling dominates).

Axis letters as in ``attn``: B batch, T queries, S keys, N heads, K kv heads,
H head dim, E value dim, F feature dim, D width, L layers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import attn
import models
from attn import masks

__all__ = [
    "CHECKS",
    "FLOAT32_TOL",
    "Check",
    "blockwise_exact_and_linear_memory",
    "causal_one_pass",
    "kv_cache_sizes",
    "linear_is_rnn",
    "permutation_equivariance",
    "rope_relative",
    "score_scale",
    "softmax_saturation",
    "worked_example",
]

# Two computations of the same float32 function (different summation orders:
# blockwise vs dense, chunkwise vs recurrent, one pass vs prefix passes) agree
# to a few ulps of O(1) values; 1e-5 is about 100 ulps of 1.0.
FLOAT32_TOL = 1e-5
# Each check runs as one jitted program (eager dispatch compiles every op on its
# own, which costs more). -O0 compiles them in about 2/3 of the time; LLVM keeps
# IEEE float semantics at -O0, so the values are the same.
_FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _jit(fn):
    """``jax.jit`` at -O0: each check is one small program, and compiling it dominates."""
    return jax.jit(fn, compiler_options=_FAST_COMPILE)


class Check(NamedTuple):
    """One claim measured.

    Attributes:
      measured: the measured value, a short sentence.
      criterion: what it is judged by, a short sentence.
      holds: whether the measured value meets the criterion.
      values: the numbers behind ``measured`` (JSON types), for results.json and tests.
    """

    measured: str
    criterion: str
    holds: bool
    values: dict[str, Any] = {}  # noqa: RUF012 (a NamedTuple default, never mutated)


def _fmt(a, digits: int = 2) -> str:
    """A NumPy array rounded to ``digits``, as a compact nested list."""
    return str(np.round(np.asarray(a, np.float64), digits).tolist())


def _rounds_to(x, want, digits: int) -> bool:
    """Whether ``x`` rounded to ``digits`` decimals is ``want`` (compared in float64)."""
    return np.allclose(np.round(np.asarray(x, np.float64), digits), want, rtol=0, atol=1e-12)


def _max_diff(a, b) -> float:
    return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


# ----------------------------------------------------------------------------
# 1-3: the arithmetic of scaled dot-product attention


def worked_example() -> Check:
    """Claim 1: the 3-token example with d_k = 2 (the one ``attn.demo`` prints).

    Q = K = [[1, 0], [0, 1], [1, 1]], V = [[1, 0], [0, 1], [0.5, 0.5]], one
    head, scale 1/sqrt(2): ``attn.dot_product_attention``'s weights must round
    to the claimed two decimals, its outputs too.
    """
    x = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])[None, :, None]  # [B=1,T=3,N=1,H=2]
    v = jnp.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])[None, :, None]
    out, w = _jit(lambda x, v: attn.dot_product_attention(x, x, v, return_weights=True))(x, v)
    w, out = np.asarray(w[0, 0], np.float64), np.asarray(out[0, :, 0], np.float64)
    want_w = np.array([[0.40, 0.20, 0.40], [0.20, 0.40, 0.40], [0.25, 0.25, 0.50]])
    want_out = np.array([[0.6, 0.4], [0.4, 0.6], [0.5, 0.5]])
    holds = _rounds_to(w, want_w, 2) and _rounds_to(out, want_out, 2)
    return Check(
        measured=f"weights {_fmt(w, 3)}, outputs {_fmt(out, 3)}",
        criterion=f"weights round to {want_w.tolist()} and outputs to {want_out.tolist()} "
        "(2 decimals)",
        holds=bool(holds),
        values={"weights": w.tolist(), "outputs": out.tolist()},
    )


def score_scale(num_pairs: int = 100_000, head_dim: int = 64, seed: int = 0) -> Check:
    """Claim 2: q.k of unit-variance vectors has std sqrt(H) = 8; 1 after the 1/sqrt(H) scale.

    The sample std of ``num_pairs`` dot products has a standard error of about
    ``8 sqrt((kurtosis - 1) / (4 n)) = 0.018`` (the sum of 64 products of
    normals has kurtosis 3 + 6/64), so the tolerance of 0.1 (0.0125 scaled) is
    about 5 standard errors.
    """
    rng = np.random.default_rng(seed)  # NumPy: sampling 13M normals eagerly in JAX is slower
    q = rng.standard_normal((num_pairs, head_dim), np.float32)
    k = rng.standard_normal((num_pairs, head_dim), np.float32)
    dots = np.einsum("PH,PH->P", q, k, dtype=np.float64)
    raw = float(np.std(dots))
    scaled = float(np.std(dots / np.sqrt(head_dim)))  # attn's default scale 1/sqrt(H)
    want = np.sqrt(head_dim)
    holds = abs(raw - want) < 0.1 and abs(scaled - 1.0) < 0.1 / want
    return Check(
        measured=f"std {raw:.3f} unscaled, {scaled:.4f} after / sqrt({head_dim}) "
        f"({num_pairs:,} pairs)",
        criterion=f"|std - {want:g}| < 0.1 and |scaled std - 1| < {0.1 / want:.4f}",
        holds=bool(holds),
        values={"std": raw, "scaled_std": scaled, "num_pairs": num_pairs},
    )


def _softmax_weights(logits):
    """Softmax over ``logits [S]`` computed by ``attn.dot_product_attention``.

    One query of value 1 and keys ``logits [S,1]`` with scale 1 (H = 1) make
    the attention logits exactly ``logits``; the weights are their softmax.
    """
    q = jnp.ones((1, 1, 1, 1), jnp.float32)
    k = jnp.asarray(logits, jnp.float32)[None, :, None, None]
    _, w = attn.dot_product_attention(q, k, k, scale=1.0, return_weights=True)
    return w[0, 0, 0]  # [S]


def softmax_saturation() -> Check:
    """Claim 3: softmax of [1,2,3] and of 8x those logits, and its Jacobian there.

    The Jacobian ``d weights / d logits`` is ``diag(p) - p p^T``: its largest
    entry is near 1/4 for spread weights and near 0 once one weight is 1.
    """

    @_jit
    def measure(logits):  # [2,3] -> weights [2,3], max |Jacobian| [2]
        jac = jax.vmap(jax.jacobian(_softmax_weights))(logits)
        return jax.vmap(_softmax_weights)(logits), jnp.abs(jac).max(axis=(1, 2))

    p, jac = measure(jnp.array([[1.0, 2.0, 3.0], [8.0, 16.0, 24.0]]))
    (p_small, p_large), (jac_small, jac_large) = np.asarray(p, np.float64), np.asarray(jac)
    holds = (
        _rounds_to(p_small, [0.09, 0.24, 0.67], 2)
        and _rounds_to(p_large, [0.0, 0.0003, 0.9997], 4)
        and jac_large < 1e-3
    )
    return Check(
        measured=f"softmax([1,2,3]) = {_fmt(p_small, 4)}, softmax([8,16,24]) = "
        f"{_fmt(p_large, 5)}; max |d weights / d logits| {jac_small:.3f} vs {jac_large:.1e}",
        criterion="rounds to [0.09,0.24,0.67] and [0,0.0003,0.9997] (4 decimals); saturated "
        "max |Jacobian| < 1e-3",
        holds=bool(holds),
        values={
            "softmax_small": p_small.tolist(),
            "softmax_large": p_large.tolist(),
            "max_jacobian_small": float(jac_small),
            "max_jacobian_large": float(jac_large),
        },
    )


# ----------------------------------------------------------------------------
# 4-6: order, causality and positions


def permutation_equivariance(T: int = 6, D: int = 8, N: int = 2, seed: int = 0) -> Check:
    """Claim 4: without positions, attention of permuted tokens is the permuted output.

    Tokens ``x [1,T,D]`` are projected to q, k, v by random matrices and
    attended (no mask); permuting the tokens must permute the outputs. The same
    layer with RoPE on q and k (positions 0..T-1) is the contrast: there the
    difference is O(1).
    """
    H = D // N
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, T, D), np.float32)
    w_q, w_k, w_v = rng.standard_normal((3, D, N * H), np.float32) / np.sqrt(D)
    perm = rng.permutation(T)

    def layer(x, rope: bool):
        q, k, v = ((x @ w).reshape(1, T, N, H) for w in (w_q, w_k, w_v))
        if rope:
            q, k = attn.apply_rope(q, jnp.arange(T)), attn.apply_rope(k, jnp.arange(T))
        return attn.dot_product_attention(q, k, v)  # [1,T,N,H]

    @_jit
    def measure(x):
        def diff(rope):
            return jnp.abs(layer(x[:, perm], rope) - layer(x, rope)[:, perm]).max()

        return diff(False), diff(True)

    plain, with_rope = (float(d) for d in measure(x))
    return Check(
        measured=f"max |f(Px) - P f(x)| = {plain:.1e} (T={T}, random permutation); "
        f"{with_rope:.2f} with RoPE",
        criterion=f"< {FLOAT32_TOL:g} (float32 rounding) without positions",
        holds=plain < FLOAT32_TOL,
        values={"max_diff": plain, "max_diff_rope": with_rope},
    )


def _decoder(vocab: int, width: int, num_layers: int, seed: int = 0):
    config = models.ModelConfig(
        vocab_size=vocab,
        width=width,
        mlp_width=2 * width,
        layers=models.pattern(("mha",) * num_layers, models.presets(num_heads=2, head_dim=8)),
    )
    return models.Decoder(config, rngs=nnx.Rngs(seed))


def _token_losses(logits, targets):
    """Next-token cross-entropy per position: ``logits [B,T,V]``, ``targets [B,T]`` -> ``[B,T]``."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def causal_one_pass(T: int = 4, B: int = 2, vocab: int = 16, seed: int = 0) -> Check:
    """Claim 5: one causal pass gives the per-position losses of T separate prefix passes.

    A 2-layer causal decoder (``models.Decoder``, softmax MHA with RoPE, width
    16) at its random initialization: the loss at position t of one pass over
    T tokens against the last position's loss of a pass over the first t + 1
    tokens only, for every t. So one pass trains on T next-token predictions.
    """
    model = _decoder(vocab, 16, 2, seed)
    graphdef, state = nnx.split(model)

    @_jit
    def losses_of(state, inputs, targets):  # one compile per length, T in all
        return _token_losses(nnx.merge(graphdef, state)(inputs), targets)  # [B,t]

    tokens = np.random.default_rng(seed).integers(0, vocab, (B, T + 1), dtype=np.int32)
    inputs, targets = tokens[:, :T], tokens[:, 1:]
    one_pass = losses_of(state, inputs, targets)  # [B,T]; also the prefix pass of length T
    prefix = [
        losses_of(state, inputs[:, : t + 1], targets[:, : t + 1])[:, -1] for t in range(T - 1)
    ]
    prefix = jnp.stack([*prefix, one_pass[:, -1]], axis=1)
    diff = _max_diff(one_pass, prefix)
    return Check(
        measured=f"{T} positions x {B} sequences: max |one pass - prefix passes| = {diff:.1e} "
        f"(losses ~{float(one_pass.mean()):.2f})",
        criterion=f"< {FLOAT32_TOL:g} (float32 rounding) at every position",
        holds=diff < FLOAT32_TOL,
        values={"max_diff": diff, "positions": T, "sequences": B},
    )


def rope_relative(head_dim: int = 64, seed: int = 0) -> Check:
    """Claim 6: with RoPE the score of q at m and k at n depends only on m - n.

    For offsets d = m - n in {-7, 0, 5, 100} the score is computed at shifts
    n = 7, 8, 44, 307, 907 (``attn.apply_rope``, base 10000). Its spread over
    shifts must be float32 rounding of the angles: positions below 1024 carry
    an angle error of at most ~6e-5 rad each, so ``|q||k| x 1e-4`` bounds it.
    The spread over offsets at a fixed shift is the contrast (O(|q||k|)).
    """
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, head_dim), np.float32)
    offsets, shifts = np.array([-7, 0, 5, 100]), np.array([7, 8, 44, 307, 907])
    m = (offsets[:, None] + shifts[None, :]).reshape(-1)  # query positions, in [0, 1024)
    n = np.broadcast_to(shifts[None, :], (len(offsets), len(shifts))).reshape(-1)  # keys

    @_jit
    def scores_at(q, k):  # [P] scores of q at m[i] against k at n[i]
        P = len(m)
        q_rot = attn.apply_rope(jnp.broadcast_to(q, (P, 1, 1, head_dim)), m[:, None])
        k_rot = attn.apply_rope(jnp.broadcast_to(k, (P, 1, 1, head_dim)), n[:, None])
        return jnp.sum(q_rot * k_rot, axis=(1, 2, 3))

    scores = np.asarray(scores_at(q, k), np.float64)
    scores = scores.reshape(len(offsets), len(shifts))  # [offset, shift]
    norm = float(np.linalg.norm(q) * np.linalg.norm(k))
    over_shifts = float(np.max(np.ptp(scores, axis=1))) / norm
    over_offsets = float(np.min(np.ptp(scores, axis=0))) / norm
    return Check(
        measured=f"score spread over shifts {over_shifts:.1e} |q||k| (max over 4 offsets, "
        f"positions < 1024); over offsets {over_offsets:.2f} |q||k|",
        criterion="spread over shifts < 1e-4 |q||k| (float32 angle rounding)",
        holds=over_shifts < 1e-4,
        values={"spread_over_shifts": over_shifts, "spread_over_offsets": over_offsets},
    )


# ----------------------------------------------------------------------------
# 7-9: memory and recurrence


def kv_cache_sizes() -> Check:
    """Claim 7: Llama 3 8B's KV cache, GQA and MQA against MHA, and MLA's latent.

    Llama 3 8B (Llama Team, "The Llama 3 Herd of Models", 2024): 32 layers,
    32 query heads, 8 kv heads of dim 128, float16. MLA: DeepSeek-V2's latent
    (DeepSeek-AI, 2024: 60 layers, rank 512, RoPE key 64, bfloat16) against MHA
    with its 128 heads of dim 128 at the same layers and dtype.
    """
    llama = {"num_layers": 32, "head_dim": 128, "dtype": jnp.float16}
    N = 32
    per_kv = {K: attn.kv_cache_bytes(**llama, num_kv_heads=K) for K in (N, 8, 1)}
    per_token = per_kv[8]
    request = attn.kv_cache_bytes(**llama, num_kv_heads=8, num_tokens=8192)
    batch = attn.kv_cache_bytes(**llama, num_kv_heads=8, num_tokens=8192, batch=16)
    mla = attn.latent_cache_bytes(num_layers=60, kv_rank=512, rope_head_dim=64, dtype=jnp.bfloat16)
    mha_dsv2 = attn.kv_cache_bytes(
        num_layers=60, num_kv_heads=128, head_dim=128, dtype=jnp.bfloat16
    )
    holds = (
        per_token == 128 * 2**10
        and request == 2**30
        and batch == 16 * 2**30
        and per_kv[N] == 4 * per_token
        and per_kv[N] // per_kv[8] == N // 8
        and per_kv[N] // per_kv[1] == N // 1
        and mla == 60 * (512 + 64) * 2  # L (R + rope dim) x 2 bytes: no head count in it
        and mla < mha_dsv2
    )
    return Check(
        measured=f"{per_token // 1024} KiB/token, {request / 2**30:g} GiB at 8K, "
        f"{batch / 2**30:g} GiB for 16; MHA {per_kv[N] // per_token}x; N/K: GQA "
        f"{per_kv[N] // per_kv[8]}x, MQA {per_kv[N] // per_kv[1]}x smaller; MLA latent "
        f"{mla:,} B/token vs MHA {mha_dsv2 / 2**20:.2f} MiB ({mha_dsv2 / mla:.0f}x)",
        criterion="128 KiB, 1 GiB, 16 GiB, 4x; MHA/GQA = 32/8, MHA/MQA = 32; MLA = L (R + rope) "
        "elements, below MHA",
        holds=bool(holds),
        values={
            "bytes_per_token": per_token,
            "bytes_8k": request,
            "bytes_8k_x16": batch,
            "bytes_per_token_by_kv_heads": {str(K): b for K, b in per_kv.items()},
            "mla_bytes_per_token": mla,
            "mha_128_heads_bytes_per_token": mha_dsv2,
        },
    )


def _compile(fn, T: int, N: int, K: int, H: int):
    """``jit(fn)`` compiled for q ``[1,T,N,H]`` and k, v ``[1,T,K,H]`` float32.

    At the default optimization level (what a user's ``jit`` plans), not at
    the -O0 of the other checks: the memory plan is the measurement.
    """
    q = jax.ShapeDtypeStruct((1, T, N, H), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, T, K, H), jnp.float32)
    return jax.jit(fn).lower(q, kv, kv).compile()


def _peak_bytes(compiled) -> int:
    """Peak memory XLA plans for a compiled program: arguments, outputs and temporaries."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes)


def blockwise_exact_and_linear_memory(
    T_small: int = 2000, T_large: int = 8000, N: int = 4, K: int = 2, H: int = 32
) -> Check:
    """Claim 8: blockwise attention equals dense attention; its memory is linear in T.

    Causal GQA (B=1, N=4, K=2, H=32) with the default blocks (1024 queries x
    512 keys), at lengths that are not multiples of them (padded tiles, partial
    causal tiles). Exactness: the compiled blockwise program at ``T_small``
    against ``attn.dot_product_attention`` on the same random inputs. Memory:
    the peak XLA plans for each compiled forward (arguments, output and
    temporaries) at two lengths. Linear memory grows by the length ratio r
    (here 4); the criterion allows 1.25 r. Dense attention, which holds
    ``[T,S]`` scores, grows by about r^2.
    """
    causal = masks.causal()

    def blockwise(q, k, v):
        return attn.blockwise_attention(q, k, v, mask=causal)

    def dense(q, k, v):
        return attn.dot_product_attention(q, k, v, mask=causal)

    compiled = {
        (name, T): _compile(fn, T, N, K, H)
        for name, fn in (("blockwise", blockwise), ("dense", dense))
        for T in (T_small, T_large)
    }
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, T_small, N, H), np.float32)
    k, v = rng.standard_normal((2, 1, T_small, K, H), np.float32)
    diff = _max_diff(compiled["blockwise", T_small](q, k, v), compiled["dense", T_small](q, k, v))
    peak = {key: _peak_bytes(c) for key, c in compiled.items()}
    r = T_large / T_small
    grow = {name: peak[name, T_large] / peak[name, T_small] for name in ("blockwise", "dense")}
    mib = lambda n: f"{n / 2**20:.1f}"  # noqa: E731
    return Check(
        measured=f"max |blockwise - dense| = {diff:.1e} (T={T_small}); peak at "
        f"T={T_small}/{T_large}: blockwise {mib(peak['blockwise', T_small])}/"
        f"{mib(peak['blockwise', T_large])} MiB ({grow['blockwise']:.2f}x), dense "
        f"{mib(peak['dense', T_small])}/{mib(peak['dense', T_large])} MiB ({grow['dense']:.1f}x)",
        criterion=f"diff < {FLOAT32_TOL:g}; blockwise peak grows <= 1.25 x {r:g} "
        f"(quadratic: {r * r:g})",
        holds=diff < FLOAT32_TOL and grow["blockwise"] <= 1.25 * r,
        values={
            "max_diff": diff,
            "lengths": [T_small, T_large],
            "peak_bytes": {n: [peak[n, T_small], peak[n, T_large]] for n in grow},
            "growth": grow,
        },
    )


def linear_is_rnn(T: int = 64, B: int = 1, N: int = 2, H: int = 8, seed: int = 0) -> Check:
    """Claim 9: causal linear attention is an RNN with a fixed-size state.

    elu+1 features (Katharopoulos et al., 2020), normalized: the parallel
    ``[T,S]`` form, the recurrent scan and the chunkwise form (chunks of 16)
    must agree. The state is the whole memory: continuing from the state after
    the first half gives the second half of the full pass, and the final state
    has the same size after T/2 and after 4T tokens.
    """
    q, k, v = np.random.default_rng(seed).standard_normal((3, B, 4 * T, N, H), np.float32)
    run = functools.partial(attn.linear_attention, feature_map="elu1", chunk_size=16)
    half = T // 2

    @_jit
    def measure(q, k, v):
        short = [x[:, :T] for x in (q, k, v)]
        outs = {form: run(*short, form=form) for form in ("parallel", "recurrent", "chunkwise")}
        forms = jnp.maximum(
            *(jnp.abs(outs[f] - outs["parallel"]).max() for f in outs if f != "parallel")
        )
        _, state = run(*(x[:, :half] for x in short), return_state=True)
        rest = run(*(x[:, half:] for x in short), initial_state=state)
        resumed = jnp.abs(rest - outs["parallel"][:, half:]).max()
        return forms, resumed, state

    forms, resumed, state = measure(q, k, v)
    forms, resumed = float(forms), float(resumed)
    # The state after 4T tokens: shapes only (the size is the claim, not the values).
    state_long = jax.eval_shape(lambda q, k, v: run(q, k, v, return_state=True)[1], q, k, v)
    size = lambda s: sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in s)  # noqa: E731
    F = attn.linear_feature_dim("elu1", H)
    formula = attn.linear_state_bytes(num_layers=1, num_heads=N, feature_dim=F, value_dim=H)
    same_size = size(state) == size(state_long) == formula
    return Check(
        measured=f"max |form - parallel| = {forms:.1e} (T={T}); resumed from the state: "
        f"{resumed:.1e}; state {size(state)} B after {half} tokens, {size(state_long)} B after "
        f"{4 * T}",
        criterion=f"both < {FLOAT32_TOL:g}; state bytes equal at both lengths "
        f"(= linear_state_bytes, {formula} B)",
        holds=forms < FLOAT32_TOL and resumed < FLOAT32_TOL and same_size,
        values={
            "max_diff_forms": forms,
            "max_diff_resumed": resumed,
            "state_bytes": [size(state), size(state_long)],
            "state_lengths": [half, 4 * T],
            "linear_state_bytes": formula,
        },
    )


CHECKS: dict[int, Callable[[], Check]] = {
    1: worked_example,
    2: score_scale,
    3: softmax_saturation,
    4: permutation_equivariance,
    5: causal_one_pass,
    6: rope_relative,
    7: kv_cache_sizes,
    8: blockwise_exact_and_linear_memory,
    9: linear_is_rnn,
}
