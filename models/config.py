"""Model configs: frozen, hashable dataclasses validated on construction.

One config class per layer kind, each holding only what its layers read:
``AttentionConfig`` holds what every kind reads (kind, heads, head dim, RoPE,
a short convolution) and is the base of the kinds' own classes, which live
beside their modules (``models.softmax.SoftmaxConfig``, ``LatentConfig``,
``LinearConfig``, ``DeltaConfig``, ``DiffConfig``). ``ModelConfig`` describes
a whole model, with one layer config per layer, so hybrids are one line::

    layers = pattern(("window", "window", "mha") * 4)           # Gemma-style local/global
    layers = pattern(("linear", "linear", "mha") * 2)           # linear/softmax hybrid
    config = ModelConfig(vocab_size=256, width=256, layers=layers)

Every bad value raises ``ValueError("<field>: expected ..., got <value>")``.
Configs are hashable, so they are static under ``jit`` and key compile caches.

Layer kinds are a registry (``KINDS``, filled by ``register_kind``): each kind
names its module class and its config class (and optionally a check of its
own); the built-in kinds register beside their modules, and a plugin adds one
the same way.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable

import jax.numpy as jnp

import attn
from attn.checks import fail, positive_float
from attn.registry import Registry

# Implementations backed by jax.nn.dot_product_attention (see attn.dispatch).
JAX_NN_IMPLS = ("xla", "cudnn")

# A softmax layer's implementations: attn.attention's, and "ring" (ring attention
# over the mesh axis "seq" of the surrounding jax.set_mesh; models.softmax).
IMPLS = (*attn.IMPLS, "ring")

# What every layer kind reads: AttentionConfig's own fields.
COMMON_FIELDS = ("kind", "num_heads", "num_kv_heads", "head_dim", "rope", "rope_base", "short_conv")


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """One layer kind of the models: how a layer of ``kind == name`` is built.

    Attributes:
      name: the kind's name (the config's ``kind``).
      module: the attention module class, constructed as
        ``module(cfg, width, *, causal, dtype, param_dtype, rngs)``, with the
        surface of ``models.heads.Heads``: ``__call__(x, *, positions, segment_ids)``,
        ``init_cache(batch, max_len)`` (its decode cache, a pytree) and
        ``extend(x, cache, start, lengths)`` (prefill and decode steps).
      family: what the kind is reported as (the comparison's table counts the layers
        of family ``"softmax"`` as its "softmax layers"): ``"softmax"`` for softmax
        attention over kept keys (MHA/GQA/MQA, MLA, windows, Diff), ``"linear"`` for a
        fixed recurrent state (linear attention, the delta rule), another name for
        another attention function (``"sigmoid"``, ``"softpick"``).
      config: the config class of the kind's layers: ``AttentionConfig`` or a
        frozen dataclass subclass of it holding the fields the kind reads.
      check: ``check(cfg)`` raising ``ValueError`` for values the kind cannot take, or None.
      sequence_parallel: True if the module runs under a mesh whose ``"seq"`` axis
        splits each sequence (it attends by the tokens' positions, as ring attention
        does, or by its sharded form over the tokens in order: ``in_order``);
        otherwise False, or a string saying why it cannot (train refuses it).
      in_order: True if the module runs a recurrence over the tokens in array
        order (linear attention, the delta rule, Mamba-2): a sequence-parallel
        run then lays each sequence out in contiguous spans, one per device.
    """

    name: str
    module: type
    family: str
    config: type | None = None
    check: Callable[[AttentionConfig], None] | None = None
    sequence_parallel: bool | str = False
    in_order: bool = False

    @property
    def config_class(self) -> type:
        return AttentionConfig if self.config is None else self.config

    @property
    def fields(self) -> tuple[str, ...]:
        """The config fields the kind reads besides ``COMMON_FIELDS``."""
        names = (f.name for f in dataclasses.fields(self.config_class))
        return tuple(n for n in names if n not in COMMON_FIELDS)

    def owns(self, field: str) -> bool:
        """Whether layers of this kind read ``field``."""
        return field in COMMON_FIELDS or field in self.fields


KINDS: Registry[LayerKind] = Registry("layer kind", "kind")


def register_kind(
    name: str,
    module: type | None = None,
    *,
    config: type | None = None,
    family: str | None = None,
    check=None,
    sequence_parallel: bool | str = False,
    in_order: bool = False,
):
    """Adds a layer kind (see ``LayerKind``); a call, or a decorator of the module class.

    ``@register_kind("gated", config=GatedConfig)`` above a module class makes
    ``GatedConfig(kind="gated", ...)`` a layer of every model, CLI and comparison;
    the built-in kinds (``softmax``, ``mla``, ``linear``, ``delta``, ``diff``) are
    added the same way, beside their modules. Several kinds may share a config
    class (a plugin attending with softmax masks may take ``models.MaskedConfig``).

    ``family`` (``LayerKind.family``) is required, except for a module deriving from
    a registered kind's module, whose family it inherits (``models.SelfAttention``:
    ``"softmax"``); a kind that computes another function than its base's says so.

    Raises:
      ValueError: the name is taken by another kind (naming both), the module
        lacks the attention surface, or ``config`` is not a dataclass subclass
        of ``AttentionConfig``.
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
        cls = config
        if cls is not None and not _is_config(cls):
            fail("config", "a dataclass subclass of AttentionConfig or None", repr(cls))
        kind_family = _inherited_family(module) if family is None else family
        if not isinstance(kind_family, str) or not kind_family:
            why = f"required: {module.__name__} derives from no registered kind's module"
            fail("family", f"a non-empty string such as 'softmax' or 'linear' ({why})", family)
        if check is not None and not callable(check):
            fail("check", "a callable check(cfg) or None", repr(check))
        if not isinstance(sequence_parallel, bool | str):
            fail(
                "sequence_parallel",
                "a bool or the reason it cannot (a str)",
                repr(sequence_parallel),
            )
        if not isinstance(in_order, bool):
            fail("in_order", "a bool", repr(in_order))
        entry = LayerKind(name, module, kind_family, cls, check, sequence_parallel, in_order)
        KINDS.add(name, entry, defined_by=module)
        return module

    return add if module is None else add(module)


def _inherited_family(module: type) -> str | None:
    """The family of the registered kind whose module is ``module`` or its nearest base, or None."""
    for base in module.__mro__:
        families = {kind.family for kind in KINDS.values() if kind.module is base}
        if families:
            return min(families)
    return None


def _is_config(c) -> bool:
    return isinstance(c, type) and issubclass(c, AttentionConfig) and dataclasses.is_dataclass(c)


def is_int(x) -> bool:
    """Whether ``x`` is an integer and not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_positive_int(value, field: str, *, allow_none: bool = False) -> None:
    """Refuses anything but an int >= 1 (or None with ``allow_none``), naming ``field``."""
    if value is None and allow_none:
        return
    if not is_int(value) or value < 1:
        fail(field, "a positive int" + (" or None" if allow_none else ""), repr(value))


def check_positive_float(value, field: str, *, allow_none: bool = False) -> None:
    """Refuses anything but a finite number > 0 (or None with ``allow_none``), naming ``field``."""
    if value is None and allow_none:
        return
    positive_float(value, field, "a positive finite number" + (" or None" if allow_none else ""))


def check_width(value, field: str) -> None:
    """Refuses anything but an int >= 0: a short convolution's width W (0: none), naming
    ``field``."""
    if not is_int(value) or value < 0:
        fail(field, "a non-negative int (the width W; 0 for none)", repr(value))


def check_bool(value, field: str) -> None:
    """Refuses anything but a bool, naming ``field``."""
    if not isinstance(value, bool):
        fail(field, "a bool", repr(value))


def check_rotary(cfg) -> None:
    """A layer's partial RoPE: ``rotary_dim`` (None: all H) even, in ``[2, H]``."""
    if not cfg.rope:
        return
    rd = cfg.head_dim if cfg.rotary_dim is None else cfg.rotary_dim
    if not is_int(rd) or rd < 2 or rd % 2 or rd > cfg.head_dim:
        field = "head_dim" if cfg.rotary_dim is None else "rotary_dim"
        fail(field, f"an even int in [2, {cfg.head_dim}] for RoPE", repr(rd))


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """What every attention layer reads; the base of each kind's config class.

    A kind without fields of its own (a plugin's) is configured by this class
    itself; the built-in kinds by their subclasses (``SoftmaxConfig(window=4)``,
    ``LinearConfig(...)``).

    Attributes:
      kind: a name in ``KINDS``: ``"softmax"`` (MHA/GQA/MQA through ``attn.attention``),
        ``"mla"`` (multi-head latent attention), ``"linear"`` (``attn.linear``),
        ``"delta"``, ``"diff"``, or one added with ``register_kind``.
      num_heads: N, query heads.
      num_kv_heads: K, key/value heads; None means N (MHA). N % K == 0; K == 1 is MQA.
      head_dim: H, query/key (and value) head dim.
      rope: rotate queries and keys by position.
      rope_base: RoPE frequency base.
      short_conv: W, width of a short causal depthwise convolution (``attn.short_conv``)
        over the layer's normalized input, before every projection of the layer; 0:
        none. Each token then sees its W-1 predecessors' features, the previous-token
        signal associative recall needs (Based, H3, Mamba, fla's ``use_short_conv``).
        Causal in every stack (in an encoder too); decoding keeps the last W-1
        inputs (``DecodeCache.conv``).
    """

    kind: str = "softmax"
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int = 8
    rope: bool = True
    rope_base: float = 10000.0
    short_conv: int = 0

    def __post_init__(self):
        kind = KINDS.lookup(self.kind, "kind")
        if type(self) is not kind.config_class:
            fail(
                "kind",
                f"a kind whose config class is {type(self).__name__} "
                f"(kind {self.kind!r} is configured by {kind.config_class.__name__})",
                repr(self.kind),
            )
        check_positive_int(self.num_heads, "num_heads")
        check_positive_int(self.num_kv_heads, "num_kv_heads", allow_none=True)
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            fail(
                "num_kv_heads", f"a divisor of num_heads={self.num_heads}", repr(self.num_kv_heads)
            )
        check_positive_int(self.head_dim, "head_dim")
        check_bool(self.rope, "rope")
        check_positive_float(self.rope_base, "rope_base")
        w = self.short_conv
        if not is_int(w) or w < 0:
            fail("short_conv", "a non-negative int (the width W; 0 for none)", repr(w))
        self.check_fields()
        if kind.check is not None:
            kind.check(self)

    def check_fields(self) -> None:
        """The checks of a kind's own fields (its config class overrides this)."""

    @property
    def kv_heads(self) -> int:
        """K, the key/value heads."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def value_dim(self) -> int:
        """E: per-head value dim (H, except where a kind sets its own)."""
        return self.head_dim

    def at_depth(self, index: int, num_layers: int) -> AttentionConfig:
        """This layer as layer ``index`` (0-based) of ``num_layers`` (``models.pattern``
        asks each layer): a kind whose paper sets a field by depth overrides it."""
        del index, num_layers
        return self

    def check_direction(self, causal: bool, name: str = "layer") -> None:
        """Raises ``ValueError`` naming ``<name>.<field>`` if this layer cannot run
        causally (``causal``) or bidirectionally; a kind with a direction overrides it."""


def _default_layers() -> tuple[AttentionConfig, ...]:
    softmax = KINDS.lookup("softmax").config_class
    return (softmax(), softmax())


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A model: embeddings, a per-layer pattern of attention configs, SwiGLU MLPs.

    Attributes:
      vocab_size: V.
      width: D, the residual stream width.
      mlp_width: hidden width of the SwiGLU MLP; None means 4 D.
      layers: one layer config per layer (L of them), e.g. from ``pattern``.
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
        check_positive_int(self.vocab_size, "vocab_size")
        check_positive_int(self.width, "width")
        check_positive_int(self.mlp_width, "mlp_width", allow_none=True)
        for field in ("layers", "encoder_layers"):
            value = getattr(self, field)
            if isinstance(value, list | tuple):  # any sequence; stored as a tuple (hashable)
                value = tuple(value)
                object.__setattr__(self, field, value)
            if not isinstance(value, tuple) or not all(
                isinstance(a, AttentionConfig) for a in value
            ):
                fail(field, "a sequence of layer configs (see pattern())", repr(value))
        if not self.layers:
            fail("layers", "at least one layer config", repr(self.layers))
        check_positive_float(self.norm_eps, "norm_eps")
        check_bool(self.tied_embeddings, "tied_embeddings")
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
                fail("cross_attention", "a layer config or None", repr(c))
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
        softmax = KINDS.lookup("softmax").config_class
        return softmax(num_heads=first.num_heads, head_dim=first.head_dim, rope=False)


# The old union config (one AttentionConfig class for every kind, before each kind had
# its own): its fields beyond COMMON_FIELDS with their defaults, which run records
# written then hold for every layer (train.config reads them).
LEGACY_DEFAULTS = {
    "rotary_dim": None,
    "window": None,
    "radius": None,
    "initial_tokens": 0,
    "global_tokens": (),
    "impl": "auto",
    "softcap": None,
    "score": None,
    "sink_logits": False,
    "feature_map": "elu1",
    "form": "chunkwise",
    "decay": None,
    "gating": False,
    "chunk_size": 64,
    "normalize": True,
    "num_features": None,
    "kv_rank": 16,
    "q_rank": None,
    "rope_head_dim": 4,
    "nope_head_dim": None,
    "v_head_dim": None,
}
