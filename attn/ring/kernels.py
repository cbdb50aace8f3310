"""The loop of ring attention: its forward over the visiting k/v blocks and its custom VJP.

Internal to ``attn.ring``, whose ``attention`` module describes the algorithm.
Operands are in the tile layout of ``attn.softmax.tiles`` (axis letters X, Q,
J there): the local queries ``[groups*nq, X, Q, H]``, keys ``[groups*nk, X, H,
J]`` and values ``[groups*nk, X, J, E]``. Each ring step runs the blockwise
kernels (``attn.softmax.kernels``) on the local queries and the visiting k/v block;
a ``lax.scan`` over the P steps keeps one copy of a step in the program, so
compile time does not grow with the number of devices.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
from jax import lax

from attn.masks import BlockKind
from attn.merge import merge_attention
from attn.softmax.kernels import KernelInputs, backward, forward, kernel_inputs, vary_like
from attn.softmax.tiles import ScoreTiles, TileConfig


class RingInputs(NamedTuple):
    """The integer inputs of one device: its queries' and its k/v block's; no gradient flows."""

    q_pos: jax.Array  # [B,T] int32
    kv_pos: jax.Array  # [B,S] int32
    q_seg: jax.Array | None  # [B,T] int32
    kv_seg: jax.Array | None  # [B,S] int32


class KVBlock(NamedTuple):
    """What travels around the ring: one device's k/v tiles with their positions and ids,
    and the key-side leaves of a score modifier (FoX's running gate sums)."""

    kT: jax.Array  # [groups*nk, X, H, J]
    v: jax.Array  # [groups*nk, X, J, E]
    pos: jax.Array  # [B,S] int32
    seg: jax.Array | None  # [B,S] int32
    mod_k: tuple  # [groups*nk, X, G, J] each


def _varying(tree, axis_name: str, like=None):
    """Marks values as differing across the ring's devices (shard_map's ``vma`` type).

    A scan carry must keep its type, and what ``ppermute`` returns varies, so
    the initial carry must vary already: over ``axis_name``, and over every
    other manual axis ``like`` (the queries) varies over, as when the enclosing
    ``shard_map`` also splits the batch. Values that vary are left as they are
    (``pcast`` refuses to cast varying to varying).
    """

    def cast(x):
        with contextlib.suppress(ValueError):  # raised when x varies over axis_name already
            x = lax.pcast(x, axis_name, to="varying")
        return x if like is None else vary_like(x, like)

    return jax.tree.map(cast, tree)


def _shift(tree, axis_name: str, num_devices: int):
    """Sends every array of ``tree`` to the next device of the ring (device i to i + 1)."""
    perm = [(i, (i + 1) % num_devices) for i in range(num_devices)]
    return jax.tree.map(lambda x: lax.ppermute(x, axis_name, perm), tree)


def _visible(config: TileConfig, inputs: RingInputs, block: KVBlock):
    """Whether any local query may see any key of ``block``: the mask's ``classify`` on the
    bounds of all positions (and segment ids) of both sides, as one box."""
    q_pos, k_pos = inputs.q_pos, block.pos
    kind = config.call.mask.classify(q_pos.min(), q_pos.max(), k_pos.min(), k_pos.max())
    seen = kind != BlockKind.EMPTY
    if config.call.has_segments:  # disjoint id ranges share no id
        q_seg, k_seg = inputs.q_seg, block.seg
        seen = seen & (q_seg.min() <= k_seg.max()) & (k_seg.min() <= q_seg.max())
    return seen


def _kernel_inputs(config: TileConfig, inputs: RingInputs, block: KVBlock) -> KernelInputs:
    """The blockwise kernels' inputs for the local queries against ``block``.

    Positions vary per device and per step, so the tile schedule is always
    computed at run time (from each tile's position bounds) and empty tiles are
    skipped inside a visited step too.
    """
    rows = [inputs.q_pos, block.pos]
    if config.call.has_segments:
        rows += [inputs.q_seg, block.seg]
    return kernel_inputs(config, rows, static=None)


def _no_sink(config: TileConfig):
    # The steps never see the sink logits: attn.ring merges them once, after the ring.
    return jnp.zeros((config.call.K, config.call.G), jnp.float32)


def ring_forward(config: TileConfig, axis_name: str, q, kT, v, mod: ScoreTiles,
                 inputs: RingInputs):  # fmt: skip
    """P ring steps of blockwise attention, merged with ``attn.merge.merge_attention``.

    Args:
      config: the local call's tiles, with ``dtype`` float32 (the partial
        outputs are merged in float32) and ``has_sink`` False.
      axis_name: the mesh axis of the ring, bound by an enclosing ``shard_map``.
      q: ``[groups*nq, X, Q, H]`` scaled query tiles; kT, v: the local k/v tiles.
      mod: the score modifier's local leaves in tile layout; the key-side ones
        travel with the k/v tiles.
      inputs: the local positions and segment ids.

    Returns:
      ``out [groups*nq, X, Q, E]`` float32 and ``lse [groups*nq, X, Q]`` over
      the keys of all devices, and int32 ``[3]`` counts: ring steps computed,
      FULL tiles and PARTIAL tiles (block pairs, over all head groups' tiles).
    """
    num_devices = lax.axis_size(axis_name)
    no_sink = _no_sink(config)
    n_tiles, X, Q, _ = q.shape
    q = _varying(q, axis_name)  # the kernels' loop carries vary where q does

    def step(carry, _):
        block, out, lse, counts = carry

        def visit(block):
            step_mod = mod._replace(k=block.mod_k)
            kernel_inputs = _kernel_inputs(config, inputs, block)
            part = forward(config, q, block.kT, block.v, no_sink, step_mod, kernel_inputs)
            o, l, (full, partial) = part
            visited = jnp.stack([1, full // config.groups, partial // config.groups])
            return o, l, visited.astype(jnp.int32)

        def skip(block):  # the mask empties the whole step: no matmul at all
            return jnp.zeros_like(out), jnp.full_like(lse, -jnp.inf), jnp.zeros_like(counts)

        o, l, visited = lax.cond(_visible(config, inputs, block), visit, skip, block)
        out, lse = merge_attention(out, lse, o, l)
        # The last shift brings every block home, unused: it keeps one step body
        # (one copy of the kernels to compile) for 1/P more traffic.
        return (_shift(block, axis_name, num_devices), out, lse, counts + visited), None

    out0 = jnp.zeros((n_tiles, X, Q, v.shape[-1]), jnp.float32)
    lse0 = jnp.full((n_tiles, X, Q), -jnp.inf, jnp.float32)
    block = KVBlock(kT, v, inputs.kv_pos, inputs.kv_seg, mod.k)
    carry = _varying((block, out0, lse0, jnp.zeros(3, jnp.int32)), axis_name, q)
    (_, out, lse, counts), _ = lax.scan(step, carry, length=num_devices)
    return out, lse, counts


def _ring_backward(config: TileConfig, axis_name: str, residuals, d_out, d_lse):
    """The FlashAttention-2 backward of every ring step, given the merged (global) out and lse.

    With the final lse, each step's probabilities ``exp(logits - lse)`` are the
    global ones, so the blockwise backward of a step gives exactly that k/v
    block's share of dq, and the whole dk, dv from the local queries. dk and dv
    travel with their block and arrive home after the P-th shift.
    """
    q, kT, v, mod, inputs, out, lse = residuals
    q = _varying(q, axis_name)  # the kernels' loop carries vary where q does
    num_devices = lax.axis_size(axis_name)
    no_sink = _no_sink(config)
    # The kernels take the cotangent in the value dtype, as in attn.softmax.blockwise.
    d_out = d_out.astype(v.dtype)

    def step(carry, _):
        block, dkT, dv, dmod_k, dq, dmod = carry

        def visit(block):
            kernel_inputs = _kernel_inputs(config, inputs, block)
            step_mod = mod._replace(k=block.mod_k)
            # float32 partials: a half-precision input is rounded once, after the ring's sum.
            dq, dkT, dv, _, dmod = backward(
                config,
                q,
                block.kT,
                block.v,
                no_sink,
                step_mod,
                kernel_inputs,
                out,
                lse,
                d_out,
                d_lse,
                grad_dtype=jnp.float32,
            )
            return dq, dkT, dv, dmod

        def skip(block):
            zeros = jax.tree.map(jnp.zeros_like, (dq, dkT, dv, dmod))
            return zeros

        dq_s, dkT_s, dv_s, dmod_s = lax.cond(_visible(config, inputs, block), visit, skip, block)
        dmod_k = jax.tree.map(jnp.add, dmod_k, dmod_s.k)
        travel = (block, dkT + dkT_s, dv + dv_s, dmod_k)
        block, dkT, dv, dmod_k = _shift(travel, axis_name, num_devices)
        dmod = jax.tree.map(jnp.add, dmod, dmod_s._replace(k=dmod.k))
        return (block, dkT, dv, dmod_k, dq + dq_s, dmod), None

    block = KVBlock(kT, v, inputs.kv_pos, inputs.kv_seg, mod.k)
    f32 = functools.partial(jnp.zeros_like, dtype=jnp.float32)
    zeros_mod = jax.tree.map(f32, mod)
    carry = (block, f32(kT), f32(v), zeros_mod.k, f32(q), zeros_mod)
    carry = _varying(carry, axis_name, q)
    (_, dkT, dv, dmod_k, dq, dmod), _ = lax.scan(step, carry, length=num_devices)
    dmod = jax.tree.map(lambda d, x: d.astype(x.dtype), dmod._replace(k=dmod_k), mod)
    return dq.astype(q.dtype), dkT.astype(kT.dtype), dv.astype(v.dtype), dmod


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def ring_flash(config: TileConfig, axis_name: str, q, kT, v, mod: ScoreTiles, inputs: RingInputs):
    """``(out, lse)`` of ``ring_forward``, differentiated by a ring of blockwise backwards.

    Saves only the local q, k, v, modifier leaves, out and lse: memory stays
    linear in the shard length.
    """
    out, lse, _ = ring_forward(config, axis_name, q, kT, v, mod, inputs)
    return out, lse


def _ring_flash_fwd(config, axis_name, q, kT, v, mod, inputs):
    out, lse, _ = ring_forward(config, axis_name, q, kT, v, mod, inputs)
    return (out, lse), (q, kT, v, mod, inputs, out, lse)


def _ring_flash_bwd(config, axis_name, residuals, cotangents):
    q, kT, v, *_ = residuals
    dq, dkT, dv, dmod = _ring_backward(config, axis_name, residuals, *cotangents)
    chex.assert_equal_shape([dq, q])
    chex.assert_equal_shape([dkT, kT])
    chex.assert_equal_shape([dv, v])
    return dq, dkT, dv, dmod, None  # the integer inputs get no cotangent


ring_flash.defvjp(_ring_flash_fwd, _ring_flash_bwd)
