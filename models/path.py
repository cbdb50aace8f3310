"""``PathAttention``: PaTH attention's layer (Yang et al. 2025) around ``attn.path_attention``.

One layer kind, ``"path"``, configured by ``PathConfig``; the presets ``path``
and ``path_fox`` (PaTH with FoX's forget gate, PaTH-FoX) are registered here.

The layer as the paper and fla's ``PaTHAttention`` build it: q, k, v
projections (GQA with K kv heads, no RoPE: the transforms are the position
encoding); the transforms' directions from a low-rank projection of the
input, a short causal convolution with SiLU, and an L2 normalization per kv
head (``w [B,T,K,H]``); their strengths ``beta = 2 sigmoid(x W_beta + b)`` in
(0, 2) per kv head (eigenvalue ``1 - beta`` down to -1); optionally FoX's log
forget gates ``log sigmoid(x W_f + b)`` per query head, which fla's kernel adds to
the logits multiplied by the logit scale (``scale * (q . k~ + c_i - c_j)``), so
the layer passes ``attn.path_attention`` (which adds its ``log_forget`` sums
unscaled, as FoX does) the gates times ``H**-0.5``: the same weights give fla's
output; then ``attn.path_attention`` and the output projection.

Decoding keeps the keys transformed (``PathCache``): a cached key j holds
``H_{t-1} ... H_{j+1} k_j`` after token t - 1. A chunk of new tokens (a
prefill or one decode step) attends to the cache with its queries carried
back to the chunk's start (``attn.path_transform_queries``) and to itself
with ``attn.path_attention``, merged by log-sum-exp; then every cached key
passes the chunk's transforms (``attn.path_update_keys``) and the chunk's keys
are stored carried to its end (``attn.path_transform_keys``). The cached keys
change at every step, so they are kept in float32 whatever the compute dtype
(rounding them to bf16 at each step would accumulate). A full cache of
``max_len`` slots, never paged: each step rewrites every slot of the row.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx, struct

import attn
from attn import masks, scores
from attn.cache import EMPTY
from attn.checks import fail
from models.cache import ForgetCache, KVCache
from models.config import AttentionConfig, check_bool, check_positive_int, is_int, register_kind
from models.heads import Heads, dense
from models.patterns import PresetSizes, register_preset
from models.softmax import FORGET_BIAS_INIT

NORM_EPS = 1e-6  # the L2 normalization of w


@dataclasses.dataclass(frozen=True)
class PathConfig(AttentionConfig):
    """A PaTH attention layer (kind ``"path"``). Besides the common fields:

    Attributes:
      form: ``"blockwise"`` or ``"naive"`` (``attn.PATH_FORMS``: the same function).
      block_size: C of the blockwise form.
      forget_gate: FoX's per-head forget gate on the logits (PaTH-FoX).
      w_rank: the rank of the projection to the directions w (fla's default 32),
        or None for a full ``[D, K*H]`` projection.
      w_conv: width W of the short causal convolution (with SiLU) on w; 0: none.
    """

    kind: str = "path"
    rope: bool = False
    form: str = "blockwise"
    block_size: int = 64
    forget_gate: bool = False
    w_rank: int | None = 32
    w_conv: int = 3

    def check_fields(self) -> None:
        if self.form not in attn.PATH_FORMS:
            fail("form", f"one of {attn.PATH_FORMS} for kind='path'", repr(self.form))
        check_positive_int(self.block_size, "block_size")
        check_bool(self.forget_gate, "forget_gate")
        check_positive_int(self.w_rank, "w_rank", allow_none=True)
        if not is_int(self.w_conv) or self.w_conv < 0:
            fail("w_conv", "a non-negative int (the width W; 0 for none)", repr(self.w_conv))
        if self.rope:
            why = "the transforms are its position encoding"
            fail("rope", f"False for kind='path' ({why})", repr(self.rope))


@struct.dataclass
class PathCache(KVCache):
    """A PaTH layer's cache: ``KVCache``'s keys ``[B,S,K,H]`` (float32, carried to the last
    token) and values, and the w convolution's last W-1 inputs ``[B,W-1,K*H]`` (or None)."""

    w_conv: jax.Array | None = None

    PAGEABLE: ClassVar[bool] = False  # each step rewrites every key of the row


@struct.dataclass
class PathForgetCache(ForgetCache):
    """``PathCache`` with FoX's running gate sums (``models.cache.ForgetCache``)."""

    w_conv: jax.Array | None = None

    PAGEABLE: ClassVar[bool] = False


@register_kind(
    "path",
    config=PathConfig,
    family="softmax",
    sequence_parallel="PaTH's keys pass every later token's transform: no sharded form yet",
)
class PathAttention(Heads):
    """PaTH attention (``attn.path_attention``) with its layer (see the module docstring).

    Parameters: q ``[D, N*H]``, k and v ``[D, K*H]``, o ``[N*H, D]``; w's projection
    (``[D, R]`` then ``[R, K*H]``, or ``[D, K*H]``) and convolution taps ``[W, K*H]``;
    beta's ``[D, K]`` with a bias; FoX's ``[D, N]`` with a bias (sigmoid(4) at start).
    Captured weights (``sow_weights``) are the softmax weights ``[B,N,T,S]``, found
    as the outputs for one-hot values.
    """

    def __init__(self, cfg: PathConfig, width: int, *, causal: bool, dtype, param_dtype, rngs):
        if not causal:
            why = "a key's path runs forward to its query"
            fail("cfg.kind", f"a causal layer for 'path' ({why})", "an encoder")
        self._init_heads(cfg, causal=causal, dtype=dtype)
        self._init_qkv(width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        K, H, N = cfg.kv_heads, cfg.head_dim, cfg.num_heads
        linear = functools.partial(dense, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        rank = cfg.w_rank
        self.w_down = linear(width, rank) if rank else nnx.data(None)
        self.w_proj = linear(rank or width, K * H)
        self.w_taps = nnx.data(None)
        if cfg.w_conv:  # a depthwise Conv1d's default init: U(+-1/sqrt(W)), fan-in W
            bound = 1 / math.sqrt(cfg.w_conv)
            init = jax.nn.initializers.uniform(2 * bound)
            self.w_taps = nnx.Param(init(rngs.params(), (cfg.w_conv, K * H), param_dtype) - bound)
        self.beta_proj = linear(width, K, use_bias=True)
        self.forget_proj = nnx.data(None)
        if cfg.forget_gate:
            bias = nnx.initializers.constant(FORGET_BIAS_INIT)
            self.forget_proj = linear(width, N, use_bias=True, bias_init=bias)

    # Pieces ------------------------------------------------------------------

    def _transforms(self, x, segment_ids=None, conv_state=None):
        """``w [B,T,K,H]`` (unit norm) and ``beta [B,T,K]`` float32, and the convolution's
        state after x (None without a convolution)."""
        cfg = self.cfg
        B, T, _ = x.shape
        raw = self.w_proj(x if self.w_down is None else self.w_down(x))
        if self.w_taps is not None:
            raw, conv_state = attn.short_conv(
                raw, self.w_taps[...], state=conv_state, segment_ids=segment_ids
            )
            raw = jax.nn.silu(raw)
        w = raw.astype(jnp.float32).reshape(B, T, cfg.kv_heads, cfg.head_dim)
        w = w * jax.lax.rsqrt(jnp.sum(w * w, axis=-1, keepdims=True) + NORM_EPS)
        beta = 2.0 * jax.nn.sigmoid(self.beta_proj(x).astype(jnp.float32))
        return w, beta, conv_state

    def _log_forget(self, x):
        """FoX's log forget gates ``[B,T,N]`` float32 times the logit scale ``H**-0.5`` (fla's
        kernel scales the gates' sums with the logits), or None without the gate."""
        if self.forget_proj is None:
            return None
        log_f = jax.nn.log_sigmoid(self.forget_proj(x).astype(jnp.float32))
        return log_f * self.cfg.head_dim**-0.5

    def _path(self, q, k, v, w, beta, log_f, segment_ids, **kwargs):
        kwargs.setdefault("block_size", self.cfg.block_size)
        return attn.path_attention(
            q, k, v, w, beta, form=self.cfg.form, log_forget=log_f,
            q_segment_ids=segment_ids, kv_segment_ids=segment_ids, **kwargs,
        )  # fmt: skip

    # Surface -----------------------------------------------------------------

    def __call__(self, x, *, positions=None, segment_ids=None):
        """``x [B,T,D] -> [B,T,D]``; segment_ids ``[B,T]`` (id 0 padding) or None."""
        del positions  # the tokens' order within each segment is the position
        q, k, v = self._qkv(x, None)
        w, beta, _ = self._transforms(x, segment_ids)
        call = functools.partial(
            self._path, q, k, w=w, beta=beta, log_f=self._log_forget(x), segment_ids=segment_ids
        )
        if self.sow_weights:  # out = P V: the outputs for one-hot values are P
            B, S, K, _ = v.shape
            eye = jnp.broadcast_to(jnp.eye(S, dtype=jnp.float32)[None, :, None], (B, S, K, S))
            self._sow(jnp.transpose(call(eye), (0, 2, 1, 3)))
        return self._output(call(v))

    def init_cache(self, batch: int, max_len: int) -> PathCache:
        """Empty cache of ``max_len`` slots: keys ``[B,S,K,H]`` float32, values in the compute
        dtype, the w convolution's inputs (a ``PathForgetCache`` with FoX's gate)."""
        cfg = self.cfg
        shape = (batch, max_len, cfg.kv_heads, cfg.head_dim)
        fields = dict(
            k=jnp.zeros(shape, jnp.float32),
            v=jnp.zeros(shape, self.dtype),
            pos=jnp.full((batch, max_len), EMPTY, jnp.int32),
            w_conv=None,
        )
        if self.w_taps is not None:
            W = cfg.w_conv
            fields["w_conv"] = jnp.zeros((batch, W - 1, cfg.kv_heads * cfg.head_dim), self.dtype)
        if self.forget_proj is None:
            return PathCache(**fields)
        N = cfg.num_heads
        sums = dict(c=jnp.zeros((batch, max_len, N), jnp.float32), total=jnp.zeros((batch, N)))
        return PathForgetCache(**fields, **sums)

    def extend(self, x, cache: PathCache, start, lengths=None):
        """Continues over T new tokens. Arguments as ``SelfAttention.extend``."""
        B, T, _ = x.shape
        segment_ids = None if lengths is None else masks.segment_ids_from_lengths(lengths, T)
        q, k, v = self._qkv(x, None)
        w, beta, conv = self._transforms(x, segment_ids, cache.w_conv)
        log_f = self._log_forget(x)
        block = min(self.cfg.block_size, T)
        own = self._path(q, k, v, w, beta, log_f, segment_ids, block_size=block, return_lse=True)
        # The cache, read by the queries carried back to the chunk's start.
        q_back = attn.path_transform_queries(q, w, beta, segment_ids=segment_ids)
        mod, c = None, None
        if log_f is not None:
            if lengths is not None:  # tokens past lengths add no gate
                log_f = jnp.where(segment_ids[..., None] > 0, log_f, 0.0)
            c = cache.total[:, None] + jnp.cumsum(log_f, axis=1)  # [B,T,N]
            mod = scores.Forgetting(c, cache.c)
        old = attn.attention(
            q_back, cache.k, cache.v, score_mod=mod, return_lse=True,
            q_segment_ids=jnp.ones((B, T), jnp.int32),
            kv_segment_ids=(cache.pos != EMPTY).astype(jnp.int32),
        )  # fmt: skip
        out = attn.merge_attention(*old, *own)[0]
        # Store: every cached key passes the chunk's transforms, the chunk's keys its rest.
        keys = attn.path_update_keys(cache.k, w, beta, segment_ids=segment_ids)
        k_end = attn.path_transform_keys(k, w, beta, block_size=block, segment_ids=segment_ids)
        cache = cache.replace(k=keys, w_conv=conv)
        new = (k_end.astype(jnp.float32), v) if c is None else (k_end.astype(jnp.float32), v, c)
        cache = cache.extend(new, start, lengths)[2]
        if c is not None:
            cache = cache.replace(total=c[:, -1])
        return self._output(out.astype(x.dtype)), cache


def _sized(forget_gate: bool):
    def build(sizes: PresetSizes) -> PathConfig:
        return PathConfig(
            num_heads=sizes.num_heads,
            head_dim=sizes.head_dim,
            block_size=sizes.chunk_size,
            forget_gate=forget_gate,
            w_conv=sizes.short_conv,
        )

    return build


register_preset(
    "path",
    _sized(False),
    description="PaTH: softmax attention positioned by Householder-like transforms of the data",
)
register_preset(
    "path_fox",
    _sized(True),
    description="PaTH-FoX: PaTH with the Forgetting Transformer's forget gate",
)
