"""The FlashAttention-2 backward of ``attn.pallas.flash_attention`` (Dao 2023).

Internal to ``attn.pallas``. With ``D = rowsum(dO * O) - d_lse`` (the lse
cotangent enters each logit's gradient as ``P`` does, so it folds into D) and
the forward's float32 lse, each tile recomputes ``P = exp(logits - lse)`` and

    dV += P^T dO      dP = dO V^T      dX = P * (dP - D)    dS = mod'(S)^T dX
    dQ += dS K        dK += dS^T Q     (times the logit scale)

in two kernels: a dq kernel over ``(B, N, query blocks)`` looping over the
forward's schedule, and a dk/dv kernel over ``(B, K, key blocks)`` looping over
the query blocks that see each key block and over the G query heads of its kv
head, so GQA sums dK and dV in the kernel without repeating K and V.

The score modifier (soft-cap included) is differentiated per tile with
``jax.vjp``, which gives dS and the tile's share of its leaves' cotangents:
the dq kernel, which owns query rows, writes those of the q leaves and a
per-program partial of the head leaves' (summed outside); the dk/dv kernel,
which owns key columns, those of the k leaves.

Tiles and launch: the dq kernel walks the forward's schedule, so it has the
forward's tiles (``block_q``, ``block_k``); the dk/dv kernel has its own
(``bwd_block_q``, ``bwd_block_k``). Both launch with the backward's Triton
settings (``FlashConfig.launch(backward=True)``: ``bwd_num_warps`` and
``bwd_num_stages``, the forward's where not set), which the tuning cache
(``attn.pallas.tuning``) may give apart from the forward's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from attn.pallas.common import (
    FlashConfig,
    KernelInts,
    flash_call,
    head_view,
    logits,
    masked_unless_full,
    matmul,
    mod_specs,
    modify_vjp,
    pair_by_key,
    pair_by_query,
    pair_columns,
    pair_rows,
    row_inputs,
    store_head,
    take_pairs,
    take_views,
    tile_visible,
)


def backward(config: FlashConfig, q, k, v, sink, mod, bias, ints: KernelInts, out, lse, d_out,
             d_lse):  # fmt: skip
    """``(dq, dk, dv, dsink, dmod, dbias)`` in the padded layouts of q, k, v, ``[N]``,
    ``mod`` and the bias (None without one)."""
    Tp, T = q.shape[1], config.call.T
    # Rows past T are padding: their outputs may be unwritten, so D is formed
    # on the real rows only and is zero on the rest, as is their dO.
    delta = jnp.einsum(
        "BTNE,BTNE->BNT", d_out[:, :T].astype(jnp.float32), out[:, :T].astype(jnp.float32)
    )
    delta = jnp.pad(delta - d_lse[:, :, :T], ((0, 0), (0, 0), (0, Tp - T)))
    # +inf gives P = 0: rows that see nothing (lse = -inf) and padding rows.
    real = (jnp.arange(Tp) < T)[None, None, :]
    lse = jnp.where(real & ~jnp.isneginf(lse), lse, jnp.inf)
    dq, d_head, d_q, dbias = _dq(config, q, k, v, d_out, lse, delta, mod, bias, ints)
    dk, dv, d_k = _dkdv(config, q, k, v, d_out, lse, delta, mod, bias, ints)
    # Per (batch, head, query block) partials -> [N, 1, ...].
    dmod = dict(head=[d.sum((0, 2)) for d in d_head], q=d_q, k=d_k)
    if config.call.has_sink:
        # d lse / d sink = P_sink = exp(sink - lse), so d sink = -sum_rows P_sink * D.
        p_sink = jnp.exp(sink[None, :, None] - lse[:, :, :T])
        dsink = -(p_sink * delta[:, :, :T]).sum((0, 2))
    else:
        dsink = jnp.zeros_like(sink)
    if bias is not None:  # [B,N,Tp,Sp] -> summed over the axes the bias broadcasts over
        dbias = dbias.reshape(dbias.shape[0], config.call.K, config.call.G, *dbias.shape[2:])
        dbias = dbias.sum(tuple(a for a, n in enumerate(bias.shape) if n == 1), keepdims=True)
    return dq, dk, dv, dsink, dmod, dbias


def _dq(config: FlashConfig, q, k, v, d_out, lse, delta, mod, bias, ints: KernelInts):
    B, _, N, H = q.shape
    Sp, E = k.shape[1], v.shape[-1]
    G, bq = config.call.G, config.block_q
    sched = ints.by_query
    nq, W = sched.key_tile.shape
    per_block = pl.BlockSpec((None, W), lambda b, n, i: (i, 0))
    q_rows = pl.BlockSpec((None, bq), lambda b, n, i: (b, i))
    kv_rows = pl.BlockSpec((None, Sp), lambda b, n, i: (b, 0))
    row_stats = pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i))
    row_specs, rows = row_inputs(config, ints, q_rows, kv_rows)
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
        *row_specs,
    ]
    args = [sched.key_tile, sched.kind, sched.count[:, None], q, k, v, d_out, lse, delta, *rows]
    q_block = ((None, None, bq), lambda b, n, i: (b, n, i))
    k_block = ((None, None, Sp), lambda b, n, i: (b, n, 0))
    specs, leaves = mod_specs(mod, head=(None, lambda b, n, i: n), q=q_block, k=k_block)
    # Outputs: dq, a per-program partial of each head leaf's cotangent, the q leaves'.
    head_partials = [
        pl.BlockSpec((None, None, None, *x.shape[1:]),
                     lambda b, n, i, _r=(0,) * (x.ndim - 1): (b, n, i, *_r))
        for x in mod["head"]
    ]  # fmt: skip
    out_specs = [pl.BlockSpec((None, bq, None, H), lambda b, n, i: (b, i, n, 0)), *head_partials]
    out_specs += [pl.BlockSpec(*q_block) for _ in mod["q"]]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_shape += [jax.ShapeDtypeStruct((B, N, nq, *x.shape[1:]), jnp.float32) for x in mod["head"]]
    out_shape += [jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in mod["q"]]
    pair_args = [x for x in (bias, ints.keep) if x is not None]
    specs += [pair_by_query(config, x) for x in pair_args]
    if bias is not None:  # every (b, n, i) writes its own rows: summed over broadcasts outside
        out_specs.append(pl.BlockSpec((None, None, bq, Sp), lambda b, n, i: (b, n, i, 0)))
        out_shape.append(jax.ShapeDtypeStruct((B, N, q.shape[1], Sp), jnp.float32))
    call = flash_call(config, _dq_kernel, "attn_flash_dq", (B, N, nq), in_specs + specs,
                      out_specs, out_shape, backward=True)  # fmt: skip
    dq, *rest = call(*args, *leaves, *pair_args)
    dbias = rest.pop() if bias is not None else None
    n_head = len(mod["head"])
    return dq, rest[:n_head], rest[n_head:], dbias


def _dq_kernel(config: FlashConfig, key_ref, kind_ref, count_ref, q_ref, k_ref, v_ref, do_ref,
               lse_ref, delta_ref, q_pos_ref, kv_pos_ref, *refs):  # fmt: skip
    if config.call.has_segments:
        q_seg_ref, kv_seg_ref, *refs = refs
    mod_refs, refs = take_views(config, refs)
    bias_ref, keep_ref, (dq_ref, *refs) = take_pairs(config, refs)
    dbias_ref = refs.pop() if bias_ref is not None else None
    d_head_refs, d_q_refs = refs[: len(mod_refs["head"])], refs[len(mod_refs["head"]) :]
    bk = config.block_k
    if dbias_ref is not None:  # tiles the schedule skips have a zero cotangent

        def clear(t, carry):
            dbias_ref[:, pl.ds(pl.multiple_of(t * bk, bk), bk)] = jnp.zeros(
                (dbias_ref.shape[0], bk), jnp.float32
            )
            return carry

        lax.fori_loop(0, dbias_ref.shape[1] // bk, clear, 0)
    q, do, q_pos = q_ref[...], do_ref[...], q_pos_ref[...]
    lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
    q_seg = q_seg_ref[...] if config.call.has_segments else None
    views = dict(head=[head_view(r) for r in mod_refs["head"]], q=[r[...] for r in mod_refs["q"]])

    def body(t, carry):
        dq, d_head, d_q = carry
        start = pl.multiple_of(key_ref[t] * bk, bk)
        keys = pl.ds(start, bk)
        k, k_pos = k_ref[keys, :], kv_pos_ref[keys]
        tile = dict(views, k=[r[keys] for r in mod_refs["k"]])

        def visible():
            k_seg = kv_seg_ref[keys] if config.call.has_segments else None
            ok = tile_visible(config, q_pos, k_pos, start, q_seg, k_seg)
            return ok if keep_ref is None else ok & (pair_rows(keep_ref, keys, ok.shape) != 0)

        s = logits(config, q, k)
        bias = None if bias_ref is None else pair_rows(bias_ref, keys, s.shape)
        ds, _, dx, d_tile = _ds(config, s, bias, kind_ref[t], visible, lse, delta, do,
                             v_ref[keys, :], tile, q_pos, k_pos)  # fmt: skip
        if dbias_ref is not None:
            dbias_ref[:, keys] = dx
        d_head = jax.tree.map(jnp.add, d_head, d_tile["head"])
        d_q = [a + b for a, b in zip(d_q, d_tile["q"], strict=True)]
        return dq + matmul(ds.astype(k.dtype), k), d_head, d_q

    zeros = jax.tree.map(jnp.zeros_like, views)
    carry = (jnp.zeros(q.shape, jnp.float32), zeros["head"], zeros["q"])
    dq, d_head, d_q = lax.fori_loop(0, count_ref[0], body, carry)
    dq_ref[...] = (dq * config.call.scale).astype(dq_ref.dtype)
    for ref, d in zip(d_head_refs, d_head, strict=True):
        store_head(ref, d)
    for ref, d in zip(d_q_refs, d_q, strict=True):
        ref[...] = d


def _ds(config: FlashConfig, s, bias, kind, visible, lse, delta, do, v, views, q_pos, k_pos):
    """``(dS, P, dX, the views' cotangents)`` of a tile from its scaled logits s ``[Q,J]``.

    ``dX = P * (dP - D)`` is the cotangent of the logits after the modifier and
    the bias (so the bias's own); ``P`` is ``exp`` of those logits less the lse.
    """
    # The modifier's derivative, from the unmasked logits: finite everywhere.
    x, vjp = modify_vjp(config, s, views, q_pos, k_pos)
    x = x if bias is None else x + bias
    x = masked_unless_full(config, x, kind, visible)
    p = jnp.exp(x - lse)  # masked logits give exp(MASKED - lse) = 0
    dx = p * (matmul(do, v, (1, 1)) - delta)
    ds, d_views = vjp(dx)
    return ds, p, dx, d_views


def _dkdv(config: FlashConfig, q, k, v, d_out, lse, delta, mod, bias, ints: KernelInts):
    B, Tp, _, H = q.shape
    K, E = k.shape[2], v.shape[-1]
    G, bk = config.call.G, config.bwd_block_k
    sched = ints.by_key
    nk, W = sched.key_tile.shape
    per_block = pl.BlockSpec((None, W), lambda b, h, j: (j, 0))
    q_rows = pl.BlockSpec((None, Tp), lambda b, h, j: (b, 0))
    kv_rows = pl.BlockSpec((None, bk), lambda b, h, j: (b, j))
    row_stats = pl.BlockSpec((None, G, Tp), lambda b, h, j: (b, h, 0))
    row_specs, rows = row_inputs(config, ints, q_rows, kv_rows)
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
        *row_specs,
    ]
    args = [sched.key_tile, sched.kind, sched.count[:, None], q, k, v, d_out, lse, delta, *rows]
    # The modifier's leaves for the G query heads of kv head h.
    k_block = ((None, G, bk), lambda b, h, j: (b, h, j))
    specs, leaves = mod_specs(
        mod, head=(G, lambda b, h, j: h), q=((None, G, Tp), lambda b, h, j: (b, h, 0)), k=k_block
    )
    out_specs = [
        pl.BlockSpec((None, bk, None, H), lambda b, h, j: (b, j, h, 0)),
        pl.BlockSpec((None, bk, None, E), lambda b, h, j: (b, j, h, 0)),
    ]
    out_specs += [pl.BlockSpec(*k_block) for _ in mod["k"]]
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    out_shape += [jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in mod["k"]]
    pair_args = [x for x in (bias, ints.keep) if x is not None]
    specs += [pair_by_key(config, x) for x in pair_args]
    call = flash_call(config, _dkdv_kernel, "attn_flash_dkdv", (B, K, nk), in_specs + specs,
                      out_specs, out_shape, backward=True)  # fmt: skip
    dk, dv, *d_k = call(*args, *leaves, *pair_args)
    return dk, dv, d_k


def _dkdv_kernel(config: FlashConfig, query_ref, kind_ref, count_ref, q_ref, k_ref, v_ref, do_ref,
                 lse_ref, delta_ref, q_pos_ref, kv_pos_ref, *refs):  # fmt: skip
    if config.call.has_segments:
        q_seg_ref, kv_seg_ref, *refs = refs
    mod_refs, refs = take_views(config, refs)
    bias_ref, keep_ref, (dk_ref, dv_ref, *d_k_refs) = take_pairs(config, refs)
    bq, bk = config.bwd_block_q, config.bwd_block_k
    k, v, kv_pos = k_ref[...], v_ref[...], kv_pos_ref[...]
    k_seg = kv_seg_ref[...] if config.call.has_segments else None
    start_k = pl.program_id(2) * bk
    for ref in d_k_refs:  # accumulated in place over query blocks and heads
        ref[...] = jnp.zeros(ref.shape, jnp.float32)

    def body(t, carry):
        rows = pl.ds(pl.multiple_of(query_ref[t] * bq, bq), bq)
        q_pos = q_pos_ref[rows]
        q_seg = q_seg_ref[rows] if config.call.has_segments else None
        kind = kind_ref[t]

        def head(g, carry):  # the G query heads of this kv head

            def visible():
                ok = tile_visible(config, q_pos, kv_pos, start_k, q_seg, k_seg)
                if keep_ref is None:
                    return ok
                return ok & (pair_columns(keep_ref, g, rows, ok.shape) != 0)

            dk, dv = carry
            q, do = q_ref[rows, g, :], do_ref[rows, g, :]
            lse, delta = lse_ref[g, rows][:, None], delta_ref[g, rows][:, None]
            views = dict(
                head=[head_view(r, g) for r in mod_refs["head"]],
                q=[r[g, rows] for r in mod_refs["q"]],
                k=[r[g, :] for r in mod_refs["k"]],
            )
            s = logits(config, q, k)
            bias = None if bias_ref is None else pair_columns(bias_ref, g, rows, s.shape)
            ds, p, _, d_views = _ds(config, s, bias, kind, visible, lse, delta, do, v, views,
                                    q_pos, kv_pos)  # fmt: skip
            for ref, d in zip(d_k_refs, d_views["k"], strict=True):
                ref[g, :] = ref[g, :] + d
            dv = dv + matmul(p.astype(do.dtype), do, (0, 0))
            dk = dk + matmul(ds.astype(q.dtype), q, (0, 0))
            return dk, dv

        return lax.fori_loop(0, config.call.G, head, carry)

    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = lax.fori_loop(0, count_ref[0], body, zeros)
    dk_ref[...] = (dk * config.call.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
