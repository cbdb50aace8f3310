"""The call contract of softmax attention: one checked call object that every implementation takes.

Dense, blockwise, ring, Pallas, splash and split-K decoding take the same
arguments and compute the same function because the arguments are declared
once here and checked once, into a ``Call``, which is all an implementation
below its entry point receives:

* ``CallArgs``: the keyword arguments every softmax entry point takes (mask,
  scale, soft-cap, score modifier, sink logits, positions, segment ids),
  declared once; an entry point takes them as ``**call_args`` and
  ``takes_call_args`` shows them in its signature;
* ``check_call``: shapes, the static arguments, default positions (keys
  ``arange(S)``, queries the last T of them: ``check_default_queries``), the
  learned sink logits, the score modifier and the segment ids, into a
  ``Call`` (a pytree: its arrays are leaves, its sizes and static settings
  aux data, so it crosses ``jit`` boundaries as one argument);
* ``visible``: which keys a query sees (the mask on absolute positions, within
  segments; id 0 is padding, see ``attn.masks.same_segment``);
* ``CallSpec``: the hashable, static part of a call that kernels are traced
  with; an implementation's own configuration holds one beside its block
  sizes (composition, not inheritance).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, TypedDict, Unpack

import jax
import jax.numpy as jnp
import numpy as np

from attn import checks, scores
from attn.checks import fail
from attn.masks import Full, Mask, drop_padding, full, same_segment
from attn.softmax.jax_nn import translate
from attn.softmax.pairs import check_pair

__all__ = [
    "CALL_ARGS",
    "MASKED",
    "Call",
    "CallArgs",
    "CallSpec",
    "check_call",
    "check_default_queries",
    "check_static",
    "takes_call_args",
    "visible",
]

# Masked logits are set to a large finite negative number rather than -inf, so
# no `-inf - -inf` ever reaches exp() and gradients stay finite.
MASKED = -1e30


class CallArgs(TypedDict, total=False):
    """The keyword arguments of every softmax implementation (``**call_args``), all optional.

    Attributes:
      mask: an ``attn.masks.Mask`` on absolute positions, or (as ``jax.nn`` takes it)
        a boolean array broadcastable to ``[B,N,T,S]`` (rank <= 4, leading axes
        added), True where the query sees the key, read per tile by the
        blockwise and Pallas kernels (a block it hides entirely is skipped);
        None is bidirectional.
      scale: logit scale, a finite float > 0, default ``1/sqrt(H)``.
      softcap: if given (finite, > 0), logits become ``softcap * tanh(logits / softcap)``
        (shorthand for ``scores.softcap``, applied before ``score_mod``).
      score_mod: an ``attn.scores`` modifier (ALiBi, T5 buckets, FoX, ...) of
        the scaled logits, evaluated on the absolute positions; gradients
        reach its arrays.
      sink_logits: ``[N]`` learned per-head logits that join the softmax
        denominator without contributing a value (gpt-oss style).
      q_positions: ``[T]`` or ``[B,T]`` ints. Default ``arange(T) + S - T``: the
        queries are the last T of the keys (bottom-right alignment, so a decode
        step or a prefill chunk is right without positions). With T > S, or
        with ``kv_positions`` and T != S, a mask other than ``full()`` needs them.
      kv_positions: ``[S]`` or ``[B,S]`` ints, default ``arange(S)``. Positions
        lie in ``[-2**30, 2**30)`` (``checks.MAX_POSITION``), so their
        differences fit int32: a ``ValueError`` where they are concrete; under
        a trace they are not checked, and values outside wrap.
      q_segment_ids: ``[B,T]`` ints in ``[0, 2**31)``, with ``kv_segment_ids``
        (both or neither): queries see only keys with the same id (packing),
        and id 0 is padding: it sees no key, is seen by no query and outputs
        0. Padding may hold anything, NaN and Inf included: it reaches no
        other token (``Call.isolate``). Ids are checked where concrete (an
        int64 id beyond int32 is refused, never wrapped into padding).
      kv_segment_ids: ``[B,S]`` ints, as ``q_segment_ids``.
      bias: additive logits broadcastable to ``[B,N,T,S]`` (rank <= 4), added after
        the score modifier; it gets gradients. Read per tile, never broadcast
        in memory.
      is_causal: ``jax.nn``'s: ``masks.causal()`` joined to the mask, with the
        queries at the top-left corner (``q_positions`` default ``arange(T)``).
      local_window_size: ``jax.nn``'s ``w`` or ``(left, right)``: ``masks.band(left, right)``
        joined to the mask, top-left aligned like ``is_causal``.
      query_seq_lengths: ``[B]`` ints: queries at or past a row's length are
        padding (segment id 0, output 0, as in ``jax.nn``).
      key_value_seq_lengths: ``[B]`` ints: keys at or past a row's length are
        padding, seen by no query.
    """

    mask: Mask | None
    scale: float | None
    softcap: float | None
    score_mod: scores.ScoreMod | None
    sink_logits: Any
    q_positions: Any
    kv_positions: Any
    q_segment_ids: Any
    kv_segment_ids: Any
    bias: Any
    is_causal: bool
    local_window_size: Any
    query_seq_lengths: Any
    key_value_seq_lengths: Any


CALL_ARGS = tuple(CallArgs.__annotations__)
_DEFAULTS = {"is_causal": False}


def takes_call_args(fn):
    """Shows an entry point's ``**call_args`` as the keywords of ``CallArgs`` in its signature.

    ``inspect.signature`` and ``help()`` then list them (static checkers read
    the ``Unpack[CallArgs]`` annotation).
    """
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    params += [
        inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=_DEFAULTS.get(n))
        for n in CALL_ARGS
        if n not in sig.parameters  # jax.nn's positional bias and mask are named already
    ]
    fn.__signature__ = sig.replace(parameters=params)
    return fn


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """The static part of a checked call: what a kernel is traced with (hashable)."""

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
    bias_shape: tuple | None = None  # the bias's rank-4 shape (1 on broadcast axes), or None
    keep_shape: tuple | None = None  # the boolean mask array's, or None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Call:
    """A checked softmax-attention call: sizes, static settings and normalized arrays.

    A pytree whose leaves are the arrays (and the score modifier's), so an
    implementation jitted at its boundary takes it as one argument. Default
    positions are built where they are read (``q_positions``,
    ``kv_positions``): inside such a jit they are constants of the program.
    """

    dims: checks.Dims = dataclasses.field(metadata=dict(static=True))
    mask: Mask = dataclasses.field(metadata=dict(static=True))
    scale: float = dataclasses.field(metadata=dict(static=True))
    softcap: float | None = dataclasses.field(metadata=dict(static=True))
    score_mod: scores.ScoreMod | None  # as given (checked)
    sink_logits: jax.Array | None  # [K, G] float32
    q_segment_ids: jax.Array | None  # [B, T] int32
    kv_segment_ids: jax.Array | None  # [B, S] int32
    bias: jax.Array | None  # [B|1, N|1, T|1, S|1] as given
    keep: jax.Array | None  # [B|1, N|1, T|1, S|1] bool
    positions: tuple  # q [B, T] and kv [B, S] int32 positions, each None where defaulted
    given: tuple  # q_positions, kv_positions, q_segment_ids, kv_segment_ids as passed

    @property
    def score(self) -> scores.ScoreMod | None:
        """What the logits go through: the soft-cap first, then ``score_mod`` (None if
        neither)."""
        cap = None if self.softcap is None else scores.Softcap(self.softcap)
        return scores.compose(cap, self.score_mod)

    @property
    def q_positions(self) -> jax.Array:
        """``[B,T]`` int32: as given, or the default, the last T key positions."""
        d = self.dims
        given = self.positions[0]
        return checks.positions(None, "", d.B, d.T, offset=d.S - d.T) if given is None else given

    @property
    def kv_positions(self) -> jax.Array:
        """``[B,S]`` int32: as given, or the default ``arange(S)``."""
        d = self.dims
        given = self.positions[1]
        return checks.positions(None, "", d.B, d.S) if given is None else given

    def isolate(self, q, k, v):
        """``q``, ``k``, ``v`` with every padding token's entries (segment id 0) set to 0.

        Every implementation calls it where the operands enter, so NaN or Inf
        held by padding (a recycled page, a stale request, a cache's unused
        tail) reaches no real token, forward or backward
        (``attn.masks.drop_padding``); without segment ids nothing is padding.

        What is not isolated: a NaN in a real key that a query cannot see but
        other queries of its row can (a future token under the causal mask,
        another packed document) reaches that query through ``P @ V``, as in
        every matmul-based attention (``jax.nn``'s and FlashAttention's packed
        forms included); hiding it would take a select per query and key pair.
        Key blocks that block skipping never visits stay isolated for free.
        """
        q_seg, kv_seg = self.q_segment_ids, self.kv_segment_ids
        return drop_padding(q, q_seg), drop_padding(k, kv_seg), drop_padding(v, kv_seg)

    def refuse_pairs(self, where: str) -> None:
        """A ``ValueError`` where an implementation that cannot read a bias or a boolean mask
        array (``attn.softmax.pairs``) is given one: never a silent wrong answer."""
        for name, x in (("bias", self.bias), ("mask", self.keep)):
            if x is not None:
                takers = "dense, blockwise, pallas and jax.nn's implementations of attn.attention"
                fail(name, f"no {name} array for {where} ({takers} take one)", f"shape {x.shape}")

    def spec(self) -> CallSpec:
        """The static part (``CallSpec``)."""
        d = self.dims
        return CallSpec(
            mask=self.mask,
            scale=self.scale,
            softcap=self.softcap,
            score=scores.split(self.score)[0],
            has_sink=self.sink_logits is not None,
            has_segments=self.q_segment_ids is not None,
            bias_shape=None if self.bias is None else tuple(self.bias.shape),
            keep_shape=None if self.keep is None else tuple(self.keep.shape),
            B=d.B,
            T=d.T,
            S=d.S,
            K=d.K,
            G=d.G,
        )

    def rows(self) -> list[jax.Array]:
        """The int32 q positions ``[B,T]`` and kv positions ``[B,S]``, then the q and kv
        segment ids when given: what a block schedule is computed from."""
        rows = [self.q_positions, self.kv_positions]
        if self.q_segment_ids is not None:
            rows += [self.q_segment_ids, self.kv_segment_ids]
        return rows

    def static_rows(self) -> list[np.ndarray] | None:
        """``rows()`` in NumPy (int64) when known at trace time, else None.

        Read from the arguments as passed (the defaults where None): known when
        tracing, they let a block schedule be computed then.
        """
        if any(isinstance(x, jax.core.Tracer) for x in self.given):
            return None
        d = self.dims
        lengths, offsets = (d.T, d.S, d.T, d.S), (d.S - d.T, 0, 0, 0)  # default queries: the last T
        count = 4 if self.q_segment_ids is not None else 2
        rows = []
        for x, length, offset in zip(self.given[:count], lengths, offsets, strict=False):
            x = checks.default_positions(length, offset) if x is None else np.asarray(x)
            rows.append(np.broadcast_to(x, (d.B, length)).astype(np.int64))
        return rows


def check_static(mask, scale, softcap) -> tuple[Mask, float | None, float | None]:
    """Validates the static (hashable, compile-time) arguments; None mask becomes ``full()``."""
    if mask is None:
        mask = full()
    elif not isinstance(mask, Mask):
        fail("mask", "an attn.masks.Mask (e.g. masks.causal()) or None", type(mask).__name__)
    expected = "a positive finite float or None"
    return (
        mask,
        None if scale is None else checks.positive_float(scale, "scale", expected),
        None if softcap is None else checks.positive_float(softcap, "softcap", expected),
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


def check_call(q, k, v, **call_args: Unpack[CallArgs]) -> Call:
    """The arguments every softmax implementation shares (``CallArgs``), checked: a ``Call``.

    Raises:
      TypeError: a keyword that is not one of ``CALL_ARGS`` (as Python does for an unknown
        argument).
      ValueError: naming the argument whose value or shape does not fit.
    """
    unknown = sorted(set(call_args) - set(CALL_ARGS))
    if unknown:
        raise TypeError(f"got unexpected keyword arguments {unknown} (the call takes {CALL_ARGS})")
    a = {name: call_args.get(name, _DEFAULTS.get(name)) for name in CALL_ARGS}
    d = checks.qkv_dims(q, k, v)
    mask, keep, q_positions, q_segment_ids, kv_segment_ids = translate(
        d, a["mask"], a["is_causal"], a["local_window_size"], a["query_seq_lengths"],
        a["key_value_seq_lengths"], a["q_positions"], a["q_segment_ids"], a["kv_segment_ids"],
    )  # fmt: skip
    kv_positions = a["kv_positions"]
    if (q_segment_ids is None) != (kv_segment_ids is None):
        fail("q_segment_ids/kv_segment_ids", "both or neither", "only one of them")
    mask, scale, softcap = check_static(mask, a["scale"], a["softcap"])
    if q_positions is None:
        check_default_queries(d.T, d.S, mask, kv_positions is not None)
    scale = d.H**-0.5 if scale is None else scale
    sink_logits = a["sink_logits"]
    if sink_logits is not None:
        sink_logits = jnp.asarray(sink_logits)
        if sink_logits.shape != (d.N,):
            fail("sink_logits", f"shape ({d.N},), one logit per query head", sink_logits.shape)
        sink_logits = sink_logits.astype(jnp.float32).reshape(d.K, d.G)
    bias = None if a["bias"] is None else check_pair(a["bias"], "bias", d, boolean=False)
    return Call(
        dims=d,
        mask=mask,
        scale=scale,
        softcap=softcap,
        score_mod=scores.check_score_mod(a["score_mod"], d),
        sink_logits=sink_logits,
        q_segment_ids=checks.segment_ids(q_segment_ids, "q_segment_ids", d.B, d.T),
        kv_segment_ids=checks.segment_ids(kv_segment_ids, "kv_segment_ids", d.B, d.S),
        bias=bias,
        keep=keep,
        positions=(
            _given_positions(q_positions, "q_positions", d.B, d.T),
            _given_positions(kv_positions, "kv_positions", d.B, d.S),
        ),
        given=(q_positions, kv_positions, q_segment_ids, kv_segment_ids),
    )


def _given_positions(x, name: str, batch: int, length: int):
    """Checked ``[B,L]`` int32 positions, or None where they default (built where read)."""
    return None if x is None else checks.positions(x, name, batch, length)


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
