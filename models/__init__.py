"""Flax NNX models that compose every attention variant of ``attn``.

Modules are thin (projections, norms, RoPE); the math is a call into ``attn``.
Axis letters as in ``attn``: B batch, T query length, S key length, N query
heads, K kv heads, H head dim, E value head dim, D width, R latent rank,
F linear feature dim, L layers, V vocabulary.

    from flax import nnx
    import models

    config = models.ModelConfig(
        vocab_size=256, width=256, layers=models.pattern(("streaming", "linear", "mla") * 2)
    )
    model = models.Decoder(config, rngs=nnx.Rngs(0))
    logits = model(tokens)                                  # [B,T,V] float32
    new_tokens = models.generate(model, prompt, 64)         # greedy, jitted

    logits, weights = models.capture_weights(model, tokens)  # L x [B,N,T,T]
    models.set_head_gates(model, gates)                      # [L,N]; 0 ablates a head
    importance = models.head_importance(model, loss_fn, tokens)  # d loss / d gates

Files, one per layer kind: ``heads.py`` (what every attention module shares:
projections, head gates, the weights tap), ``softmax.py`` (``SelfAttention``,
``CrossAttention``), ``latent.py`` (``LatentAttention``), ``linear.py``
(``LinearAttention``), ``delta.py`` (the delta rule, DeltaProduct), ``mamba.py``
(``Mamba2``), ``sparse.py`` (MoBA, NSA, DSA), ``block.py`` (``MLP``, ``ShortConv``,
``Block``), ``transformer.py`` (the three models), ``taps.py`` (weights, gates,
importance), ``cache.py``, ``config.py`` / ``patterns.py`` (presets), ``generate.py``
and ``serving.py`` (continuous batching over a paged cache: ``serve``).

Extending without editing the package (``docs/extending.md``): ``register_kind``
adds a layer kind (its module class, the config fields it reads, optionally a
config subclass with fields of its own), ``register_preset`` a named config,
``attn.register_feature_map`` a feature map; the built-in kinds and presets are
registered the same way, and every lookup reads the registries at call time.

Padding and packing are segment ids (id 0 is padding) for every layer kind.

Any layer may convolve its input with a short causal convolution
(``AttentionConfig.short_conv``, a ``ShortConv`` in the ``Block``; presets
``based`` and ``based_window``).

Decoding caches (``DecodeCache``) are pytrees: full KV caches with K kv heads,
ring buffers for sliding windows (plus pinned initial tokens), MLA latent caches,
the sparse kinds' full caches (DSA's with its indexer's keys), linear-attention
states, mixed freely across layers, and the short convolutions'
last inputs. Full caches may be paged (``init_cache(..., page_size=...)``):
one pool of pages per layer, shared by the rows through block tables.
"""

from attn.deprecation import deprecated_names
from models.block import MLP, Block, ShortConv
from models.cache import (
    EMPTY,
    CrossCache,
    DecodeCache,
    KVCache,
    LatentCache,
    SlotCache,
    bookkeeping_bytes,
    cache_bytes,
    cache_overflow,
    clear_rows,
    latent_cache_bytes,
    linear_state_bytes,
    paged_layer,
    set_block_tables,
)
from models.config import (
    COMMON_FIELDS,
    KINDS,
    LEGACY_GROUPS,
    AttentionConfig,
    LayerKind,
    ModelConfig,
    register_kind,
)
from models.delta import DeltaAttention, DeltaCache, DeltaConfig
from models.diff import DiffAttention, DiffConfig, depth_lambda_init
from models.functions import FunctionAttention, FunctionConfig, attention_kind
from models.generate import generate
from models.heads import Buffer, HeadGate, Heads
from models.latent import LatentAttention, LatentConfig
from models.linear import LinearAttention, LinearConfig
from models.mamba import Mamba2, Mamba2Cache, Mamba2Config
from models.masked import MaskedConfig
from models.patterns import (
    DEPRECATED_NAMES,
    PRESET_REGISTRY,
    PresetSizes,
    describe,
    pattern,
    presets,
    register_preset,
)
from models.serving import serve
from models.softmax import CrossAttention, SelfAttention, SoftmaxConfig
from models.sparse import (
    DSAAttention,
    DSAConfig,
    IndexedCache,
    MobaAttention,
    MobaCache,
    MobaConfig,
    NSAAttention,
    NSACache,
    NSAConfig,
)
from models.taps import (
    attention_modules,
    capture_weights,
    head_gates,
    head_importance,
    set_head_gates,
)
from models.transformer import Decoder, Encoder, EncoderDecoder, packed_positions

__all__ = [
    "COMMON_FIELDS",
    "DEPRECATED_NAMES",
    "EMPTY",
    "KINDS",
    "MLP",
    "PRESET_REGISTRY",
    "AttentionConfig",
    "Block",
    "Buffer",
    "CrossAttention",
    "CrossCache",
    "DSAAttention",
    "DSAConfig",
    "DecodeCache",
    "Decoder",
    "DeltaAttention",
    "DeltaCache",
    "DeltaConfig",
    "DiffAttention",
    "DiffConfig",
    "Encoder",
    "EncoderDecoder",
    "FunctionAttention",
    "FunctionConfig",
    "HeadGate",
    "Heads",
    "IndexedCache",
    "KVCache",
    "LatentAttention",
    "LatentCache",
    "LatentConfig",
    "LayerKind",
    "LinearAttention",
    "LinearConfig",
    "Mamba2",
    "Mamba2Cache",
    "Mamba2Config",
    "MaskedConfig",
    "MobaAttention",
    "MobaCache",
    "MobaConfig",
    "ModelConfig",
    "NSAAttention",
    "NSACache",
    "NSAConfig",
    "PresetSizes",
    "SelfAttention",
    "ShortConv",
    "SlotCache",
    "SoftmaxConfig",
    "attention_kind",
    "attention_modules",
    "bookkeeping_bytes",
    "cache_bytes",
    "cache_overflow",
    "capture_weights",
    "clear_rows",
    "depth_lambda_init",
    "describe",
    "generate",
    "head_gates",
    "head_importance",
    "latent_cache_bytes",
    "linear_state_bytes",
    "packed_positions",
    "paged_layer",
    "pattern",
    "presets",
    "register_kind",
    "register_preset",
    "serve",
    "set_block_tables",
    "set_head_gates",
]


# Deprecated names (removed in attnlab 0.2).
__getattr__ = deprecated_names(
    __name__,
    {
        "PRESETS": ("models.presets() (the presets at the default sizes)", presets),
        **{
            name: (
                f"the fields of the kind's config class (LayerKind.fields), not {name}",
                lambda g=group: g,
            )
            for name, group in LEGACY_GROUPS.items()
        },
    },
)
