"""Shared tiny configs and jitted entry points for the model tests.

Compiling dominates these tests, so models are built once per pattern
(``model_for``) and every call goes through a few module-level jitted functions
keyed by the model's graph definition: one compile per (pattern, shape).
LLVM's -O0 keeps IEEE float semantics, so it changes speed, not results.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import models
from models.diff import depth_lambda_init

VOCAB, WIDTH = 32, 32
B, MAX_LEN = 2, 16

# The presets plus variants that switch on the remaining options in one place.
REGISTRY = dict(models.presets())
# Gated attention rides on two of them: MLA's direct queries gated per head and without
# positions (Kimi Linear's NoPE MLA), GQA (with a soft-cap, sink logits, partial RoPE and
# Qwen3-Next's q/k norm) per channel.
REGISTRY["mla_direct_q_gated"] = dataclasses.replace(
    REGISTRY["mla"], q_rank=None, output_gate="headwise", rope=False
)
REGISTRY["gqa_gated_softcap_sinks"] = dataclasses.replace(
    REGISTRY["gqa"], softcap=20.0, sink_logits=True, rotary_dim=4, output_gate="elementwise",
    qk_norm=True,
)  # fmt: skip
# FAVOR+ random features, GQA (K=2) and RetNet decay in one linear layer.
REGISTRY["linear_favor"] = dataclasses.replace(
    REGISTRY["linear_decay"], feature_map="favor", num_features=16, num_kv_heads=2
)
REGISTRY["streaming_blockwise"] = dataclasses.replace(REGISTRY["streaming"], impl="blockwise")
REGISTRY["gqa_blockwise"] = dataclasses.replace(REGISTRY["gqa"], impl="blockwise")
# Short convolutions ride on models other tests compile anyway (compiling dominates):
# a full KV cache (gqa), and in the hybrid linear attention with decay and gates, MLA and
# a window's ring buffer, at widths W = 4, 3, 2; an encoder layer (W = 3) too.
REGISTRY["gqa_gated_softcap_sinks_conv"] = dataclasses.replace(
    REGISTRY["gqa_gated_softcap_sinks"], short_conv=4
)
REGISTRY["linear_decay_gated_conv"] = dataclasses.replace(
    REGISTRY["linear_gated"], decay="retnet", short_conv=4
)
REGISTRY["mla_conv"] = dataclasses.replace(REGISTRY["mla"], short_conv=3)
REGISTRY["streaming_conv"] = dataclasses.replace(REGISTRY["streaming"], short_conv=2)
REGISTRY["linear_conv"] = dataclasses.replace(REGISTRY["linear"], short_conv=3)
# The delta rule: grouped value heads (8 of them for 4 q/k heads) in chunks of 4
# tokens (prefills span chunks), the recurrent form, and a Block input conv too.
REGISTRY["gated_deltanet_grouped"] = dataclasses.replace(
    REGISTRY["gated_deltanet"], value_heads=8, chunk_size=4
)
REGISTRY["kda_recurrent_conv"] = dataclasses.replace(
    REGISTRY["kda"], form="recurrent", short_conv=3
)
# Mamba-2 with B and C in 2 groups, decays in (-1, 1], chunks of 4; DeltaProduct with
# three steps per token in the recurrent form (the preset has two, chunkwise).
REGISTRY["mamba2_groups_negative"] = dataclasses.replace(
    REGISTRY["mamba2"], groups=2, chunk_size=4, negative_eigenvalues=True
)
REGISTRY["deltaproduct3_recurrent"] = dataclasses.replace(
    REGISTRY["gated_deltaproduct"], householder_steps=3, form="recurrent"
)
# Score modifiers: FoX over a window's ring buffer (its gate sums are cache payload),
# T5 buckets with GQA, ALiBi with a soft-cap (applied first).
REGISTRY["fox_window"] = dataclasses.replace(REGISTRY["fox"], window=4)
REGISTRY["t5_gqa"] = dataclasses.replace(REGISTRY["t5"], num_kv_heads=2)
REGISTRY["alibi_softcap"] = dataclasses.replace(REGISTRY["alibi"], softcap=20.0)
# Attention functions as kinds (models.attention_kind): softpick over a window's ring buffer.
REGISTRY["softpick_window"] = dataclasses.replace(REGISTRY["softpick"], window=4)
# Differential attention with GQA over a window's ring buffer, at the first layer's lambda_init.
REGISTRY["diff_window_gqa"] = dataclasses.replace(
    REGISTRY["diff"], window=4, num_kv_heads=2, lambda_init=depth_lambda_init(1)
)

# Sparse attention at sizes where the selection matters within MAX_LEN = 16 tokens: MoBA's
# 2 blocks of 4 with GQA, NSA's 2 selected blocks of 4 beside blocks of 4 compressed every 2
# and a window of 4, DSA's 4 tokens with ALiBi and a soft-cap.
REGISTRY["moba_small"] = dataclasses.replace(
    REGISTRY["moba"], block_size=4, top_k=2, num_kv_heads=2
)
REGISTRY["nsa_small"] = dataclasses.replace(
    REGISTRY["nsa"], compress_block=4, compress_stride=2, select_block=4, num_selected=2,
    branch_window=4, compress_hidden=8, num_kv_heads=2,
)  # fmt: skip
REGISTRY["dsa_small"] = dataclasses.replace(
    REGISTRY["dsa"], top_k=4, index_heads=2, index_dim=8, score="alibi", softcap=20.0
)

# The newest families at sizes where their pieces matter within MAX_LEN = 16 tokens: RWKV-7
# in chunks of 4, PaTH-FoX with GQA, blocks of 4 and a rank-8 projection to w.
REGISTRY["rwkv7_chunks"] = dataclasses.replace(REGISTRY["rwkv7"], chunk_size=4)
# The log-linear kinds in chunks of 4 with 4 levels (the top one shared past 8 tokens), Mamba-2's
# B and C in 2 groups, Gated DeltaNet's 8 value heads in the recurrent form.
REGISTRY["log_linear_mamba2_small"] = dataclasses.replace(
    REGISTRY["log_linear_mamba2"], chunk_size=4, num_levels=4, groups=2
)
REGISTRY["log_linear_gdn_grouped"] = dataclasses.replace(
    REGISTRY["log_linear_gated_deltanet"], num_levels=4, value_heads=8, form="recurrent"
)
REGISTRY["comba_grouped"] = dataclasses.replace(REGISTRY["comba"], chunk_size=4, value_heads=8)
REGISTRY["path_fox_small"] = dataclasses.replace(
    REGISTRY["path_fox"], num_kv_heads=2, block_size=4, w_rank=8
)
# The trained memories. TTT and Titans in mini-batches of 4 (several within MAX_LEN = 16
# tokens): TTT-Linear's dual form with its convolutions, TTT-MLP's primal form with separate q
# and k projections, Titans' MLP memory.
REGISTRY["ttt_linear_small"] = dataclasses.replace(REGISTRY["ttt_linear"], mini_batch=4)
REGISTRY["ttt_mlp_small"] = dataclasses.replace(
    REGISTRY["ttt_mlp"], mini_batch=4, form="primal", qk_conv=0, mlp_ratio=2
)
REGISTRY["titans_small"] = dataclasses.replace(REGISTRY["titans"], mini_batch=4, mlp_ratio=2)
# MesaNet in chunks of 4 with 4 CG steps and the output gate.
REGISTRY["mesanet_small"] = dataclasses.replace(
    REGISTRY["mesanet"], chunk_size=4, cg_steps=4, output_gate=True
)

# One decoder per attention kind; the hybrid mixes all three cache kinds and convolutions.
KINDS = {
    "mha": ("mha", "mha"),
    "gqa": ("gqa", "gqa_gated_softcap_sinks_conv"),
    "mqa": ("mqa", "mqa"),
    "mla": ("mla", "mla_direct_q_gated"),
    "window": ("window", "window"),
    "streaming": ("streaming", "streaming"),
    "global_tokens": ("global_tokens", "global_tokens"),
    "linear": ("linear", "linear"),
    "linear_decay": ("lightning", "linear_decay", "linear_favor"),  # MiniMax-01's first
    "hybrid": ("linear_decay_gated_conv", "mla_conv", "streaming_conv"),
    "blockwise": ("streaming_blockwise", "gqa_blockwise"),  # attn's FlashAttention impl
    "delta": ("deltanet", "kda_recurrent_conv"),
    "delta_hybrid": ("gated_deltanet", "gated_deltanet_grouped", "mha"),
    "scores": ("alibi_softcap", "fox_window", "t5_gqa"),
    "diff": ("diff", "diff_window_gqa"),
    "functions": ("sigmoid", "softpick_window"),
    # The state-tracking kinds and the note's hybrid: fixed states, then softmax.
    "ssm_hybrid": (
        "mamba2",
        "mamba2_groups_negative",
        "gated_deltaproduct",
        "deltaproduct3_recurrent",
        "mha",
    ),
    "sparse": ("moba_small", "nsa_small", "dsa_small"),
    "families2025": (
        "rwkv7_chunks",
        "path_fox_small",
        "log_linear_mamba2_small",
        "log_linear_gdn_grouped",
        "comba_grouped",
    ),
    "ttt": ("ttt_linear_small", "ttt_mlp_small", "titans_small", "mesanet_small"),
}


def config_for(names, **kwargs) -> models.ModelConfig:
    return models.ModelConfig(
        vocab_size=VOCAB, width=WIDTH, layers=models.pattern(names, REGISTRY), **kwargs
    )


@functools.cache
def model_for(names: tuple[str, ...], cls=models.Decoder, seed: int = 0, **kwargs):
    model = cls(config_for(names, **kwargs), rngs=nnx.Rngs(seed))
    # A short conv starts as the identity, which no test could tell from no conv at
    # all: give its taps random values (fixed by the seed).
    rng = np.random.default_rng(seed)
    for block in (*getattr(model, "encoder_blocks", ()), *model.blocks):
        if block.conv is not None:
            shape = block.conv.weight[...].shape
            block.conv.weight.set_value(jnp.asarray(rng.normal(0.0, 0.5, shape), jnp.float32))
    return model


def tokens(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, shape), jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "capture"))
def _apply(graphdef, state, args, kwargs, *, capture):
    model = nnx.merge(graphdef, state)
    if capture:
        return models.capture_weights(model, *args, **kwargs)
    return model(*args, **kwargs)


def apply(model, *args, capture=False, **kwargs):
    """Jitted ``model(*args, **kwargs)`` (``models.capture_weights`` with ``capture``);
    kwargs are arrays or None. Head gates are state, so setting them reuses the compile."""
    graphdef, state = nnx.split(model)
    return _apply(graphdef, state, args, kwargs, capture=capture)


def forward(model, tokens, *, capture=False):
    """Jitted ``model(tokens)``."""
    return apply(model, tokens, capture=capture)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _extend(graphdef, state, tokens, cache, lengths):
    model = nnx.merge(graphdef, state)
    if tokens.shape[1] == 1 and lengths is None:
        logits, cache = model.decode_step(tokens[:, 0], cache)
        return logits[:, None], cache
    return model.prefill(tokens, cache, lengths)


def extend(model, tokens, cache, lengths=None):
    """Jitted ``prefill`` (or ``decode_step`` for one token without lengths)."""
    graphdef, state = nnx.split(model)
    return _extend(graphdef, state, tokens, cache, lengths)


def init_cache(model, batch=B, max_len=MAX_LEN):
    return model.init_cache(batch, max_len)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len"))
def _init_cache(graphdef, state, max_len, kwargs):
    return nnx.merge(graphdef, state).init_cache(B, max_len, **kwargs)


def init_enc_dec_cache(model, src, src_lengths, max_len=MAX_LEN):
    """Jitted ``EncoderDecoder.init_cache`` (it runs the encoder)."""
    graphdef, state = nnx.split(model)
    return _init_cache(graphdef, state, max_len, {"src": src, "src_lengths": src_lengths})
