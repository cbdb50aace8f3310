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
``CrossAttention``), ``latent.py`` (``LatentAttention``), ``recurrent.py`` (the
fixed-state kinds' base), ``linear.py`` (``LinearAttention``), ``delta.py`` (the
delta rule, DeltaProduct), ``comba.py`` (Comba), ``mamba.py`` (``Mamba2``),
``rwkv7.py`` (RWKV-7), ``log_linear.py`` and ``levels.py`` (log-linear Mamba-2 and
Gated DeltaNet), ``sparse.py`` (MoBA, NSA, DSA), ``path.py`` (PaTH), ``lightning.py``
(MiniMax-01's lightning attention), ``layouts.py`` (production hybrids), ``block.py``
(``MLP``, ``ShortConv``, ``Block``), ``transformer.py`` (the three models), ``taps.py``
(weights, gates, importance), ``cache.py``, ``config.py`` / ``patterns.py`` (presets),
``generate.py`` and ``serving.py`` (continuous batching over a paged cache: ``serve``).

Extending without editing the package (``docs/extending.md``): ``register_kind``
adds a layer kind (its module class, the config fields it reads, optionally a
config subclass with fields of its own), ``register_preset`` a named config,
``attn.register_feature_map`` a feature map; the built-in kinds and presets are
registered the same way, and every lookup reads the registries at call time.

This namespace is the public surface: the models and their config, the layer
modules and their per-kind configs, the kind registry, presets and patterns,
``generate``, ``serve``, and the operations a researcher calls on a model
(``capture_weights``, head gates and importance, ``packed_positions``,
``cache_bytes``). The building blocks live in their submodules, each name in
one: ``models.cache`` (``DecodeCache``, ``KVCache``, ``LatentCache``, ...,
``set_block_tables``, ``clear_rows``), the fixed-state kinds' base and cache
(``models.recurrent``: ``Recurrent``, ``RecurrentCache``), ``models.sparse``'s caches,
``models.heads`` (``Heads``, ``HeadGate``, ``Buffer``), ``models.block`` (``MLP``,
``Block``, ``ShortConv``), ``models.taps`` (``attention_modules``),
``models.config`` (``COMMON_FIELDS``); the cache sizes of one layer
(``latent_cache_bytes``, ``linear_state_bytes``) are ``attn``'s.

Padding and packing are segment ids (id 0 is padding) for every layer kind.

Any layer may convolve its input with a short causal convolution
(``AttentionConfig.short_conv``, a ``models.block.ShortConv`` in the layer's
``Block``; presets ``based`` and ``based_window``).

Decoding caches (``models.cache.DecodeCache``) are pytrees: full KV caches with K kv heads,
ring buffers for sliding windows (plus pinned initial tokens), MLA latent caches,
the sparse kinds' full caches (DSA's with its indexer's keys), linear-attention
states, mixed freely across layers, and the short convolutions'
last inputs. Full caches may be paged (``init_cache(..., page_size=...)``):
one pool of pages per layer, shared by the rows through block tables.
"""

from models.cache import cache_bytes
from models.comba import CombaAttention, CombaConfig
from models.config import (
    KINDS,
    AttentionConfig,
    LayerKind,
    ModelConfig,
    register_kind,
)
from models.delta import DeltaAttention, DeltaConfig
from models.diff import DiffAttention, DiffConfig
from models.functions import FunctionAttention, FunctionConfig, attention_kind
from models.generate import generate
from models.latent import LatentAttention, LatentConfig
from models.layouts import LAYOUTS, layout
from models.lightning import LightningAttention, LightningConfig
from models.linear import LinearAttention, LinearConfig
from models.log_linear import (
    LogLinearDeltaConfig,
    LogLinearMamba2Config,
)
from models.mamba import Mamba2, Mamba2Config
from models.masked import MaskedConfig
from models.mesa import MesaAttention, MesaConfig
from models.path import PathAttention, PathConfig
from models.patterns import (
    PRESET_REGISTRY,
    Presets,
    PresetSizes,
    describe,
    pattern,
    presets,
    register_preset,
)
from models.rwkv7 import Rwkv7Attention, Rwkv7Config
from models.serving import serve
from models.softmax import CrossAttention, SelfAttention, SoftmaxConfig
from models.sparse import (
    DSAAttention,
    DSAConfig,
    MobaAttention,
    MobaConfig,
    NSAAttention,
    NSAConfig,
)
from models.taps import capture_weights, head_gates, head_importance, set_head_gates
from models.transformer import Decoder, Encoder, EncoderDecoder, packed_positions
from models.ttt import TitansAttention, TitansConfig, TTTAttention, TTTConfig

__all__ = [
    "KINDS",
    "LAYOUTS",
    "PRESET_REGISTRY",
    "AttentionConfig",
    "CombaAttention",
    "CombaConfig",
    "CrossAttention",
    "DSAAttention",
    "DSAConfig",
    "Decoder",
    "DeltaAttention",
    "DeltaConfig",
    "DiffAttention",
    "DiffConfig",
    "Encoder",
    "EncoderDecoder",
    "FunctionAttention",
    "FunctionConfig",
    "LatentAttention",
    "LatentConfig",
    "LayerKind",
    "LightningAttention",
    "LightningConfig",
    "LinearAttention",
    "LinearConfig",
    "LogLinearDeltaConfig",
    "LogLinearMamba2Config",
    "Mamba2",
    "Mamba2Config",
    "MaskedConfig",
    "MesaAttention",
    "MesaConfig",
    "MobaAttention",
    "MobaConfig",
    "ModelConfig",
    "NSAAttention",
    "NSAConfig",
    "PathAttention",
    "PathConfig",
    "PresetSizes",
    "Presets",
    "Rwkv7Attention",
    "Rwkv7Config",
    "SelfAttention",
    "SoftmaxConfig",
    "TTTAttention",
    "TTTConfig",
    "TitansAttention",
    "TitansConfig",
    "attention_kind",
    "cache_bytes",
    "capture_weights",
    "describe",
    "generate",
    "head_gates",
    "head_importance",
    "layout",
    "packed_positions",
    "pattern",
    "presets",
    "register_kind",
    "register_preset",
    "serve",
    "set_head_gates",
]
