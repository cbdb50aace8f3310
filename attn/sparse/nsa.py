"""Native Sparse Attention (NSA; Yuan et al. 2025, DeepSeek).

Three branches per query, mixed by gates ``g [B,T,N,3]`` (the layer's
sigmoids): ``out = g_cmp o_cmp + g_slc o_slc + g_win o_win``.

* compressed: attention over one compressed key and value per block of
  ``compress_block`` positions taken every ``compress_stride`` positions
  (overlapping when the stride is smaller); the layer compresses each block's
  keys and values (``compression_windows`` gives them; the paper uses an MLP
  with a position encoding inside the block). A query reads a compressed
  block only when it sees every key in it (under ``causal()``: the block has
  ended);
* selected: the query's compressed attention probabilities, summed over the
  heads of a kv head's group (the paper shares one selection per group, so a
  kernel loads each block once for G heads), score the blocks of
  ``select_block`` positions that the compressed blocks overlap; the group
  reads the ``num_selected`` best, with the first ``initial_blocks`` blocks and
  the ``local_blocks`` ending at the query's own always among them;
* window: the last ``window`` positions up to the query's.

Selected blocks that tie go to the earlier block (``jax.lax.top_k``'s order);
their scores are float32 probabilities, so two blocks within float rounding of
each other may be chosen differently by computations of other shapes (a
forward pass and a decode step).

Every branch follows the call's mask and segments (blocks never cross a
segment). The selection has no gradient of its own; what trains it is the
compressed branch, whose probabilities are the scores, and whose keys and
values get gradients through its output. The score modifier, soft-cap and
sink logits shape the token branches (selected and window); the compressed
branch attends with plain scaled logits, as the paper's does.
"""

from __future__ import annotations

from typing import Unpack

import jax
import jax.numpy as jnp

from attn.checks import fail, positive_int
from attn.masks import PADDING, BlockKind, drop_padding
from attn.softmax.call import MASKED, Call, CallArgs, check_call, takes_call_args
from attn.sparse import gather, layout
from attn.sparse import pallas as sparse_pallas
from attn.sparse.gather import DEFAULT_CHUNK, chunks, split, unsplit

SIZES = (
    "compress_block",
    "compress_stride",
    "select_block",
    "num_selected",
    "window",
    "initial_blocks",
    "local_blocks",
)


def compression_slots(c: Call, block: int, stride: int):
    """Where the compressed blocks of each row start: ``(start [B,M], real [B,M])``.

    A compressed block holds ``block`` consecutive positions of one run, from a
    position that is a multiple of ``stride``. Block starting at key ``s`` sits in
    slot ``s // stride`` (``M = ceil(S / stride)``): starts are at least
    ``stride`` apart, so no two blocks share a slot.
    """
    B, S = c.dims.B, c.dims.S
    ids = c.kv_segment_ids if c.kv_segment_ids is not None else jnp.ones((B, S), jnp.int32)
    s = jnp.arange(S, dtype=jnp.int32)
    stops = S - layout.run_starts(ids[:, ::-1])[:, ::-1]  # where each key's run ends
    is_start = (c.kv_positions % stride == 0) & (s + block <= stops) & (ids != PADDING)
    M = -(-S // stride)
    start = jnp.full((B, M), -1, jnp.int32)
    start = start.at[jnp.arange(B)[:, None], s // stride].max(jnp.where(is_start, s, -1))
    return jnp.maximum(start, 0), start >= 0


def compression_windows(
    x,
    *,
    compress_block: int = 32,
    compress_stride: int = 16,
    kv_positions=None,
    kv_segment_ids=None,
):
    """The keys (or values) of every compressed block, for the layer to compress.

    Args:
      x: ``[B,S,K,...]`` keys or values.
      compress_block, compress_stride: as ``nsa_attention``'s.
      kv_positions, kv_segment_ids: the call's (default ``arange(S)``, no segments).

    Returns:
      ``(windows [B,M,compress_block,K,...], real [B,M])``, ``M = ceil(S / compress_stride)``;
      slots without a block hold zeros.
    """
    c = _slots_call(x, kv_positions, kv_segment_ids)
    block, stride = _compression(compress_block, compress_stride)
    start, real = compression_slots(c, block, stride)
    idx = start[..., None] + jnp.arange(block)  # [B,M,l]
    windows = jnp.asarray(x)[jnp.arange(x.shape[0])[:, None, None], jnp.minimum(idx, c.dims.S - 1)]
    mask = real.reshape(real.shape + (1,) * (windows.ndim - 2))
    return jnp.where(mask, windows, jnp.zeros((), windows.dtype)), real


def compressed_at_ends(x, *, compress_block: int = 32, compress_stride: int = 16,
                       kv_positions=None, kv_segment_ids=None):  # fmt: skip
    """Per-token values ``x [B,S,...]`` (a decode cache's compressed key or value of the
    block ending at each token) in ``nsa_attention``'s slot layout ``[B,M,...]``.

    Slot m's block ends at key ``start + compress_block - 1`` (``compression_slots``);
    slots without a block hold zeros.
    """
    c = _slots_call(x, kv_positions, kv_segment_ids)
    block, stride = _compression(compress_block, compress_stride)
    start, real = compression_slots(c, block, stride)
    x = jnp.asarray(x)
    ends = x[jnp.arange(x.shape[0])[:, None], jnp.minimum(start + block - 1, c.dims.S - 1)]
    mask = real.reshape(real.shape + (1,) * (ends.ndim - 2))
    return jnp.where(mask, ends, jnp.zeros((), ends.dtype))


def _slots_call(x, kv_positions, kv_segment_ids) -> Call:
    x = jnp.asarray(x)
    if x.ndim < 3:
        fail("x", "keys or values [B,S,K,...]", x.shape)
    B, S = x.shape[:2]
    q = jnp.zeros((B, 1, 1, 1), jnp.float32)
    kv = jnp.zeros((B, S, 1, 1), jnp.float32)
    seg = None if kv_segment_ids is None else jnp.ones((B, 1), jnp.int32)
    return check_call(
        q,
        kv,
        kv,
        q_positions=jnp.zeros((B, 1), jnp.int32),
        kv_positions=kv_positions,
        q_segment_ids=seg,
        kv_segment_ids=kv_segment_ids,
    )


def _compression(block, stride) -> tuple[int, int]:
    block, stride = positive_int(block, "compress_block"), positive_int(stride, "compress_stride")
    if stride > block:
        fail("compress_stride", f"at most compress_block={block} (blocks cover every key)", stride)
    return block, stride


@takes_call_args
def nsa_attention(
    q,
    k,
    v,
    gates,
    compressed_k,
    compressed_v,
    *,
    compress_block: int = 32,
    compress_stride: int = 16,
    select_block: int = 64,
    num_selected: int = 16,
    window: int = 512,
    initial_blocks: int = 1,
    local_blocks: int = 2,
    chunk: int = DEFAULT_CHUNK,
    impl: str = "gather",
    platform: str | None = None,
    interpret: bool | None = None,
    **call_args: Unpack[CallArgs],
):
    """NSA's three branches, gated (module docstring). Defaults: the paper's sizes.

    Args:
      q: ``[B,T,N,H]``; k: ``[B,S,K,H]``; v: ``[B,S,K,E]``.
      gates: ``[B,T,N,3]``: the compressed, selected and window branches' weights.
      compressed_k: ``[B,M,K,H]``, compressed_v: ``[B,M,K,E]``: one per slot of
        ``compression_windows`` (``M = ceil(S / compress_stride)``); slots without a
        block are never read (whatever they hold, NaN included, reaches nothing).
      compress_block, compress_stride: positions per compressed block, and between their
        starts (``compress_stride <= compress_block``).
      select_block: positions per selected block; num_selected: blocks a kv head's group
        reads per query, the forced ones included; with enough, every visible key is read.
      window: positions of the window branch, the query's own included.
      initial_blocks, local_blocks: selected blocks always read: the first ones of the
        sequence, and those ending at the query's own (0 for none).
      chunk: queries per step.
      impl: ``"gather"`` (XLA) or ``"pallas"``: the selected branch as the block-sparse
        kernel of ``attn.sparse.pallas`` (default positions, no segments, modifiers or
        sinks), the other branches in XLA.
      platform, interpret: the Pallas kernel's (on a CPU it runs only with
        ``interpret=True``).
      **call_args: the call's (``attn.softmax.call.CallArgs``); no bias or mask array.

    Returns:
      ``out [B,T,N,E]`` in q's dtype.
    """
    c = check_call(q, k, v, **call_args)
    c.refuse_pairs("nsa_attention")
    sparse_pallas.check_impl(c, impl, platform, interpret, False, "nsa_attention")
    layout.check_runs(c)
    B, T, S, N, K, _, H, E = c.dims
    block, stride = _compression(compress_block, compress_stride)
    M = -(-S // stride)
    for name, x, shape in (
        ("gates", gates, (B, T, N, 3)),
        ("compressed_k", compressed_k, (B, M, K, H)),
        ("compressed_v", compressed_v, (B, M, K, E)),
    ):
        if getattr(x, "shape", None) != shape:
            fail(name, f"shape {shape}", getattr(x, "shape", type(x).__name__))
    sizes = dict(
        compress_block=block,
        compress_stride=stride,
        select_block=positive_int(select_block, "select_block"),
        num_selected=positive_int(num_selected, "num_selected"),
        window=positive_int(window, "window"),
        chunk=positive_int(chunk, "chunk"),
    )
    for name, x in (("initial_blocks", initial_blocks), ("local_blocks", local_blocks)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            fail(name, "an int >= 0", repr(x))
    return _nsa(
        c,
        q,
        k,
        v,
        gates,
        compressed_k,
        compressed_v,
        initial_blocks=initial_blocks,
        local_blocks=local_blocks,
        impl=impl,
        platform=platform,
        interpret=interpret,
        **sizes,
    )


@gather.jit_static(*SIZES, "chunk", "impl", "platform", "interpret")
def _nsa(c, q, k, v, gates, ck, cv, *, impl, platform, interpret, **sizes):
    chunk, block = sizes["chunk"], sizes["select_block"]
    o_cmp, start, stop = compressed_branch(c, q, ck, cv, **sizes)
    if impl == "pallas":
        ids = sparse_pallas.block_ids(start, stop, block)
        o_slc = sparse_pallas.block_sparse_attention(
            c, q, k, v, ids, block=block, platform=platform, interpret=interpret
        )
    else:
        o_slc, _ = gather.gathered_attention(c, q, k, v, start, stop, block=block, chunk=chunk)
    w_start, w_stop = window_ranges(c, sizes["window"])
    o_win, _ = gather.gathered_attention(
        c, q, k, v, w_start, w_stop, block=sizes["window"], chunk=chunk
    )
    g = drop_padding(gates, c.q_segment_ids).astype(jnp.float32)  # a padding query outputs 0
    out = sum(g[..., i, None] * o.astype(jnp.float32) for i, o in enumerate((o_cmp, o_slc, o_win)))
    return out.astype(q.dtype)


def window_ranges(c: Call, window: int):
    """``(start, stop)`` ``[B,T,1,1]``: the keys of positions ``(p - window, p]`` of each
    query's run."""
    runs = layout.locate(c)
    p = c.q_positions
    start = jnp.clip(runs.origin + p - window + 1, runs.lo, runs.hi)
    stop = jnp.clip(runs.origin + p + 1, start, runs.hi)
    return start[..., None, None], stop[..., None, None]


def compressed_branch(
    c: Call,
    q,
    ck,
    cv,
    *,
    compress_block,
    compress_stride,
    select_block,
    num_selected,
    initial_blocks,
    local_blocks,
    chunk,
    **_,
):
    """The compressed branch's output ``[B,T,N,E]`` and the blocks each kv head's group
    selects from its probabilities: ``(start, stop)`` ``[B,T,K,n]``."""
    B, T, S, N, K, G, H, E = c.dims
    q = c.isolate(q, q[:, :1], q[:, :1])[0]
    slot, real = compression_slots(c, compress_block, compress_stride)
    # Slots without a block hold whatever the caller's buffer held: zeroed before any
    # product, so a NaN there reaches no output or gradient (0 * NaN is NaN).
    ck, cv = (jnp.where(real[:, :, None, None], x, jnp.zeros((), x.dtype)) for x in (ck, cv))
    b = jnp.arange(B)[:, None]
    first = jnp.where(real, c.kv_positions[b, slot], 0)  # [B,M] the blocks' first positions
    last = first + compress_block - 1
    seg = None if c.kv_segment_ids is None else c.kv_segment_ids[b, slot]
    runs = layout.locate(c)
    C, _ = chunks(T, chunk)
    J = layout.max_blocks(S, select_block)
    n = min(num_selected, J)
    spans = (last // select_block - first // select_block) + 1  # selected blocks a block overlaps

    @jax.checkpoint
    def one(xs):
        qc, pos, q_seg, *rc = xs
        runs_c = layout.Runs(*rc)
        p = pos[:, :, None]
        ok = real[:, None] & (
            c.mask.classify(p, p, first[:, None], last[:, None]) == int(BlockKind.FULL)
        )
        if seg is not None:
            ok &= seg[:, None] == q_seg[:, :, None]
        ok = ok[:, None, None]  # [B,1,1,C,M]
        s = (
            jnp.einsum(
                "BCKGH,BMKH->BKGCM",
                qc.reshape(B, -1, K, G, H),
                ck,
                preferred_element_type=jnp.float32,
            )
            * c.scale
        )
        s = jnp.where(ok, s, MASKED)
        m = jax.lax.stop_gradient(s.max(-1, keepdims=True))
        e = jnp.where(ok, jnp.exp(s - m), 0.0)
        den = e.sum(-1, keepdims=True)
        w = e / jnp.where(den > 0, den, 1.0)
        out = jnp.einsum("BKGCM,BMKE->BCKGE", w, cv.astype(jnp.float32))
        blk = layout.blocks(c.mask, runs_c, pos, select_block, S)
        score = _block_scores(
            jax.lax.stop_gradient(w).sum(2), first, spans, runs_c, compress_block, select_block, J
        )
        j = jnp.arange(J)
        own = layout.own_block(runs_c, pos, select_block)[..., None]
        forced = (j < initial_blocks) | ((j <= own) & (j > own - local_blocks))
        nonempty = blk.kind != int(BlockKind.EMPTY)
        forced, nonempty = (forced & nonempty)[:, :, None], nonempty[:, :, None]  # [B,C,1,J]
        score = jnp.where(forced, jnp.inf, jnp.where(nonempty, score, -jnp.inf))
        top, pick = jax.lax.top_k(score, n)  # [B,C,K,n]
        lo = jnp.take_along_axis(blk.start[:, :, None], pick, axis=-1)
        hi = jnp.take_along_axis(blk.stop[:, :, None], pick, axis=-1)
        return out.reshape(B, -1, N, E), lo, jnp.where(top > -jnp.inf, hi, lo)

    q_seg = None if c.q_segment_ids is None else split(c.q_segment_ids, C, PADDING)
    xs = (split(q, C), split(c.q_positions, C), q_seg, *(split(x, C) for x in runs))
    out, start, stop = jax.lax.map(one, xs)
    return unsplit(out, T).astype(q.dtype), unsplit(start, T), unsplit(stop, T)


def _block_scores(p, first, spans, runs, compress_block: int, select_block: int, J: int):
    """``[B,C,K,J]``: the compressed probabilities ``p [B,K,C,M]`` summed into the selected
    blocks each compressed block overlaps (j counted from the query's run's first block)."""
    B, K, C, _ = p.shape
    j0 = first[:, None] // select_block - (runs.first // select_block)[..., None]  # [B,C,M]
    p = jnp.moveaxis(p, 1, 2)  # [B,C,K,M]
    b = jnp.arange(B)[:, None, None, None]
    t = jnp.arange(C)[None, :, None, None]
    h = jnp.arange(K)[None, None, :, None]
    out = jnp.zeros((B, C, K, J + 1), jnp.float32)  # entry J collects what lies outside
    for o in range((compress_block - 1) // select_block + 2):  # the most blocks one overlaps
        j = j0 + o
        inside = (o < spans[:, None]) & (j >= 0) & (j < J)
        out = out.at[b, t, h, jnp.where(inside, j, J)[:, :, None]].add(p)
    return out[..., :J]
