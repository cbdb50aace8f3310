"""The forward kernels of ``attn.pallas.mosaic``: FlashAttention-3's for Hopper, its
unspecialised form, and their twin.

Internal to ``attn.pallas``. Each program holds query rows' float32 online
softmax over the key blocks of its schedule row (``[count, W blocks, W
kinds]``: EMPTY blocks are never listed, FULL ones skip the mask); the tile
math between ``q k^T`` and ``P`` is ``attn.pallas.mosaic_tiles``'.

* ``_specialized`` (``consumers >= 1``, FlashAttention-3, Shah et al. 2024):
  one producer warpgroup streams the scheduled K and V blocks (and their
  positions and segment ids) through TMA into ``stages`` shared-memory slots
  (``plgpu.emit_pipeline_warp_specialized``); each consumer warpgroup holds
  its own ``block_q`` of the program's rows and runs both products on
  ``wgmma``. The consumers walk the same schedule row (laid out in the
  program's rows), so they release each slot together; with two of them a
  barrier takes turns (ping-pong), so that one's softmax overlaps the other's
  products.
* ``_hopper`` (``consumers == 0``): one warpgroup per ``block_q`` rows that
  pipelines its own copies (``plgpu.emit_pipeline``).
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
    ROW_ALIGN,
    MosaicConfig,
    accumulate,
    copy_in,
    dot,
    interpreter,
    kernel,
    key_stream,
    load,
    product,
    scheduled,
    sink_rows,
    swizzle,
    take_rows,
)

ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a wgmma tile
COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column
PRODUCER_REGISTERS = 40  # the TMA warpgroup's registers a thread; the consumers share the rest


def forward(config: MosaicConfig, q, k, v, sink, ints):
    """``(out [B,Tp,N,E], lse [B,N,Tp] float32)``; rows that see nothing are 0 and ``-inf``."""
    (table, _, _), rows = ints
    B, Tp, N, _ = q.shape
    out_shape = (
        jax.ShapeDtypeStruct((B, Tp, N, v.shape[-1]), q.dtype),
        jax.ShapeDtypeStruct((B, N, Tp), jnp.float32),
    )
    args = [q, k, v, table, *rows, *([sink_rows(sink)] if config.call.has_sink else [])]
    grid = (B, N, Tp // config.program_rows)
    if config.interpret:
        body = functools.partial(_twin, config)
        return kernel(body, out_shape, [], grid, interpret=interpreter())(*args)
    scratch = _scratch(config, q, v, table.shape[1])
    if config.consumers == 0:
        return kernel(functools.partial(_hopper, config), out_shape, scratch, grid,
                      approx=config.approx)(*args)  # fmt: skip
    return kernel(functools.partial(_specialized, config), out_shape, scratch, grid,
                  approx=config.approx, num_threads=config.consumers + 1,
                  thread_name="wg")(*args)  # fmt: skip


def _scratch(config: MosaicConfig, q, v, table_width: int) -> list:
    """Per consumer (one without specialisation): its query rows (which the output reuses
    where E == H, else an output block), positions, segment ids, sink and lse; the schedule
    row; one barrier per copy in (the schedule's first); the consumers' turn barrier."""
    C, bq = max(config.consumers, 1), config.block_q
    H, E = q.shape[-1], v.shape[-1]
    out = [] if E == H else [plgpu.SMEM((C, bq, E), q.dtype, transforms=swizzle())]
    turn = [plgpu.Barrier(num_arrivals=C)] if config.consumers else []
    return [
        plgpu.SMEM((C, bq, H), q.dtype, transforms=swizzle()),
        *out,
        plgpu.SMEM((table_width,), jnp.int32),
        plgpu.SMEM((C, bq), jnp.int32),
        plgpu.SMEM((C, bq), jnp.int32),
        plgpu.SMEM((C, ROW_ALIGN), jnp.float32),
        plgpu.SMEM((C, bq), jnp.float32),
        plgpu.Barrier(num_barriers=1 + 4 * C),
        *turn,
    ]


def _unpack(config: MosaicConfig, v_ref, q_ref, refs):
    """``(q_seg_ref, kv_seg_ref, sink_ref, o_ref, lse_ref, scratch)`` from a Hopper
    kernel's refs after its positions; ``scratch`` as ``_scratch`` lists it, with the
    query rows standing in for the output rows where E == H."""
    q_seg_ref, kv_seg_ref, sink_ref, refs = take_rows(config, refs, sink=True)
    o_ref, lse_ref, q_smem, *refs = refs
    # The output reuses the query rows once the last product has read them.
    o_smem, *refs = refs if v_ref.shape[-1] != q_ref.shape[-1] else (q_smem, *refs)
    return q_seg_ref, kv_seg_ref, sink_ref, o_ref, lse_ref, (q_smem, o_smem, *refs)


def _rows_in(config: MosaicConfig, refs, smem, c, bar, rows):
    """Copies consumer ``c``'s query rows, positions, segment ids and sink into its slots
    (on barriers ``1 + 4c`` on) and returns its ``(q_pos, q_seg)`` row vectors."""
    q_ref, q_pos_ref, q_seg_ref, sink_ref = refs
    q_smem, qpos_smem, qseg_smem, sink_smem = smem
    b, n = lax.axis_index("b"), lax.axis_index("h")
    copies = [(q_ref.at[b, rows, n], q_smem.at[c]), (q_pos_ref.at[b, rows], qpos_smem.at[c])]
    if config.segments:
        copies.append((q_seg_ref.at[b, rows], qseg_smem.at[c]))
    if config.call.has_sink:
        copies.append((sink_ref.at[n], sink_smem.at[c]))
    copy_in(copies, bar, first=1 + 4 * c)
    q_seg = load(qseg_smem.at[c], ROW) if config.segments else None
    return load(qpos_smem.at[c], ROW), q_seg


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


def _start(config: MosaicConfig, sink_smem, c, E: int):
    """A consumer's ``(acc, m, l)`` before its first tile, in wgmma's layouts."""
    sink = sink_smem[c, 0] if config.call.has_sink else None
    m0, l0 = tiles.start(config.call, config.block_q, sink)
    acc = jnp.zeros((config.block_q, E), jnp.float32)
    return (plgpu.layout_cast(acc, plgpu.Layout.WGMMA), plgpu.layout_cast(m0, ROW),
            plgpu.layout_cast(l0, ROW))  # fmt: skip


def _rows_out(acc, m, l, o_smem, lse_smem, o_ref, lse_ref, rows) -> None:
    """A consumer's finished rows through its shared-memory slots to the outputs."""
    b, n = lax.axis_index("b"), lax.axis_index("h")
    out, lse = tiles.finish(acc, m, l)
    o_smem[...] = out.astype(o_smem.dtype)
    lse_smem[...] = lse
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, rows, n])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, n, rows])
    plgpu.wait_smem_to_gmem(0)


# ----------------------------------------------------------------------------
# FlashAttention-3: a producer warpgroup and consumer warpgroups


def _specialized(config: MosaicConfig, q_ref, k_ref, v_ref, table_ref, q_pos_ref, kv_pos_ref,
                 *refs):  # fmt: skip
    C, bq = config.consumers, config.block_q
    q_seg_ref, kv_seg_ref, sink_ref, o_ref, lse_ref, scratch = _unpack(config, v_ref, q_ref, refs)
    q_smem, o_smem, table_smem, qpos_smem, qseg_smem, sink_smem, lse_smem, bar, turn = scratch
    turn = turn if C == 2 else None  # ping-pong takes two
    i, wg = lax.axis_index("i"), lax.axis_index("wg")

    @pl.when(wg == C)  # the producer brings in the schedule row; everyone reads it
    def _():
        plgpu.copy_gmem_to_smem(table_ref.at[i], table_smem, bar.at[0])

    plgpu.barrier_wait(bar.at[0])

    def step(index, k_smem, v_smem, kpos_smem, *rest):
        *kseg_smem, carry = rest
        kseg_smem = kseg_smem[0] if kseg_smem else None
        q_slot = q_smem.at[lax.axis_index("wg")]
        return _tile(config, q_slot, k_smem, v_smem, kpos_smem, kseg_smem, index[0], carry,
                     table_smem, turn)  # fmt: skip

    def consumer(pipeline):
        rows = pl.ds((i * C + wg) * bq, bq)
        refs = (q_ref, q_pos_ref, q_seg_ref, sink_ref)
        q_pos, q_seg = _rows_in(config, refs, (q_smem, qpos_smem, qseg_smem, sink_smem), wg, bar,
                                rows)  # fmt: skip
        acc, m, l = _start(config, sink_smem, wg, v_ref.shape[-1])
        if turn is not None:
            pl.when(wg == 1)(functools.partial(_take_turn, turn))  # consumer 0 goes first
        acc, m, l, *_ = pipeline((acc, m, l, q_pos, q_seg))
        if turn is not None:
            pl.when(wg == 0)(functools.partial(_take_turn, turn))  # the turns balance
        _rows_out(acc, m, l, o_smem.at[wg], lse_smem.at[wg], o_ref, lse_ref, rows)

    specs, sources = key_stream(config, k_ref, v_ref, kv_pos_ref, kv_seg_ref, table_smem)
    pipeline = plgpu.emit_pipeline_warp_specialized(
        step, grid=(table_smem[0],), in_specs=specs, max_concurrent_steps=config.stages,
        num_compute_wgs=C, wg_axis="wg", memory_registers=PRODUCER_REGISTERS,
        compute_context=consumer,
    )  # fmt: skip
    pipeline(*sources)


# ----------------------------------------------------------------------------
# One warpgroup per block_q rows, pipelining its own copies


def _hopper(config: MosaicConfig, q_ref, k_ref, v_ref, table_ref, q_pos_ref, kv_pos_ref, *refs):
    q_seg_ref, kv_seg_ref, sink_ref, o_ref, lse_ref, scratch = _unpack(config, v_ref, q_ref, refs)
    q_smem, o_smem, table_smem, qpos_smem, qseg_smem, sink_smem, lse_smem, bar = scratch
    i = lax.axis_index("i")
    rows = pl.ds(i * config.block_q, config.block_q)
    copy_in([(table_ref.at[i], table_smem)], bar)
    q_pos, q_seg = _rows_in(config, (q_ref, q_pos_ref, q_seg_ref, sink_ref),
                            (q_smem, qpos_smem, qseg_smem, sink_smem), 0, bar, rows)  # fmt: skip

    def step(index, k_smem, v_smem, kpos_smem, *rest):
        *kseg_smem, carry = rest
        kseg_smem = kseg_smem[0] if kseg_smem else None
        return _tile(config, q_smem.at[0], k_smem, v_smem, kpos_smem, kseg_smem, index[0],
                     carry, table_smem)  # fmt: skip

    acc, m, l = _start(config, sink_smem, 0, v_ref.shape[-1])
    specs, sources = key_stream(config, k_ref, v_ref, kv_pos_ref, kv_seg_ref, table_smem)
    pipeline = plgpu.emit_pipeline(
        step, grid=(table_smem[0],), in_specs=specs, max_concurrent_steps=config.stages,
        init_carry=(acc, m, l, q_pos, q_seg),
    )  # fmt: skip
    acc, m, l, *_ = pipeline(*sources)
    _rows_out(acc, m, l, o_smem.at[0], lse_smem.at[0], o_ref, lse_ref, rows)


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
        rows = pl.ds((i * max(config.consumers, 1) + c) * bq, bq)
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

    for c in range(max(config.consumers, 1)):
        consumer(c)
