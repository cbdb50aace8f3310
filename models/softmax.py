"""Softmax attention modules: ``SelfAttention`` (MHA/GQA/MQA, any mask) and ``CrossAttention``.

``Softmax`` is what softmax-based layers share (``LatentAttention`` too): the
layer's mask, soft-cap and learned sink logits around a call into ``attn``,
the weights tap, and the slot layout of their decode caches.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from flax import nnx

import attn
from models.cache import EMPTY, CrossCache, KVCache
from models.config import AttentionConfig
from models.heads import Heads, cached_impl, step_positions


class Softmax(Heads):
    """Base of softmax layers: mask, soft-cap, sink logits, the weights tap, cache slots."""

    def _init_softmax(self, cfg: AttentionConfig, *, causal: bool, dtype, param_dtype):
        self._init_heads(cfg, causal=causal, dtype=dtype)
        self.sink_logits = (
            nnx.Param(jnp.zeros((cfg.num_heads,), param_dtype)) if cfg.sink_logits else None
        )

    def _softmax(self, fn, *args, impl: str, tap: bool = False, **kwargs):
        """``fn(*args, ...)`` (``attn.attention`` or ``attn.latent_attention``) with this
        layer's mask, soft-cap and learned sink logits; returns ``out [B,T,N,E]``.

        With ``tap`` and ``sow_weights`` it also sows the weights ``[B,N,T,S]``:
        only the dense implementation materializes them, so the tapped call uses
        it (every implementation computes the same function).
        """
        kwargs["mask"] = self.cfg.mask(self.causal)
        if self.cfg.softcap is not None:
            kwargs["softcap"] = self.cfg.softcap
        if self.sink_logits is not None:
            kwargs["sink_logits"] = self.sink_logits[...]
        if tap and self.sow_weights:
            out, weights = fn(*args, impl="dense", return_weights=True, **kwargs)
            self._sow(weights)
            return out
        return fn(*args, impl=impl, **kwargs)

    @staticmethod
    def _full_kwargs(positions, segment_ids) -> dict:
        """Position and segment arguments of a whole-sequence call (none when default,
        so positionless implementations such as jax.nn's stay eligible)."""
        kw = {}
        if positions is not None:
            kw.update(q_positions=positions, kv_positions=positions)
        if segment_ids is not None:
            kw.update(q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
        return kw

    @staticmethod
    def _cached_kwargs(positions, kv_pos) -> dict:
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


class SelfAttention(Softmax):
    """Softmax self-attention: MHA (K == N), GQA (1 < K < N), MQA (K == 1), any mask.

    Parameters: q ``[D, N*H]``, k and v ``[D, K*H]``, o ``[N*H, D]``, optional sink
    logits ``[N]``. RoPE (``cfg.rope``) rotates q and k at their absolute positions.
    """

    def __init__(self, cfg: AttentionConfig, width: int, *, causal: bool, dtype, param_dtype, rngs):
        self._init_softmax(cfg, causal=causal, dtype=dtype, param_dtype=param_dtype)
        self._init_qkv(width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, *, positions=None, segment_ids=None):
        """Self-attention over the whole sequence.

        Args:
          x: ``[B,T,D]``.
          positions: ``[B,T]`` ints (default ``arange(T)``), for RoPE and the mask.
          segment_ids: ``[B,T]`` ints; tokens attend within their segment (packing;
            id 0 is padding).

        Returns:
          ``y [B,T,D]``.
        """
        q, k, v = self._qkv(x, jnp.arange(x.shape[1]) if positions is None else positions)
        kwargs = self._full_kwargs(positions, segment_ids)
        out = self._softmax(attn.attention, q, k, v, impl=self.cfg.impl, tap=True, **kwargs)
        return self._output(out)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """Empty ``KVCache``: k, v ``[B,S,K,H]`` with S from ``cfg.cache_layout(max_len)``."""
        cfg = self.cfg
        S, fields = self._slots(batch, max_len)
        zeros = functools.partial(jnp.zeros, (batch, S, cfg.kv_heads, cfg.head_dim), self.dtype)
        return KVCache(zeros(), zeros(), **fields)

    def extend(self, x, cache: KVCache, start, lengths=None):
        """Attends T new tokens to the cache and themselves, and stores them.

        Args:
          x: ``[B,T,D]``; cache: ``KVCache``; start: ``[B]`` position of ``x[:, 0]``.
          lengths: ``[B]`` real tokens per row, or None (all T).

        Returns:
          ``(y [B,T,D], KVCache)``.
        """
        positions = step_positions(start, x.shape[1])
        q, k, v = self._qkv(x, positions)
        (keys, values), kv_pos, cache = cache.extend((k, v), start, lengths)
        kwargs = self._cached_kwargs(positions, kv_pos)
        out = self._softmax(
            attn.attention, q, keys, values, impl=cached_impl(self.cfg.impl), **kwargs
        )
        return self._output(out), cache


class CrossAttention(Softmax):
    """Softmax cross-attention: T decoder queries over S encoder outputs (T != S).

    No RoPE and no mask (positions of two sequences are not comparable); source
    padding is hidden by segment ids (1 real, 0 padding). A query whose whole
    source is padding gets zeros.
    """

    def __init__(self, cfg: AttentionConfig, width: int, *, dtype, param_dtype, rngs):
        self._init_softmax(cfg, causal=False, dtype=dtype, param_dtype=param_dtype)
        self._init_qkv(width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def memory(self, memory, segment_ids) -> CrossCache:
        """Keys and values ``[B,S,K,H]`` of the encoder output ``memory [B,S,D]``.

        Args:
          memory: ``[B,S,D]``; segment_ids: ``[B,S]`` ints, 1 real and 0 padding.
        """
        cfg = self.cfg
        B, S, _ = memory.shape
        return CrossCache(
            k=self.k_proj(memory).reshape(B, S, cfg.kv_heads, cfg.head_dim),
            v=self.v_proj(memory).reshape(B, S, cfg.kv_heads, cfg.head_dim),
            segment_ids=segment_ids.astype(jnp.int32),
        )

    def __call__(self, x, memory: CrossCache):
        """Args: x ``[B,T,D]``; memory from ``memory()``. Returns ``y [B,T,D]``."""
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, cfg.num_heads, cfg.head_dim)
        out = self._softmax(
            attn.attention,
            q,
            memory.k,
            memory.v,
            impl=cached_impl(cfg.impl),
            tap=True,
            q_segment_ids=jnp.ones((B, T), jnp.int32),
            kv_segment_ids=memory.segment_ids,
        )
        return self._output(out)
