"""The call contract of softmax attention, shared by every implementation.

Dense, blockwise, ring, Pallas and splash attention take the same arguments
and compute the same function because they check them here and read them
through the same rules:

* ``check_call``: shapes, the static arguments, default positions (keys
  ``arange(S)``, queries the last T of them: ``check_default_queries``), the
  learned sink logits and the segment ids, into a ``Call``;
* ``visible``: which keys a query sees (the mask on absolute positions, within
  segments; id 0 is padding, see ``attn.masks.same_segment``);
* ``score``: the call's score modifier (``attn.scores``), with ``softcap=``
  folded in as ``scores.softcap`` applied first; ``shape_logits`` / ``softcap``
  / ``softcap_grad``: the logit scale and the tanh soft-cap, and its
  derivative, for kernels that handle the soft-cap alone;
* ``CallSpec``: the hashable, static part of a call that kernels are traced
  with (implementations extend it with their block sizes);
* ``static_rows``: the positions and segment ids as NumPy arrays when they are
  known at trace time (a block schedule can then be computed when tracing),
  or None when any of them is traced (it is computed at run time).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attn import errors, scores
from attn.errors import fail
from attn.masks import Full, Mask, full, same_segment

__all__ = [
    "MASKED",
    "Call",
    "CallSpec",
    "apply_score",
    "check_call",
    "check_default_queries",
    "check_static",
    "dims_or_none",
    "modified",
    "shape_logits",
    "softcap",
    "softcap_grad",
    "spec_fields",
    "static_rows",
    "visible",
]

# Masked logits are set to a large finite negative number rather than -inf, so
# no `-inf - -inf` ever reaches exp() and gradients stay finite.
MASKED = -1e30


class Call(NamedTuple):
    """A checked softmax-attention call: sizes and normalized optional arguments."""

    dims: errors.Dims
    mask: Mask
    scale: float
    softcap: float | None
    score: scores.ScoreMod | None  # softcap= first, then score_mod=
    sink_logits: jax.Array | None  # [K, G] float32
    q_positions: jax.Array  # [B, T] int32
    kv_positions: jax.Array  # [B, S] int32
    q_segment_ids: jax.Array | None  # [B, T] int32
    kv_segment_ids: jax.Array | None  # [B, S] int32
    given: tuple  # q_positions, kv_positions, q_segment_ids, kv_segment_ids as passed


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """The static part of a checked call: what a kernel is traced with (hashable).

    Implementations subclass it with their own static settings (block sizes,
    launch parameters), so a new spec means a new trace.
    """

    mask: Mask
    scale: float
    softcap: float | None
    score: scores.Structure | None  # the static part of Call.score
    has_sink: bool
    has_segments: bool
    B: int
    T: int
    S: int
    K: int
    G: int


def spec_fields(call: Call) -> dict[str, Any]:
    """The ``CallSpec`` fields of a checked call, to build a ``CallSpec`` subclass from."""
    d = call.dims
    return dict(
        mask=call.mask,
        scale=call.scale,
        softcap=call.softcap,
        score=scores.split(call.score)[0],
        has_sink=call.sink_logits is not None,
        has_segments=call.q_segment_ids is not None,
        B=d.B,
        T=d.T,
        S=d.S,
        K=d.K,
        G=d.G,
    )


def check_static(mask, scale, softcap) -> tuple[Mask, float | None, float | None]:
    """Validates the static (hashable, compile-time) arguments; None mask becomes ``full()``."""
    if mask is None:
        mask = full()
    elif not isinstance(mask, Mask):
        fail("mask", "an attn.masks.Mask (e.g. masks.causal()) or None", type(mask).__name__)
    if scale is not None and (not isinstance(scale, numbers.Real) or scale <= 0):
        fail("scale", "a positive float or None", repr(scale))
    if softcap is not None and (not isinstance(softcap, numbers.Real) or softcap <= 0):
        fail("softcap", "a positive float or None", repr(softcap))
    return (
        mask,
        None if scale is None else float(scale),
        None if softcap is None else float(softcap),
    )


def check_default_queries(T: int, S: int, mask: Mask, kv_positions_given: bool) -> None:
    """The rule for default query positions, the last T of the S key positions.

    It needs T <= S, and it means nothing against keys placed by explicit
    ``kv_positions``; either is a ``ValueError`` asking for ``q_positions``
    unless the mask ignores positions (``full()``) or T == S.
    """
    if T == S or isinstance(mask, Full):
        return
    if T > S:
        fail(
            "q_positions",
            f"explicit positions for T={T} queries over S={S} keys (T > S) with mask "
            f"{mask!r}: by default the queries are the last T key positions",
            None,
        )
    if kv_positions_given:
        fail(
            "q_positions",
            f"explicit positions with kv_positions and T={T} != S={S} under mask "
            f"{mask!r} (the default, the last T key indices, ignores kv_positions)",
            None,
        )


def check_call(
    q,
    k,
    v,
    *,
    mask=None,
    scale=None,
    softcap=None,
    score_mod=None,
    sink_logits=None,
    q_positions=None,
    kv_positions=None,
    q_segment_ids=None,
    kv_segment_ids=None,
) -> Call:
    """Validates the arguments every softmax implementation shares."""
    d = errors.qkv_dims(q, k, v)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        fail("q_segment_ids/kv_segment_ids", "both or neither", "only one of them")
    mask, scale, softcap = check_static(mask, scale, softcap)
    if q_positions is None:
        check_default_queries(d.T, d.S, mask, kv_positions is not None)
    scale = d.H**-0.5 if scale is None else scale
    if sink_logits is not None:
        sink_logits = jnp.asarray(sink_logits)
        if sink_logits.shape != (d.N,):
            fail("sink_logits", f"shape ({d.N},), one logit per query head", sink_logits.shape)
        sink_logits = sink_logits.astype(jnp.float32).reshape(d.K, d.G)
    score_mod = scores.check_score_mod(score_mod, d)
    return Call(
        dims=d,
        mask=mask,
        scale=scale,
        softcap=softcap,
        score=scores.compose(None if softcap is None else scores.softcap(softcap), score_mod),
        sink_logits=sink_logits,
        q_positions=errors.positions(q_positions, "q_positions", d.B, d.T, offset=d.S - d.T),
        kv_positions=errors.positions(kv_positions, "kv_positions", d.B, d.S),
        q_segment_ids=errors.segment_ids(q_segment_ids, "q_segment_ids", d.B, d.T),
        kv_segment_ids=errors.segment_ids(kv_segment_ids, "kv_segment_ids", d.B, d.S),
        given=(q_positions, kv_positions, q_segment_ids, kv_segment_ids),
    )


def dims_or_none(q, k, v) -> errors.Dims | None:
    """The sizes of a well-formed call, or None (the implementation it goes to then reports it)."""
    try:
        return errors.qkv_dims(q, k, v)
    except ValueError:
        return None


def static_rows(call: Call) -> list[np.ndarray] | None:
    """The call's positions (and segment ids) in NumPy, or None when any is traced.

    Returns ``[q positions [B,T], kv positions [B,S]]`` int64, followed by the
    q and kv segment ids with segment ids, from the arguments as passed (the
    defaults where None): known when tracing, they let a block schedule be
    computed then.
    """
    if any(isinstance(x, jax.core.Tracer) for x in call.given):
        return None
    d = call.dims
    lengths, offsets = (d.T, d.S, d.T, d.S), (d.S - d.T, 0, 0, 0)  # default queries: the last T
    count = 4 if call.q_segment_ids is not None else 2
    rows = []
    for x, length, offset in zip(call.given[:count], lengths, offsets, strict=False):
        x = errors.default_positions(length, offset) if x is None else np.asarray(x)
        rows.append(np.broadcast_to(x, (d.B, length)).astype(np.int64))
    return rows


def visible(mask: Mask, q_pos, k_pos, q_seg=None, k_seg=None):
    """Boolean ``[..., T, S]``: the mask on positions, within segments when ids are given.

    Args:
      q_pos: ``[..., T]`` positions; k_pos: ``[..., S]``; q_seg, k_seg: ids of the
        same shapes, or None.
    """
    ok = mask.allowed(q_pos, k_pos)
    if q_seg is not None:
        ok &= same_segment(q_seg, k_seg)
    return ok


def softcap(s, cap: float | None):
    """The tanh soft-cap (Gemma 2) ``cap * tanh(s / cap)`` on float32 logits; s without a cap."""
    return s if cap is None else cap * jnp.tanh(s / cap)


def softcap_grad(x, cap: float | None):
    """``d softcap(s) / d s`` from the capped logits x: ``1 - (x / cap)^2``; None without a cap."""
    if cap is None:
        return None
    t = x / cap
    return 1.0 - t * t


def modified(call: Call, s, q_pos, k_pos, view):
    """``s`` through the call's modifier, its leaves laid out by ``view(role, leaf)``.

    Args:
      s: float32 scaled logits; q_pos, k_pos: int32 positions broadcastable to it.
      view: maps a leaf and its role (``attn.scores.ROLES``) to an array that
        broadcasts against ``s`` (a head leaf keeping its trailing axes).
    """
    return apply_score(scores.split(call.score), s, q_pos, k_pos, view)


def apply_score(parts, s, q_pos, k_pos, view):
    """``modified`` from a modifier's ``(structure, leaves)``; ``s`` as it is without one."""
    structure, leaves = parts
    if structure is None:
        return s
    mod = structure.rebuild([view(r, x) for r, x in zip(structure.roles, leaves, strict=True)])
    return mod.apply(s, q_pos, k_pos)


def shape_logits(s, scale: float, cap: float | None):
    """Scales float32 logits and applies the soft-cap when given."""
    return softcap(s * scale, cap)
