"""FlashAttention for Hopper in Pallas's Mosaic GPU API.

``mosaic_attention`` computes ``attn.dot_product_attention``'s function for
bfloat16 and float16 inputs with head dims 64 and 128: every mask of the
algebra (by the block schedule: EMPTY key blocks are never visited, FULL ones
never evaluate the mask, PARTIAL ones evaluate it on the tile's positions),
explicit positions, segment ids (empty rows give zeros), learned sink logits,
soft-cap and GQA/MQA (K and V read through the query head's kv head, never
repeated). It refuses by name what it does not take: other dtypes and head
dims, score modifiers other than the soft-cap, bias and boolean mask arrays.

Its kernels (``attn.pallas.mosaic_forward``, ``attn.pallas.mosaic_backward``)
come in two forms sharing the tile math (``attn.pallas.mosaic_tiles``):

* for sm90: FlashAttention-3's warp specialisation in every kernel (a TMA
  producer warpgroup streaming the scheduled blocks to two consumer
  warpgroups, each holding its own block, on ``wgmma`` with float32
  accumulators; in the forward the two take turns), or with ``consumers=0``
  one warpgroup a block pipelining its own copies. The backward is
  FlashAttention-2's split: a dq kernel over query rows, a dk/dv kernel over
  keys. They lower and export for ``cuda`` from any host; they run only on a
  Hopper GPU.
* twins, the same loops over the same schedules with ref slices and
  ``jnp.dot``: what Pallas's Mosaic GPU interpreter runs on a CPU, so the
  numerics of the schedule, the masks, the statistics and the padding are
  checked without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Unpack

import jax
import jax.numpy as jnp
import numpy as np

from attn.checks import as_arrays, fail
from attn.pallas import mosaic_backward, mosaic_forward
from attn.pallas.common import FlashConfig, interpret_mode
from attn.pallas.mosaic_common import ROW_ALIGN, MosaicConfig, round_up
from attn.pallas.schedule import schedules
from attn.softmax.call import Call, CallArgs, check_call, takes_call_args

DTYPES = (jnp.bfloat16, jnp.float16)
HEAD_DIMS = (64, 128)  # wgmma's N for P V, and TMA's 128-byte swizzle rows
BLOCKS = (64, 128)  # wgmma's M is 64 a warpgroup; N (the key block) up to 256
SHARED_BYTES = 232_448  # an sm90 block's shared memory (227 KiB), what Mosaic GPU checks
CONSUMERS = (0, 1, 2)  # consumer warpgroups a program (0: not specialised)


@takes_call_args
def mosaic_attention(q, k, v, *, return_lse: bool = False, block_q: int = 64, block_k: int = 64,
                     stages: int = 2, consumers: int = 2, interpret: bool | None = None,
                     platform: str | None = None, **call_args: Unpack[CallArgs]):  # fmt: skip
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
      block_q, block_k: query rows per warpgroup and keys per pipeline step, 64 or 128.
      stages: key blocks in flight in the Hopper kernels' pipelines (>= 1).
      consumers: each Hopper kernel's consumer warpgroups beside a TMA producer
        warpgroup (FlashAttention-3's warp specialisation), each on its own ``block_q``
        rows (``block_k`` keys in the dk/dv kernel); the forward's two take turns. 0 runs
        one warpgroup a block that pipelines its own copies.
      interpret: True runs the twin under Pallas's Mosaic GPU interpreter; False or None
        lowers the Hopper kernel (None is refused on a non-GPU backend without
        ``platform``, where only the interpreter runs it).
      platform: ``"cuda"`` (or ``"gpu"``): lower the Hopper kernels whatever the host, for
        ``jax.export`` to ``cuda`` from a CPU (as ``flash_attention``'s ``platform``);
        None: the default backend's.
      **call_args: the call (``attn.softmax.call.CallArgs``).

    Returns:
      ``out [B,T,N,E]`` in q's dtype, and ``lse [B,T,N]`` if ``return_lse``.
    """
    q, k, v = as_arrays(q, k, v)
    call = check_call(q, k, v, **call_args)
    return attend(call, q, k, v, return_lse=return_lse, block_q=block_q, block_k=block_k,
                  stages=stages, consumers=consumers, interpret=interpret,
                  platform=platform)  # fmt: skip


def attend(call: Call, q, k, v, *, return_lse=False, block_q=64, block_k=64, stages=2,
           consumers=2, interpret=None, platform=None):  # fmt: skip
    """``mosaic_attention`` of a checked call (see there)."""
    interpret = _interpret(interpret, platform)
    config = _config(call, q, k, v, block_q, block_k, stages, consumers, interpret)
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
    return mosaic_forward.forward(config, q, k, v, sink, ints)


def _attention_fwd(config, q, k, v, sink, ints):
    out, lse = mosaic_forward.forward(config, q, k, v, sink, ints)
    return (out, lse), (q, k, v, sink, ints, out, lse)


def _attention_bwd(config, residuals, cotangents):
    q, k, v, sink, ints, out, lse = residuals
    grads = mosaic_backward.backward(config, q, k, v, sink, ints, out, lse, *cotangents)
    return *grads, None  # the integer inputs get no cotangent


_attention.defvjp(_attention_fwd, _attention_bwd)


def _config(call: Call, q, k, v, block_q, block_k, stages, consumers, interpret) -> MosaicConfig:
    """The call's kernel settings, refusing by name what the kernels do not take."""
    where = "impl='mosaic'"
    call.refuse_pairs(where)
    if call.score_mod is not None:
        fail("score_mod", f"None for {where} (it takes softcap=)", type(call.score_mod).__name__)
    backend = jax.default_backend()
    interpret = interpret_mode(interpret, backend, backend == "gpu", where)
    # The twin also takes float32, which checks its math at float32's precision.
    dtypes = DTYPES + ((jnp.float32,) if interpret else ())
    if q.dtype not in dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
        names = "bfloat16, float16 (or float32 interpreted)" if interpret else "bfloat16 or float16"
        fail("q, k, v", f"all in one of {names} for {where}", f"{q.dtype}, {k.dtype}, {v.dtype}")
    d = call.dims
    for name, dim in (("head dim H", d.H), ("value head dim E", d.E)):
        if dim not in HEAD_DIMS:
            fail(name, f"one of {HEAD_DIMS} for {where}", dim)
    # Ints (NumPy's too, as flash_attention takes them), never floats or bools: 64.0 would
    # compare equal to 64 and fail inside Pallas.
    block_q, block_k = (_int(b, n, BLOCKS) for b, n in ((block_q, "block_q"), (block_k, "block_k")))
    stages, consumers = _int(stages, "stages"), _int(consumers, "consumers", CONSUMERS)
    if consumers == 2 and stages < 2:
        # Taking turns, one consumer's next product waits for the other's release of the
        # slot it would be copied into.
        fail("stages", ">= 2 with consumers=2 (they take turns across steps)", stages)
    need = _shared_bytes(d, q.dtype.itemsize, block_q, block_k, stages, consumers)
    if not interpret and need > SHARED_BYTES:
        fail("block_q, block_k, stages, consumers",
             f"tiles that fit Hopper's {SHARED_BYTES:,} bytes of shared memory a block",
             f"{block_q}, {block_k}, {stages}, {consumers}: {need:,} bytes")  # fmt: skip
    return MosaicConfig(call.spec(), block_q, block_k, stages, interpret, consumers)


def _interpret(interpret, platform) -> bool | None:
    """``interpret`` given ``platform`` (None, or CUDA's: the Hopper kernels, not the twin)."""
    if platform is None:
        return interpret
    if platform not in ("cuda", "gpu"):
        fail("platform", "None, 'cuda' or 'gpu' for impl='mosaic' (Mosaic GPU lowers for "
             "CUDA)", repr(platform))  # fmt: skip
    if interpret:
        fail("interpret", f"False or None with platform={platform!r} (the kernels, not the "
             "twin)", repr(interpret))  # fmt: skip
    return False


def _int(x, name: str, allowed: tuple[int, ...] | None = None) -> int:
    """``x`` as an int, one of ``allowed`` (else >= 1); else the uniform ``ValueError``."""
    whole = not isinstance(x, bool) and isinstance(x, int | np.integer)
    if not whole or (x not in allowed if allowed else x < 1):
        fail(name, f"one of {allowed}" if allowed else "an int >= 1", repr(x))
    return int(x)


def _shared_bytes(d, itemsize: int, bq: int, bk: int, stages: int, consumers: int) -> int:
    """The most shared memory any of the three Hopper kernels takes (dims ``d``): each slot's
    own rows or keys (the outputs reuse them), the ``stages`` blocks in flight, the schedule
    row and the vectors."""
    H, E, C = d.H, d.E, max(consumers, 1)
    width = 1 << max(-(-d.S // bk), -(-d.T // bq), 1).bit_length()  # the widest schedule row
    small = (round_up(1 + 2 * width, ROW_ALIGN) * 4 + 4 * 4 * C * max(bq, bk)
             + stages * max(bk, bq) * 16 + 4 * ROW_ALIGN * C)  # fmt: skip
    forward = (C * bq * (H + (E if E != H else 0)) + stages * bk * (H + E)) * itemsize
    dq = (C * bq * (H + E) + stages * bk * (H + E)) * itemsize
    dkdv = (C * bk * (H + E) + stages * bq * (H + E)) * itemsize
    return max(forward, dq, dkdv) + small


def _schedule(config: MosaicConfig, call: Call):
    """``(config, tables, rows)``: the config with the schedules' widths, the packed
    schedules (per program its count, W blocks and W kinds: the forward's and dq's per
    program's query rows, over key blocks; the dk/dv kernel's per program's keys, over
    query blocks) and the padded rows: positions, then segment ids where the kernels
    read them."""
    flash = FlashConfig(config.call, config.program_rows, config.block_k, config.block_q,
                        config.program_keys, "gpu", config.interpret, None, None)  # fmt: skip
    plan = schedules(flash, call.rows(), call.static_rows())
    widths = [x.key_tile.shape[1] for x in plan]
    config = dataclasses.replace(config, width=widths[0], width_k=widths[1])
    Tp, Sp = config.padded
    tables = (_pack(plan.by_query, Tp // config.program_rows),
              _pack(plan.by_key, Sp // config.program_keys))  # fmt: skip
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


def _pack(schedule, blocks: int) -> jax.Array:
    """A schedule as one int32 table of ``blocks`` rows: per block its count, its W blocks,
    their W kinds (count 0 for blocks wholly in the padding)."""
    count = jnp.asarray(schedule.count, jnp.int32)[:, None]
    table = jnp.concatenate([count, schedule.key_tile, schedule.kind], axis=1).astype(jnp.int32)
    pad = ((0, blocks - table.shape[0]), (0, round_up(table.shape[1], ROW_ALIGN) - table.shape[1]))
    return jnp.pad(table, pad)


# ----------------------------------------------------------------------------
# Helpers


def _pad(x, length: int, mode: str = "constant"):
    """Pads axis 1 of ``x`` to ``length``."""
    if x.shape[1] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, length - x.shape[1])
    return jnp.pad(x, widths, mode=mode)
