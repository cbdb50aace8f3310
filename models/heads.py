"""What every attention module shares: projections, RoPE, per-head gates, the weights tap.

Every attention module (``SelfAttention``, ``CrossAttention``,
``LatentAttention``, ``LinearAttention``) derives from ``Heads`` and has the
same surface, so blocks and models never branch on the kind:

* ``__call__(x [B,T,D], *, positions=None, segment_ids=None) -> y [B,T,D]``:
  the whole sequence at once (cross-attention takes the encoder memory instead).
* ``init_cache(batch, max_len)`` -> the layer's cache pytree.
* ``extend(x [B,T,D], cache, start [B], lengths [B] or None) -> (y [B,T,D], cache)``:
  T new tokens per row at positions ``start[b] + t``, of which ``lengths[b]``
  are real (None: all T). Prefill and decoding (T = 1) are both ``extend``.

Two taps, through NNX's own mechanisms rather than arguments and return values:

* ``head_gate``: a ``HeadGate`` variable ``[N]`` (ones) multiplying each head's
  output before the output projection. Not a ``Param``, so optimizers built
  with ``wrt=nnx.Param`` leave it alone; setting it ablates heads, and the
  gradient with respect to it is head importance (``models.taps``).
* ``sow_weights``: when True (``models.capture_weights`` sets it for one call),
  ``__call__`` also computes its attention weights ``[B,N,T,S]`` float32 and
  sows them as ``nnx.Intermediate`` ``"weights"``. False by default, so the
  default call never materializes them and compiles as before.
"""

from __future__ import annotations

import functools
import itertools

import chex
import jax
import jax.numpy as jnp
from flax import nnx

import attn
from models.config import JAX_NN_IMPLS, AttentionConfig
from models.mesh import explicit_spec


class HeadGate(nnx.Variable):
    """Per-head output multipliers ``[N]`` of an attention module (ones: no change); not trained."""


class Buffer(nnx.Variable):
    """A non-trainable array owned by a module (e.g. FAVOR+ random features)."""


def rows(x):
    """``x [..., D]`` as ``[M, D]`` rows where that is free of sharding constraints, else None.

    XLA:CPU lays out the weight gradient of a dot over ``[B,T,D]`` with both
    operands transposed, which runs at about half the rate of the same dot on
    ``[B*T, D]`` rows; so the projections compute on rows. Under Explicit mesh
    axes the leading axes keep their own shardings (no merge is stated).
    """
    if x.ndim == 2 or explicit_spec(x) is not None:
        return None
    return x.reshape(-1, x.shape[-1])


class Dense(nnx.Linear):
    """``nnx.Linear`` over the last axis, computed on rows ``[M, D]`` (see ``rows``)."""

    def __call__(self, inputs, out_sharding=None):
        flat = rows(inputs) if out_sharding is None else None
        if flat is None:
            return super().__call__(inputs, out_sharding=out_sharding)
        return super().__call__(flat).reshape(*inputs.shape[:-1], -1)


def dense(d_in: int, d_out: int, *, dtype, param_dtype, rngs, **kwargs) -> Dense:
    """A bias-free ``Dense`` (the projections of every layer)."""
    kwargs.setdefault("use_bias", False)
    return Dense(d_in, d_out, dtype=dtype, param_dtype=param_dtype, rngs=rngs, **kwargs)


def fused(x, *projections: nnx.Linear) -> tuple:
    """``tuple(p(x) for p in projections)`` as one dot with their kernels side by side.

    One ``[M,D] @ [D, sum F]`` (and one of each in the backward) instead of a
    dot per projection: at the small widths of the lab's models a dot's fixed
    cost is a large part of it. Bias-free projections of one input only.
    """
    flat = rows(x)
    if flat is None or len(projections) == 1:
        return tuple(p(x) for p in projections)
    kernels = [p.kernel[...] for p in projections]
    dtype = projections[0].dtype
    y = jnp.dot(flat.astype(dtype), jnp.concatenate(kernels, axis=1).astype(dtype))
    cuts = list(itertools.accumulate(k.shape[1] for k in kernels))[:-1]
    lead = x.shape[:-1]
    return tuple(part.reshape(*lead, -1) for part in jnp.split(y, cuts, axis=-1))


# Gated attention's gates (Qiu et al. 2025): one per output channel, or one per head.
OUTPUT_GATES = ("elementwise", "headwise")
# The q/k RMSNorm's epsilon: Qwen3's and Qwen3-Next's rms_norm_eps.
QK_NORM_EPS = 1e-6

# Kernels that need positions known when tracing: jax.nn's take no positions or
# segment ids at all, and splash builds its mask from concrete positions.
STATIC_POSITION_IMPLS = (*JAX_NN_IMPLS, "splash")


def cached_impl(impl: str) -> str:
    """Cached and cross-attention calls pass traced positions and segment ids, which
    ``STATIC_POSITION_IMPLS`` cannot take, so those calls let "auto" pick one that can."""
    return "auto" if impl in STATIC_POSITION_IMPLS else impl


def step_positions(start, T: int):
    """``[B,T]`` absolute positions ``start[b] + t``."""
    return start[:, None].astype(jnp.int32) + jnp.arange(T, dtype=jnp.int32)


class Heads(nnx.Module):
    """Base of the attention modules: config, head gate, weights tap, q/k/v/o projections."""

    def _init_heads(self, cfg: AttentionConfig, *, causal: bool, dtype):
        cfg.check_direction(causal, "cfg")
        self.cfg = cfg
        self.causal = causal
        self.dtype = dtype
        self.head_gate = HeadGate(jnp.ones((cfg.num_heads,), jnp.float32))
        self.sow_weights = False

    def _init_qkv(self, width: int, *, dtype, param_dtype, rngs):
        """q ``[D, N*H]``, k and v ``[D, K*H]``, o ``[N*H, D]``."""
        cfg = self.cfg
        N, K, H = cfg.num_heads, cfg.kv_heads, cfg.head_dim
        linear = functools.partial(dense, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = linear(width, N * H)
        self.k_proj = linear(width, K * H)
        self.v_proj = linear(width, K * H)
        self.o_proj = linear(N * H, width)
        norm = functools.partial(nnx.RMSNorm, H, epsilon=QK_NORM_EPS, dtype=jnp.float32,
                                 param_dtype=param_dtype, rngs=rngs)  # fmt: skip
        qk_norm = getattr(cfg, "qk_norm", False)
        self.q_head_norm = norm() if qk_norm else nnx.data(None)
        self.k_head_norm = norm() if qk_norm else nnx.data(None)

    def _init_output_gate(self, width: int, gate: str | None, value_dim: int, *, dtype,
                          param_dtype, rngs):  # fmt: skip
        """``out_gate``: gated attention's projection (``gate`` in ``OUTPUT_GATES``),
        ``[D, N*E]`` (``"elementwise"``) or ``[D, N]`` (``"headwise"``); None without one."""
        N = self.cfg.num_heads
        size = {None: 0, "elementwise": N * value_dim, "headwise": N}[gate]
        self.out_gate = (dense(width, size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                         if size else nnx.data(None))  # fmt: skip

    def _gated(self, out, x, activation=jax.nn.sigmoid):
        """``out [B,T,N,E]`` times ``activation(x W_g)``, x ``[B,T,D]`` the layer's input:
        per channel, or per head where ``out_gate`` is ``[D, N]``; ``out`` without one."""
        if self.out_gate is None:
            return out
        B, T, N, _ = out.shape
        return out * activation(self.out_gate(x)).reshape(B, T, N, -1)

    def _rope(self, x, positions):
        """x ``[B,T,heads,H]`` rotated at ``positions [B,T]`` if ``cfg.rope`` (the
        leading ``cfg.rotary_dim`` channels, for a kind whose config has that field)."""
        cfg = self.cfg
        if not cfg.rope:
            return x
        rotary_dim = getattr(cfg, "rotary_dim", None)
        return attn.apply_rope(x, positions, base=cfg.rope_base, rotary_dim=rotary_dim)

    def _qkv(self, x, positions):
        """q ``[B,T,N,H]`` and k, v ``[B,T,K,H]`` from x ``[B,T,D]`` (RoPE at ``positions``)."""
        cfg = self.cfg
        B, T, _ = x.shape
        q, k, v = fused(x, self.q_proj, self.k_proj, self.v_proj)
        q = self._head_norm(q.reshape(B, T, cfg.num_heads, cfg.head_dim), self.q_head_norm)
        k = self._head_norm(k.reshape(B, T, cfg.kv_heads, cfg.head_dim), self.k_head_norm)
        v = v.reshape(B, T, cfg.kv_heads, cfg.head_dim)
        chex.assert_equal_shape([k, v])
        return self._rope(q, positions), self._rope(k, positions), v

    @staticmethod
    def _head_norm(x, norm):
        """``x [..., H]`` through ``norm`` (an RMSNorm over H, in float32), or ``x`` without one."""
        return x if norm is None else norm(x.astype(jnp.float32)).astype(x.dtype)

    def _output(self, out):
        """``out [B,T,N,E]`` times the head gates, then the output projection: ``[B,T,D]``."""
        B, T, N, E = out.shape
        gated = out * self.head_gate[...].astype(out.dtype)[:, None]
        return self.o_proj(gated.reshape(B, T, N * E))

    def _sow(self, weights):
        """Records ``weights [B,N,T,S]`` float32 (only called when ``sow_weights``)."""
        chex.assert_rank(weights, 4)
        self.sow(nnx.Intermediate, "weights", weights)
