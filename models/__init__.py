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

Decoding caches (``DecodeCache``) are pytrees: full KV caches with K kv heads,
ring buffers for sliding windows (plus pinned initial tokens), MLA latent caches,
linear-attention states, mixed freely across layers.
"""

from models.cache import (
    EMPTY,
    CrossCache,
    DecodeCache,
    KVCache,
    LatentCache,
    bookkeeping_bytes,
    cache_bytes,
    cache_overflow,
    latent_cache_bytes,
    linear_state_bytes,
)
from models.config import KINDS, PRESETS, AttentionConfig, ModelConfig, pattern, presets
from models.generate import generate
from models.layers import (
    MLP,
    Block,
    CrossAttention,
    LatentAttention,
    LinearAttention,
    SelfAttention,
)
from models.transformer import Decoder, Encoder, EncoderDecoder

__all__ = [
    "EMPTY",
    "KINDS",
    "MLP",
    "PRESETS",
    "AttentionConfig",
    "Block",
    "CrossAttention",
    "CrossCache",
    "DecodeCache",
    "Decoder",
    "Encoder",
    "EncoderDecoder",
    "KVCache",
    "LatentAttention",
    "LatentCache",
    "LinearAttention",
    "ModelConfig",
    "SelfAttention",
    "bookkeeping_bytes",
    "cache_bytes",
    "cache_overflow",
    "generate",
    "latent_cache_bytes",
    "linear_state_bytes",
    "pattern",
    "presets",
]
