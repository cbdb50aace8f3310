"""Named attention configs (presets) and ``pattern``, which turns names into layers::

layers = pattern(("window", "window", "mha") * 4)           # Gemma-style local/global
layers = pattern(("linear", "linear", "mha") * 2)           # linear/softmax hybrid
layers = pattern(("band_global_tokens", "linear"))            # an encoder (Longformer-style)
layers = pattern(("based", "based", "based_window"))          # Based (Arora et al. 2024)
layers = pattern(("mha_conv", "linear_conv"))                 # any preset with a short conv

A preset is a function of the shared sizes (``PresetSizes``: heads, head
dim, window, ranks, ...) registered under a name in ``PRESET_REGISTRY``
(``register_preset``), so a comparison and a command line size every preset
alike; ``presets(**sizes)`` builds them at those sizes, reading the registry
at each lookup, so presets registered later are in it. Each layer has one
name.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence

from attn.checks import fail
from attn.linear.front import CHUNK_SIZE
from attn.registry import Registry
from models.config import KINDS, AttentionConfig
from models.latent import LatentConfig
from models.linear import LinearConfig
from models.softmax import SoftmaxConfig

# The width of the presets' short convolutions (the current token and the three
# before it): Mamba's ``d_conv`` and fla's ``conv_size`` default.
SHORT_CONV = 4
# Based projects queries and keys to 16 channels per head before its Taylor map
# (F = 1 + 16 + 16^2 = 273): a small head dim keeps the state [N,F,H] affordable.
BASED_HEAD_DIM = 16
# ``<preset>_conv`` is ``<preset>`` with a short convolution of width ``short_conv``.
CONV_SUFFIX = "_conv"


@dataclasses.dataclass(frozen=True)
class PresetSizes:
    """The sizes (heads, head dim, window, ranks, ...) a preset is built from; no layers.

    A preset's ``build`` takes one; ``presets(**sizes)`` builds every preset at
    ``PresetSizes(**sizes)`` and returns them as a ``Presets`` mapping.

    Attributes:
      num_heads: N. head_dim: H.
      gqa_kv_heads: K of ``gqa``.
      window: the sliding window of the window presets (itself included).
      num_initial_tokens: the always-visible first positions of ``streaming``.
      global_positions: Longformer's global positions of ``global_tokens``.
      radius: the band of ``band`` presets; None means ``window``.
      kv_rank, q_rank, rope_head_dim: MLA's latent rank, query rank, RoPE key width.
      chunk_size: C of the chunkwise linear presets.
      short_conv: W of the short convolutions (``based``, ``*_conv``).
      based_head_dim: the head dim of Based's Taylor linear attention.
      state_dim: the SSD state dim of the Mamba-2 presets (Mamba's ``d_state``).
    """

    num_heads: int = 4
    head_dim: int = 8
    gqa_kv_heads: int = 2
    window: int = 4
    num_initial_tokens: int = 2
    global_positions: tuple[int, ...] = (0, 5)
    radius: int | None = None
    kv_rank: int = 8
    q_rank: int | None = 16
    rope_head_dim: int = 4
    chunk_size: int = CHUNK_SIZE
    short_conv: int = SHORT_CONV
    based_head_dim: int = BASED_HEAD_DIM
    state_dim: int = 16

    def base(self, **fields) -> SoftmaxConfig:
        """Causal softmax MHA of N heads of dim H, with ``fields`` replaced."""
        return SoftmaxConfig(**self._heads(fields))

    def latent(self, **fields) -> LatentConfig:
        """MLA of N heads of dim H at the sizes' ranks, with ``fields`` replaced."""
        ranks = dict(kv_rank=self.kv_rank, q_rank=self.q_rank, rope_head_dim=self.rope_head_dim)
        return LatentConfig(**self._heads({**ranks, **fields}))

    def linear(self, **fields) -> LinearConfig:
        """Linear attention (elu+1, no RoPE, chunks of C) of N heads of dim H."""
        fields = {"rope": False, "chunk_size": self.chunk_size, **fields}
        return LinearConfig(**self._heads(fields))

    def function(self, kind: str, **fields):
        """A layer of the function kind ``kind`` (``models.attention_kind``): N heads of dim H
        with the softmax layer's defaults (causal, RoPE), ``fields`` replaced."""
        return KINDS.lookup(kind, "kind").config_class(**self._heads(fields))

    def _heads(self, fields: dict) -> dict:
        return {"num_heads": self.num_heads, "head_dim": self.head_dim, **fields}


@dataclasses.dataclass(frozen=True)
class Preset:
    """A registered preset: ``build(sizes) -> AttentionConfig`` and a one-line description."""

    build: Callable[[PresetSizes], AttentionConfig]
    description: str


PRESET_REGISTRY: Registry[Preset] = Registry("preset", "names")


def register_preset(name: str, build=None, *, description: str):
    """Adds a preset: ``build(sizes: PresetSizes) -> AttentionConfig``; a call or a decorator.

    The preset is then a name of ``pattern``, ``--model.pattern`` and a
    comparison variant's layers, sized by the caller's ``PresetSizes``, and
    ``<name>_conv`` is the same with a short convolution (of the sizes' width).

    Raises:
      ValueError: the name is taken by another preset (naming both), ends in
        ``_conv`` (the short-conv twins' suffix), or ``build`` is not callable.
    """

    def add(build):
        if not callable(build):
            fail("build", "a callable build(sizes) -> AttentionConfig", repr(build))
        if isinstance(name, str) and name.endswith(CONV_SUFFIX):
            fail("name", f"a name not ending in {CONV_SUFFIX!r} (the short-conv twins)", name)
        PRESET_REGISTRY.add(name, Preset(build, description), defined_by=build)
        return build

    return add if build is None else add(build)


def _builtin(name: str, description: str, build) -> None:
    register_preset(name, build, description=description)


_builtin("mha", "softmax, multi-head (also the global layer of hybrids)", lambda s: s.base())
_builtin("gqa", "softmax, gqa_kv_heads kv heads", lambda s: s.base(num_kv_heads=s.gqa_kv_heads))
_builtin("mqa", "softmax, one kv head", lambda s: s.base(num_kv_heads=1))
_builtin("mla", "multi-head latent attention (DeepSeek-V2)", lambda s: s.latent())
_builtin(
    "gated_mha",
    "softmax, its output gated per channel by sigmoid(x W_g) (gated attention, Qiu et al. 2025)",
    lambda s: s.base(output_gate="elementwise"),
)
_builtin("window", "softmax, sliding window", lambda s: s.base(window=s.window))
_builtin(
    "streaming",
    "sliding window + the first positions (StreamingLLM)",
    lambda s: s.base(window=s.window, initial_tokens=s.num_initial_tokens),
)
_builtin(
    "global_tokens",
    "sliding window + Longformer global positions",
    lambda s: s.base(window=s.window, global_tokens=tuple(s.global_positions)),
)
_builtin(
    "band",
    "bidirectional band (encoders)",
    lambda s: s.base(radius=s.window if s.radius is None else s.radius),
)
_builtin(
    "band_global_tokens",
    "bidirectional band + global positions (encoders)",
    lambda s: s.base(
        radius=s.window if s.radius is None else s.radius,
        global_tokens=tuple(s.global_positions),
    ),
)
_builtin(
    "alibi",
    "softmax with ALiBi's fixed per-head slopes instead of RoPE (Press et al. 2022)",
    lambda s: s.base(rope=False, score="alibi"),
)
_builtin(
    "t5",
    "softmax with T5's learned relative-position buckets instead of RoPE",
    lambda s: s.base(rope=False, score="t5"),
)
_builtin(
    "fox",
    "the Forgetting Transformer: softmax with per-head forget gates, no RoPE (Lin et al. 2025)",
    lambda s: s.base(rope=False, score="forgetting"),
)
_builtin("linear", "linear, elu+1", lambda s: s.linear())
_builtin("linear_decay", "linear, RetNet decay", lambda s: s.linear(decay="retnet"))
_builtin("linear_gated", "linear, data-dependent gates", lambda s: s.linear(gating=True))
_builtin(
    "based",
    "Based: Taylor linear attention with a short conv",
    lambda s: s.linear(feature_map="taylor", head_dim=s.based_head_dim, short_conv=s.short_conv),
)
_builtin(
    "based_window",
    "Based: the sliding window with a short conv",
    lambda s: s.base(window=s.window, short_conv=s.short_conv),
)


class Presets(Mapping[str, AttentionConfig]):
    """The registered presets built at one ``PresetSizes``: what ``presets(**sizes)`` returns.

    A read-only mapping, preset name -> ``AttentionConfig``, over every name of
    ``PRESET_REGISTRY`` (read at each lookup, so presets registered later are in
    it) and its ``<name>_conv`` twin; each layer is built when first looked up.
    A preset that cannot be built at these sizes (``gqa``'s kv heads must divide
    the heads) raises only when it is looked up, so the others stay usable;
    ``buildable()`` gives those that can be built.

    Attributes:
      sizes: the ``PresetSizes`` every preset here is built at.
    """

    def __init__(self, sizes: PresetSizes):
        if not isinstance(sizes, PresetSizes):
            fail("sizes", "a PresetSizes", repr(sizes))
        self.sizes = sizes
        self._built: dict[str, AttentionConfig] = {}

    def __getitem__(self, name: str) -> AttentionConfig:
        if name not in self:
            raise KeyError(name)
        base, conv = _split_conv(name)
        if name not in self._built:
            try:
                layer = PRESET_REGISTRY[base].build(self.sizes)
            except ValueError as e:
                raise ValueError(f"{e} (building preset {base!r} at {self.sizes})") from None
            if not isinstance(layer, AttentionConfig):
                fail(f"preset {base!r}", "a build returning an AttentionConfig", repr(layer))
            if conv:
                layer = dataclasses.replace(layer, short_conv=self.sizes.short_conv)
            self._built[name] = layer
        return self._built[name]

    def __contains__(self, name) -> bool:
        if not isinstance(name, str):
            return False
        base = _split_conv(name)[0]
        return base in PRESET_REGISTRY

    def __iter__(self) -> Iterator[str]:
        names = list(PRESET_REGISTRY)
        return iter([*names, *(name + CONV_SUFFIX for name in names)])

    def __len__(self) -> int:
        return 2 * len(PRESET_REGISTRY)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.sizes!r})"

    def buildable(self) -> dict[str, AttentionConfig]:
        """The presets that can be built at these sizes, built."""
        out = {}
        for name in self:
            with contextlib.suppress(ValueError):
                out[name] = self[name]
        return out


def _split_conv(name: str) -> tuple[str, str]:
    """``("mha", "_conv")`` of ``"mha_conv"``; ``("mha", "")`` of ``"mha"``."""
    if name.endswith(CONV_SUFFIX):
        return name[: -len(CONV_SUFFIX)], CONV_SUFFIX
    return name, ""


def presets(**sizes) -> Presets:
    """The registered presets built at ``PresetSizes(**sizes)``: a ``Presets`` mapping.

    The mapping holds every registered preset and its ``_conv`` twin, each built
    when first looked up (``PresetSizes`` holds only the sizes; this builds layers).

    Built-in names: ``mha`` (full causal softmax, also the "global" layer of
    local/global hybrids), ``gqa`` (``gqa_kv_heads`` kv
    heads), ``mqa``, ``mla``, ``window``, ``streaming`` (StreamingLLM: window
    plus the first ``num_initial_tokens`` positions), ``global_tokens`` (window
    plus Longformer global positions), ``linear`` (elu+1), ``linear_decay``
    (RetNet gammas), ``linear_gated`` (data-dependent gates), ``based`` and
    ``based_window`` (below), and those other modules register (``deltanet``,
    ``gated_deltanet``, ``kda``, ``diff``, ...). Each preset also comes as
    ``<name>_conv``, with a short convolution of width ``short_conv``.

    ``based`` and ``based_window`` are the two attention layers of Based (Arora
    et al. 2024, "Simple linear attention language models balance the
    recall-throughput tradeoff"), which mixes linear attention with the
    second-order Taylor feature map (``phi(q).phi(k) = 1 + q.k + (q.k)^2/2``, an
    approximation of ``exp(q.k)``), small sliding-window softmax attention and
    short convolutions: ``based`` is Taylor linear attention with head dim
    ``based_head_dim`` (Based's feature dim, 16; here the value dim too, where
    Based's values keep the model's head dim) and ``based_window`` a softmax
    window of ``window``, both with a short convolution of width ``short_conv``
    on their input. Based's convolutions are gated layers of their own; here each
    attention layer convolves its own input (``AttentionConfig.short_conv``; fla's
    ``use_short_conv`` convolves q, k and v instead).

    Window presets are causal (decoder layers). Their bidirectional (encoder)
    counterparts are ``band`` (a band of ``radius``, default ``window``) and
    ``band_global_tokens`` (the band plus the global positions).

    Args:
      **sizes: fields of ``PresetSizes``.
    """
    unknown = sorted(set(sizes) - {f.name for f in dataclasses.fields(PresetSizes)})
    if unknown:
        fail("sizes", f"fields of PresetSizes {list(PresetSizes.__dataclass_fields__)}", unknown)
    return Presets(PresetSizes(**sizes))


def valid_in(layer: AttentionConfig, causal: bool) -> bool:
    """Whether ``layer`` can run in a causal (decoder) or a bidirectional (encoder) stack."""
    try:
        layer.check_direction(causal)
    except ValueError:
        return False
    return True


def describe(layer: AttentionConfig) -> str:
    """The layer in a few words: kind, heads and the fields that differ from the defaults.

    E.g. ``"softmax, 4 heads x 16, window 6"`` (what ``--help`` shows per preset).
    """
    shown = f"{layer.kind}, {layer.num_heads} heads x {layer.head_dim}"
    skip = ("kind", "num_heads", "head_dim")
    extra = [
        f"{f.name} {getattr(layer, f.name)}"
        for f in dataclasses.fields(layer)
        if f.name not in skip and getattr(layer, f.name) != f.default
    ]
    return ", ".join([shown, *extra])


def pattern(
    names: Sequence[str], registry: Mapping[str, AttentionConfig] | None = None
) -> tuple[AttentionConfig, ...]:
    """``ModelConfig.layers`` from preset names, e.g. ``pattern(("window", "mha") * 2)``.

    Args:
      names: one preset name per layer.
      registry: name -> ``AttentionConfig`` (a ``Presets``, ``presets(**sizes)``, or
        any mapping); default ``presets()`` (the default sizes).

    Returns:
      A tuple of L ``AttentionConfig``, each as its depth sets it
      (``AttentionConfig.at_depth``: MiniMax-01's lightning decay, for one).

    Raises:
      ValueError: ``names`` is not a non-empty sequence of names of ``registry``
        (naming the first unknown one), ``registry`` is not a mapping, or a
        preset cannot be built at the registry's sizes (naming it and them).
    """
    registry = presets() if registry is None else registry
    if not isinstance(registry, Mapping):
        fail("registry", "a mapping of names to layers (models.presets(...))", repr(registry))
    if isinstance(names, str) or not isinstance(names, Sequence) or not names:
        fail("names", "a non-empty sequence of preset names", repr(names))
    for name in names:
        if name not in registry:
            fail("names", f"preset names from {sorted(registry)}", repr(name))
    L = len(names)
    return tuple(registry[name].at_depth(i, L) for i, name in enumerate(names))
