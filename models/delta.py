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
from flax import nnx, struct

import attn
from attn import masks
from attn.checks import fail
from attn.linear.front import CHUNK_SIZE
from models.config import AttentionConfig, check_bool, check_positive_int, register_kind
from models.heads import HeadGate, Heads, dense
from models.mesh import in_sequence
from models.patterns import PresetSizes, register_preset

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
        w = self.qkv_conv
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            fail("qkv_conv", "a non-negative int (the width W; 0 for none)", repr(w))


@struct.dataclass
class DeltaCache:
    """Decode cache of a delta layer: the state ``[B,N,H,E]`` float32 and the last
    W-1 inputs of the q/k/v convolution ``[B,W-1,2KH+NE]`` (None without one)."""

    state: jax.Array
    conv: jax.Array | None


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
class DeltaAttention(Heads):
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

    The decode cache (``DeltaCache``) is the state and the convolution's last
    W-1 inputs. Padding and packing are segment ids, passed to the convolution
    and to ``attn.delta_rule`` (padding writes nothing; a new segment starts
    from a zero state). Captured weights (``sow_weights``) are the matrix M
    with ``out = M V`` before the output norm (the delta rule is linear in V
    for given q, k, beta and gates), found as the outputs for one-hot values.
    """

    def __init__(self, cfg: DeltaConfig, width: int, *, causal: bool, dtype, param_dtype, rngs):
        if not causal:
            fail(
                "cfg.kind", "a causal layer for 'delta' (a recurrence needs an order)", "an encoder"
            )
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

    # Pieces ------------------------------------------------------------------

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
        unit = functools.partial(_l2_normalize, eps=NORM_EPS)
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

    def _finish(self, out, x):
        """Per-head RMSNorm, the SiLU output gate, the head gates and ``o_proj``."""
        B, T, N, E = out.shape
        normed = self.out_norm(out.astype(jnp.float32)).astype(x.dtype)
        gate = jax.nn.silu(self.out_gate(x)).reshape(B, T, N, E)
        return self._output(normed * gate)

    def _options(self) -> dict:
        return dict(form=self.cfg.form, chunk_size=self.cfg.chunk_size)

    def _extend_options(self) -> dict:
        """The options of a prefill's call from a cached state (a subclass's form may differ)."""
        return self._options()

    def _rule_for(self, x):
        """``rule(q, k, v, beta, **options)`` over a sequence with input ``x``: ``attn.delta_rule``,
        or ``attn.delta_product`` for several steps per token (a subclass's reads more of x)."""
        del x
        return attn.delta_rule if self.cfg.householder_steps == 1 else attn.delta_product

    def _step_for(self, x):
        """``step(q, k, v, beta, state, *, log_gates)`` for one token with input ``x [B,1,D]``."""
        del x
        return attn.delta_rule_step if self.cfg.householder_steps == 1 else attn.delta_product_step

    # Surface -----------------------------------------------------------------

    def __call__(self, x, *, positions=None, segment_ids=None):
        """``x [B,T,D] -> [B,T,D]``; segment_ids ``[B,T]`` (id 0 padding) or None."""
        del positions  # the recurrence orders the tokens
        mixed = self.qkv_proj(x)
        if self.conv is not None:
            mixed = in_sequence(attn.short_conv)(mixed, self.conv[...], segment_ids=segment_ids)[0]
        q, k, v = self._split(mixed)
        beta, log_g = self._beta_and_gates(x)
        call = functools.partial(
            in_sequence(self._rule_for(x)),
            log_gates=log_g,
            q_segment_ids=segment_ids,
            kv_segment_ids=segment_ids,
            **self._options(),
        )
        if self.sow_weights:
            self._sow(self._weights(call, q, k, beta))
        return self._finish(call(q, k, v, beta), x)

    def _weights(self, call, q, k, beta):
        """``[B,N,T,S]`` float32: the outputs for one-hot values ``e_s`` (M of ``out = M V``;
        for DeltaProduct, the value ``e_s`` at each of token s's steps)."""
        B, S = q.shape[:2]
        N = self.cfg.num_value_heads
        steps = k.shape[2:-2]
        eye = jnp.eye(S, dtype=jnp.float32).reshape(1, S, *(1,) * len(steps), 1, S)
        one_hot = jnp.broadcast_to(eye, (B, S, *steps, N, S))
        return jnp.transpose(call(q, k, one_hot, beta), (0, 2, 1, 3))

    def init_cache(self, batch: int, max_len: int) -> DeltaCache:
        """Zero state ``[B,N,H,E]`` float32 and convolution inputs ``[B,W-1,2KH+NE]``."""
        del max_len
        cfg = self.cfg
        state = attn.init_delta_state(batch, cfg.num_value_heads, cfg.head_dim, cfg.head_dim)
        conv = None
        if self.conv is not None:
            conv = jnp.zeros((batch, cfg.qkv_conv - 1, self.channels), self.dtype)
        return DeltaCache(state=state, conv=conv)

    def extend(self, x, cache: DeltaCache, start, lengths=None):
        """Continues over T new tokens. Arguments as ``SelfAttention.extend``."""
        del start
        T = x.shape[1]
        step = T == 1 and lengths is None
        segment_ids = None if lengths is None else masks.segment_ids_from_lengths(lengths, T)
        mixed, conv = self.qkv_proj(x), cache.conv
        if self.conv is not None and step:
            mixed, conv = attn.short_conv_step(conv, mixed[:, 0], self.conv[...])
            mixed = mixed[:, None]
        elif self.conv is not None:
            mixed, conv = attn.short_conv(
                mixed, self.conv[...], state=conv, segment_ids=segment_ids
            )
        q, k, v = self._split(mixed)
        beta, log_g = self._beta_and_gates(x)
        if step:
            out, state = self._step_for(x)(
                q[:, 0],
                k[:, 0],
                v[:, 0],
                beta[:, 0],
                cache.state,
                log_gates=None if log_g is None else log_g[:, 0],
            )
            out = out[:, None]
        else:
            out, state = self._rule_for(x)(
                q,
                k,
                v,
                beta,
                log_gates=log_g,
                initial_state=cache.state,
                return_state=True,
                q_segment_ids=segment_ids,
                kv_segment_ids=segment_ids,
                **self._extend_options(),
            )
        return self._finish(out, x), cache.replace(state=state, conv=conv)


def _l2_normalize(x, eps: float):
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
