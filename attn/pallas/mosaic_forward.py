"""The forward kernels of ``attn.pallas.mosaic``: FlashAttention-3's for Hopper, its
unspecialised form, and their twin.

Internal to ``attn.pallas``. Each program holds query rows' float32 online
softmax over the key blocks of its schedule row (``[count, W blocks, W
kinds]``: EMPTY blocks are never listed, FULL ones skip the mask); the tile
math between ``q k^T`` and ``P`` is ``attn.pallas.mosaic_tiles``'.

* ``_hopper`` (specialised, ``consumers >= 1``: FlashAttention-3, Shah et al.
  2024): one producer warpgroup streams the scheduled K and V blocks (and their
  positions and segment ids) through TMA into ``stages`` shared-memory slots
  (``plgpu.emit_pipeline_warp_specialized``); each consumer warpgroup holds its
  own ``block_q`` of the program's rows and runs both products on ``wgmma``.
  The consumers walk the same schedule row (laid out in the program's rows),
  so they release each slot together; two of them take turns on a barrier
  (ping-pong), so that one's softmax overlaps the other's products. With
  ``consumers == 0``, one warpgroup per ``block_q`` rows pipelines its own
  copies (``plgpu.emit_pipeline``). Both through ``mosaic_common.program``.
* ``_twin``: the same loop over the same schedule rows, per consumer's rows,
  with ref slices and ``jnp.dot``: what Pallas's Mosaic GPU interpreter runs on
  a CPU, so the schedule, the masks, the statistics and the padding are checked
  without a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from attn.pallas import mosaic_tiles as tiles
from attn.pallas.mosaic_common import (
    COL,
    ROW,
    ROW_ALIGN,
    MosaicConfig,
    accumulate,
    barriers,
    dot,
    key_stream,
    launch,
    load,
    product,
    program,
    scheduled,
    sink_rows,
    slot_in,
    slot_of,
    swizzle,
    take_rows,
)


def forward(config: MosaicConfig, q, k, v, sink, ints):
    """``(out [B,Tp,N,E], lse [B,N,Tp] float32)``; rows that see nothing are 0 and ``-inf``."""
    (table, _), rows = ints
    B, Tp, N, _ = q.shape
    out_shape = (
        jax.ShapeDtypeStruct((B, Tp, N, v.shape[-1]), q.dtype),
        jax.ShapeDtypeStruct((B, N, Tp), jnp.float32),
    )
    args = [q, k, v, table, *rows, *([sink_rows(sink)] if config.call.has_sink else [])]
    grid = (B, N, Tp // config.program_rows)
    scratch = _scratch(config, q, v, table.shape[1])
    return launch(config, _twin, _hopper, scratch, out_shape, grid, args)


def _scratch(config: MosaicConfig, q, v, table_width: int) -> list:
    """Per slot: its query rows (which the output reuses where E == H, else an output
    block), positions, segment ids, sink and lse; the schedule row; the copy barriers; the
    consumers' turn barrier."""
    C, bq = config.slots, config.block_q
    H, E = q.shape[-1], v.shape[-1]
    out = [] if E == H else [plgpu.SMEM((C, bq, E), q.dtype, transforms=swizzle())]
    turn = [plgpu.Barrier(num_arrivals=C)] if config.consumers == 2 else []
    return [
        plgpu.SMEM((C, bq, H), q.dtype, transforms=swizzle()),
        *out,
        plgpu.SMEM((table_width,), jnp.int32),
        plgpu.SMEM((C, bq), jnp.int32),
        plgpu.SMEM((C, bq), jnp.int32),
        plgpu.SMEM((C, ROW_ALIGN), jnp.float32),
        plgpu.SMEM((C, bq), jnp.float32),
        barriers(config),
        *turn,
    ]


def _tile(config: MosaicConfig, q_smem, k_smem, v_smem, kpos_smem, kseg_smem, t, carry,
          table_smem, turn=None):  # fmt: skip
    """One scheduled key block into a consumer's ``(acc, m, l, q_pos, q_seg)``; with
    ``turn``, the consumers take turns: one's softmax between the other's products."""
    acc, m, l, q_pos, q_seg = carry
    tile = (config.block_q, config.block_k)
    take_turn = None if turn is None else functools.partial(_take_turn, turn)
    s = product(q_smem, k_smem, tile, issued=take_turn)
    k_pos = tiles.along(load(kpos_smem, COL), tile, 1)
    segs = ()
    if config.segments:
        segs = (tiles.along(q_seg, tile, 0), tiles.along(load(kseg_smem, COL), tile, 1))
    kind = table_smem[1 + config.width + t]
    s = tiles.scores(config.call, s, kind, tiles.along(q_pos, tile, 0), k_pos, *segs)
    m, l, alpha, p = tiles.online(m, l, s)
    acc = acc * tiles.along(alpha, acc.shape, 0)
    if turn is not None:
        plgpu.barrier_arrive(turn)  # done with the softmax
        plgpu.barrier_wait(turn)  # until the other's product is issued
    return accumulate(acc, p, v_smem), m, l, q_pos, q_seg


def _take_turn(turn) -> None:
    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(turn)


# ----------------------------------------------------------------------------
# The Hopper kernel: FlashAttention-3's, or one warpgroup per block


def _hopper(config: MosaicConfig, q_ref, k_ref, v_ref, table_ref, q_pos_ref, kv_pos_ref, *refs):
    call, bq, E = config.call, config.block_q, v_ref.shape[-1]
    q_seg_ref, kv_seg_ref, sink_ref, refs = take_rows(config, refs, sink=True)
    o_ref, lse_ref, q_smem, *refs = refs
    # The output reuses the query rows once the last product has read them.
    o_smem, *refs = refs if q_ref.shape[-1] != E else (q_smem, *refs)
    table_smem, qpos_smem, qseg_smem, sink_smem, lse_smem, bar, *turn = refs
    turn = turn[0] if turn else None  # two consumers take turns
    b, n, i = (lax.axis_index(a) for a in "bhi")
    rows = lambda slot: pl.ds((i * config.slots + slot) * bq, bq)  # noqa: E731

    def start(slot):
        r = rows(slot)
        copies = [(q_ref.at[b, r, n], q_smem.at[slot]), (q_pos_ref.at[b, r], qpos_smem.at[slot])]
        if config.segments:
            copies.append((q_seg_ref.at[b, r], qseg_smem.at[slot]))
        if call.has_sink:
            copies.append((sink_ref.at[n], sink_smem.at[slot]))
        slot_in(copies, bar, slot)
        q_seg = load(qseg_smem.at[slot], ROW) if config.segments else None
        m, l = tiles.start(call, bq, sink_smem[slot, 0] if call.has_sink else None)
        acc = plgpu.layout_cast(jnp.zeros((bq, E), jnp.float32), plgpu.Layout.WGMMA)
        if turn is not None:
            pl.when(slot == 1)(functools.partial(_take_turn, turn))  # consumer 0 goes first
        return (acc, plgpu.layout_cast(m, ROW), plgpu.layout_cast(l, ROW),
                load(qpos_smem.at[slot], ROW), q_seg)  # fmt: skip

    def step(index, k_smem, v_smem, kpos_smem, *rest):
        *kseg_smem, carry = rest
        q_slot = q_smem.at[slot_of(config)]
        return _tile(config, q_slot, k_smem, v_smem, kpos_smem, (kseg_smem or [None])[0],
                     index[0], carry, table_smem, turn)  # fmt: skip

    def finish(slot, carry):
        acc, m, l, *_ = carry
        if turn is not None:
            pl.when(slot == 0)(functools.partial(_take_turn, turn))  # the turns balance
        out, lse = tiles.finish(acc, m, l)
        o_smem.at[slot][...] = out.astype(o_smem.dtype)
        lse_smem.at[slot][...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[slot], o_ref.at[b, rows(slot), n])
        plgpu.copy_smem_to_gmem(lse_smem.at[slot], lse_ref.at[b, n, rows(slot)])
        plgpu.wait_smem_to_gmem(0)

    stream = key_stream(config, k_ref, v_ref, kv_pos_ref, kv_seg_ref, table_smem)
    program(config, (table_ref, table_smem), bar, stream, step, start, finish)


# ----------------------------------------------------------------------------
# The twin: the same schedule rows and tile math, as the interpreter runs it


def _twin(config: MosaicConfig, q_ref, k_ref, v_ref, table_ref, q_pos_ref, kv_pos_ref, *refs):
    call, bq, bk = config.call, config.block_q, config.block_k
    segments = config.segments
    q_seg_ref, kv_seg_ref, sink_ref, refs = take_rows(config, refs, sink=True)
    o_ref, lse_ref = refs
    b, n, i = (lax.axis_index(a) for a in "bhi")
    kv, tile = n // call.G, (bq, bk)
    width = config.width

    def consumer(c):
        rows = pl.ds((i * config.slots + c) * bq, bq)
        q = q_ref[b, rows, n, :]
        q_pos = tiles.along(q_pos_ref[b, rows], tile, 0)
        q_seg = tiles.along(q_seg_ref[b, rows], tile, 0) if segments else None

        def step(t, carry):
            acc, m, l = carry
            keys = pl.ds(table_ref[i, 1 + t] * bk, bk)
            s = dot(q, k_ref[b, keys, kv, :], (1, 1))
            k_pos = tiles.along(kv_pos_ref[b, keys], tile, 1)
            k_seg = tiles.along(kv_seg_ref[b, keys], tile, 1) if segments else None
            s = tiles.scores(call, s, table_ref[i, 1 + width + t], q_pos, k_pos, q_seg, k_seg)
            m, l, alpha, p = tiles.online(m, l, s)
            v = v_ref[b, keys, kv, :]
            pv = dot(p.astype(v.dtype), v, (1, 0))
            return acc * tiles.along(alpha, acc.shape, 0) + pv, m, l

        sink = sink_ref[n, 0] if call.has_sink else None
        m, l = tiles.start(call, bq, sink)
        carry = (jnp.zeros((bq, v_ref.shape[-1]), jnp.float32), m, l)
        acc, m, l = scheduled(table_ref[i, 0], width, step, carry)
        out, lse = tiles.finish(acc, m, l)
        o_ref[b, rows, n, :] = out.astype(o_ref.dtype)
        lse_ref[b, n, rows] = lse

    for c in range(config.slots):
        consumer(c)
