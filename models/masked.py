"""What every layer attending by softmax over masked keys shares (softmax, MLA, diff).

* ``MaskedConfig``: the fields such a layer reads (window, radius, initial and
  global tokens, impl, soft-cap, sink logits), its mask on positions and its
  decode cache's slot layout;
* ``Softmax``: the module base: the sink-logit parameter, one helper
  (``_softmax``) that calls ``attn`` with the layer's settings and a call's
  positions and segment ids as named keywords, the weights tap, and the cache slots.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from attn import masks
from attn.checks import fail
from models.cache import EMPTY
from models.config import (
    IMPLS,
    JAX_NN_IMPLS,
    AttentionConfig,
    check_bool,
    check_positive_float,
    check_positive_int,
    is_int,
)
from models.heads import OUTPUT_GATES, Heads, cached_impl


@dataclasses.dataclass(frozen=True)
class MaskedConfig(AttentionConfig):
    """A layer attending by softmax over the keys a mask selects (softmax, MLA, diff).

    Attributes:
      window: (causal layers) a sliding window of ``window`` positions, itself
        included. None: unbounded.
      radius: (bidirectional layers) a band: query q sees keys with
        ``|q - k| <= radius`` (Longformer's local attention). None: unbounded.
        A layer is causal or not by the stack it is in (``check_direction``), so a
        decoder layer may not set ``radius`` nor an encoder layer ``window``.
      initial_tokens: the first ``initial_tokens`` positions stay visible to every
        query (StreamingLLM, which calls them attention sinks); needs a window or
        a radius.
      global_tokens: positions that see and are seen by all (Longformer); needs
        a window or a radius.
      impl: ``attn.attention``'s implementation; never changes the math.
        ``"ring"`` (softmax only): ring attention over the mesh axis ``"seq"`` of the
        mesh set by ``jax.set_mesh`` (sequence parallelism, see the module doc);
        without such a mesh the layer computes as ``"auto"``. ``"auto"`` itself
        turns into ring attention under a mesh whose ``"seq"`` axis has > 1 device.
      softcap: logit soft-cap (Gemma 2), or None.
      sink_logits: a learned per-head logit joins each softmax denominator (gpt-oss).
      output_gate: gated attention (Qiu et al. 2025; Qwen3-Next's): the attention's
        output times ``sigmoid(x W_g)`` before the output projection, x the layer's input;
        ``"elementwise"`` (a gate per channel) or ``"headwise"`` (one per head), or None.
    """

    window: int | None = None
    radius: int | None = None
    initial_tokens: int = 0
    global_tokens: tuple[int, ...] = ()
    impl: str = "auto"
    softcap: float | None = None
    sink_logits: bool = False
    output_gate: str | None = None

    def check_fields(self) -> None:
        check_positive_int(self.window, "window", allow_none=True)
        r = self.radius
        if r is not None and (not is_int(r) or r < 0):
            fail("radius", "a non-negative int or None", repr(r))
        if r is not None and self.window is not None:
            fail(
                "radius",
                "None with a window (window is a causal layer's, radius a bidirectional one's)",
                repr(r),
            )
        local = self.window is not None or r is not None
        n = self.initial_tokens
        if not is_int(n) or n < 0:
            fail("initial_tokens", "a non-negative int", repr(n))
        g = self.global_tokens
        if not isinstance(g, tuple) or not all(is_int(p) and p >= 0 for p in g):
            fail("global_tokens", "a tuple of non-negative ints", repr(g))
        for field, value, off in (("initial_tokens", n, 0), ("global_tokens", g, ())):
            if value and not local:
                why = "every position is visible anyway"
                fail(field, f"{off!r} without a window or radius ({why})", repr(value))
        if not isinstance(self.impl, str) or self.impl not in IMPLS:
            fail("impl", f"one of {IMPLS}", repr(self.impl))
        if self.impl in JAX_NN_IMPLS and (
            self.initial_tokens
            or self.global_tokens
            or self.softcap is not None
            or self.sink_logits
        ):
            # jax.nn has causal and band masks only, and no soft-cap or sink logits.
            fail(
                "impl",
                "'auto' or 'dense' with initial tokens, global tokens, softcap or sink logits",
                repr(self.impl),
            )
        check_positive_float(self.softcap, "softcap", allow_none=True)
        check_bool(self.sink_logits, "sink_logits")
        if self.output_gate is not None and self.output_gate not in OUTPUT_GATES:
            fail("output_gate", f"one of {OUTPUT_GATES} or None", repr(self.output_gate))

    def check_direction(self, causal: bool, name: str = "layer") -> None:
        """A causal layer's local span is ``window``, a bidirectional one's ``radius``."""
        if causal and self.radius is not None:
            fail(
                f"{name}.radius",
                "None in a causal layer (set window, the causal span)",
                repr(self.radius),
            )
        if not causal and self.window is not None:
            fail(
                f"{name}.window",
                "None in a bidirectional layer (set radius, the band of a bidirectional layer)",
                repr(self.window),
            )

    def mask(self, causal: bool) -> masks.Mask:
        """The softmax mask on absolute positions, for a causal or a bidirectional layer."""
        self.check_direction(causal)
        span = self.window if causal else self.radius
        if span is None:
            return masks.causal() if causal else masks.full()
        local = masks.sliding_window(span) if causal else masks.bidirectional_window(span)
        if self.initial_tokens:
            local = local | masks.initial_tokens(self.initial_tokens)
        if self.global_tokens:
            local = local | masks.global_tokens(self.global_tokens)
        return masks.causal() & local if causal else local

    def cache_layout(self, max_len: int) -> tuple[int, int]:
        """``(slots, pinned)`` of this layer's decode cache for sequences up to ``max_len``.

        A causal window (optionally with initial tokens) needs only
        ``initial_tokens + window`` slots: the first ``pinned = initial_tokens``
        hold the initial positions forever and the rest are a ring buffer of the
        latest ``window`` positions. Global tokens make a query see everything
        before it, so they need every slot.
        """
        if self.window is not None and not self.global_tokens:
            slots = self.initial_tokens + self.window
            if slots < max_len:
                return slots, self.initial_tokens
        return max_len, 0


class Softmax(Heads):
    """Base of softmax layers: mask, soft-cap, sink logits, the weights tap, cache slots."""

    def _init_softmax(self, cfg: MaskedConfig, *, causal: bool, dtype, param_dtype):
        self._init_heads(cfg, causal=causal, dtype=dtype)
        self.sink_logits = (
            nnx.Param(jnp.zeros((cfg.num_heads,), param_dtype)) if cfg.sink_logits else None
        )

    def _impl(self, cached: bool = False) -> str:
        """``attn.attention``'s impl for a call off the ring (``"ring"`` computes as
        ``"auto"``), and for a cached call, which passes traced positions (``cached_impl``)."""
        impl = "auto" if self.cfg.impl == "ring" else self.cfg.impl
        return cached_impl(impl) if cached else impl

    def _sinks(self):
        """The learned sink logits ``[N]``, or None."""
        return None if self.sink_logits is None else self.sink_logits[...]

    def _softmax(
        self,
        fn,
        *args,
        impl: str,
        tap: bool = False,
        q_positions=None,
        kv_positions=None,
        q_segment_ids=None,
        kv_segment_ids=None,
        score_mod=None,
        **kind_args,
    ):
        """``fn(*args, ...)`` (``attn.attention`` or ``attn.latent_attention``) with this
        layer's mask, soft-cap and sink logits; returns ``out [B,T,N,E]``.

        Positions, segment ids and the score modifier are the call's (None: ``fn``'s
        default, so that positionless implementations such as jax.nn's stay eligible);
        ``kind_args`` go to ``fn`` as they are (a function kind's ``kv_length``).
        With ``tap`` and ``sow_weights`` it also sows the weights ``[B,N,T,S]``: only
        the dense implementation materializes them, so the tapped call uses it
        (every implementation computes the same function).
        """
        sow = tap and self.sow_weights
        out = fn(
            *args,
            impl="dense" if sow else impl,
            mask=self.cfg.mask(self.causal),
            softcap=self.cfg.softcap,
            sink_logits=self._sinks(),
            q_positions=q_positions,
            kv_positions=kv_positions,
            q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids,
            score_mod=score_mod,
            return_weights=sow,
            **kind_args,
        )
        if not sow:
            return out
        out, weights = out
        self._sow(weights)
        return out

    @staticmethod
    def _whole(positions, segment_ids) -> dict:
        """Position and segment arrays of a whole-sequence call (None where default)."""
        return dict(
            q_positions=positions,
            kv_positions=positions,
            q_segment_ids=segment_ids,
            kv_segment_ids=segment_ids,
        )

    @staticmethod
    def _cached(positions, kv_pos) -> dict:
        """Cached calls see slots by their stored positions; empty slots by segment id 0."""
        return dict(
            q_positions=positions,
            kv_positions=kv_pos,
            q_segment_ids=jnp.ones(positions.shape, jnp.int32),
            kv_segment_ids=(kv_pos != EMPTY).astype(jnp.int32),
        )

    def _slots(self, batch: int, max_len: int) -> tuple[int, dict]:
        """``(S, SlotCache fields)`` of an empty cache: S from ``cfg.cache_layout(max_len)``."""
        S, pinned = self.cfg.cache_layout(max_len)
        # A window's ring buffer when it is shorter than max_len; else one slot per position.
        fields = dict(pos=jnp.full((batch, S), EMPTY, jnp.int32), pinned=pinned, ring=max_len > S)
        return S, fields
