"""FlashAttention for Hopper in Pallas's Mosaic GPU API: the forward kernel and its twin.

``mosaic_attention`` computes ``attn.dot_product_attention``'s function for
bfloat16 and float16 inputs with head dims 64 and 128: every mask of the
algebra (by the block schedule: EMPTY key blocks are never visited, FULL ones
never evaluate the mask, PARTIAL ones evaluate it on the tile's positions),
explicit positions, segment ids (empty rows give zeros), learned sink logits,
soft-cap and GQA/MQA (K and V read through the query head's kv head, never
repeated). It refuses by name what it does not take: other dtypes and head
dims, score modifiers other than the soft-cap, bias and boolean mask arrays.

Two kernels share the tile math (``attn.pallas.mosaic_tiles``):

* ``_hopper``, for sm90: one warpgroup per (batch, head, query block), the
  query block in shared memory, the scheduled key blocks (with their positions
  and segment ids) streamed by ``plgpu.emit_pipeline`` through TMA, both
  products on ``wgmma`` with float32 accumulators. It lowers and exports for
  ``cuda`` from any host; it runs only on a Hopper GPU.
* ``_twin``, the same loop over the same schedule with ref slices and
  ``jnp.dot``: what Pallas's Mosaic GPU interpreter runs on a CPU, so the
  numerics of the schedule, the masks, the statistics and the padding are
  checked without a GPU.

The backward (``attn.pallas.mosaic_backward``) is FlashAttention-2's in the
same two forms: a dq kernel over query blocks, a dk/dv kernel over key blocks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Unpack

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from attn.checks import as_arrays, fail
from attn.pallas import mosaic_backward
from attn.pallas import mosaic_tiles as tiles
from attn.pallas.common import FlashConfig
from attn.pallas.mosaic_common import (
    ROW_ALIGN,
    MosaicConfig,
    copy_in,
    dot,
    interpreter,
    kernel,
    load,
    product,
    round_up,
    scheduled,
    sink_rows,
    swizzle,
    take_rows,
)
from attn.pallas.schedule import schedules
from attn.softmax.call import Call, CallArgs, check_call, takes_call_args

DTYPES = (jnp.bfloat16, jnp.float16)
HEAD_DIMS = (64, 128)  # wgmma's N for P V, and TMA's 128-byte swizzle rows
BLOCKS = (64, 128)  # wgmma's M is 64 a warpgroup; N (the key block) up to 256
SHARED_BYTES = 232_448  # an sm90 block's shared memory (227 KiB), what Mosaic GPU checks


@takes_call_args
def mosaic_attention(q, k, v, *, return_lse: bool = False, block_q: int = 64, block_k: int = 64,
                     stages: int = 2, interpret: bool | None = None,
                     **call_args: Unpack[CallArgs]):  # fmt: skip
    """Softmax attention as Mosaic GPU kernels for Hopper (forward and backward).

    Computes ``attn.dot_product_attention``'s function; takes its arguments
    except ``bias``, ``return_weights``, mask arrays and score modifiers other
    than ``softcap``.

    Args:
      q: ``[B,T,N,H]`` queries, bfloat16 or float16 (float32 too when interpreted), H 64
        or 128.
      k: ``[B,S,K,H]`` keys, ``N % K == 0``; v: ``[B,S,K,E]`` values, E 64 or 128;
        all three in one dtype.
      return_lse: also return the float32 lse ``[B,T,N]`` (``-inf`` for a row that
        sees nothing).
      block_q, block_k: query rows per program and keys per pipeline step, 64 or 128.
      stages: key blocks in flight in the Hopper kernel's pipeline (>= 1).
      interpret: run the twin under Pallas's Mosaic GPU interpreter; None means on a CPU.
        False lowers the Hopper kernel (give it to ``jax.export`` for ``cuda``).
      **call_args: the call (``attn.softmax.call.CallArgs``).

    Returns:
      ``out [B,T,N,E]`` in q's dtype, and ``lse [B,T,N]`` if ``return_lse``.
    """
    q, k, v = as_arrays(q, k, v)
    call = check_call(q, k, v, **call_args)
    return attend(call, q, k, v, return_lse=return_lse, block_q=block_q, block_k=block_k,
                  stages=stages, interpret=interpret)  # fmt: skip


def attend(call: Call, q, k, v, *, return_lse=False, block_q=64, block_k=64, stages=2,
           interpret=None):  # fmt: skip
    """``mosaic_attention`` of a checked call (see there)."""
    config = _config(call, q, k, v, block_q, block_k, stages, interpret)
    q, k, v = call.isolate(q, k, v)
    config, tables, rows = _schedule(config, call)
    Tp, Sp = config.padded
    N = call.dims.N
    sink = jnp.zeros((N,), jnp.float32) if call.sink_logits is None else call.sink_logits.reshape(N)
    out, lse = _attention(config, _pad(q, Tp), _pad(k, Sp), _pad(v, Sp), sink, (tables, rows))
    T = call.dims.T
    out = out[:, :T]
    return (out, lse[:, :, :T].transpose(0, 2, 1)) if return_lse else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(config: MosaicConfig, q, k, v, sink, ints):
    return _forward(config, q, k, v, sink, ints)


def _attention_fwd(config, q, k, v, sink, ints):
    out, lse = _forward(config, q, k, v, sink, ints)
    return (out, lse), (q, k, v, sink, ints, out, lse)


def _attention_bwd(config, residuals, cotangents):
    q, k, v, sink, ints, out, lse = residuals
    grads = mosaic_backward.backward(config, q, k, v, sink, ints, out, lse, *cotangents)
    return *grads, None  # the integer inputs get no cotangent


_attention.defvjp(_attention_fwd, _attention_bwd)


def _config(call: Call, q, k, v, block_q, block_k, stages, interpret) -> MosaicConfig:
    """The call's kernel settings, refusing by name what the kernels do not take."""
    where = "impl='mosaic'"
    call.refuse_pairs(where)
    if call.score_mod is not None:
        fail("score_mod", f"None for {where} (it takes softcap=)", type(call.score_mod).__name__)
    interpret = jax.default_backend() == "cpu" if interpret is None else bool(interpret)
    # The twin also takes float32, which checks its math at float32's precision.
    dtypes = DTYPES + ((jnp.float32,) if interpret else ())
    if q.dtype not in dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
        names = "bfloat16, float16 (or float32 interpreted)" if interpret else "bfloat16 or float16"
        fail("q, k, v", f"all in one of {names} for {where}", f"{q.dtype}, {k.dtype}, {v.dtype}")
    d = call.dims
    for name, dim in (("head dim H", d.H), ("value head dim E", d.E)):
        if dim not in HEAD_DIMS:
            fail(name, f"one of {HEAD_DIMS} for {where}", dim)
    for name, block in (("block_q", block_q), ("block_k", block_k)):
        if block not in BLOCKS:
            fail(name, f"one of {BLOCKS}", repr(block))
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        fail("stages", "an int >= 1", repr(stages))
    need = _shared_bytes(d.H, d.E, q.dtype.itemsize, block_q, block_k, stages, d.S)
    if not interpret and need > SHARED_BYTES:
        fail("block_q, block_k, stages",
             f"tiles that fit Hopper's {SHARED_BYTES:,} bytes of shared memory a block",
             f"{block_q}, {block_k}, {stages}: {need:,} bytes")  # fmt: skip
    return MosaicConfig(call.spec(), block_q, block_k, stages, interpret)


def _shared_bytes(H: int, E: int, itemsize: int, bq: int, bk: int, stages: int, S: int) -> int:
    """The most shared memory any of the three Hopper kernels takes: its own block (the
    output reuses it), the ``stages`` blocks in flight, the schedule row and the vectors."""
    width = 1 << max(-(-S // bk) - 1, 0).bit_length()  # the schedule's widest row
    small = round_up(1 + 2 * width, ROW_ALIGN) * 4 + 4 * 4 * max(bq, bk) + 4 * ROW_ALIGN
    forward = (bq * max(H, E) + (bq * E if E != H else 0) + stages * bk * (H + E)) * itemsize
    dq = (bq * (H + E) + stages * bk * (H + E)) * itemsize
    dkdv = (bk * (H + E) + stages * bq * (H + E)) * itemsize + stages * bq * 4 * 4
    return max(forward, dq, dkdv) + small


def _schedule(config: MosaicConfig, call: Call):
    """``(config, tables, rows)``: the config with the schedules' widths, the packed
    schedules (``by_query [nq, Wp]``: per query block its count, W key blocks and W kinds;
    ``by_key [nk, Wp']``: per key block its query blocks) and the padded rows: positions,
    then segment ids where the kernels read them."""
    flash = FlashConfig(config.call, config.block_q, config.block_k, config.block_q,
                        config.block_k, "gpu", config.interpret, None, None)  # fmt: skip
    plan = schedules(flash, call.rows(), call.static_rows())
    tables = tuple(map(_pack, plan))
    widths = (x.key_tile.shape[1] for x in plan)
    config = dataclasses.replace(config, **dict(zip(("width", "width_k"), widths, strict=True)))
    Tp, Sp = config.padded
    # Padding repeats the last position (the schedule's bounds stay the real rows'); padded
    # keys get segment id 0 (padding), which no query sees.
    rows = [_pad(call.q_positions, Tp, "edge"), _pad(call.kv_positions, Sp, "edge")]
    if config.segments:
        d = call.dims
        q_seg, kv_seg = call.q_segment_ids, call.kv_segment_ids
        if q_seg is None:
            q_seg, kv_seg = jnp.ones((d.B, d.T), jnp.int32), jnp.ones((d.B, d.S), jnp.int32)
        rows += [_pad(q_seg, Tp), _pad(kv_seg, Sp)]
    return config, tables, rows


def _pack(schedule) -> jax.Array:
    """A schedule as one int32 table: per block its count, its W blocks, their W kinds."""
    count = jnp.asarray(schedule.count, jnp.int32)[:, None]
    table = jnp.concatenate([count, schedule.key_tile, schedule.kind], axis=1).astype(jnp.int32)
    return jnp.pad(table, ((0, 0), (0, round_up(table.shape[1], ROW_ALIGN) - table.shape[1])))


def _forward(config: MosaicConfig, q, k, v, sink, ints):
    """``(out [B,Tp,N,E], lse [B,N,Tp] float32)``; rows that see nothing are 0 and ``-inf``."""
    (table, _), rows = ints
    B, Tp, N, _ = q.shape
    out_shape = (
        jax.ShapeDtypeStruct((B, Tp, N, v.shape[-1]), q.dtype),
        jax.ShapeDtypeStruct((B, N, Tp), jnp.float32),
    )
    args = [q, k, v, table, *rows, *([sink_rows(sink)] if config.call.has_sink else [])]
    grid = (B, N, Tp // config.block_q)
    if config.interpret:
        body = functools.partial(_twin, config)
        return kernel(body, out_shape, [], grid, interpret=interpreter())(*args)
    body = functools.partial(_hopper, config)
    scratch = _hopper_scratch(config, q, v, table.shape[1])
    return kernel(body, out_shape, scratch, grid)(*args)


# ----------------------------------------------------------------------------
# The Hopper kernel


def _hopper_scratch(config: MosaicConfig, q, v, table_width: int) -> list:
    """The query block (which the output reuses where E == H, else an output block), the
    schedule row, the block's positions and segment ids, its sink, its lse, and one barrier
    per copy in."""
    bq, (H, E) = config.block_q, (q.shape[-1], v.shape[-1])
    out = [] if E == H else [plgpu.SMEM((bq, E), q.dtype, transforms=swizzle())]
    return [
        plgpu.SMEM((bq, H), q.dtype, transforms=swizzle()),
        *out,
        plgpu.SMEM((table_width,), jnp.int32),
        plgpu.SMEM((bq,), jnp.int32),
        plgpu.SMEM((bq,), jnp.int32),
        plgpu.SMEM((ROW_ALIGN,), jnp.float32),
        plgpu.SMEM((bq,), jnp.float32),
        plgpu.Barrier(num_barriers=5),
    ]


def _hopper(config: MosaicConfig, q_ref, k_ref, v_ref, table_ref, q_pos_ref, kv_pos_ref, *refs):
    call, bq, bk = config.call, config.block_q, config.block_k
    segments = config.segments
    q_seg_ref, kv_seg_ref, sink_ref, refs = take_rows(config, refs, sink=True)
    o_ref, lse_ref, q_smem, *refs = refs
    # The output reuses the query block once the last product has read it.
    o_smem, *refs = refs if v_ref.shape[-1] != q_ref.shape[-1] else (q_smem, *refs)
    table_smem, qpos_smem, qseg_smem, sink_smem, lse_smem, bar = refs
    b, n, i = (lax.axis_index(a) for a in "bhi")
    rows = pl.ds(i * bq, bq)
    copies = [(q_ref.at[b, rows, n], q_smem), (table_ref.at[i], table_smem),
              (q_pos_ref.at[b, rows], qpos_smem)]  # fmt: skip
    if segments:
        copies.append((q_seg_ref.at[b, rows], qseg_smem))
    if call.has_sink:
        copies.append((sink_ref.at[n], sink_smem))
    copy_in(copies, bar)
    width = config.width
    tile = (bq, bk)
    row = plgpu.Layout.WGMMA.reduce(1)
    q_pos = tiles.along(load(qpos_smem, row), tile, 0)
    q_seg = tiles.along(load(qseg_smem, row), tile, 0) if segments else None

    def step(index, k_smem, v_smem, kpos_smem, *rest):
        (t,) = index
        *kseg_smem, (acc, m, l) = rest

        s = product(q_smem, k_smem, tile)
        col = plgpu.Layout.WGMMA.reduce(0)
        k_pos = tiles.along(load(kpos_smem, col), tile, 1)
        k_seg = tiles.along(load(kseg_smem[0], col), tile, 1) if segments else None
        s = tiles.scores(call, s, table_smem[1 + width + t], q_pos, k_pos, q_seg, k_seg)
        m, l, alpha, p = tiles.online(m, l, s)
        acc = acc * tiles.along(alpha, acc.shape, 0)
        acc = pl.run_state(lambda ref: plgpu.wgmma(ref, p.astype(v_smem.dtype), v_smem))(
            plgpu.ACC.init(acc)
        )
        return acc, m, l

    E = v_ref.shape[-1]
    sink = sink_smem[0] if call.has_sink else None
    m0, l0 = tiles.start(call, bq, sink)
    carry = (
        plgpu.layout_cast(jnp.zeros((bq, E), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(m0, row),
        plgpu.layout_cast(l0, row),
    )
    key_block = lambda t: (table_smem[1 + t], 0)  # noqa: E731
    key_vector = lambda t: (table_smem[1 + t],)  # noqa: E731
    specs = [
        plgpu.BlockSpec((bk, k_ref.shape[-1]), key_block, transforms=swizzle()),
        plgpu.BlockSpec((bk, E), key_block, transforms=swizzle()),
        plgpu.BlockSpec((bk,), key_vector),
    ]
    kv = n // call.G
    sources = [k_ref.at[b, :, kv, :], v_ref.at[b, :, kv, :], kv_pos_ref.at[b]]
    if segments:
        specs.append(plgpu.BlockSpec((bk,), key_vector))
        sources.append(kv_seg_ref.at[b])
    pipeline = plgpu.emit_pipeline(
        step, grid=(table_smem[0],), in_specs=specs, max_concurrent_steps=config.stages,
        init_carry=carry,
    )  # fmt: skip
    acc, m, l = pipeline(*sources)
    out, lse = tiles.finish(acc, m, l)
    o_smem[...] = out.astype(o_smem.dtype)
    lse_smem[...] = lse
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, rows, n])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, n, rows])
    plgpu.wait_smem_to_gmem(0)


# ----------------------------------------------------------------------------
# The twin: the same schedule and tile math, as the interpreter runs it


def _twin(config: MosaicConfig, q_ref, k_ref, v_ref, table_ref, q_pos_ref, kv_pos_ref, *refs):
    call, bq, bk = config.call, config.block_q, config.block_k
    segments = config.segments
    q_seg_ref, kv_seg_ref, sink_ref, refs = take_rows(config, refs, sink=True)
    o_ref, lse_ref = refs
    b, n, i = (lax.axis_index(a) for a in "bhi")
    rows, kv = pl.ds(i * bq, bq), n // call.G
    q = q_ref[b, rows, n, :]
    tile = (bq, bk)
    q_pos = tiles.along(q_pos_ref[b, rows], tile, 0)
    q_seg = tiles.along(q_seg_ref[b, rows], tile, 0) if segments else None
    width = config.width

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
    acc, m, l = scheduled(table_ref[i, 0], config.width, step, carry)
    out, lse = tiles.finish(acc, m, l)
    o_ref[b, rows, n, :] = out.astype(o_ref.dtype)
    lse_ref[b, n, rows] = lse


# ----------------------------------------------------------------------------
# Helpers


def _pad(x, length: int, mode: str = "constant"):
    """Pads axis 1 of ``x`` to ``length``."""
    if x.shape[1] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, length - x.shape[1])
    return jnp.pad(x, widths, mode=mode)
