"""The FlashAttention-2 backward of ``attn.pallas.mosaic`` (Dao 2023), for Hopper and as a twin.

Internal to ``attn.pallas``. With ``D = rowsum(dO * O) - d_lse`` and the
forward's lse, each tile recomputes ``P = exp(logits - lse)`` and

    dV += P^T dO      dP = dO V^T      dX = P * (dP - D)   (through the soft-cap)
    dQ += dX K        dK += dX^T Q     (times the logit scale)

in two kernels, each in the two forms of the forward (the Hopper kernel on
``wgmma`` and TMA pipelines, specialised as the forward is, a producer
warpgroup streaming to consumers that each hold their own block; the twin on
ref slices for the interpreter), sharing the tile math of
``attn.pallas.mosaic_tiles``:

* dq over ``(B, N, programs of query rows)``, walking the forward's schedule;
* dk/dv over ``(B, K, programs of keys)``, walking the query blocks that see
  each program's keys and, for each, the G query heads of its kv head, so GQA
  sums dK and dV in the kernel. Its tiles are transposed, ``[keys, queries]``,
  so that ``P^T`` and ``dX^T`` are wgmma's register operand as they are
  computed: the tile math is elementwise, the per-query statistics come in as
  columns.

The sink's gradient, ``-sum over rows of exp(sink - lse) * D``, is formed outside.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from attn.pallas import mosaic_tiles as tiles
from attn.pallas.mosaic_common import (
    COL,
    ROW,
    MosaicConfig,
    accumulate,
    dot,
    key_stream,
    launch,
    load,
    product,
    program,
    scheduled,
    slot_in,
    slot_of,
    slot_scratch,
    swizzle,
    take_rows,
)


def backward(config: MosaicConfig, q, k, v, sink, ints, out, lse, d_out, d_lse):
    """``(dq, dk, dv, dsink)`` in the padded layouts of q, k, v and ``[N]``."""
    T, Tp = config.call.T, q.shape[1]
    # Rows past T are padding: D is formed on the real rows and is zero on the rest, as is
    # their dO; +inf for their lse (and for rows that see nothing) gives P = 0.
    delta = jnp.einsum(
        "BTNE,BTNE->BNT", d_out[:, :T].astype(jnp.float32), out[:, :T].astype(jnp.float32)
    )
    delta = jnp.pad(delta - d_lse[:, :, :T], ((0, 0), (0, 0), (0, Tp - T)))
    real = (jnp.arange(Tp) < T)[None, None, :]
    lse2 = jnp.where(real & ~jnp.isneginf(lse), lse * tiles.LOG2E, jnp.inf)
    dq = _dq(config, q, k, v, d_out, lse2, delta, ints)
    dk, dv = _dkdv(config, q, k, v, d_out, lse2, delta, ints)
    if config.call.has_sink:
        p_sink = jnp.exp(sink[None, :, None] - lse[:, :, :T])
        dsink = -(p_sink * delta[:, :, :T]).sum((0, 2))
    else:
        dsink = jnp.zeros_like(sink)
    return dq, dk, dv, dsink


# ----------------------------------------------------------------------------
# dq: programs of query rows over their scheduled key blocks


def _dq(config: MosaicConfig, q, k, v, d_out, lse2, delta, ints):
    (table, _), rows = ints
    B, Tp, N, H = q.shape
    # q and dO; positions, segment ids, lse and D
    vectors = (jnp.int32, jnp.int32, jnp.float32, jnp.float32)
    scratch = slot_scratch(config, config.block_q, (H, v.shape[-1]), q.dtype, table.shape[1],
                           vectors)  # fmt: skip
    out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    args = [q, k, v, d_out, lse2, delta, table, *rows]
    grid = (B, N, Tp // config.program_rows)
    return launch(config, _dq_twin, _dq_hopper, scratch, out_shape, grid, args)


def _dq_hopper(config: MosaicConfig, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, table_ref,
               q_pos_ref, kv_pos_ref, *refs):  # fmt: skip
    call, bq, bk = config.call, config.block_q, config.block_k
    segments = config.segments
    q_seg_ref, kv_seg_ref, _, refs = take_rows(config, refs)
    dq_ref, q_smem, do_smem, table_smem, qpos_smem, qseg_smem, lse_smem, delta_smem, bar = refs
    b, n, i = (lax.axis_index(a) for a in "bhi")
    rows = lambda slot: pl.ds((i * config.slots + slot) * bq, bq)  # noqa: E731

    def start(slot):
        r = rows(slot)
        copies = [(q_ref.at[b, r, n], q_smem.at[slot]), (do_ref.at[b, r, n], do_smem.at[slot]),
                  (q_pos_ref.at[b, r], qpos_smem.at[slot]),
                  (lse_ref.at[b, n, r], lse_smem.at[slot]),
                  (delta_ref.at[b, n, r], delta_smem.at[slot])]  # fmt: skip
        if segments:
            copies.append((q_seg_ref.at[b, r], qseg_smem.at[slot]))
        slot_in(copies, bar, slot)
        dq = plgpu.layout_cast(jnp.zeros((bq, q_ref.shape[-1]), jnp.float32), plgpu.Layout.WGMMA)
        vectors = (qpos_smem, qseg_smem if segments else None, lse_smem, delta_smem)
        return dq, *(None if x is None else load(x.at[slot], ROW) for x in vectors)

    def step(index, k_smem, v_smem, kpos_smem, *rest):
        (t,), (*kseg_smem, (dq, q_pos, q_seg, lse, delta)) = index, rest
        slot, tile = slot_of(config), (bq, bk)
        qk = product(q_smem.at[slot], k_smem, tile)
        dp = product(do_smem.at[slot], v_smem, tile)
        k_pos = tiles.along(load(kpos_smem, COL), tile, 1)
        segs = ()
        if segments:
            segs = (tiles.along(q_seg, tile, 0), tiles.along(load(kseg_smem[0], COL), tile, 1))
        kind = table_smem[1 + config.width + t]
        s = tiles.scores(call, qk, kind, tiles.along(q_pos, tile, 0), k_pos, *segs)
        p = tiles.probabilities(s, tiles.along(lse, tile, 0))
        dx = tiles.logit_grads(call, qk, p, dp, tiles.along(delta, tile, 0))
        return accumulate(dq, dx, k_smem), q_pos, q_seg, lse, delta

    def finish(slot, carry):
        q_smem.at[slot][...] = (carry[0] * call.scale).astype(q_smem.dtype)  # q is read
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem.at[slot], dq_ref.at[b, rows(slot), n])
        plgpu.wait_smem_to_gmem(0)

    stream = key_stream(config, k_ref, v_ref, kv_pos_ref, kv_seg_ref, table_smem)
    program(config, (table_ref, table_smem), bar, stream, step, start, finish)


def _dq_twin(config: MosaicConfig, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, table_ref,
             q_pos_ref, kv_pos_ref, *refs):  # fmt: skip
    call, bq, bk = config.call, config.block_q, config.block_k
    segments = config.segments
    q_seg_ref, kv_seg_ref, _, refs = take_rows(config, refs)
    (dq_ref,) = refs
    b, n, i = (lax.axis_index(a) for a in "bhi")
    kv, tile = n // call.G, (bq, bk)

    def slot(c):
        rows = pl.ds((i * config.slots + c) * bq, bq)
        q, do = q_ref[b, rows, n, :], do_ref[b, rows, n, :]
        q_pos = tiles.along(q_pos_ref[b, rows], tile, 0)
        q_seg = tiles.along(q_seg_ref[b, rows], tile, 0) if segments else None
        lse = tiles.along(lse_ref[b, n, rows], tile, 0)
        delta = tiles.along(delta_ref[b, n, rows], tile, 0)

        def step(t, dq):
            keys = pl.ds(table_ref[i, 1 + t] * bk, bk)
            k = k_ref[b, keys, kv, :]
            qk = dot(q, k, (1, 1))
            dp = dot(do, v_ref[b, keys, kv, :], (1, 1))
            k_pos = tiles.along(kv_pos_ref[b, keys], tile, 1)
            k_seg = tiles.along(kv_seg_ref[b, keys], tile, 1) if segments else None
            kind = table_ref[i, 1 + config.width + t]
            s = tiles.scores(call, qk, kind, q_pos, k_pos, q_seg, k_seg)
            dx = tiles.logit_grads(call, qk, tiles.probabilities(s, lse), dp, delta)
            return dq + dot(dx.astype(k.dtype), k, (1, 0))

        dq0 = jnp.zeros((bq, q_ref.shape[-1]), jnp.float32)
        dq = scheduled(table_ref[i, 0], config.width, step, dq0)
        dq_ref[b, rows, n, :] = (dq * call.scale).astype(dq_ref.dtype)

    for c in range(config.slots):
        slot(c)


# ----------------------------------------------------------------------------
# dk/dv: programs of keys over the query blocks (and query heads) that see them


def _dkdv(config: MosaicConfig, q, k, v, d_out, lse2, delta, ints):
    (_, table), rows = ints
    B, Sp, K, H = k.shape
    # K and V; positions and segment ids
    scratch = slot_scratch(config, config.block_k, (H, v.shape[-1]), k.dtype, table.shape[1],
                           (jnp.int32, jnp.int32))  # fmt: skip
    out_shape = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
    args = [q, k, v, d_out, lse2, delta, table, *rows]
    grid = (B, K, Sp // config.program_keys)
    return launch(config, _dkdv_twin, _dkdv_hopper, scratch, out_shape, grid, args)


def _dkdv_hopper(config: MosaicConfig, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                 table_ref, q_pos_ref, kv_pos_ref, *refs):  # fmt: skip
    call, bq, bk, G = config.call, config.block_q, config.block_k, config.call.G
    segments = config.segments
    q_seg_ref, kv_seg_ref, _, refs = take_rows(config, refs)
    dk_ref, dv_ref, k_smem, v_smem, table_smem, kpos_smem, kseg_smem, bar = refs
    b, h, j = (lax.axis_index(a) for a in "bhi")
    keys = lambda slot: pl.ds((j * config.slots + slot) * bk, bk)  # noqa: E731

    def start(slot):
        r = keys(slot)
        copies = [(k_ref.at[b, r, h], k_smem.at[slot]), (v_ref.at[b, r, h], v_smem.at[slot]),
                  (kv_pos_ref.at[b, r], kpos_smem.at[slot])]  # fmt: skip
        if segments:
            copies.append((kv_seg_ref.at[b, r], kseg_smem.at[slot]))
        slot_in(copies, bar, slot)
        zeros = lambda E: plgpu.layout_cast(jnp.zeros((bk, E), jnp.float32), plgpu.Layout.WGMMA)  # noqa: E731
        k_seg = load(kseg_smem.at[slot], ROW) if segments else None
        return zeros(k_ref.shape[-1]), zeros(v_ref.shape[-1]), load(kpos_smem.at[slot], ROW), k_seg

    def step(index, q_smem, do_smem, lse_smem, delta_smem, qpos_smem, *rest):
        (t, _), (*qseg_smem, (dk, dv, k_pos, k_seg)) = index, rest
        slot, tile = slot_of(config), (bk, bq)  # transposed: keys down, queries across
        qk = product(k_smem.at[slot], q_smem, tile)
        dp = product(v_smem.at[slot], do_smem, tile)
        q_pos = tiles.along(load(qpos_smem, COL), tile, 1)
        segs = ()
        if segments:
            segs = (tiles.along(load(qseg_smem[0], COL), tile, 1), tiles.along(k_seg, tile, 0))
        kind = table_smem[1 + config.width_k + t]
        s = tiles.scores(call, qk, kind, q_pos, tiles.along(k_pos, tile, 0), *segs)
        p = tiles.probabilities(s, tiles.along(load(lse_smem, COL), tile, 1))
        dx = tiles.logit_grads(call, qk, p, dp, tiles.along(load(delta_smem, COL), tile, 1))
        return accumulate(dk, dx, q_smem), accumulate(dv, p, do_smem), k_pos, k_seg

    def finish(slot, carry):
        dk, dv, *_ = carry
        k_smem.at[slot][...] = (dk * call.scale).astype(k_smem.dtype)  # K and V are read
        v_smem.at[slot][...] = dv.astype(v_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_smem.at[slot], dk_ref.at[b, keys(slot), h])
        plgpu.copy_smem_to_gmem(v_smem.at[slot], dv_ref.at[b, keys(slot), h])
        plgpu.wait_smem_to_gmem(0)

    block = lambda t, g: (table_smem[1 + t], h * G + g, 0)  # noqa: E731
    stats = lambda t, g: (h * G + g, table_smem[1 + t])  # noqa: E731
    vector = lambda t, g: (table_smem[1 + t],)  # noqa: E731
    specs = [
        plgpu.BlockSpec((bq, None, q_ref.shape[-1]), block, transforms=swizzle()),
        plgpu.BlockSpec((bq, None, do_ref.shape[-1]), block, transforms=swizzle()),
        plgpu.BlockSpec((None, bq), stats),
        plgpu.BlockSpec((None, bq), stats),
        plgpu.BlockSpec((bq,), vector),
    ]
    sources = [q_ref.at[b], do_ref.at[b], lse_ref.at[b], delta_ref.at[b], q_pos_ref.at[b]]
    if segments:
        specs.append(plgpu.BlockSpec((bq,), vector))
        sources.append(q_seg_ref.at[b])
    program(config, (table_ref, table_smem), bar, (specs, sources), step, start, finish, tail=(G,))


def _dkdv_twin(config: MosaicConfig, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, table_ref,
               q_pos_ref, kv_pos_ref, *refs):  # fmt: skip
    call, bq, bk, G = config.call, config.block_q, config.block_k, config.call.G
    segments = config.segments
    q_seg_ref, kv_seg_ref, _, refs = take_rows(config, refs)
    dk_ref, dv_ref = refs
    b, h, j = (lax.axis_index(a) for a in "bhi")
    tile = (bk, bq)

    def slot(c):
        keys = pl.ds((j * config.slots + c) * bk, bk)
        k, v = k_ref[b, keys, h, :], v_ref[b, keys, h, :]
        k_pos = tiles.along(kv_pos_ref[b, keys], tile, 0)
        k_seg = tiles.along(kv_seg_ref[b, keys], tile, 0) if segments else None

        def step(t, carry):
            rows = pl.ds(table_ref[j, 1 + t] * bq, bq)
            q_pos = tiles.along(q_pos_ref[b, rows], tile, 1)
            q_seg = tiles.along(q_seg_ref[b, rows], tile, 1) if segments else None
            kind = table_ref[j, 1 + config.width_k + t]

            def head(g, carry):
                dk, dv = carry
                n = h * G + g
                q, do = q_ref[b, rows, n, :], do_ref[b, rows, n, :]
                qk = dot(k, q, (1, 1))
                s = tiles.scores(call, qk, kind, q_pos, k_pos, q_seg, k_seg)
                p = tiles.probabilities(s, tiles.along(lse_ref[b, n, rows], tile, 1))
                dp = dot(v, do, (1, 1))
                delta = tiles.along(delta_ref[b, n, rows], tile, 1)
                dx = tiles.logit_grads(call, qk, p, dp, delta)
                dk = dk + dot(dx.astype(q.dtype), q, (1, 0))
                return dk, dv + dot(p.astype(do.dtype), do, (1, 0))

            return lax.fori_loop(0, G, head, carry)

        zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
        dk, dv = scheduled(table_ref[j, 0], config.width_k, step, zeros)
        dk_ref[b, keys, h, :] = (dk * call.scale).astype(dk_ref.dtype)
        dv_ref[b, keys, h, :] = dv.astype(dv_ref.dtype)

    for c in range(config.slots):
        slot(c)
