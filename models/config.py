"""Model configs: frozen, hashable dataclasses validated on construction.

``AttentionConfig`` describes one attention layer (softmax MHA/GQA/MQA with any
mask, multi-head latent attention, or linear attention); ``ModelConfig`` a whole
model, with one ``AttentionConfig`` per layer so hybrids are one line::

    layers = pattern(("window", "window", "global") * 4)        # Gemma-style local/global
    layers = pattern(("linear", "linear", "softmax") * 2)         # linear/softmax hybrid
    config = ModelConfig(vocab_size=256, width=256, layers=layers)

Every bad value raises ``ValueError("<field>: expected ..., got <value>")``.
Configs are hashable, so they are static under ``jit`` and key compile caches.

Layer kinds are a registry (``KINDS``, filled by ``register_kind``): each kind
names its module class, the config fields it reads and its own checks; the
built-in kinds register beside their modules (``models.softmax``,
``models.latent``, ``models.linear``), and a plugin adds one the same way.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable

import jax.numpy as jnp

import attn
from attn import masks
from attn.errors import fail
from attn.linear import FEATURE_MAPS, FORMS
from attn.registry import Registry

# Implementations backed by jax.nn.dot_product_attention (see attn.dispatch).
JAX_NN_IMPLS = ("xla", "cudnn")

# A softmax layer's implementations: attn.attention's, and "ring" (ring attention
# over the mesh axis "seq" of the surrounding jax.set_mesh; models.softmax).
IMPLS = (*attn.IMPLS, "ring")

# AttentionConfig's fields in groups. Every kind reads the common ones; a kind
# names the groups (or single fields) it reads besides, and every other field
# must keep its default (a value there would be silently ignored).
COMMON_FIELDS = ("kind", "num_heads", "num_kv_heads", "head_dim", "rope", "rope_base", "short_conv")
MASK_FIELDS = (
    "window",
    "radius",
    "initial_tokens",
    "global_tokens",
    "impl",
    "softcap",
    "sink_logits",
)
LINEAR_FIELDS = (
    "feature_map",
    "form",
    "decay",
    "gating",
    "chunk_size",
    "normalize",
    "num_features",
)
LATENT_FIELDS = ("kv_rank", "q_rank", "rope_head_dim", "nope_head_dim", "v_head_dim")

# A softmax layer's score modifiers (``attn.scores``): ALiBi's fixed slopes, T5's
# learned bucket table, the Forgetting Transformer's per-head forget gates.
SCORES = ("alibi", "t5", "forgetting")
# T5's bucketing (Raffel et al. 2020): 32 buckets, log-spaced up to 128 positions.
T5_BUCKETS = 32
T5_MAX_DISTANCE = 128


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """One layer kind of the models: how a layer of ``AttentionConfig.kind == name`` is built.

    Attributes:
      name: the kind's name (``AttentionConfig.kind``).
      module: the attention module class, constructed as
        ``module(cfg, width, *, causal, dtype, param_dtype, rngs)``, with the
        surface of ``models.heads.Heads``: ``__call__(x, *, positions, segment_ids)``,
        ``init_cache(batch, max_len)`` (its decode cache, a pytree) and
        ``extend(x, cache, start, lengths)`` (prefill and decode steps).
      fields: the ``AttentionConfig`` fields the kind reads besides ``COMMON_FIELDS``.
      family: ``"softmax"`` for a layer that keeps keys (a full cache or a window;
        the comparison's "softmax layers"), ``"linear"`` for a fixed recurrent state.
      config: the config class of the kind's layers: ``AttentionConfig`` or a
        frozen dataclass subclass of it holding the kind's own fields (theirs too).
      check: ``check(cfg)`` raising ``ValueError`` for values the kind cannot take, or None.
      sequence_parallel: True if the module runs under a mesh whose ``"seq"`` axis
        splits each sequence (it attends by the tokens' positions, as ring attention
        does); otherwise False, or a string saying why it cannot (train refuses it).
    """

    name: str
    module: type
    fields: tuple[str, ...] = ()
    family: str = "softmax"
    config: type | None = None
    check: Callable[[AttentionConfig], None] | None = None
    sequence_parallel: bool | str = False

    @property
    def config_class(self) -> type:
        return AttentionConfig if self.config is None else self.config

    def owns(self, field: str) -> bool:
        """Whether layers of this kind read ``field``."""
        own = field in COMMON_FIELDS or field in self.fields
        return own or field not in _BASE_FIELDS  # a config subclass's own field


KINDS: Registry[LayerKind] = Registry("layer kind", "kind")


def register_kind(
    name: str,
    module: type | None = None,
    *,
    fields=(),
    family: str = "softmax",
    config: type | None = None,
    check=None,
    sequence_parallel: bool | str = False,
):
    """Adds a layer kind (see ``LayerKind``); a call, or a decorator of the module class.

    ``@register_kind("gated", fields=MASK_FIELDS)`` above a module class makes
    ``AttentionConfig(kind="gated")`` a layer of every model, CLI and comparison;
    the built-in kinds ``softmax``, ``mla`` and ``linear`` are added the same way,
    beside their modules.

    Raises:
      ValueError: the name is taken by another kind (naming both), the module
        lacks the attention surface, ``fields`` names no ``AttentionConfig``
        field, or ``config`` is not a subclass of ``AttentionConfig``.
    """

    def add(module):
        missing = [
            m
            for m in ("__call__", "init_cache", "extend")
            if not callable(getattr(module, m, None))
        ]
        if not isinstance(module, type) or missing:
            fail(
                "module",
                "an attention module class with __call__, init_cache and extend",
                f"{module!r} (missing {missing})",
            )
        names = tuple(fields)
        unknown = [f for f in names if f not in _BASE_FIELDS or f in COMMON_FIELDS]
        if unknown:
            fail("fields", f"AttentionConfig fields beyond {COMMON_FIELDS}", repr(unknown))
        if config is not None and not (
            isinstance(config, type) and issubclass(config, AttentionConfig)
        ):
            fail("config", "a dataclass subclass of AttentionConfig or None", repr(config))
        if not isinstance(family, str) or not family:
            fail("family", "a non-empty string such as 'softmax' or 'linear'", repr(family))
        if check is not None and not callable(check):
            fail("check", "a callable check(cfg) or None", repr(check))
        if not isinstance(sequence_parallel, bool | str):
            fail(
                "sequence_parallel",
                "a bool or the reason it cannot (a str)",
                repr(sequence_parallel),
            )
        entry = LayerKind(name, module, names, family, config, check, sequence_parallel)
        KINDS.add(name, entry, defined_by=module)
        return module

    return add if module is None else add(module)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _positive_int(value, field: str, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not _is_int(value) or value < 1:
        fail(field, "a positive int" + (" or None" if allow_none else ""), repr(value))


def _positive_float(value, field: str, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value <= 0
    ):
        fail(field, "a positive finite number" + (" or None" if allow_none else ""), repr(value))


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """One attention layer.

    Fields come in groups (``COMMON_FIELDS``, ``MASK_FIELDS``, ``LINEAR_FIELDS``,
    ``LATENT_FIELDS``); each layer kind reads the common ones and those its
    ``LayerKind.fields`` name, and every other field must keep its default.
    A kind registered with a config subclass (``register_kind(config=...)``)
    adds fields of its own, and its layers are instances of that subclass.

    Attributes:
      kind: a name in ``KINDS``: ``"softmax"`` (MHA/GQA/MQA through ``attn.attention``),
        ``"mla"`` (multi-head latent attention, DeepSeek-V2), ``"linear"``
        (``attn.linear``), or one added with ``register_kind``.
      num_heads: N, query heads.
      num_kv_heads: K, key/value heads; None means N (MHA). N % K == 0; K == 1 is MQA.
        MLA has no kv heads (keys are per head after the up-projection): None or N.
      head_dim: H, query/key (and value) head dim. For MLA the default of
        ``nope_head_dim`` and ``v_head_dim``.
      rope: rotate queries and keys by position (for MLA: the decoupled key).
      rope_base: RoPE frequency base.
      rotary_dim: leading channels that rotate (partial RoPE); None means all H.
      short_conv: W, width of a short causal depthwise convolution (``attn.short_conv``)
        over the layer's normalized input, before every projection of the layer (q, k,
        v, MLA's latents, linear gates); 0: none. Each token then sees its W-1
        predecessors' features, the previous-token signal associative recall needs
        (Based, H3, Mamba, fla's ``use_short_conv``). Any kind; causal in every stack
        (in an encoder too); decoding keeps the last W-1 inputs (``DecodeCache.conv``).
      window: (softmax, MLA; causal layers) a sliding window of ``window`` positions,
        itself included. None: unbounded.
      radius: (softmax, MLA; bidirectional layers) a band: query q sees keys with
        ``|q - k| <= radius`` (Longformer's local attention). None: unbounded.
        A layer is causal or not by the stack it is in (``check_direction``), so a
        decoder layer may not set ``radius`` nor an encoder layer ``window``.
      initial_tokens: (softmax, MLA) the first ``initial_tokens`` positions stay
        visible to every query (StreamingLLM, which calls them attention sinks);
        needs a window or a radius.
      global_tokens: (softmax, MLA) positions that see and are seen by all
        (Longformer); needs a window or a radius.
      impl: (softmax, MLA) ``attn.attention``'s implementation; never changes the math.
        ``"ring"`` (softmax only): ring attention over the mesh axis ``"seq"`` of the
        mesh set by ``jax.set_mesh`` (sequence parallelism, ``models.softmax``);
        without such a mesh the layer computes as ``"auto"``. ``"auto"`` itself
        turns into ring attention under a mesh whose ``"seq"`` axis has > 1 device.
      softcap: (softmax, MLA) logit soft-cap (Gemma 2), or None.
      score: (softmax) a score modifier of the logits (``attn.scores``), or None:
        ``"alibi"`` (ALiBi's fixed per-head slopes, Press et al. 2022),
        ``"t5"`` (a learned bias per head and log-spaced distance bucket, T5),
        ``"forgetting"`` (FoX, Lin et al. 2025: a per-head forget gate
        ``sigmoid(x W_f + b_f)`` per token; the logit of key j for query i gets
        the sum of the log gates after j up to i). Usually with ``rope=False``:
        each is a position signal of its own. ``"forgetting"`` decodes with the
        running sum of the gates in its cache and cannot run sequence-parallel.
      sink_logits: (softmax, MLA) a learned per-head logit joins each softmax
        denominator (gpt-oss).
      feature_map: (linear) a name in ``attn.linear.FEATURE_MAPS``.
      form: (linear) ``"parallel"``, ``"recurrent"`` or ``"chunkwise"`` (same function).
      decay: (linear) fixed per-head decay gamma in (0, 1]: a number, a tuple of N
        numbers, ``"retnet"`` (gamma_n = 1 - 2^(-5-n)), or None.
      gating: (linear) data-dependent per-head log-gates from a projection of the
        input (gated linear attention / Mamba-2 style); combines with ``decay``.
      chunk_size: (linear) C for the chunkwise form.
      normalize: (linear) divide by ``phi(q).z`` (use False with ``"identity"``).
      num_features: (linear) F for ``"favor"`` (random features).
      kv_rank: (MLA) R, rank of the shared key/value latent (what the cache holds).
      q_rank: (MLA) rank of the query latent, or None for a direct query projection.
      rope_head_dim: (MLA) width of the decoupled RoPE key shared by all heads (and
        of each head's RoPE query part).
      nope_head_dim: (MLA) per-head query/key channels without RoPE; None means H.
      v_head_dim: (MLA) E, per-head value dim; None means H.
    """

    kind: str = "softmax"
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int = 8
    rope: bool = True
    rope_base: float = 10000.0
    rotary_dim: int | None = None
    short_conv: int = 0
    window: int | None = None
    radius: int | None = None
    initial_tokens: int = 0
    global_tokens: tuple[int, ...] = ()
    impl: str = "auto"
    softcap: float | None = None
    score: str | None = None
    sink_logits: bool = False
    feature_map: str = "elu1"
    form: str = "chunkwise"
    decay: float | tuple[float, ...] | str | None = None
    gating: bool = False
    chunk_size: int = 64
    normalize: bool = True
    num_features: int | None = None
    kv_rank: int = 16
    q_rank: int | None = None
    rope_head_dim: int = 4
    nope_head_dim: int | None = None
    v_head_dim: int | None = None

    def __post_init__(self):
        kind = KINDS.lookup(self.kind, "kind")
        if type(self) is not kind.config_class:
            fail(
                "kind",
                f"a kind whose config class is {type(self).__name__} "
                f"(kind {self.kind!r} is configured by {kind.config_class.__name__})",
                repr(self.kind),
            )
        for name, f in _BASE_FIELDS.items():  # another kind's field would be silently ignored
            if not kind.owns(name) and getattr(self, name) != f.default:
                fail(
                    name,
                    f"{f.default!r} for kind={self.kind!r} (a field its layers do not read)",
                    repr(getattr(self, name)),
                )
        _positive_int(self.num_heads, "num_heads")
        _positive_int(self.num_kv_heads, "num_kv_heads", allow_none=True)
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            fail(
                "num_kv_heads", f"a divisor of num_heads={self.num_heads}", repr(self.num_kv_heads)
            )
        _positive_int(self.head_dim, "head_dim")
        if not isinstance(self.rope, bool):
            fail("rope", "a bool", repr(self.rope))
        _positive_float(self.rope_base, "rope_base")
        if self.rope and kind.owns("rotary_dim"):
            rd = self.head_dim if self.rotary_dim is None else self.rotary_dim
            if not _is_int(rd) or rd < 2 or rd % 2 or rd > self.head_dim:
                field = "head_dim" if self.rotary_dim is None else "rotary_dim"
                value = self.head_dim if self.rotary_dim is None else self.rotary_dim
                fail(field, f"an even int in [2, {self.head_dim}] for RoPE", repr(value))
        w = self.short_conv
        if not _is_int(w) or w < 0:
            fail("short_conv", "a non-negative int (the width W; 0 for none)", repr(w))
        self._check_mask()
        self._check_linear()
        self._check_latent()
        if kind.check is not None:
            kind.check(self)

    def _check_mask(self):
        _positive_int(self.window, "window", allow_none=True)
        r = self.radius
        if r is not None and (not _is_int(r) or r < 0):
            fail("radius", "a non-negative int or None", repr(r))
        if r is not None and self.window is not None:
            fail(
                "radius",
                "None with a window (window is a causal layer's, radius a bidirectional one's)",
                repr(r),
            )
        local = self.window is not None or r is not None
        n = self.initial_tokens
        if not _is_int(n) or n < 0:
            fail("initial_tokens", "a non-negative int", repr(n))
        g = self.global_tokens
        if not isinstance(g, tuple) or not all(_is_int(p) and p >= 0 for p in g):
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
        _positive_float(self.softcap, "softcap", allow_none=True)
        if self.score is not None and self.score not in SCORES:
            fail("score", f"one of {SCORES} or None", repr(self.score))
        if self.score == "forgetting" and self.impl == "ring":
            why = "FoX's running sum of gates runs in array order, which the ring's layout permutes"
            fail("impl", f"not 'ring' with score='forgetting' ({why})", repr(self.impl))
        if not isinstance(self.sink_logits, bool):
            fail("sink_logits", "a bool", repr(self.sink_logits))

    def _check_linear(self):
        if self.feature_map not in FEATURE_MAPS:
            fail("feature_map", f"one of {sorted(FEATURE_MAPS)}", repr(self.feature_map))
        if self.form not in FORMS:
            fail("form", f"one of {FORMS}", repr(self.form))
        _positive_int(self.chunk_size, "chunk_size")
        if not isinstance(self.gating, bool):
            fail("gating", "a bool", repr(self.gating))
        if not isinstance(self.normalize, bool):
            fail("normalize", "a bool", repr(self.normalize))
        _positive_int(self.num_features, "num_features", allow_none=True)
        d = self.decay
        if d is not None and d != "retnet":
            values = d if isinstance(d, tuple) else (d,)
            ok = all(
                isinstance(x, numbers.Real) and not isinstance(x, bool) and 0 < x <= 1
                for x in values
            )
            if not ok or (isinstance(d, tuple) and len(d) != self.num_heads):
                fail(
                    "decay",
                    f"None, 'retnet', a number in (0, 1] or a tuple of {self.num_heads} of them",
                    repr(d),
                )

    def _check_latent(self):
        _positive_int(self.kv_rank, "kv_rank")
        _positive_int(self.q_rank, "q_rank", allow_none=True)
        _positive_int(self.nope_head_dim, "nope_head_dim", allow_none=True)
        _positive_int(self.v_head_dim, "v_head_dim", allow_none=True)
        r = self.rope_head_dim
        if not _is_int(r) or r < 2 or r % 2:
            fail("rope_head_dim", "an even int >= 2", repr(r))

    # Derived sizes -----------------------------------------------------------

    @property
    def kv_heads(self) -> int:
        """K (MLA: N, the heads keys and values are up-projected to)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def qk_nope_dim(self) -> int:
        """MLA: per-head query/key channels without RoPE."""
        return self.head_dim if self.nope_head_dim is None else self.nope_head_dim

    @property
    def value_dim(self) -> int:
        """E: per-head value dim (H except where MLA sets ``v_head_dim``)."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def decay_values(self) -> tuple[float, ...] | None:
        """Per-head gammas ``[N]`` as a tuple, or None without fixed decay."""
        if self.decay is None:
            return None
        if self.decay == "retnet":
            # RetNet's multi-scale retention: head n forgets with 1 - 2^(-5-n).
            return tuple(1.0 - 2.0 ** (-5 - n) for n in range(self.num_heads))
        if isinstance(self.decay, tuple):
            return tuple(float(x) for x in self.decay)
        return (float(self.decay),) * self.num_heads

    def check_direction(self, causal: bool, name: str = "layer") -> None:
        """Raises ``ValueError`` naming ``<name>.<field>`` if this layer cannot run
        causally (``causal``) or bidirectionally: a causal layer's local span is
        ``window``, a bidirectional one's ``radius``, and decay needs an order."""
        if causal:
            if self.radius is not None:
                fail(
                    f"{name}.radius",
                    "None in a causal layer (set window, the causal span)",
                    repr(self.radius),
                )
            return
        for field, off, why in (
            ("window", None, "set radius, the band of a bidirectional layer"),
            ("decay", None, "decay needs an order"),
            ("gating", False, "gates need an order"),
        ):
            if getattr(self, field) != off:
                fail(
                    f"{name}.{field}",
                    f"{off!r} in a bidirectional layer ({why})",
                    repr(getattr(self, field)),
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


_BASE_FIELDS = {f.name: f for f in dataclasses.fields(AttentionConfig)}


def _default_layers() -> tuple[AttentionConfig, ...]:
    return (AttentionConfig(), AttentionConfig())


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A model: embeddings, a per-layer pattern of attention configs, SwiGLU MLPs.

    Attributes:
      vocab_size: V.
      width: D, the residual stream width.
      mlp_width: hidden width of the SwiGLU MLP; None means 4 D.
      layers: one ``AttentionConfig`` per layer (L of them), e.g. from ``pattern``.
        For an ``EncoderDecoder``: the decoder's self-attention layers. Causal in a
        ``Decoder``/``EncoderDecoder`` (local span ``window``), bidirectional in an
        ``Encoder`` (``radius``); the model checks which when it is built.
      norm_eps: RMSNorm epsilon.
      tied_embeddings: the output projection is the embedding table (transposed).
      dtype: compute dtype (activations, caches); logits are always float32.
      param_dtype: parameter storage dtype.
      encoder_layers: the encoder's layers (``EncoderDecoder`` only; bidirectional).
      cross_attention: the decoder's cross-attention (``EncoderDecoder`` only; kind
        ``"softmax"``, no RoPE, no window or radius); None means MHA shaped like ``layers[0]``.
    """

    vocab_size: int = 32
    width: int = 32
    mlp_width: int | None = None
    layers: tuple[AttentionConfig, ...] = dataclasses.field(default_factory=_default_layers)
    norm_eps: float = 1e-6
    tied_embeddings: bool = True
    dtype: str = "float32"
    param_dtype: str = "float32"
    encoder_layers: tuple[AttentionConfig, ...] = ()
    cross_attention: AttentionConfig | None = None

    def __post_init__(self):
        _positive_int(self.vocab_size, "vocab_size")
        _positive_int(self.width, "width")
        _positive_int(self.mlp_width, "mlp_width", allow_none=True)
        for field in ("layers", "encoder_layers"):
            value = getattr(self, field)
            if isinstance(value, list | tuple):  # any sequence; stored as a tuple (hashable)
                value = tuple(value)
                object.__setattr__(self, field, value)
            if not isinstance(value, tuple) or not all(
                isinstance(a, AttentionConfig) for a in value
            ):
                fail(field, "a sequence of AttentionConfig (see pattern())", repr(value))
        if not self.layers:
            fail("layers", "at least one AttentionConfig", repr(self.layers))
        _positive_float(self.norm_eps, "norm_eps")
        if not isinstance(self.tied_embeddings, bool):
            fail("tied_embeddings", "a bool", repr(self.tied_embeddings))
        for field in ("dtype", "param_dtype"):
            value = getattr(self, field)
            try:
                ok = jnp.issubdtype(jnp.dtype(value), jnp.floating)
            except TypeError:
                ok = False
            if not ok:
                fail(field, "a floating dtype name such as 'float32' or 'bfloat16'", repr(value))
        c = self.cross_attention
        if c is not None:
            if not isinstance(c, AttentionConfig):
                fail("cross_attention", "an AttentionConfig or None", repr(c))
            if c.kind != "softmax" or c.rope or c.window is not None or c.radius is not None:
                fail(
                    "cross_attention",
                    "kind='softmax', rope=False, window=None, radius=None (positions of two "
                    "sequences are not comparable)",
                    repr(c),
                )
            if c.short_conv:  # the Block convolves its self-attention's input only
                fail("cross_attention", "short_conv=0 (a self-attention layer's option)", repr(c))
        for i, layer in enumerate(self.encoder_layers):  # an encoder is always bidirectional
            layer.check_direction(False, f"encoder_layers[{i}]")

    @property
    def hidden_width(self) -> int:
        """The SwiGLU hidden width (``mlp_width``, default 4 D)."""
        return 4 * self.width if self.mlp_width is None else self.mlp_width

    @property
    def cross(self) -> AttentionConfig:
        """The cross-attention config, defaulting to MHA shaped like ``layers[0]``."""
        if self.cross_attention is not None:
            return self.cross_attention
        first = self.layers[0]
        return AttentionConfig(
            kind="softmax", num_heads=first.num_heads, head_dim=first.head_dim, rope=False
        )
