"""``DiffAttention``: differential attention (Diff Transformer, Ye et al. ICLR 2025).

Each head computes two softmax maps from two halves of its queries and keys
and subtracts them, weighted by a learned scalar, before a per-head norm::

    A_i = softmax(q_i k_i^T / sqrt(d))                  (i = 1, 2)
    out_n = (1 - lambda_init) * RMSNorm((A_1 - lambda A_2) v)
    lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init

with q1, q2, k1, k2 of d channels and v of 2d per head. The paper's argument:
the common part of the two maps (attention noise on irrelevant tokens)
cancels, sharpening the map on the relevant ones.

Both maps are one ``attn.attention`` call: the two query halves are 2N query
heads over the 2K key heads of the two key halves (query head n < N reads key
head n // G, query head N + n key head K + n // G), sharing each kv head's
values. So the layer is a softmax-family kind that needs no kernel of its own:
every implementation, mask, window, soft-cap and cached decoding of ``attn``
applies to it unchanged. The worked example of ``models.register_kind`` for a
layer built on ``attn.attention``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

import attn
from attn.checks import fail
from models.cache import KVCache
from models.config import check_rotary, register_kind
from models.heads import dense, step_positions
from models.masked import MaskedConfig, Softmax
from models.patterns import register_preset


def depth_lambda_init(layer: int) -> float:
    """The paper's ``lambda_init`` of layer ``layer`` (1-based): ``0.8 - 0.6 exp(-0.3 (l - 1))``."""
    return 0.8 - 0.6 * math.exp(-0.3 * (layer - 1))


@dataclasses.dataclass(frozen=True)
class DiffConfig(MaskedConfig):
    """A differential-attention layer: N heads, each with two query/key halves of
    ``head_dim`` channels and values of ``2 * head_dim`` (the paper's parameter count
    at half the heads). Besides the common and mask fields (``MaskedConfig``):

    Attributes:
      rotary_dim: leading channels that rotate (partial RoPE); None means all H.
      lambda_init: the constant part of lambda, in [0, 1). The paper sets it by
        depth (``depth_lambda_init(l)``, 0.2 at the first layer to 0.8 deep
        down) and reports a constant one works about as well; configs that know
        their depth set it per layer.
    """

    kind: str = "diff"
    rotary_dim: int | None = None
    lambda_init: float = 0.8

    def check_fields(self) -> None:
        check_rotary(self)
        super().check_fields()
        li = self.lambda_init
        if isinstance(li, bool) or not isinstance(li, int | float) or not 0 <= li < 1:
            fail("lambda_init", "a number in [0, 1)", repr(li))


@register_kind(
    "diff",
    config=DiffConfig,
    family="softmax",
    sequence_parallel="no ring path for its paired maps yet (use kind='softmax' on a seq mesh)",
)
class DiffAttention(Softmax):
    """Differential attention; decodes with a ``KVCache`` of keys ``[B,S,2K,H]`` (both halves)
    and values ``[B,S,K,2H]``.

    Parameters: q ``[D, 2NH]``, k ``[D, 2KH]``, v ``[D, 2KH]``, o ``[2NH, D]``, the
    lambda vectors ``[4, H]`` (lq1, lk1, lq2, lk2) and the head norm's scale ``[2H]``.
    """

    def __init__(self, cfg: DiffConfig, width: int, *, causal: bool, dtype, param_dtype, rngs):
        self._init_softmax(cfg, causal=causal, dtype=dtype, param_dtype=param_dtype)
        N, K, H = cfg.num_heads, cfg.kv_heads, cfg.head_dim
        linear = functools.partial(dense, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = linear(width, 2 * N * H)
        self.k_proj = linear(width, 2 * K * H)
        self.v_proj = linear(width, 2 * K * H)
        self.o_proj = linear(2 * N * H, width)
        self._init_output_gate(width, cfg.output_gate, 2 * H, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs)  # fmt: skip
        # The paper draws the lambda vectors from N(0, 0.1^2).
        self.lambdas = nnx.Param(0.1 * jax.random.normal(rngs.params(), (4, H), param_dtype))
        self.head_norm = nnx.RMSNorm(2 * H, epsilon=1e-5, dtype=jnp.float32, rngs=rngs)

    def _projections(self, x, positions):
        """q ``[B,T,2N,H]`` (halves as head blocks), k ``[B,T,2K,H]``, v ``[B,T,K,2H]``."""
        cfg = self.cfg
        B, T, _ = x.shape
        N, K, H = cfg.num_heads, cfg.kv_heads, cfg.head_dim
        # Head n's halves are q[..., n, 0, :] and q[..., n, 1, :]; as head blocks,
        # half i of every head is heads [i*N, (i+1)*N).
        q = self.q_proj(x).reshape(B, T, N, 2, H).transpose(0, 1, 3, 2, 4).reshape(B, T, 2 * N, H)
        k = self.k_proj(x).reshape(B, T, K, 2, H).transpose(0, 1, 3, 2, 4).reshape(B, T, 2 * K, H)
        v = self.v_proj(x).reshape(B, T, K, 2 * H)
        return self._rope(q, positions), self._rope(k, positions), v

    def _lambda(self):
        lq1, lk1, lq2, lk2 = self.lambdas[...].astype(jnp.float32)
        return jnp.exp(lq1 @ lk1) - jnp.exp(lq2 @ lk2) + self.cfg.lambda_init

    def _combine(self, out, x):
        """``[B,T,2N,2H]`` maps' outputs -> the layer output ``[B,T,D]`` (x ``[B,T,D]``
        the layer's input, for the output gate)."""
        N = self.cfg.num_heads
        lam = self._lambda()
        diff = out[:, :, :N].astype(jnp.float32) - lam * out[:, :, N:].astype(jnp.float32)
        normed = self.head_norm(diff) * (1.0 - self.cfg.lambda_init)
        return self._output(self._gated(normed.astype(self.dtype), x))

    def _maps(self, q, k, v, *, impl: str, tap: bool, **rows):
        """Both maps in one call: values shared by the two halves' kv heads. ``rows``: the
        call's positions and segment ids (``_whole``, ``_cached``)."""
        vv = jnp.concatenate([v, v], axis=2)  # kv heads [0, K) and [K, 2K) read the same values
        sinks = self._sinks()
        if sinks is not None:  # one sink per differential head, in both maps
            sinks = jnp.concatenate([sinks] * 2)
        call = functools.partial(attn.attention, q, k, vv, mask=self.cfg.mask(self.causal),
                                 softcap=self.cfg.softcap, sink_logits=sinks, **rows)  # fmt: skip
        if tap and self.sow_weights:
            out, w = call(impl="dense", return_weights=True)
            N = self.cfg.num_heads
            self._sow(w[:, :N] - self._lambda() * w[:, N:])  # the differential map
            return out
        return call(impl=impl)

    def __call__(self, x, *, positions=None, segment_ids=None):
        """Args: x ``[B,T,D]``; positions, segment_ids ``[B,T]`` or None. Returns ``[B,T,D]``."""
        q, k, v = self._projections(x, jnp.arange(x.shape[1]) if positions is None else positions)
        arrays = self._whole(positions, segment_ids)
        return self._combine(self._maps(q, k, v, impl=self._impl(), tap=True, **arrays), x)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        cfg = self.cfg
        S, fields = self._slots(batch, max_len)
        K, H = cfg.kv_heads, cfg.head_dim
        k = jnp.zeros((batch, S, 2 * K, H), self.dtype)
        v = jnp.zeros((batch, S, K, 2 * H), self.dtype)
        return KVCache(k, v, **fields)

    def extend(self, x, cache: KVCache, start, lengths=None):
        positions = step_positions(start, x.shape[1])
        q, k, v = self._projections(x, positions)
        (keys, values), kv_pos, cache = cache.extend((k, v), start, lengths)
        cached = self._cached(positions, kv_pos)
        out = self._maps(q, keys, values, impl=self._impl(cached=True), tap=False, **cached)
        return self._combine(out, x), cache


register_preset(
    "diff",
    lambda s: DiffConfig(num_heads=s.num_heads, head_dim=s.head_dim),
    description="differential attention: two softmax maps subtracted (Diff Transformer)",
)
