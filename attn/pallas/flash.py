"""FlashAttention in Pallas: the forward kernel, the call's preparation and the custom VJP.

``flash_attention`` computes ``attn.dot_product_attention``'s function (every
mask of the algebra, explicit positions, segment ids with empty rows giving
zeros, soft-cap, learned sink logits, GQA/MQA, any T and S) as Pallas kernels:

* The grid is ``(B, N, query blocks)``. Each program keeps one query block of
  one head and loops (``lax.fori_loop``) over the key blocks its schedule lists,
  merging each tile into a float32 online softmax (Dao et al. 2022,
  FlashAttention). K and V are read through the kv head ``n // G`` of the
  query head: GQA and MQA never repeat them in memory.
* The schedule comes from ``attn.softmax.schedule`` (``Mask.classify`` on
  block bounds), computed outside the kernel: in NumPy when positions and
  segment ids are known at trace time, at run time when they are traced. It
  is an input array, since Triton has no scalar prefetch. EMPTY tiles are never
  visited and FULL ones never evaluate the mask; PARTIAL ones evaluate the
  ``Mask`` itself on the tile's position vectors (``attn.pallas.common.allowed``).
* The backward (``attn.pallas.flash_backward``) is FlashAttention-2's (Dao 2023):
  a dq kernel over query blocks and a dk/dv kernel over key blocks, both
  recomputing ``P = exp(logits - lse)`` from the saved float32 lse.

T and S are padded to whole blocks inside (padding keys are masked, padding
rows dropped); on a compiled GPU the head dims are padded to powers of two, as
Triton requires. Block sizes and launch settings come from
``attn.pallas.tuning``'s cache where the GPU has a measured entry for the case,
else from ``attn.pallas.blocks``.
"""

from __future__ import annotations

import functools
from typing import Unpack

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from attn import scores
from attn.checks import as_arrays, fail, positive_int
from attn.pallas import blocks as blocks_lib
from attn.pallas import tuning
from attn.pallas.common import (
    PLATFORMS,
    FlashConfig,
    KernelInts,
    flash_call,
    head_view,
    interpret_mode,
    logits,
    masked_unless_full,
    matmul,
    mod_specs,
    modify,
    pair_by_query,
    pair_layout,
    pair_rows,
    row_inputs,
    score_leaves,
    take_pairs,
    take_views,
    tile_visible,
)
from attn.pallas.flash_backward import backward
from attn.pallas.schedule import schedules
from attn.softmax.call import MASKED, Call, CallArgs, check_call, takes_call_args


@takes_call_args
def flash_attention(
    q,
    k,
    v,
    *,
    return_lse: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    interpret: bool | None = None,
    platform: str | None = None,
    tiles: blocks_lib.Blocks | None = None,
    device_kind: str | None = None,
    **call_args: Unpack[CallArgs],
):
    """Softmax attention as Pallas kernels (forward and FlashAttention-2 backward).

    Computes ``attn.dot_product_attention``'s function; takes its arguments
    except ``bias`` and ``return_weights``. A score modifier is evaluated in
    the kernels on each tile's position vectors and its slice of the
    modifier's arrays; the backward kernels give those arrays' gradients.

    Args:
      q: ``[B,T,N,H]`` queries (float32, bfloat16 or float16).
      k: ``[B,S,K,H]`` keys, ``N % K == 0``; v: ``[B,S,K,E]`` values.
      return_lse: also return the float32 lse ``[B,T,N]`` (``-inf`` for a row that
        sees nothing), which ``attn.merge_attention`` merges and which is
        differentiable.
      block_q, block_k: tile sizes for every kernel, over ``tiles`` and the
        cache; None takes ``tiles``, else the tuning cache's entry for the GPU
        (``attn.pallas.tuning``), else ``attn.pallas.blocks.BLOCKS`` for the
        platform. Compiled, they must be powers of two >= 16.
      interpret: run the kernels in Pallas interpret mode; None compiles them, and is
        refused for ``platform`` ``"cpu"``, where only the interpreter runs them.
      platform: the platform the kernels are lowered for: ``"gpu"`` (or
        ``"cuda"``/``"rocm"``: Triton), ``"tpu"`` or ``"cpu"``; None is
        ``jax.default_backend()``. Give it to ``jax.export`` a call for an
        accelerator from another host: the blocks, the launch parameters and
        interpret mode follow it.
      tiles: every tile and launch setting at once (``attn.pallas.blocks.Blocks``;
        launch settings None take the defaults), instead of the cache's entry
        or ``BLOCKS``: what a sweep times. Tiles longer than the sequence shrink
        to it.
      device_kind: the GPU (``jax.Device.device_kind``, e.g. ``"NVIDIA H200"``)
        whose tuning-cache entry to use; None: the host's default device when
        compiling for a GPU on one (interpret mode and lowering from a CPU then
        take the defaults).
      **call_args: the call (``attn.softmax.call.CallArgs``), as in
        ``attn.dot_product_attention`` (segment ids: id 0 is padding).

    Returns:
      ``out [B,T,N,E]`` in q's dtype, and ``lse [B,T,N]`` if ``return_lse``.
    """
    q, k, v = as_arrays(q, k, v)
    call = check_call(q, k, v, **call_args)
    return attend(call, q, k, v, return_lse=return_lse, block_q=block_q, block_k=block_k,
                  interpret=interpret, platform=platform, tiles=tiles,
                  device_kind=device_kind)  # fmt: skip


def attend(call: Call, q, k, v, *, return_lse=False, block_q=None, block_k=None, interpret=None,
           platform=None, tiles=None, device_kind=None):  # fmt: skip
    """``flash_attention`` of a checked call (see there)."""
    q, k, v = call.isolate(q, k, v)
    dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
    config = _config(call, dtype, block_q, block_k, interpret, platform, tiles, device_kind)
    ints = _kernel_ints(config, call)
    qp, kp, vp = _padded_operands(config, q, k, v)
    N = call.dims.N
    sink = call.sink_logits.reshape(N) if config.call.has_sink else jnp.zeros((N,), jnp.float32)
    mod = score_leaves(config, scores.split(call.score)[1], *_padded_lengths(config))
    bias = None
    if call.bias is not None:
        bias = pair_layout(call.bias.astype(jnp.float32), call.dims.K, call.dims.G,
                           *_padded_lengths(config), 0.0)  # fmt: skip
    out, lse = _flash(config, qp, kp, vp, sink, mod, bias, ints)
    T, E = call.dims.T, call.dims.E
    out = out[:, :T, :, :E].astype(q.dtype)
    return (out, lse[:, :, :T].transpose(0, 2, 1)) if return_lse else out


def _config(call: Call, dtype, block_q, block_k, interpret, platform, tiles=None,
            device_kind=None) -> FlashConfig:  # fmt: skip
    """The call's kernel settings: interpret mode, the tiles and the launch parameters."""
    given = jax.default_backend() if platform is None else platform
    if given not in PLATFORMS:
        fail("platform", f"one of {sorted(PLATFORMS)} or None", repr(platform))
    platform = PLATFORMS[given]
    interpret = interpret_mode(interpret, given, platform != "cpu", "impl='pallas'")
    table = _table(call, dtype, platform, interpret, tiles, device_kind)
    minimum = 1 if interpret else blocks_lib.MIN_BLOCK
    T, S = call.dims.T, call.dims.S
    bq, bk, bwd_bq, bwd_bk = (
        _block(given, default, length, minimum, interpret, name)
        for given, default, length, name in (
            (block_q, table.block_q, T, "block_q"),
            (block_k, table.block_k, S, "block_k"),
            (block_q, table.bwd_block_q, T, "block_q"),
            (block_k, table.bwd_block_k, S, "block_k"),
        )
    )
    num_warps = table.num_warps or (4 if call.dims.H <= 64 else 8)
    bwd_num_warps = table.bwd_num_warps or num_warps
    bwd_num_stages = table.num_stages if table.bwd_num_stages is None else table.bwd_num_stages
    return FlashConfig(
        call=call.spec(),
        block_q=bq,
        block_k=bk,
        bwd_block_q=bwd_bq,
        bwd_block_k=bwd_bk,
        platform=platform,
        interpret=interpret,
        num_warps=None if interpret else num_warps,
        num_stages=None if interpret else table.num_stages,
        bwd_num_warps=None if interpret else bwd_num_warps,
        bwd_num_stages=None if interpret else bwd_num_stages,
    )


def _table(call: Call, dtype, platform: str, interpret: bool, tiles, device_kind):
    """The settings before explicit block sizes: ``tiles``, else the tuning cache's entry
    for the device (named, or the host's GPU when compiling for one), else ``BLOCKS``."""
    if tiles is not None:
        return tuning.check_tiles(tiles, compiled=not interpret)
    if device_kind is not None:
        if not isinstance(device_kind, str) or not device_kind:
            fail("device_kind", "a jax.Device.device_kind string or None", repr(device_kind))
    elif platform == "gpu" and not interpret:
        device_kind = tuning.host_device_kind()
    if device_kind is not None:
        d = call.dims
        found = tuning.lookup(device_kind, tuning.case(d.H, d.E, dtype, call.mask, d.T, d.S))
        if found is not None:
            return found
    return blocks_lib.platform_blocks("cpu" if interpret else platform)


def _padded_lengths(config: FlashConfig) -> tuple[int, int]:
    """``(Tp, Sp)``: T and S padded to whole blocks of every kernel."""
    Tp = _round_up(config.call.T, max(config.block_q, config.bwd_block_q))
    Sp = _round_up(config.call.S, max(config.block_k, config.bwd_block_k))
    return Tp, Sp


def _kernel_ints(config: FlashConfig, call: Call) -> KernelInts:
    """Both schedules, and the positions and segment ids padded to ``_padded_lengths``."""
    rows = call.rows()
    plan = schedules(config, rows, call.static_rows(), call.keep)
    Tp, Sp = _padded_lengths(config)
    # Padding repeats the last entry: the blocks' bounds, and so the schedule, stay those
    # of the real rows; padding keys are masked by index (tile_visible).
    q_pos, kv_pos, *segments = (
        _pad(x, length, "edge") for x, length in zip(rows, (Tp, Sp) * 2, strict=False)
    )
    q_seg, kv_seg = segments if segments else (None, None)
    keep = None
    if call.keep is not None:  # int8: Triton loads no bool from memory
        keep = pair_layout(call.keep.astype(jnp.int8), call.dims.K, call.dims.G, Tp, Sp, 0)
    return KernelInts(plan.by_query, plan.by_key, q_pos, kv_pos, q_seg, kv_seg, keep)


def _padded_operands(config: FlashConfig, q, k, v):
    """q, k, v in one dtype, padded to whole blocks (and, compiled, to power-of-two head dims)."""
    Tp, Sp = _padded_lengths(config)
    H, E = q.shape[-1], v.shape[-1]
    Hp, Ep = (H, E) if config.interpret else (_head_pad(H), _head_pad(E))
    dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
    return (
        _pad(q.astype(dtype), Tp, "constant", Hp),
        _pad(k.astype(dtype), Sp, "constant", Hp),
        _pad(v.astype(dtype), Sp, "constant", Ep),
    )


def _block(given, default, length, minimum, interpret, name) -> int:
    if given is None:
        return blocks_lib.fit_block(default, length, minimum)
    given = positive_int(given, name)
    if not interpret and (given & (given - 1) or given < blocks_lib.MIN_BLOCK):
        fail(name, f"a power of two >= {blocks_lib.MIN_BLOCK} for a compiled kernel", given)
    return given


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def _head_pad(d: int) -> int:
    return blocks_lib.padded_head_dim(d)


def _pad(x, length: int, mode: str, last: int | None = None):
    """Pads axis 1 to ``length`` (and the last axis of ``[B,L,heads,D]`` to ``last``)."""
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, length - x.shape[1])
    if last is not None:
        widths[-1] = (0, last - x.shape[-1])
    if all(w == (0, 0) for w in widths):
        return x
    return jnp.pad(x, widths, mode=mode)


def forward(config: FlashConfig, q, k, v, sink, mod: dict, bias, ints: KernelInts):
    """``(out [B,Tp,N,E], lse [B,N,Tp] float32)`` over the ``by_query`` schedule.

    Rows past the last scheduled query block are left unwritten (they are padding).
    """
    B, Tp, N, H = q.shape
    Sp, E = k.shape[1], v.shape[-1]
    G, bq = config.call.G, config.block_q
    sched = ints.by_query
    nq, W = sched.key_tile.shape
    per_block = pl.BlockSpec((None, W), lambda b, n, i: (i, 0))
    one = pl.BlockSpec((None, 1), lambda b, n, i: (i, 0))
    q_rows = pl.BlockSpec((None, bq), lambda b, n, i: (b, i))
    kv_rows = pl.BlockSpec((None, Sp), lambda b, n, i: (b, 0))
    row_specs, rows = row_inputs(config, ints, q_rows, kv_rows)
    in_specs = [
        per_block,
        per_block,
        one,
        pl.BlockSpec((None, bq, None, H), lambda b, n, i: (b, i, n, 0)),
        pl.BlockSpec((None, Sp, None, H), lambda b, n, i: (b, 0, n // G, 0)),
        pl.BlockSpec((None, Sp, None, E), lambda b, n, i: (b, 0, n // G, 0)),
        *row_specs,
    ]
    args = [sched.key_tile, sched.kind, sched.count[:, None], q, k, v, *rows]
    specs, leaves = mod_specs(
        mod,
        head=(None, lambda b, n, i: n),
        q=((None, None, bq), lambda b, n, i: (b, n, i)),
        k=((None, None, Sp), lambda b, n, i: (b, n, 0)),
    )
    in_specs += [*specs, pl.BlockSpec((None, 1), lambda b, n, i: (n, 0))]
    args += [*leaves, sink[:, None]]
    pair_args = [x for x in (bias, ints.keep) if x is not None]
    in_specs += [pair_by_query(config, x) for x in pair_args]
    args += pair_args
    out_specs = [
        pl.BlockSpec((None, bq, None, E), lambda b, n, i: (b, i, n, 0)),
        pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((B, Tp, N, E), q.dtype),
        jax.ShapeDtypeStruct((B, N, Tp), jnp.float32),
    ]
    call = flash_call(config, _forward_kernel, "attn_flash_forward", (B, N, nq), in_specs,
                      out_specs, out_shape)  # fmt: skip
    return call(*args)


def _forward_kernel(config: FlashConfig, key_ref, kind_ref, count_ref, q_ref, k_ref, v_ref,
                    q_pos_ref, kv_pos_ref, *refs):  # fmt: skip
    if config.call.has_segments:
        q_seg_ref, kv_seg_ref, *refs = refs
    mod_refs, (sink_ref, *refs) = take_views(config, refs)
    bias_ref, keep_ref, (o_ref, lse_ref) = take_pairs(config, refs)
    bq, bk = config.block_q, config.block_k
    q, q_pos = q_ref[...], q_pos_ref[...]
    q_seg = q_seg_ref[...] if config.call.has_segments else None
    views = dict(head=[head_view(r) for r in mod_refs["head"]], q=[r[...] for r in mod_refs["q"]])

    def body(t, carry):
        m, l, acc = carry
        start = pl.multiple_of(key_ref[t] * bk, bk)
        keys = pl.ds(start, bk)
        tile = dict(views, k=[r[keys] for r in mod_refs["k"]])
        s = modify(config, logits(config, q, k_ref[keys, :]), tile, q_pos, kv_pos_ref[keys])
        if bias_ref is not None:
            s = s + pair_rows(bias_ref, keys, s.shape)

        def visible():
            k_seg = kv_seg_ref[keys] if config.call.has_segments else None
            ok = tile_visible(config, q_pos, kv_pos_ref[keys], start, q_seg, k_seg)
            return ok if keep_ref is None else ok & (pair_rows(keep_ref, keys, ok.shape) != 0)

        s = masked_unless_full(config, s, kind_ref[t], visible)
        m_new = jnp.maximum(m, s.max(-1))
        alpha = jnp.exp(m - m_new)
        # A row that has seen nothing yet (max still MASKED) must add nothing:
        # subtracting +inf makes its p exactly 0.
        p = jnp.exp(s - jnp.where(m_new > MASKED, m_new, jnp.inf)[:, None])
        v = v_ref[keys, :]
        l = alpha * l + p.sum(-1)
        acc = alpha[:, None] * acc + matmul(p.astype(v.dtype), v)
        return m_new, l, acc

    if config.call.has_sink:  # the sink is one more logit with no value: max = sink, sum = 1
        m0, l0 = jnp.full((bq,), sink_ref[0], jnp.float32), jnp.ones((bq,), jnp.float32)
    else:
        m0, l0 = jnp.full((bq,), MASKED, jnp.float32), jnp.zeros((bq,), jnp.float32)
    acc0 = jnp.zeros((bq, o_ref.shape[-1]), jnp.float32)
    m, l, acc = lax.fori_loop(0, count_ref[0], body, (m0, l0, acc0))
    seen = l > 0
    safe = jnp.where(seen, l, 1.0)
    o_ref[...] = (acc / safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(safe), -jnp.inf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(config: FlashConfig, q, k, v, sink, mod: dict, bias, ints: KernelInts):
    return forward(config, q, k, v, sink, mod, bias, ints)


def _flash_fwd(config, q, k, v, sink, mod, bias, ints):
    out, lse = forward(config, q, k, v, sink, mod, bias, ints)
    return (out, lse), (q, k, v, sink, mod, bias, ints, out, lse)


def _flash_bwd(config, residuals, cotangents):
    q, k, v, sink, mod, bias, ints, out, lse = residuals
    d_out, d_lse = cotangents
    grads = backward(config, q, k, v, sink, mod, bias, ints, out, lse, d_out, d_lse)
    return *grads, None  # the integer inputs get no cotangent


_flash.defvjp(_flash_fwd, _flash_bwd)
