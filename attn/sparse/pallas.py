"""A block-sparse Pallas kernel for the selected blocks of MoBA and NSA.

Each program holds one block of ``block_q`` queries of one head and loops over
the key blocks any of its queries selected (their union, a per-query-block list
computed outside the kernel), merging each tile into a float32 online softmax;
inside a tile a query keeps the keys of the blocks it selected itself, and the
call's mask on positions. Key and value blocks are read through the query
head's kv head (GQA without repeating them).

The backward pass is the gathered form's (``attn.sparse.gather``), recomputed:
the same function, so the kernel trains as the XLA form does.

What the kernel takes (others are refused by name): the default positions
(keys ``arange(S)``, queries the last T of them), no segment ids, no score
modifier, soft-cap or sink logits; the call's mask is evaluated per tile.
Blocks are then array blocks of ``block`` keys, the layout the selections use.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from attn.checks import fail
from attn.pallas.common import PLATFORMS, allowed, interpret_mode, matmul
from attn.softmax.call import MASKED, Call
from attn.sparse import gather

DEFAULT_BLOCK_Q = 64


IMPLS = ("gather", "pallas")


def check_impl(c: Call, impl, platform, interpret, return_lse: bool, where: str) -> None:
    """A sparse function's ``impl``: ``"gather"`` takes any call, ``"pallas"`` what
    ``check_kernel_call`` allows, and returns no lse; ``interpret`` is the kernel's."""
    if impl not in IMPLS:
        fail("impl", f"one of {IMPLS}", repr(impl))
    if platform is not None and platform not in PLATFORMS:
        fail("platform", f"one of {sorted(PLATFORMS)} or None", repr(platform))
    if interpret is not None and impl != "pallas":
        fail("interpret", f"None for impl={impl!r} (a setting of impl='pallas')", repr(interpret))
    if impl == "pallas":
        check_kernel_call(c, where)
        if return_lse:
            fail("return_lse", "False with impl='pallas' (the kernel keeps no lse)", True)


def check_kernel_call(c: Call, where: str) -> None:
    """Refuses, naming the argument, what the kernel does not compute."""
    for name, given in (
        ("q_positions", c.positions[0]),
        ("kv_positions", c.positions[1]),
        ("q_segment_ids", c.q_segment_ids),
        ("score_mod", c.score),
        ("sink_logits", c.sink_logits),
    ):
        if given is not None:
            fail(name, f"None for {where} with impl='pallas' (the kernel reads default "
                 "positions, no segments, modifiers or sinks; impl='gather' takes them)",
                 "an argument")  # fmt: skip


def block_ids(start, stop, block: int):
    """Selected array blocks ``[..., n]`` (-1: none) from key ranges on the default layout."""
    return jnp.where(stop > start, start // block, -1)


def block_lists(ids, block_q: int, J: int):
    """Per query block, the union of its queries' selected blocks.

    Args:
      ids: ``[B,Tp,X,n]`` selected block ids (-1: none), Tp a multiple of ``block_q``.

    Returns:
      ``(lists [B,X,nq,L], counts [B,X,nq])``: each list's first ``count`` entries are the
      blocks, ascending; ``L = min(J, block_q * n)``.
    """
    B, Tp, X, n = ids.shape
    nq = Tp // block_q
    per_block = ids.reshape(B, nq, block_q, X, n).transpose(0, 3, 1, 2, 4).reshape(B, X, nq, -1)
    hit = jnp.zeros((B, X, nq, J + 1), bool)
    b, x, i = (jnp.arange(s).reshape(-1, *(1,) * (3 - d)) for d, s in enumerate((B, X, nq)))
    hit = hit.at[b, x, i, jnp.where(per_block >= 0, per_block, J)].set(True)[..., :J]
    L = min(J, block_q * n)
    lists = jnp.argsort(~hit, axis=-1, stable=True)[..., :L].astype(jnp.int32)
    return lists, hit.sum(-1).astype(jnp.int32)


def block_sparse_attention(c: Call, q, k, v, ids, *, block: int, block_q: int | None = None,
                           interpret: bool | None = None, platform: str | None = None):  # fmt: skip
    """Attention of each query over the keys of its selected blocks, as a Pallas kernel.

    Args:
      c: the checked call (``check_kernel_call``'s restrictions).
      q: ``[B,T,N,H]``; k: ``[B,S,K,H]``; v: ``[B,S,K,E]``.
      ids: ``[B,T,X,n]`` int32 selected blocks of ``block`` keys (-1: none); X is 1, K
        or N (who shares a selection, as in ``attn.sparse.gather``).
      block_q: queries per program (default 64, or T's next power of two, at least 16,
        when smaller).
      interpret: Pallas interpret mode; None compiles, refused on a CPU (only the
        interpreter runs the kernel there).
      platform: lower for ``"cpu"``, ``"gpu"`` (``"cuda"``) or ``"tpu"``; None: the host's.

    Returns:
      ``out [B,T,N,E]`` in q's dtype.
    """
    given = jax.default_backend() if platform is None else platform
    if given not in PLATFORMS:
        fail("platform", f"one of {sorted(PLATFORMS)} or None", repr(platform))
    platform = PLATFORMS[given]
    interpret = interpret_mode(interpret, given, platform != "cpu", "the block-sparse kernel")
    T = c.dims.T
    bq = block_q or min(DEFAULT_BLOCK_Q, max(16, _pow2(T)))
    if not interpret and platform == "gpu":  # Triton's tiles are powers of two, at least 16
        H, E = c.dims.H, c.dims.E
        for name, x in (("block_size", block), ("block_q", bq), ("head dim", H), ("value dim", E)):
            if x < 16 or x != _pow2(x):
                fail(name, "a power of two >= 16 for the Pallas kernel on a GPU "
                     "(impl='gather' takes any)", x)  # fmt: skip
    static = (block, bq, interpret, platform)
    return _sparse(static, c, q, k, v, ids)


def _pow2(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << max(0, (n - 1).bit_length())


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sparse(static, c, q, k, v, ids):
    return _forward(static, c, q, k, v, ids)


def _sparse_fwd(static, c, q, k, v, ids):
    return _forward(static, c, q, k, v, ids), (c, q, k, v, ids)


def _sparse_bwd(static, residuals, g):
    c, q, k, v, ids = residuals
    block = static[0]
    start = jnp.where(ids >= 0, ids * block, 0)
    stop = jnp.where(ids >= 0, jnp.minimum(start + block, c.dims.S), start)

    def gathered(q, k, v):
        return gather.gathered_attention(c, q, k, v, start, stop, block=block)[0]

    _, vjp = jax.vjp(gathered, q, k, v)
    dq, dk, dv = vjp(g)
    return jax.tree.map(jnp.zeros_like, c), dq, dk, dv, None  # the call holds no arrays here


_sparse.defvjp(_sparse_fwd, _sparse_bwd)


def _forward(static, c: Call, q, k, v, ids):
    block, bq, interpret, platform = static
    B, T, S, N, _, G, H, E = c.dims
    X, n = ids.shape[2], ids.shape[3]
    Tp, Sp = -(-T // bq) * bq, -(-S // block) * block
    n_pad = _pow2(n)  # Triton's tiles are powers of two
    q = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0)))
    k = jnp.pad(k, ((0, 0), (0, Sp - S), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, Sp - S), (0, 0), (0, 0)))
    ids = jnp.pad(ids, ((0, 0), (0, Tp - T), (0, 0), (0, n_pad - n)), constant_values=-1)
    lists, counts = block_lists(ids, bq, Sp // block)
    nq, L = Tp // bq, lists.shape[-1]
    per_x = N // X  # query heads per selection
    kernel = functools.partial(_kernel, c.mask, c.scale, block, S - T, S)
    params = None
    if platform == "gpu" and not interpret:
        from jax.experimental.pallas import triton as plgpu  # Triton's lowering: GPU only

        params = plgpu.CompilerParams(num_warps=4 if H <= 64 else 8, num_stages=2)
    out = pl.pallas_call(
        kernel,
        grid=(B, N, nq),
        in_specs=[
            pl.BlockSpec((None, None, None, L), lambda b, h, i: (b, h // per_x, i, 0)),
            pl.BlockSpec((None, None, None, 1), lambda b, h, i: (b, h // per_x, i, 0)),
            pl.BlockSpec((None, bq, None, n_pad), lambda b, h, i: (b, i, h // per_x, 0)),
            pl.BlockSpec((None, bq, None, H), lambda b, h, i: (b, i, h, 0)),
            pl.BlockSpec((None, Sp, None, H), lambda b, h, i: (b, 0, h // G, 0)),
            pl.BlockSpec((None, Sp, None, E), lambda b, h, i: (b, 0, h // G, 0)),
        ],
        out_specs=pl.BlockSpec((None, bq, None, E), lambda b, h, i: (b, i, h, 0)),
        out_shape=jax.ShapeDtypeStruct((B, Tp, N, E), q.dtype),
        interpret=interpret,
        compiler_params=params,
        name="attn_block_sparse_forward",
    )(lists, counts[..., None], ids, q, k, v)
    return out[:, :T]


def _kernel(mask, scale, block, offset, S, list_ref, count_ref, ids_ref, q_ref, k_ref, v_ref,
            o_ref):  # fmt: skip
    bq = q_ref.shape[0]
    q, ids = q_ref[...], ids_ref[...]  # [bq,H], [bq,n]
    q_pos = offset + pl.program_id(2) * bq + lax.broadcasted_iota(jnp.int32, (bq,), 0)

    def body(t, carry):
        m, l, acc = carry
        j = list_ref[t]
        start = pl.multiple_of(j * block, block)
        keys = pl.ds(start, block)
        s = lax.dot_general(q, k_ref[keys, :], (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * scale  # fmt: skip
        k_pos = start + lax.broadcasted_iota(jnp.int32, (block,), 0)
        chose = jnp.max((ids == j).astype(jnp.int32), axis=1) > 0  # [bq]: it chose the block
        ok = allowed(mask, q_pos, k_pos) & chose[:, None] & (k_pos < S)[None, :]
        s = jnp.where(ok, s, MASKED)
        m_new = jnp.maximum(m, s.max(-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - jnp.where(m_new > MASKED, m_new, jnp.inf)[:, None])
        p = jnp.where(ok, p, 0.0)
        vb = v_ref[keys, :]
        return m_new, alpha * l + p.sum(-1), alpha[:, None] * acc + matmul(p.astype(vb.dtype), vb)

    m0 = jnp.full((bq,), MASKED, jnp.float32)
    carry = (m0, jnp.zeros((bq,), jnp.float32), jnp.zeros((bq, o_ref.shape[-1]), jnp.float32))
    _, l, acc = lax.fori_loop(0, count_ref[0], body, carry)
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
