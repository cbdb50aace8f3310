"""Decode attention: a few queries per row over a cache of rows with their own lengths.

One decode step attends one query (or a few: speculative or chunked decoding)
of each row over that row's cached keys. The cache is ``[B,S,K,H]`` with row b
holding ``lengths[b]`` valid keys in slots ``0..lengths[b]-1``; the rest is
whatever a longer row needs the room for. Done as ordinary attention, the
step is one matrix-vector product per row over all S keys, which keeps a
single core (or a single accelerator block) busy however many there are.

Split-K (flash-decoding; Dao et al., "Flash-Decoding for long-context
inference", 2023) cuts the keys into ``num_splits`` chunks, computes each
chunk's attention and log-sum-exp independently (they are separate rows of
one batched computation, so XLA can hand them to different cores) and merges
the partials with ``attn.merge.merge_partials``: softmax over a union of
disjoint key sets is the lse-weighted mix of the softmax over each.

Every part of the call contract (``attn.softmax.call``) carries over: masks on
absolute positions, GQA without repeating K/V, learned sink logits (merged as
one more partial: a logit with no value), the soft-cap and score modifiers
(whose per-key arrays are cut like the keys).
"""

from __future__ import annotations

import functools
from typing import Unpack

import jax
import jax.numpy as jnp

from attn import checks, scores
from attn.checks import fail
from attn.merge import merge_partials
from attn.pallas import flash
from attn.softmax import dense
from attn.softmax.call import Call, CallArgs, check_call, takes_call_args

__all__ = ["decode_attention", "default_splits"]

# Keys per split below which splitting only adds merge work (the auto choice).
MIN_SPLIT_KEYS = 1024
MAX_SPLITS = 16
# What computes each split: the vocabulary of attn.attention's impl.
IMPLS = ("dense", "pallas")


def default_splits(S: int) -> int:
    """The split count ``num_splits=None`` chooses for S cached keys: one per
    ``MIN_SPLIT_KEYS`` keys, at most ``MAX_SPLITS``."""
    return int(min(max(S // MIN_SPLIT_KEYS, 1), MAX_SPLITS))


@takes_call_args
def decode_attention(
    q,
    k,
    v,
    *,
    lengths,
    num_splits: int | None = None,
    kv_valid=None,
    return_lse: bool = False,
    impl: str = "dense",
    platform: str | None = None,
    interpret: bool | None = None,
    **call_args: Unpack[CallArgs],
):
    """Attention of T query tokens per row over the ``lengths[b]`` valid keys of a cache.

    Equal to ``dot_product_attention`` over each row's valid keys (the ones in
    slots ``< lengths[b]``), with the keys cut into ``num_splits`` chunks
    computed independently and merged by their log-sum-exps.

    Args:
      q: ``[B,T,N,H]`` queries (T small: 1 for a decode step).
      k: ``[B,S,K,H]`` cached keys, ``N % K == 0``.
      v: ``[B,S,K,E]`` cached values.
      lengths: ``[B]`` ints in ``[0, S]``: valid slots per row (checked when concrete).
      num_splits: chunks of keys, a positive int (need not divide S); None:
        ``default_splits(S)``.
      kv_valid: ``[B,S]`` bools, or None: which slots below ``lengths`` hold a
        key (a paged cache's freed pages do not).
      return_lse: also return the float32 log-sum-exp ``[B,T,N]``.
      impl: what computes each split: ``"dense"`` (``dot_product_attention``) or
        ``"pallas"`` (``attn.pallas.flash_attention``: its grid runs over the
        splits as batch rows; on a CPU only with ``interpret=True``).
      platform: with ``"pallas"``, the platform its kernel is lowered for (as
        ``flash_attention``'s: ``jax.export`` for an accelerator from a CPU).
      **call_args: the call (``attn.softmax.call.CallArgs``), as in
        ``dot_product_attention``, without segment ids (``lengths`` and
        ``kv_valid`` say which slots hold keys). ``q_positions`` default to the
        last T valid positions of each row, ``lengths[b] - T + t``;
        ``kv_positions`` (a ring buffer's slots hold other positions) to ``arange(S)``.

    Returns:
      ``out [B,T,N,E]`` in q's dtype (zeros for a row that sees no key), and
      the lse if asked.
    """
    q, k, v = checks.as_arrays(q, k, v)
    d = checks.qkv_dims(q, k, v)
    if impl not in IMPLS:
        fail("impl", f"one of {IMPLS}", repr(impl))
    if interpret is not None and impl != "pallas":
        fail("interpret", f"None for impl={impl!r} (a setting of impl='pallas')", repr(interpret))
    for name in ("q_segment_ids", "kv_segment_ids", "query_seq_lengths", "key_value_seq_lengths"):
        if call_args.get(name) is not None:
            fail(name, "None for decode_attention (lengths and kv_valid say which slots hold keys)",
                 "an array")  # fmt: skip
    lengths = _check_lengths(lengths, d.B, d.S)
    P = default_splits(d.S) if num_splits is None else checks.positive_int(num_splits, "num_splits")
    P = min(P, d.S)
    q_positions = call_args.get("q_positions")
    if q_positions is None:
        q_positions = lengths[:, None] - d.T + jnp.arange(d.T, dtype=jnp.int32)
    kv_positions = checks.positions(call_args.get("kv_positions"), "kv_positions", d.B, d.S)
    call = check_call(q, k, v, **{**call_args, "q_positions": q_positions,
                                  "kv_positions": kv_positions})  # fmt: skip
    call.refuse_pairs("decode_attention")
    valid = jnp.arange(d.S)[None, :] < lengths[:, None]
    if kv_valid is not None:
        kv_valid = jnp.asarray(kv_valid)
        if kv_valid.shape != (d.B, d.S) or kv_valid.dtype != jnp.bool_:
            fail("kv_valid", f"bools of shape ({d.B}, {d.S})", f"{kv_valid.dtype} {kv_valid.shape}")
        valid &= kv_valid
    return _decode(call, q, k, v, valid, splits=P, return_lse=bool(return_lse), impl=impl,
                   platform=platform, interpret=interpret)  # fmt: skip


def _check_lengths(lengths, B: int, S: int):
    value = checks.concrete(lengths)  # as given: an int64 length must not wrap into range
    lengths = jnp.asarray(lengths)
    if lengths.shape != (B,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        fail("lengths", f"integer lengths of shape ({B},)", f"{lengths.dtype} {lengths.shape}")
    if value is not None and (value.min() < 0 or value.max() > S):
        fail("lengths", f"lengths in [0, {S}] (the cache's slots)", f"{value.min()}..{value.max()}")
    return lengths.astype(jnp.int32)


@functools.partial(
    jax.jit, static_argnames=("splits", "return_lse", "impl", "platform", "interpret")
)
def _decode(call: Call, q, k, v, valid, *, splits, return_lse, impl, platform, interpret):
    B, T, N, _ = q.shape
    S = k.shape[1]
    C = -(-S // splits)  # keys per split; the last split is padded with invalid slots
    valid = valid.astype(jnp.int32)  # [B,S]: segment 1, or 0 (padding: no key)

    def cut(x):  # [B,S,...] -> [P*B, C, ...], split-major
        x = jnp.pad(x, [(0, 0), (0, splits * C - S)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, splits, C, *x.shape[2:])
        return jnp.swapaxes(x, 0, 1).reshape(splits * B, C, *x.shape[3:])

    def tile(x):  # [B,...] -> [P*B, ...]: the queries' side, the same in every split
        return jnp.broadcast_to(x[None], (splits, *x.shape)).reshape(splits * B, *x.shape[1:])

    structure, leaves = scores.split(call.score)
    score_mod = None
    if structure is not None:
        by_role = {"head": lambda x: x, "q": tile, "k": cut}
        leaves = [by_role[role](x) for role, x in zip(structure.roles, leaves, strict=True)]
        score_mod = structure.rebuild(leaves)
    parts = check_call(
        tile(q), cut(k), cut(v),
        mask=call.mask, scale=call.scale, score_mod=score_mod,
        q_positions=tile(call.q_positions), kv_positions=cut(call.kv_positions),
        q_segment_ids=jnp.ones((splits * B, T), jnp.int32), kv_segment_ids=cut(valid),
    )  # fmt: skip
    if impl == "pallas":
        out, lse = flash.attend(
            parts, tile(q), cut(k), cut(v), return_lse=True, platform=platform, interpret=interpret
        )
    else:
        out, lse = dense.attend(parts, tile(q), cut(k), cut(v), return_lse=True)
    outs = out.reshape(splits, B, T, N, -1)
    lses = lse.reshape(splits, B, T, N)
    if call.sink_logits is not None:  # one more partial: the sink's logit, no value
        outs = jnp.concatenate([outs, jnp.zeros_like(outs[:1])])
        sink_lse = jnp.broadcast_to(call.sink_logits.reshape(N), (1, B, T, N))
        lses = jnp.concatenate([lses, sink_lse])
    out, lse = merge_partials(outs, lses)
    return (out, lse) if return_lse else out
