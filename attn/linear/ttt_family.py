"""TTT-Linear, TTT-MLP and Titans as family records (``attn.linear.family``).

Their states are models trained on the sequence, not linear in their past, so a
span's transition is no matrix to exchange (``kind="none"``, no sharded form);
the records give what the rest of the library reads of a family: the function
and step, the forms, how a span runs, the zero state, the float64 reference and
the inputs the benchmarks draw. The inner model's weights are ``params``
fields (``w1, b1`` for a linear model's ``W, b``; ``w1, b1, w2, b2`` for an MLP's).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attn.linear import reference, sharded  # noqa: F401  (sharded: its six records first)
from attn.linear.family import FAMILIES, Family, normal
from attn.linear.titans import TITANS_FORMS, titans, titans_step, titans_zero_state
from attn.linear.ttt import (
    TTT_FORMS,
    ttt_linear,
    ttt_linear_step,
    ttt_mlp,
    ttt_mlp_step,
    ttt_zero_state,
)

__all__ = ["TTTParams", "TTTTokens", "TitansParams", "TitansTokens"]


class TTTTokens(NamedTuple):
    q: jax.Array  # [B,T,N,H]
    k: jax.Array  # [B,T,N,H]
    v: jax.Array  # [B,T,N,H]
    eta: jax.Array  # [B,T,N]


class TTTParams(NamedTuple):
    """The LayerNorm, the per-position rates and the initial inner model, per head."""

    norm_scale: jax.Array  # [N,H]
    norm_bias: jax.Array  # [N,H]
    position_lr: jax.Array  # [mini_batch]
    w1: jax.Array  # [N,H,H] or [N,H,F]
    b1: jax.Array  # [N,H] or [N,F]
    w2: jax.Array | None = None  # [N,F,H]
    b2: jax.Array | None = None  # [N,H]


def _model(p):
    return tuple(x for x in (p.w1, p.b1, p.w2, p.b2) if x is not None)


def _run(fn, t, p, ids, state, options):
    options = {n: x for n, x in options.items() if n != "chunk_size"}  # b is the math's own
    return fn(*t, norm_scale=p.norm_scale, norm_bias=p.norm_bias, position_lr=p.position_lr,
              model=_model(p), initial_state=state, return_state=True,
              q_segment_ids=ids.q_seg, kv_segment_ids=ids.kv_seg, **options)  # fmt: skip


def _zeros(t, p, options):
    B, _, N, H = t.q.shape
    return ttt_zero_state(B, N, H, params=_model(p))


def _examples(rng, z, mlp: bool):
    """Keys and queries of unit rms, the layer's rates (``base_lr sigmoid(.) / H``), a
    mini-batch that does not divide T, and a small initial model (the layer's init)."""
    B, T, N, H = (z[n] for n in "BTNH")
    F = 2 * H
    b = 8
    eta = (0.1 if mlp else 1.0) / (1 + np.exp(-normal(rng, B, T, N))) / H
    shapes = [(N, H, F), (N, F), (N, F, H), (N, H)] if mlp else [(N, H, H), (N, H)]
    model = [0.02 * normal(rng, *s) for s in shapes]
    lr = (1 / np.arange(1, b + 1)).astype(np.float32)
    params = TTTParams(1 + 0.1 * normal(rng, N, H), 0.1 * normal(rng, N, H), lr, *model)
    tokens = TTTTokens(*(normal(rng, B, T, N, H) for _ in "qkv"), eta.astype(np.float32))
    return {f"b{b}": (tokens, params, {"mini_batch": b})}


def _reference(t, p, options):
    B = t.q.shape[0]
    params = tuple(jnp.broadcast_to(x, (B, *jnp.shape(x))) for x in _model(p))
    state = (params, tuple(jnp.zeros_like(x) for x in params), jnp.zeros(B, jnp.int32))
    return reference.ttt(*t, p.norm_scale, p.norm_bias, p.position_lr, state,
                         mini_batch=options["mini_batch"])  # fmt: skip


for _name, _fn, _step, _mlp in (("ttt_linear", ttt_linear, ttt_linear_step, False),
                                ("ttt_mlp", ttt_mlp, ttt_mlp_step, True)):  # fmt: skip
    FAMILIES.add(_name, Family(
        _name, _fn, _step, TTT_FORMS, _run, _zeros, "none", None, None,
        reference=_reference, examples=lambda rng, z, m=_mlp: _examples(rng, z, m),
        data=("q", "k", "v"),
    ))  # fmt: skip


class TitansTokens(NamedTuple):
    q: jax.Array  # [B,T,N,H]
    k: jax.Array  # [B,T,N,H]
    v: jax.Array  # [B,T,N,H]
    theta: jax.Array  # [B,T,N]
    log_momentum: jax.Array  # [B,T,N]
    log_decay: jax.Array  # [B,T,N]


class TitansParams(NamedTuple):
    """The memory's LayerNorm and its initial weights, per head."""

    norm_scale: jax.Array  # [N,H]
    norm_bias: jax.Array  # [N,H]
    w1: jax.Array  # [N,H,H] or [N,H,F]
    b1: jax.Array  # [N,H] or [N,F]
    w2: jax.Array | None = None  # [N,F,H]
    b2: jax.Array | None = None  # [N,H]


def _titans_run(fn, t, p, ids, state, options):
    options = {n: x for n, x in options.items() if n != "chunk_size"}
    memory = "mlp" if p.w2 is not None else "linear"
    return fn(*t, norm_scale=p.norm_scale, norm_bias=p.norm_bias, memory=memory,
              model=_model(p), initial_state=state, return_state=True,
              q_segment_ids=ids.q_seg, kv_segment_ids=ids.kv_seg, **options)  # fmt: skip


def _titans_zeros(t, p, options):
    B, _, N, H = t.q.shape
    return titans_zero_state(B, N, H, memory="mlp" if p.w2 is not None else "linear",
                             params=_model(p))  # fmt: skip


def _titans_examples(rng, z):
    """Both memories, a mini-batch that does not divide T: steps of the layer's scale,
    momentum in (0.5, 0.95), weight decay up to 0.1."""
    B, T, N, H = (z[n] for n in "BTNH")
    out = {}
    for memory in ("linear", "mlp"):
        F = 2 * H
        shapes = [(N, H, F), (N, F), (N, F, H), (N, H)] if memory == "mlp" else [(N, H, H), (N, H)]
        model = [0.02 * normal(rng, *s) for s in shapes]
        theta = (0.1 / (1 + np.exp(-normal(rng, B, T, N))) / H).astype(np.float32)
        log_m = np.log(rng.uniform(0.5, 0.95, (B, T, N))).astype(np.float32)
        log_d = np.log1p(-rng.uniform(0.0, 0.1, (B, T, N))).astype(np.float32)
        tokens = TitansTokens(*(normal(rng, B, T, N, H) for _ in "qkv"), theta, log_m, log_d)
        params = TitansParams(1 + 0.1 * normal(rng, N, H), 0.1 * normal(rng, N, H), *model)
        out[memory] = (tokens, params, {"mini_batch": 8})
    return out


def _titans_reference(t, p, options):
    B = t.q.shape[0]
    params = tuple(jnp.broadcast_to(x, (B, *jnp.shape(x))) for x in _model(p))
    state = (params, tuple(jnp.zeros_like(x) for x in params), params, jnp.zeros(B, jnp.int32))
    return reference.titans(*t, p.norm_scale, p.norm_bias, state,
                            mini_batch=options["mini_batch"])  # fmt: skip


FAMILIES.add("titans", Family(
    "titans", titans, titans_step, TITANS_FORMS, _titans_run, _titans_zeros, "none", None, None,
    reference=_titans_reference, examples=_titans_examples, data=("q", "k", "v"),
))  # fmt: skip
