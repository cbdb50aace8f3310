"""Attention layers, the MLP and the block: thin Flax NNX modules around ``attn``.

Every attention module has the same surface, so blocks and models never branch
on the kind:

* ``__call__(x [B,T,D], *, positions, segment_ids, valid, head_gates, capture_weights)``
  -> ``(y [B,T,D], weights [B,N,T,S] or None)``: the whole sequence at once.
* ``init_cache(batch, max_len)`` -> the layer's cache pytree.
* ``extend(x [B,T,D], cache, start [B], lengths [B] or None, *, head_gates)``
  -> ``(y [B,T,D], cache)``: T new tokens per row at positions ``start[b] + t``,
  of which ``lengths[b]`` are real (None: all T). Prefill and decoding
  (T = 1) are both ``extend``.

``head_gates`` ``[N]`` multiplies each head's output before the output
projection (ones = no change): ablation and gradient-based head importance.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import attn
from attn.linear import (
    FEATURE_MAPS,
    LinearState,
    favor_projection,
    init_linear_state,
    linear_attention,
    linear_attention_step,
    linear_feature_dim,
)
from models.cache import (
    EMPTY,
    CrossCache,
    KVCache,
    LatentCache,
    write_token,
    write_tokens,
)
from models.config import EXP_KERNEL_MAPS, JAX_NN_IMPLS, AttentionConfig, ModelConfig

# Gated linear attention: gates are sigmoid(x W + b) ** (1 / 16) (Yang et al.
# 2023), so they start close to 1 (long memory) and learn to forget.
GATE_TEMPERATURE = 16.0
GATE_BIAS_INIT = 2.0


class Buffer(nnx.Variable):
    """A non-trainable array owned by a module (e.g. FAVOR+ random features)."""


def _dense(d_in, d_out, *, dtype, param_dtype, rngs, **kwargs):
    kwargs.setdefault("use_bias", False)
    return nnx.Linear(d_in, d_out, dtype=dtype, param_dtype=param_dtype, rngs=rngs, **kwargs)


def _cached_impl(impl: str) -> str:
    """jax.nn's kernels cannot take the positions and segment ids that cached and
    cross-attention calls pass, so those calls let "auto" pick one that can."""
    return "auto" if impl in JAX_NN_IMPLS else impl


def _step_positions(start, T: int):
    """``[B,T]`` absolute positions ``start[b] + t``."""
    return start[:, None].astype(jnp.int32) + jnp.arange(T, dtype=jnp.int32)


def _valid(lengths, B: int, T: int):
    """``[B,T]`` bool: the first ``lengths[b]`` tokens of each row are real (None: all)."""
    if lengths is None:
        return jnp.ones((B, T), bool)
    return jnp.arange(T)[None, :] < lengths[:, None]


def _gate_heads(out, head_gates):
    """``out [B,T,N,E]`` times ``head_gates [N]`` per head (None: unchanged)."""
    if head_gates is None:
        return out
    return out * jnp.asarray(head_gates, out.dtype)[:, None]


class _Softmax(nnx.Module):
    """What softmax-based layers share: the mask, sink logits and the call into ``attn``."""

    def _init_common(self, cfg: AttentionConfig, causal: bool, dtype, param_dtype):
        self.cfg = cfg
        self.causal = causal
        self.dtype = dtype
        self.sink_logits = (
            nnx.Param(jnp.zeros((cfg.num_heads,), param_dtype)) if cfg.sink_logits else None
        )

    def _attend(self, q, k, v, *, impl, capture, scale=None, **kwargs):
        """``attn.attention`` with this layer's mask, soft-cap and learned sink logits.

        Weights are only materialized by the dense implementation, so capture
        uses it (every implementation computes the same function).
        """
        extra = dict(kwargs)
        if self.cfg.softcap is not None:
            extra["softcap"] = self.cfg.softcap
        if self.sink_logits is not None:
            extra["sink_logits"] = self.sink_logits[...]
        if scale is not None:
            extra["scale"] = scale
        mask = self.cfg.mask(self.causal)
        if capture:
            return attn.attention(q, k, v, impl="dense", mask=mask, return_weights=True, **extra)
        return attn.attention(q, k, v, impl=impl, mask=mask, **extra), None

    def _full_kwargs(self, positions, segment_ids):
        """Position and segment arguments of a whole-sequence call (none when default,
        so positionless implementations such as jax.nn's stay eligible)."""
        kw = {}
        if positions is not None:
            kw.update(q_positions=positions, kv_positions=positions)
        if segment_ids is not None:
            kw.update(q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
        return kw

    def _cached_kwargs(self, positions, kv_pos):
        """Cached calls see slots by their stored positions; empty slots by segment id 0."""
        B, T = positions.shape
        return dict(
            q_positions=positions,
            kv_positions=kv_pos,
            q_segment_ids=jnp.ones((B, T), jnp.int32),
            kv_segment_ids=(kv_pos != EMPTY).astype(jnp.int32),
        )


class SelfAttention(_Softmax):
    """Softmax self-attention: MHA (K == N), GQA (1 < K < N), MQA (K == 1), any mask.

    Parameters: q ``[D, N*H]``, k and v ``[D, K*H]``, o ``[N*H, D]``, optional sink
    logits ``[N]``. RoPE (``cfg.rope``) rotates q and k at their absolute positions.
    """

    def __init__(self, cfg: AttentionConfig, width: int, *, causal: bool, dtype, param_dtype, rngs):
        self._init_common(cfg, causal, dtype, param_dtype)
        N, K, H = cfg.num_heads, cfg.kv_heads, cfg.head_dim
        dense = functools.partial(_dense, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = dense(width, N * H)
        self.k_proj = dense(width, K * H)
        self.v_proj = dense(width, K * H)
        self.o_proj = dense(N * H, width)

    def _project(self, x, positions):
        """q ``[B,T,N,H]``, k and v ``[B,T,K,H]`` from x ``[B,T,D]`` at positions ``[B,T]``."""
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(B, T, cfg.kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(B, T, cfg.kv_heads, cfg.head_dim)
        if cfg.rope:
            rope = functools.partial(
                attn.apply_rope, positions=positions, base=cfg.rope_base, rotary_dim=cfg.rotary_dim
            )
            q, k = rope(q), rope(k)
        chex.assert_shape(q, (B, T, cfg.num_heads, cfg.head_dim))
        chex.assert_equal_shape([k, v])
        return q, k, v

    def _output(self, out, head_gates):
        B, T, N, E = out.shape
        return self.o_proj(_gate_heads(out, head_gates).reshape(B, T, N * E))

    def __call__(
        self,
        x,
        *,
        positions=None,
        segment_ids=None,
        valid=None,
        head_gates=None,
        capture_weights=False,
    ):
        """Self-attention over the whole sequence.

        Args:
          x: ``[B,T,D]``.
          positions: ``[B,T]`` ints (default ``arange(T)``), for RoPE and the mask.
          segment_ids: ``[B,T]`` ints; tokens attend within their segment (padding, packing).
          valid: unused (padding is expressed by ``segment_ids``).
          head_gates: ``[N]`` per-head output multipliers, or None.
          capture_weights: also return the weights ``[B,N,T,T]``.

        Returns:
          ``(y [B,T,D], weights [B,N,T,T] float32 or None)``.
        """
        del valid
        q, k, v = self._project(x, jnp.arange(x.shape[1]) if positions is None else positions)
        out, w = self._attend(
            q,
            k,
            v,
            impl=self.cfg.impl,
            capture=capture_weights,
            **self._full_kwargs(positions, segment_ids),
        )
        return self._output(out, head_gates), w

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """Empty ``KVCache``: k, v ``[B,S,K,H]`` with S from ``cfg.cache_layout(max_len)``."""
        cfg = self.cfg
        S, pinned = cfg.cache_layout(max_len)
        shape = (batch, S, cfg.kv_heads, cfg.head_dim)
        return KVCache(
            k=jnp.zeros(shape, self.dtype),
            v=jnp.zeros(shape, self.dtype),
            pos=jnp.full((batch, S), EMPTY, jnp.int32),
            pinned=pinned,
            ring=max_len > S,  # a window's ring buffer; else one slot per position
        )

    def extend(self, x, cache: KVCache, start, lengths=None, *, head_gates=None):
        """Attends T new tokens to the cache and themselves, and stores them.

        Args:
          x: ``[B,T,D]``; cache: ``KVCache``; start: ``[B]`` position of ``x[:, 0]``.
          lengths: ``[B]`` real tokens per row, or None (all T).
          head_gates: ``[N]`` or None.

        Returns:
          ``(y [B,T,D], KVCache)``.
        """
        B, T, _ = x.shape
        positions = _step_positions(start, T)
        q, k, v = self._project(x, positions)
        if T == 1 and lengths is None:
            # Decoding: write first, then attend over the cache alone. In a ring
            # the overwritten entry is w positions back, already outside the window.
            (keys, values), kv_pos = write_token(
                (cache.k, cache.v), cache.pos, (k, v), start, cache.pinned
            )
            new_k, new_v, new_pos = keys, values, kv_pos
        else:
            # Prefill: the prompt may be longer than a ring buffer, so attend over
            # the old entries plus all new tokens, then keep what the cache can hold.
            valid = _valid(lengths, B, T)
            keys = jnp.concatenate([cache.k, k.astype(cache.k.dtype)], axis=1)
            values = jnp.concatenate([cache.v, v.astype(cache.v.dtype)], axis=1)
            kv_pos = jnp.concatenate([cache.pos, jnp.where(valid, positions, EMPTY)], axis=1)
            count = valid.sum(-1).astype(jnp.int32)
            (new_k, new_v), new_pos = write_tokens(
                (cache.k, cache.v), cache.pos, (k, v), start, count, cache.pinned
            )
        out, _ = self._attend(
            q,
            keys,
            values,
            impl=_cached_impl(self.cfg.impl),
            capture=False,
            **self._cached_kwargs(positions, kv_pos),
        )
        return self._output(out, head_gates), KVCache(
            new_k, new_v, new_pos, pinned=cache.pinned, ring=cache.ring
        )


class LatentAttention(_Softmax):
    """Multi-head latent attention (DeepSeek-V2).

    Keys and values of all heads are up-projected from one latent
    ``c_kv = norm(x W_dkv) [B,S,R]``; positions enter through a decoupled RoPE key
    ``k_rope [B,S,Hr]`` shared by the heads. Head n's key is
    ``[c_kv W_uk[:, n], k_rope]`` and its value ``c_kv W_uv[:, n]``; queries are
    ``[q_nope, rope(q_rope)]`` per head, from ``x`` directly or through a query
    latent of rank ``q_rank``.

    Two equal ways to compute it (``absorbed``), the two forms of
    ``attn.latent_attention``; this module owns the parameters, projections,
    RoPE and the cache:

    * naive: materialize per-head keys ``[B,S,N,Hn+Hr]`` and values ``[B,S,N,E]``
      and run MHA;
    * absorbed (decoding): the up-projections move to the query and output
      side. Scores are ``(q_nope W_uk^T) . c_kv + q_rope . k_rope``, i.e. MQA with
      one shared key ``[c_kv, k_rope]`` of width R + Hr and value ``c_kv``; the
      latent output ``[B,T,N,R]`` is up-projected by ``W_uv`` before the output
      projection. The cache holds only ``c_kv`` and ``k_rope``.

    The logit scale is ``1/sqrt(Hn + Hr)`` in both (the naive head dim).
    """

    def __init__(self, cfg: AttentionConfig, width: int, *, causal: bool, dtype, param_dtype, rngs):
        self._init_common(cfg, causal, dtype, param_dtype)
        N, R, Hr, Hn, E = (
            cfg.num_heads,
            cfg.kv_rank,
            cfg.rope_head_dim,
            cfg.qk_nope_dim,
            cfg.value_dim,
        )
        dense = functools.partial(_dense, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm = functools.partial(nnx.RMSNorm, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if cfg.q_rank is None:
            self.q_proj = dense(width, N * (Hn + Hr))
            self.q_down = self.q_norm = self.q_up = None
        else:
            self.q_proj = None
            self.q_down = dense(width, cfg.q_rank)
            self.q_norm = norm(cfg.q_rank)
            self.q_up = dense(cfg.q_rank, N * (Hn + Hr))
        self.kv_down = dense(width, R + Hr)  # the latent and the shared RoPE key, one matmul
        self.kv_norm = norm(R)
        # Up-projections [R,N,H]: fan-in R, the latent axis.
        init = jax.nn.initializers.variance_scaling(
            1.0, "fan_in", "truncated_normal", in_axis=0, out_axis=(1, 2)
        )
        self.w_uk = nnx.Param(init(rngs.params(), (R, N, Hn), param_dtype))
        self.w_uv = nnx.Param(init(rngs.params(), (R, N, E), param_dtype))
        self.o_proj = dense(N * E, width)

    @property
    def scale(self) -> float:
        return (self.cfg.qk_nope_dim + self.cfg.rope_head_dim) ** -0.5

    def _queries(self, x, positions):
        """q_nope ``[B,T,N,Hn]`` and rotated q_rope ``[B,T,N,Hr]``."""
        cfg = self.cfg
        B, T, _ = x.shape
        direct = self.q_proj is not None
        h = self.q_proj(x) if direct else self.q_up(self.q_norm(self.q_down(x)))
        q = h.reshape(B, T, cfg.num_heads, cfg.qk_nope_dim + cfg.rope_head_dim)
        q_nope, q_rope = q[..., : cfg.qk_nope_dim], q[..., cfg.qk_nope_dim :]
        return q_nope, attn.apply_rope(q_rope, positions, base=cfg.rope_base)

    def _latent(self, x, positions):
        """c_kv ``[B,T,R]`` (normalized) and the rotated shared key k_rope ``[B,T,Hr]``."""
        R = self.cfg.kv_rank
        h = self.kv_down(x)
        c_kv = self.kv_norm(h[..., :R])
        k_rope = attn.apply_rope(h[..., R:][:, :, None], positions, base=self.cfg.rope_base)
        return c_kv, k_rope[:, :, 0]

    def _mla(self, q_nope, q_rope, c_kv, k_rope, *, form, impl, capture, **kwargs):
        """``attn.latent_attention`` with this layer's up-projections, mask, soft-cap and
        learned sink logits (what ``_attend`` adds to ``attn.attention``). Returns
        ``(out [B,T,N,E], w)``.

        Weights are only materialized by the dense implementation, so capture uses it.
        """
        extra = dict(kwargs)
        if self.cfg.softcap is not None:
            extra["softcap"] = self.cfg.softcap
        if self.sink_logits is not None:
            extra["sink_logits"] = self.sink_logits[...]
        w_uk, w_uv = self.w_uk[...].astype(self.dtype), self.w_uv[...].astype(self.dtype)
        call = functools.partial(
            attn.latent_attention,
            q_nope,
            q_rope,
            c_kv,
            k_rope,
            w_uk,
            w_uv,
            form=form,
            mask=self.cfg.mask(self.causal),
            scale=self.scale,
            **extra,
        )
        if capture:
            return call(impl="dense", return_weights=True)
        return call(impl=impl), None

    def _output(self, out, head_gates):
        B, T, N, E = out.shape
        return self.o_proj(_gate_heads(out, head_gates).reshape(B, T, N * E))

    def __call__(
        self,
        x,
        *,
        positions=None,
        segment_ids=None,
        valid=None,
        head_gates=None,
        capture_weights=False,
        absorbed=False,
    ):
        """MLA over the whole sequence; arguments and result as ``SelfAttention.__call__``.

        ``absorbed`` picks the latent-space computation (same function).
        """
        del valid
        rope_pos = jnp.arange(x.shape[1]) if positions is None else positions
        q_nope, q_rope = self._queries(x, rope_pos)
        c_kv, k_rope = self._latent(x, rope_pos)
        out, w = self._mla(
            q_nope,
            q_rope,
            c_kv,
            k_rope,
            form="absorbed" if absorbed else "naive",
            impl=self.cfg.impl,
            capture=capture_weights,
            **self._full_kwargs(positions, segment_ids),
        )
        return self._output(out, head_gates), w

    def init_cache(self, batch: int, max_len: int) -> LatentCache:
        """Empty ``LatentCache``: c_kv ``[B,S,R]``, k_rope ``[B,S,Hr]``."""
        cfg = self.cfg
        S, pinned = cfg.cache_layout(max_len)
        return LatentCache(
            c_kv=jnp.zeros((batch, S, cfg.kv_rank), self.dtype),
            k_rope=jnp.zeros((batch, S, cfg.rope_head_dim), self.dtype),
            pos=jnp.full((batch, S), EMPTY, jnp.int32),
            pinned=pinned,
            ring=max_len > S,
        )

    def extend(self, x, cache: LatentCache, start, lengths=None, *, head_gates=None):
        """As ``SelfAttention.extend``, attending in latent space (absorbed)."""
        B, T, _ = x.shape
        positions = _step_positions(start, T)
        q_nope, q_rope = self._queries(x, positions)
        c_kv, k_rope = self._latent(x, positions)
        old = (cache.c_kv, cache.k_rope)
        if T == 1 and lengths is None:
            (all_c, all_r), kv_pos = write_token(
                old, cache.pos, (c_kv, k_rope), start, cache.pinned
            )
            new_c, new_r, new_pos = all_c, all_r, kv_pos
        else:
            valid = _valid(lengths, B, T)
            all_c = jnp.concatenate([cache.c_kv, c_kv.astype(cache.c_kv.dtype)], axis=1)
            all_r = jnp.concatenate([cache.k_rope, k_rope.astype(cache.k_rope.dtype)], axis=1)
            kv_pos = jnp.concatenate([cache.pos, jnp.where(valid, positions, EMPTY)], axis=1)
            count = valid.sum(-1).astype(jnp.int32)
            (new_c, new_r), new_pos = write_tokens(
                old, cache.pos, (c_kv, k_rope), start, count, cache.pinned
            )
        out, _ = self._mla(
            q_nope,
            q_rope,
            all_c,
            all_r,
            form="absorbed",
            impl=_cached_impl(self.cfg.impl),
            capture=False,
            **self._cached_kwargs(positions, kv_pos),
        )
        return self._output(out, head_gates), LatentCache(
            new_c, new_r, new_pos, pinned=cache.pinned, ring=cache.ring
        )


class LinearAttention(nnx.Module):
    """Linear attention ``phi(q).phi(k)`` (``attn.linear``), any feature map, form and decay.

    Parameters: q ``[D, N*H]``, k and v ``[D, K*H]``, o ``[N*H, D]``; with gating a
    gate projection ``[D, N]`` (+ bias) giving log-gates
    ``log_sigmoid(x W_g + b) / GATE_TEMPERATURE`` ``[B,T,N]``; for ``"favor"`` fixed
    random features ``[H, F]`` (a ``Buffer``, not trained). Fixed decay gammas
    are static config. The decode cache is the recurrent ``LinearState``.

    Padding (right-padded prompts, padded encoder inputs): a padding key must
    add nothing to the state and the normalizer, and a padding step must not
    decay it. ``attn.linear`` has no key mask, so the key gets one extra
    channel, 1 on real tokens and 0 on padding, which the feature map reads to
    zero its features; the decay is folded into log-gates that are 0 (no decay)
    on padding. Real tokens' outputs and the final state are then exactly
    those of the unpadded rows.
    """

    def __init__(self, cfg: AttentionConfig, width: int, *, causal: bool, dtype, param_dtype, rngs):
        if not causal and (cfg.decay is not None or cfg.gating):
            raise ValueError(
                "decay/gating: expected None/False in a bidirectional encoder (decay needs an "
                f"order), got decay={cfg.decay!r}, gating={cfg.gating!r}"
            )
        self.cfg = cfg
        self.causal = causal
        self.dtype = dtype
        N, K, H = cfg.num_heads, cfg.kv_heads, cfg.head_dim
        dense = functools.partial(_dense, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = dense(width, N * H)
        self.k_proj = dense(width, K * H)
        self.v_proj = dense(width, K * H)
        self.o_proj = dense(N * H, width)
        self.gate_proj = (
            _dense(
                width,
                N,
                dtype=jnp.float32,
                param_dtype=param_dtype,
                rngs=rngs,
                use_bias=True,
                bias_init=jax.nn.initializers.constant(GATE_BIAS_INIT),
            )
            if cfg.gating
            else None
        )
        self.projection = (
            Buffer(favor_projection(rngs.params(), H, cfg.num_features))
            if cfg.feature_map == "favor"
            else None
        )

    @property
    def scale(self) -> float:
        # Passed explicitly (attn.linear's default for these maps) because the
        # padding path widens the key by one channel.
        return self.cfg.head_dim**-0.5 if self.cfg.feature_map in EXP_KERNEL_MAPS else 1.0

    @property
    def feature_dim(self) -> int:
        """F of the feature map."""
        proj = None if self.projection is None else self.projection[...]
        return linear_feature_dim(self.cfg.feature_map, self.cfg.head_dim, projection=proj)

    def _map_kwargs(self):
        proj = None if self.projection is None else self.projection[...]
        return dict(
            feature_map=self.cfg.feature_map,
            projection=proj,
            normalize=self.cfg.normalize,
            scale=self.scale,
        )

    def _masked_map(self):
        """``[..., H+1] -> [..., F]``: the feature map of the first H channels, zeroed
        where the last channel (the validity flag) is 0."""
        phi = FEATURE_MAPS[self.cfg.feature_map]
        if self.projection is not None:
            phi = functools.partial(phi, projection=self.projection[...])

        def masked(x):
            return phi(x[..., :-1]) * (x[..., -1:] != 0)

        return masked

    def _gammas(self):
        gammas = self.cfg.decay_values()
        return None if gammas is None else np.asarray(gammas, np.float32)

    def _project(self, x, positions):
        """q ``[B,T,N,H]``, k, v ``[B,T,K,H]`` and log-gates ``[B,T,N]`` float32 (or None)."""
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(B, T, cfg.kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(B, T, cfg.kv_heads, cfg.head_dim)
        if cfg.rope:
            rope = functools.partial(
                attn.apply_rope, positions=positions, base=cfg.rope_base, rotary_dim=cfg.rotary_dim
            )
            q, k = rope(q), rope(k)
        log_gates = None
        if self.gate_proj is not None:
            log_gates = jax.nn.log_sigmoid(self.gate_proj(x.astype(jnp.float32)))
            log_gates = log_gates / GATE_TEMPERATURE
        return q, k, v, log_gates

    def _sequence(self, q, k, v, log_gates, valid, initial_state=None, return_state=False):
        """``attn.linear.linear_attention`` over T tokens, with ``valid [B,T]`` or None."""
        cfg = self.cfg
        common = dict(
            form=cfg.form,
            causal=self.causal,
            chunk_size=cfg.chunk_size,
            initial_state=initial_state,
            return_state=return_state,
        )
        if valid is None:
            return linear_attention(
                q, k, v, decay=self._gammas(), log_gates=log_gates, **common, **self._map_kwargs()
            )
        flag = valid[:, :, None, None].astype(k.dtype)
        q = jnp.concatenate([q, jnp.ones((*q.shape[:3], 1), q.dtype)], -1)
        k = jnp.concatenate([k, jnp.broadcast_to(flag, (*k.shape[:3], 1))], -1)
        log_a = None
        gammas = self._gammas()
        if gammas is not None or log_gates is not None:
            log_a = jnp.zeros((*valid.shape, cfg.num_heads), jnp.float32)
            if gammas is not None:
                log_a = log_a + jnp.log(gammas)
            if log_gates is not None:
                log_a = log_a + log_gates
            log_a = jnp.where(valid[..., None], log_a, 0.0)  # no decay on padding
        return linear_attention(
            q,
            k,
            v,
            log_gates=log_a,
            feature_map=self._masked_map(),
            normalize=cfg.normalize,
            scale=self.scale,
            **common,
        )

    def _output(self, out, head_gates):
        B, T, N, E = out.shape
        return self.o_proj(_gate_heads(out, head_gates).reshape(B, T, N * E))

    def __call__(
        self,
        x,
        *,
        positions=None,
        segment_ids=None,
        valid=None,
        head_gates=None,
        capture_weights=False,
    ):
        """Linear attention over the whole sequence.

        Args:
          x: ``[B,T,D]``.
          positions: ``[B,T]`` ints for RoPE (if ``cfg.rope``); default ``arange(T)``.
          segment_ids: must be None: the state would cross segments (use ``valid``
            for padding).
          valid: ``[B,T]`` bool, False on padding tokens, or None.
          head_gates: ``[N]`` or None.
          capture_weights: ignored (no ``[T,S]`` weights exist); returns None for them.

        Returns:
          ``(y [B,T,D], None)``.
        """
        if segment_ids is not None:
            raise ValueError(
                "segment_ids: expected None for linear attention (its state would cross "
                "segments; pass lengths for padding), got an array"
            )
        del capture_weights
        positions = jnp.arange(x.shape[1]) if positions is None else positions
        q, k, v, log_gates = self._project(x, positions)
        out = self._sequence(q, k, v, log_gates, valid)
        return self._output(out, head_gates), None

    def init_cache(self, batch: int, max_len: int) -> LinearState:
        """Zero ``LinearState``: kv ``[B,N,F,E]``, z ``[B,N,F]`` float32 (no length axis)."""
        del max_len
        cfg = self.cfg
        return init_linear_state(batch, cfg.num_heads, self.feature_dim, cfg.value_dim)

    def extend(self, x, cache: LinearState, start, lengths=None, *, head_gates=None):
        """Continues the recurrence over T new tokens. Arguments as ``SelfAttention.extend``."""
        B, T, _ = x.shape
        positions = _step_positions(start, T)
        q, k, v, log_gates = self._project(x, positions)
        if T == 1 and lengths is None:
            out, state = linear_attention_step(
                cache,
                q[:, 0],
                k[:, 0],
                v[:, 0],
                decay=self._gammas(),
                log_gate=None if log_gates is None else log_gates[:, 0],
                **self._map_kwargs(),
            )
            out = out[:, None]
        else:
            valid = None if lengths is None else _valid(lengths, B, T)
            out, state = self._sequence(
                q, k, v, log_gates, valid, initial_state=cache, return_state=True
            )
        return self._output(out, head_gates), LinearState(*state)


class CrossAttention(_Softmax):
    """Softmax cross-attention: T decoder queries over S encoder outputs (T != S).

    No RoPE and no mask (positions of two sequences are not comparable); source
    padding is hidden by segment ids (1 real, 0 padding). A query whose whole
    source is padding gets zeros.
    """

    def __init__(self, cfg: AttentionConfig, width: int, *, dtype, param_dtype, rngs):
        self._init_common(cfg, False, dtype, param_dtype)
        N, K, H = cfg.num_heads, cfg.kv_heads, cfg.head_dim
        dense = functools.partial(_dense, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = dense(width, N * H)
        self.k_proj = dense(width, K * H)
        self.v_proj = dense(width, K * H)
        self.o_proj = dense(N * H, width)

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

    def __call__(self, x, memory: CrossCache, *, head_gates=None, capture_weights=False):
        """Args: x ``[B,T,D]``; memory from ``memory()``. Returns ``(y [B,T,D], w [B,N,T,S])``."""
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, cfg.num_heads, cfg.head_dim)
        out, w = self._attend(
            q,
            memory.k,
            memory.v,
            impl=_cached_impl(cfg.impl),
            capture=capture_weights,
            q_segment_ids=jnp.ones((B, T), jnp.int32),
            kv_segment_ids=memory.segment_ids,
        )
        out = _gate_heads(out, head_gates)
        return self.o_proj(out.reshape(B, T, -1)), w


class MLP(nnx.Module):
    """SwiGLU: ``W_down (silu(x W_gate) * (x W_up))``, hidden width M."""

    def __init__(self, width: int, hidden: int, *, dtype, param_dtype, rngs):
        dense = functools.partial(_dense, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate = dense(width, hidden)
        self.up = dense(width, hidden)
        self.down = dense(hidden, width)

    def __call__(self, x):
        """``[B,T,D] -> [B,T,D]``."""
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


ATTENTION_MODULES = {"softmax": SelfAttention, "mla": LatentAttention, "linear": LinearAttention}


class Block(nnx.Module):
    """Pre-norm residual block: ``x + attn(norm(x))`` [``+ cross(norm(x))``] ``+ mlp(norm(x))``."""

    def __init__(
        self,
        config: ModelConfig,
        layer: AttentionConfig,
        *,
        causal: bool,
        cross: AttentionConfig | None = None,
        rngs: nnx.Rngs,
    ):
        D = config.width
        kw = dict(dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype))
        norm = functools.partial(nnx.RMSNorm, D, epsilon=config.norm_eps, rngs=rngs, **kw)
        self.kind = layer.kind
        self.attn_norm = norm()
        self.attn = ATTENTION_MODULES[layer.kind](layer, D, causal=causal, rngs=rngs, **kw)
        self.cross_norm = norm() if cross is not None else None
        self.cross = CrossAttention(cross, D, rngs=rngs, **kw) if cross is not None else None
        self.mlp_norm = norm()
        self.mlp = MLP(D, config.hidden_width, rngs=rngs, **kw)

    def __call__(
        self,
        x,
        *,
        positions=None,
        segment_ids=None,
        valid=None,
        memory: CrossCache | None = None,
        head_gates=None,
        capture_weights=False,
    ):
        """Args: x ``[B,T,D]``; the rest as the attention modules' ``__call__``.

        Returns:
          ``(x [B,T,D], (self weights, cross weights))``, each ``[B,N,T,S]`` or None.
        """
        a, w = self.attn(
            self.attn_norm(x),
            positions=positions,
            segment_ids=None if self.kind == "linear" else segment_ids,
            valid=valid,
            head_gates=head_gates,
            capture_weights=capture_weights,
        )
        x = x + a
        wc = None
        if self.cross is not None:
            c, wc = self.cross(self.cross_norm(x), memory, capture_weights=capture_weights)
            x = x + c
        return x + self.mlp(self.mlp_norm(x)), (w, wc)

    def extend(self, x, cache, start, lengths=None, *, memory=None, head_gates=None):
        """Args: x ``[B,T,D]``, the layer's cache, start ``[B]``, lengths ``[B]`` or None.

        Returns:
          ``(x [B,T,D], cache)``.
        """
        a, cache = self.attn.extend(self.attn_norm(x), cache, start, lengths, head_gates=head_gates)
        x = x + a
        if self.cross is not None:
            c, _ = self.cross(self.cross_norm(x), memory)
            x = x + c
        return x + self.mlp(self.mlp_norm(x)), cache
