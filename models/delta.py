"""``DeltaAttention``: the delta-rule layers (``attn.delta_rule``) as their papers build them.

One layer kind, ``"delta"``, configured by ``DeltaConfig``; its ``gate`` picks
the variant: ``"none"`` DeltaNet (Yang et al. 2024), ``"head"`` Gated DeltaNet
(Yang, Kautz and Hatamizadeh, ICLR 2025), ``"channel"`` Kimi Delta Attention
(the Kimi Linear report, 2025); ``householder_steps`` > 1 makes it DeltaProduct
(Siems et al. 2025) and ``negative_eigenvalues`` widens beta to (0, 2)
(Grazzi et al., ICLR 2025). The presets ``deltanet``, ``gated_deltanet``,
``kda`` and ``gated_deltaproduct`` are registered here.
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
from attn.linear.front import CHUNK_SIZE
from models.config import (
    AttentionConfig,
    check_bool,
    check_positive_int,
    check_width,
    register_kind,
)
from models.heads import HeadGate, dense
from models.levels import init_levels, level_weights, num_levels
from models.mesh import in_sequence
from models.patterns import PresetSizes, register_preset
from models.recurrent import Recurrent, one_hot_values

GATES = ("none", "head", "channel")
# Mamba-2's initialization of the decay rates A (uniform in [1, 16]) and of the
# time steps dt (log-uniform in [1e-3, 1e-1], stored through softplus's inverse).
A_INIT = (1.0, 16.0)
DT_INIT = (1e-3, 1e-1)
NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class DeltaConfig(AttentionConfig):
    """A delta-rule layer (kind ``"delta"``). Besides the common fields:

    Attributes:
      form: ``"recurrent"`` or ``"chunkwise"`` (``attn.DELTA_FORMS``: the same function).
      chunk_size: C for the chunkwise form.
      gate: ``"none"`` (DeltaNet), ``"head"`` (Gated DeltaNet: one decay per
        head and token) or ``"channel"`` (KDA: one per key channel).
      value_heads: value heads (each with its own state), a multiple of the
        ``num_heads`` query/key heads (Gated DeltaNet's grouped value heads);
        None means ``num_heads``.
      qkv_conv: width W of the short causal convolutions (with SiLU) on the q,
        k and v projections, as the papers place them; 0: none.
      negative_eigenvalues: ``beta = 2 sigmoid(.)`` in (0, 2), so the write's
        eigenvalue ``1 - beta`` reaches (-1, 0) (Grazzi et al.); else ``sigmoid(.)``.
      householder_steps: n, keys, values and betas per token (DeltaProduct,
        ``attn.delta_product``); 1 is the delta rule.
    """

    kind: str = "delta"
    rope: bool = False
    form: str = "chunkwise"
    chunk_size: int = CHUNK_SIZE
    gate: str = "head"
    value_heads: int | None = None
    qkv_conv: int = 4
    negative_eigenvalues: bool = False
    householder_steps: int = 1

    @property
    def num_value_heads(self) -> int:
        return self.num_heads if self.value_heads is None else self.value_heads

    def check_fields(self) -> None:
        check_positive_int(self.chunk_size, "chunk_size")
        if self.gate not in GATES:
            fail("gate", f"one of {GATES}", repr(self.gate))
        if self.form not in attn.DELTA_FORMS:
            fail("form", f"one of {attn.DELTA_FORMS} for kind='delta'", repr(self.form))
        if self.rope:
            why = "the recurrence orders the tokens"
            fail("rope", f"False for kind='delta' ({why})", repr(self.rope))
        if self.num_kv_heads is not None:
            why = "q and k share heads; set value_heads for more value heads"
            fail("num_kv_heads", f"None for kind='delta' ({why})", repr(self.num_kv_heads))
        nv = self.value_heads
        if nv is not None and (isinstance(nv, bool) or not isinstance(nv, int) or nv < 1):
            fail("value_heads", "a positive int or None", repr(nv))
        if self.num_value_heads % self.num_heads:
            fail("value_heads", f"a multiple of num_heads={self.num_heads}", repr(nv))
        check_bool(self.negative_eigenvalues, "negative_eigenvalues")
        check_positive_int(self.householder_steps, "householder_steps")
        check_width(self.qkv_conv, "qkv_conv")


def _inverse_softplus(y):
    return y + jnp.log(-jnp.expm1(-y))


def decay_init(heads: int, channels: int, key):
    """Mamba-2's ``A_log [heads]`` and ``dt_bias [channels]`` (``A_INIT``, ``DT_INIT``)."""
    k_a, k_dt = jax.random.split(key)
    A = jax.random.uniform(k_a, (heads,), minval=A_INIT[0], maxval=A_INIT[1])
    lo, hi = (math.log(x) for x in DT_INIT)
    dt = jnp.exp(jax.random.uniform(k_dt, (channels,), minval=lo, maxval=hi))
    return jnp.log(A), _inverse_softplus(dt)


@register_kind(
    "delta",
    config=DeltaConfig,
    family="linear",
    sequence_parallel=True,
    in_order=True,
)
class DeltaAttention(Recurrent):
    """The delta rule (``attn.delta_rule``) with the layer the papers put around it.

    Per token, from the layer input x: ``q, k, v = SiLU(conv(x W_qkv))`` (one
    short causal convolution of width ``qkv_conv`` over the three projections'
    channels), q and k L2-normalized per head, ``beta = sigmoid(x W_beta)`` per
    value head, and for the gated variants the log decay
    ``g = -exp(A_log) * softplus(x W_a + dt_bias)`` (Mamba-2's parametrization,
    per value head, or per key channel for KDA: A_log per head, dt_bias per
    channel). The output of each value head is RMS-normalized (a learned
    ``[E]`` weight shared by the heads), gated by ``SiLU(x W_g)``, and projected
    back: ``o_proj [N*E, D]``. E = H; N = ``value_heads``.

    The decode cache (``models.recurrent.RecurrentCache``) is the state and the convolution's last
    W-1 inputs. Padding and packing are segment ids, passed to the convolution
    and to ``attn.delta_rule`` (padding writes nothing; a new segment starts
    from a zero state). Captured weights (``sow_weights``) are the matrix M
    with ``out = M V`` before the output norm (the delta rule is linear in V
    for given q, k, beta and gates), found as the outputs for one-hot values.
    """

    def __init__(self, cfg: DeltaConfig, width: int, *, causal: bool, dtype, param_dtype, rngs):
        if not causal:
            why = "a recurrence needs an order"
            fail("cfg.kind", f"a causal layer for {cfg.kind!r} ({why})", "an encoder")
        self._init_heads(cfg, causal=causal, dtype=dtype)
        K, H, N = cfg.num_heads, cfg.head_dim, cfg.num_value_heads
        n = cfg.householder_steps
        self.head_gate = HeadGate(jnp.ones((N,), jnp.float32))  # one per value head
        linear = functools.partial(dense, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.channels = K * H + n * (K * H + N * H)
        self.qkv_proj = linear(width, self.channels)
        self.conv = nnx.data(None)
        if cfg.qkv_conv:  # a depthwise Conv1d's default init: U(+-1/sqrt(W)), fan-in W
            bound = 1 / math.sqrt(cfg.qkv_conv)
            init = jax.nn.initializers.uniform(2 * bound)
            shape = (cfg.qkv_conv, self.channels)
            self.conv = nnx.Param(init(rngs.params(), shape, param_dtype) - bound)
        self.beta_proj = linear(width, n * N)
        per = {"none": 0, "head": N, "channel": N * H}[cfg.gate]
        if per:
            self.gate_proj = dense(
                width, per, dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs
            )
            A_log, dt_bias = decay_init(N, per, rngs.params())
            self.A_log = nnx.Param(A_log.astype(param_dtype))
            self.dt_bias = nnx.Param(dt_bias.astype(param_dtype))
        else:
            self.gate_proj = nnx.data(None)
        self.out_gate = linear(width, N * H)
        self.out_norm = nnx.RMSNorm(
            H, epsilon=NORM_EPS, dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs
        )
        self.o_proj = linear(N * H, width)
        self.levels = num_levels(cfg)
        if self.levels:  # log-linear Gated DeltaNet (models.log_linear): the level weights
            init_levels(self, width, N, self.levels, param_dtype=param_dtype, rngs=rngs)

    # Pieces (models.recurrent.Recurrent's) -----------------------------------

    def _front(self, x, positions, segment_ids):
        """The q/k/v projection (convolved next, if the layer has a convolution), and x."""
        del positions, segment_ids  # the recurrence orders the tokens
        return self.qkv_proj(x), x

    def _conv_params(self):
        return None if self.conv is None else (self.conv[...], None)

    def _conv_shape(self):
        return None if self.conv is None else (self.cfg.qkv_conv, self.channels)

    def _inputs(self, x, mixed, ctx) -> dict:
        """q ``[B,T,K,H]``, k ``[B,T,(n,)K,H]`` (unit norm), v ``[B,T,(n,)N,H]``, beta and
        the log gates (and a log-linear layer's level weights ``[B,T,N,L]``)."""
        q, k, v = self._split(mixed)
        beta, log_g = self._beta_and_gates(x)
        inputs = dict(q=q, k=k, v=v, beta=beta, log_g=log_g)
        if self.levels:
            inputs["lam"] = level_weights(self, x)
        return inputs

    def _split(self, mixed):
        """``[B,T,KH+n(KH+NH)]`` -> q ``[B,T,K,H]``, k ``[B,T,(n,)K,H]`` (unit norm) and
        v ``[B,T,(n,)N,H]``; the step axis n only for DeltaProduct (n > 1)."""
        cfg = self.cfg
        B, T, _ = mixed.shape
        K, H, N = cfg.num_heads, cfg.head_dim, cfg.num_value_heads
        steps = () if cfg.householder_steps == 1 else (cfg.householder_steps,)
        mixed = jax.nn.silu(mixed)
        n = cfg.householder_steps
        q, k, v = jnp.split(mixed, [K * H, (n + 1) * K * H], axis=-1)
        unit = functools.partial(l2_normalize, eps=NORM_EPS)
        k, v = k.reshape(B, T, *steps, K, H), v.reshape(B, T, *steps, N, H)
        return unit(q.reshape(B, T, K, H)), unit(k), v

    def _beta_and_gates(self, x):
        """``beta [B,T,(n,)N]`` in (0, 1) (or (0, 2)) and log decays ``[B,T,N]``/``[B,T,N,H]``
        (or None)."""
        cfg = self.cfg
        beta = jax.nn.sigmoid(self.beta_proj(x).astype(jnp.float32))
        if cfg.negative_eigenvalues:
            beta = 2.0 * beta
        if cfg.householder_steps > 1:
            beta = beta.reshape(*x.shape[:2], cfg.householder_steps, cfg.num_value_heads)
        if self.gate_proj is None:
            return beta, None
        B, T, _ = x.shape
        raw = self.gate_proj(x.astype(jnp.float32)) + self.dt_bias[...].astype(jnp.float32)
        rate = jnp.exp(self.A_log[...].astype(jnp.float32))
        if cfg.gate == "channel":
            N, H = cfg.num_value_heads, cfg.head_dim
            return beta, -rate[:, None] * jax.nn.softplus(raw.reshape(B, T, N, H))
        return beta, -rate * jax.nn.softplus(raw)

    def _mix(self, p, *, segment_ids=None, sharded=False, **options):
        """The delta rule (DeltaProduct for several steps; the sharded form with
        ``sharded``, under a mesh), or its log-linear form with the level weights."""
        ids = dict(q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
        args = (p["q"], p["k"], p["v"], p["beta"])
        if self.levels:
            return attn.log_linear_delta_rule(*args, p["lam"], log_gates=p["log_g"], **ids,
                                              **options)  # fmt: skip
        rule = attn.delta_rule if self.cfg.householder_steps == 1 else attn.delta_product
        rule = in_sequence(rule) if sharded else rule
        return rule(*args, log_gates=p["log_g"], **ids, **options)

    def _mix_step(self, p, state):
        args = (p["q"], p["k"], p["v"], p["beta"])
        if self.levels:
            return attn.log_linear_delta_rule_step(*args, p["lam"], state, log_gates=p["log_g"])
        one = self.cfg.householder_steps == 1
        step = attn.delta_rule_step if one else attn.delta_product_step
        return step(*args, state, log_gates=p["log_g"])

    def _extend_options(self) -> dict:
        """A log-linear prefill continues the cached levels in the recurrent form (the
        chunkwise form's levels need the sequence to start at position 0)."""
        if self.levels:
            return dict(form="recurrent", chunk_size=self.cfg.chunk_size)
        return self._options()

    def _one_hot(self, p) -> dict:
        """The value ``e_s`` at token s (at each of its steps, for DeltaProduct)."""
        return {**p, "v": one_hot_values(p["v"])}

    def _zero_state(self, batch: int):
        """The state ``[B,N,H,E]`` float32 (log-linear: the Fenwick states ``[B,N,L,H,E]``)."""
        cfg = self.cfg
        N, H = cfg.num_value_heads, cfg.head_dim
        if self.levels:
            return attn.init_log_linear_state(batch, N, H, H, self.levels)
        return attn.init_delta_state(batch, N, H, H)

    def _finish(self, out, inputs, x):
        """Per-head RMSNorm, the SiLU output gate, the head gates and ``o_proj``."""
        normed = self.out_norm(out.astype(jnp.float32)).astype(x.dtype)
        return self._output(self._gated(normed, x, jax.nn.silu))


def l2_normalize(x, eps: float):
    """``x / ||x||`` over the last axis, in float32 (``eps`` keeps a zero vector finite)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _sized(gate: str, **fields):
    def build(sizes: PresetSizes) -> DeltaConfig:
        return DeltaConfig(
            num_heads=sizes.num_heads,
            head_dim=sizes.head_dim,
            chunk_size=sizes.chunk_size,
            gate=gate,
            **fields,
        )

    return build


for _name, _gate, _fields, _description in (
    ("deltanet", "none", {}, "DeltaNet: the delta rule, q/k/v short convs"),
    ("gated_deltanet", "head", {}, "Gated DeltaNet: the delta rule with a decay per head"),
    ("kda", "channel", {}, "Kimi Delta Attention: the delta rule with a decay per key channel"),
    (
        "gated_deltaproduct",
        "head",
        dict(householder_steps=2, negative_eigenvalues=True),
        "Gated DeltaProduct: two Householder steps per token, beta in (0, 2) (Siems et al.)",
    ),
):
    register_preset(_name, _sized(_gate, **_fields), description=_description)
