"""The FlashAttention-2 backward of ``attn.pallas.flash_attention`` (Dao 2023).

Internal to ``attn.pallas``. With ``D = rowsum(dO * O) - d_lse`` (the lse
cotangent enters each logit's gradient as ``P`` does, so it folds into D) and
the forward's float32 lse, each tile recomputes ``P = exp(logits - lse)`` and

    dV += P^T dO      dP = dO V^T      dS = P * (dP - D) * cap'
    dQ += dS K        dK += dS^T Q     (times the logit scale)

in two kernels: a dq kernel over ``(B, N, query blocks)`` looping over the
forward's schedule, and a dk/dv kernel over ``(B, K, key blocks)`` looping over
the query blocks that see each key block and over the G query heads of its kv
head, so GQA sums dK and dV in the kernel without repeating K and V.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from attn.pallas.common import (
    FlashConfig,
    KernelInts,
    compiler_params,
    logits,
    masked_unless_full,
    matmul,
    tile_visible,
)
from attn.softmax.call import softcap_grad


def backward(config: FlashConfig, q, k, v, sink, ints: KernelInts, out, lse, d_out, d_lse):
    """``(dq, dk, dv, dsink)`` in the padded layouts of q, k, v and ``[N]``."""
    Tp, T = q.shape[1], config.T
    # Rows past T are padding: their outputs may be unwritten, so D is formed
    # on the real rows only and is zero on the rest, as is their dO.
    delta = jnp.einsum(
        "BTNE,BTNE->BNT", d_out[:, :T].astype(jnp.float32), out[:, :T].astype(jnp.float32)
    )
    delta = jnp.pad(delta - d_lse[:, :, :T], ((0, 0), (0, 0), (0, Tp - T)))
    # +inf gives P = 0: rows that see nothing (lse = -inf) and padding rows.
    real = (jnp.arange(Tp) < T)[None, None, :]
    lse = jnp.where(real & ~jnp.isneginf(lse), lse, jnp.inf)
    dq = _dq(config, q, k, v, d_out, lse, delta, ints)
    dk, dv = _dkdv(config, q, k, v, d_out, lse, delta, ints)
    if config.has_sink:
        # d lse / d sink = P_sink = exp(sink - lse), so d sink = -sum_rows P_sink * D.
        p_sink = jnp.exp(sink[None, :, None] - lse[:, :, :T])
        dsink = -(p_sink * delta[:, :, :T]).sum((0, 2))
    else:
        dsink = jnp.zeros_like(sink)
    return dq, dk, dv, dsink


def _dq(config: FlashConfig, q, k, v, d_out, lse, delta, ints: KernelInts):
    B, _, N, H = q.shape
    Sp, E = k.shape[1], v.shape[-1]
    G, bq = config.G, config.block_q
    sched = ints.by_query
    nq, W = sched.key_tile.shape
    per_block = pl.BlockSpec((None, W), lambda b, n, i: (i, 0))
    q_rows = pl.BlockSpec((None, bq), lambda b, n, i: (b, i))
    kv_rows = pl.BlockSpec((None, Sp), lambda b, n, i: (b, 0))
    row_stats = pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i))
    in_specs = [
        per_block,
        per_block,
        pl.BlockSpec((None, 1), lambda b, n, i: (i, 0)),
        pl.BlockSpec((None, bq, None, H), lambda b, n, i: (b, i, n, 0)),
        pl.BlockSpec((None, Sp, None, H), lambda b, n, i: (b, 0, n // G, 0)),
        pl.BlockSpec((None, Sp, None, E), lambda b, n, i: (b, 0, n // G, 0)),
        pl.BlockSpec((None, bq, None, E), lambda b, n, i: (b, i, n, 0)),
        row_stats,
        row_stats,
        q_rows,
        kv_rows,
    ]
    args = [sched.key_tile, sched.kind, sched.count[:, None], q, k, v, d_out, lse, delta]
    args += [ints.q_pos, ints.kv_pos]
    if config.has_segments:
        in_specs += [q_rows, kv_rows]
        args += [ints.q_seg, ints.kv_seg]
    return pl.pallas_call(
        functools.partial(_dq_kernel, config),
        grid=(B, N, nq),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, bq, None, H), lambda b, n, i: (b, i, n, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=config.interpret,
        compiler_params=compiler_params(config),
        name="attn_flash_dq",
    )(*args)


def _dq_kernel(config: FlashConfig, key_ref, kind_ref, count_ref, q_ref, k_ref, v_ref, do_ref,
               lse_ref, delta_ref, q_pos_ref, kv_pos_ref, *refs):  # fmt: skip
    if config.has_segments:
        q_seg_ref, kv_seg_ref, *refs = refs
    (dq_ref,) = refs
    bk = config.block_k
    q, do, q_pos = q_ref[...], do_ref[...], q_pos_ref[...]
    lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
    q_seg = q_seg_ref[...] if config.has_segments else None

    def body(t, dq):
        start = pl.multiple_of(key_ref[t] * bk, bk)
        keys = pl.ds(start, bk)
        k = k_ref[keys, :]

        def visible():
            k_seg = kv_seg_ref[keys] if config.has_segments else None
            return tile_visible(config, q_pos, kv_pos_ref[keys], start, q_seg, k_seg)

        ds = _ds(config, logits(config, q, k), kind_ref[t], visible, lse, delta, do, v_ref[keys, :])
        return dq + matmul(ds.astype(k.dtype), k)

    dq = lax.fori_loop(0, count_ref[0], body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * config.scale).astype(dq_ref.dtype)


def _ds(config: FlashConfig, x, kind, visible, lse, delta, do, v, p_out=None):
    """``dS`` of a tile from its capped logits x ``[Q,J]`` (and P, if ``p_out`` is a list)."""
    cap_grad = softcap_grad(x, config.softcap)  # from the unmasked logits: finite everywhere
    x = masked_unless_full(config, x, kind, visible)
    p = jnp.exp(x - lse)  # masked logits give exp(MASKED - lse) = 0
    if p_out is not None:
        p_out.append(p)
    ds = p * (matmul(do, v, (1, 1)) - delta)
    return ds if cap_grad is None else ds * cap_grad


def _dkdv(config: FlashConfig, q, k, v, d_out, lse, delta, ints: KernelInts):
    B, Tp, _, H = q.shape
    K, E = k.shape[2], v.shape[-1]
    G, bk = config.G, config.bwd_block_k
    sched = ints.by_key
    nk, W = sched.key_tile.shape
    per_block = pl.BlockSpec((None, W), lambda b, h, j: (j, 0))
    q_rows = pl.BlockSpec((None, Tp), lambda b, h, j: (b, 0))
    kv_rows = pl.BlockSpec((None, bk), lambda b, h, j: (b, j))
    row_stats = pl.BlockSpec((None, G, Tp), lambda b, h, j: (b, h, 0))
    in_specs = [
        per_block,
        per_block,
        pl.BlockSpec((None, 1), lambda b, h, j: (j, 0)),
        pl.BlockSpec((None, Tp, G, H), lambda b, h, j: (b, 0, h, 0)),
        pl.BlockSpec((None, bk, None, H), lambda b, h, j: (b, j, h, 0)),
        pl.BlockSpec((None, bk, None, E), lambda b, h, j: (b, j, h, 0)),
        pl.BlockSpec((None, Tp, G, E), lambda b, h, j: (b, 0, h, 0)),
        row_stats,
        row_stats,
        q_rows,
        kv_rows,
    ]
    args = [sched.key_tile, sched.kind, sched.count[:, None], q, k, v, d_out, lse, delta]
    args += [ints.q_pos, ints.kv_pos]
    if config.has_segments:
        in_specs += [q_rows, kv_rows]
        args += [ints.q_seg, ints.kv_seg]
    return pl.pallas_call(
        functools.partial(_dkdv_kernel, config),
        grid=(B, K, nk),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, bk, None, H), lambda b, h, j: (b, j, h, 0)),
            pl.BlockSpec((None, bk, None, E), lambda b, h, j: (b, j, h, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        interpret=config.interpret,
        compiler_params=compiler_params(config),
        name="attn_flash_dkdv",
    )(*args)


def _dkdv_kernel(config: FlashConfig, query_ref, kind_ref, count_ref, q_ref, k_ref, v_ref, do_ref,
                 lse_ref, delta_ref, q_pos_ref, kv_pos_ref, *refs):  # fmt: skip
    if config.has_segments:
        q_seg_ref, kv_seg_ref, *refs = refs
    dk_ref, dv_ref = refs
    bq, bk = config.bwd_block_q, config.bwd_block_k
    k, v, kv_pos = k_ref[...], v_ref[...], kv_pos_ref[...]
    k_seg = kv_seg_ref[...] if config.has_segments else None
    start_k = pl.program_id(2) * bk

    def body(t, carry):
        rows = pl.ds(pl.multiple_of(query_ref[t] * bq, bq), bq)
        q_pos = q_pos_ref[rows]
        q_seg = q_seg_ref[rows] if config.has_segments else None
        kind = kind_ref[t]

        def visible():
            return tile_visible(config, q_pos, kv_pos, start_k, q_seg, k_seg)

        def head(g, carry):  # the G query heads of this kv head
            dk, dv = carry
            q, do = q_ref[rows, g, :], do_ref[rows, g, :]
            lse, delta = lse_ref[g, rows][:, None], delta_ref[g, rows][:, None]
            p = []
            ds = _ds(config, logits(config, q, k), kind, visible, lse, delta, do, v, p)
            dv = dv + matmul(p[0].astype(do.dtype), do, (0, 0))
            dk = dk + matmul(ds.astype(q.dtype), q, (0, 0))
            return dk, dv

        return lax.fori_loop(0, config.G, head, carry)

    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = lax.fori_loop(0, count_ref[0], body, zeros)
    dk_ref[...] = (dk * config.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
