"""The log-linear layers (Guo et al. 2025): Mamba-2 and Gated DeltaNet over a Fenwick tree.

Two layer kinds, each its parent's layer (``models.mamba.Mamba2``,
``models.delta.DeltaAttention`` with ``gate="head"``) with the one state
replaced by ``attn.log_linear_attention``'s (``attn.log_linear_delta_rule``'s)
Fenwick levels, read with per-token level weights:

- ``"log_linear_mamba2"`` (``LogLinearMamba2Config``, ``LogLinearMamba2``):
  q = C, k = B, v = dt x, log decay dt A, ``scale=1``, plus Mamba-2's ``D x``.
- ``"log_linear_gated_deltanet"`` (``LogLinearDeltaConfig``,
  ``LogLinearDeltaAttention``): the delta rule's q, k, v, beta and log gates
  (``gate="none"``: log-linear DeltaNet).

Level weights, as the paper's and fla's log-linear Mamba-2 parametrize them
(fla's ``LogLinearMamba2``: its ``dl`` channels of the input projection and its
``L`` parameter): ``lambda [B,T,N,L] = softplus(level_scale * (x W_level))``,
``W_level [D, N*L]`` a bias-free projection of the layer input (in float32, as
the delta layer's gate projection) and ``level_scale [N,L]`` a learned scale
initialized to ones; so every weight is positive and input-dependent, and at
initialization near ``softplus(0) = log 2``. Levels at or above ``L - 1``
share the top weight; ``num_levels`` defaults to 12, every level its own
weight up to ``2^11 = 2048`` tokens (fla takes 15, for 16384).

The presets ``log_linear_mamba2`` and ``log_linear_gated_deltanet`` are
registered here. Neither kind runs sequence-parallel: there is no sharded
log-linear form.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from attn import masks
from attn.checks import fail
from attn.linear.log_linear import (
    LOG_LINEAR_DELTA_FORMS,
    LOG_LINEAR_FORMS,
    LogLinearState,
    init_log_linear_state,
    log_linear_attention,
    log_linear_attention_step,
    log_linear_delta_rule,
    log_linear_delta_rule_step,
)
from models.config import check_bool, check_positive_int, is_int, register_kind
from models.delta import DeltaAttention, DeltaConfig
from models.heads import dense
from models.mamba import Mamba2, Mamba2Config
from models.patterns import PresetSizes, register_preset

NUM_LEVELS = 12  # every level its own weight up to 2^(12 - 1) = 2048 tokens
NOT_SHARDED = "no sharded log-linear form (its Fenwick levels span the sequence)"


def _check_log_linear(cfg, kind: str, forms: tuple[str, ...]) -> None:
    """The fields both log-linear kinds check: levels, form, chunk size, rope, kv heads."""
    check_positive_int(cfg.num_levels, "num_levels")
    if cfg.form not in forms:
        fail("form", f"one of {forms} for kind={kind!r}", repr(cfg.form))
    c = cfg.chunk_size
    if not is_int(c) or c < 1 or c & (c - 1):
        why = "the levels align with chunks"
        fail("chunk_size", f"a power of 2 for kind={kind!r} ({why})", repr(c))
    if cfg.rope:
        fail("rope", f"False for kind={kind!r} (the recurrence orders the tokens)", "True")


def _refuse_encoder(causal: bool, kind: str) -> None:
    if not causal:
        fail("cfg.kind", f"a causal layer for {kind!r} (a recurrence needs an order)", "an encoder")


class LevelWeights:
    """The level weights of a log-linear layer, and its prefill's form (mixed into its module
    class)."""

    def _init_levels(self, width: int, heads: int, num_levels: int, *, param_dtype, rngs):
        """``level_proj [D, N*L]`` (float32, bias-free) and ``level_scale [N,L]`` ones."""
        self.level_proj = dense(
            width, heads * num_levels, dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs
        )
        self.level_scale = nnx.Param(jnp.ones((heads, num_levels), param_dtype))

    def _extend_options(self) -> dict:
        """A prefill continues the cached levels in the recurrent form (the chunkwise form's
        levels need the sequence to start at position 0)."""
        return dict(form="recurrent", chunk_size=self.cfg.chunk_size)

    def _level_weights(self, x):
        """``x [B,T,D] -> lambda [B,T,N,L]`` float32: ``softplus(level_scale * (x W_level))``."""
        B, T, _ = x.shape
        N, L = self.level_scale.shape
        raw = self.level_proj(x.astype(jnp.float32)).reshape(B, T, N, L)
        return jax.nn.softplus(self.level_scale[...].astype(jnp.float32) * raw)


# ----------------------------------------------------------------------------
# Log-linear Mamba-2


@dataclasses.dataclass(frozen=True)
class LogLinearMamba2Config(Mamba2Config):
    """A log-linear Mamba-2 layer (kind ``"log_linear_mamba2"``): ``Mamba2Config``'s
    fields (``form`` one of ``attn.LOG_LINEAR_FORMS``, ``chunk_size`` a power of 2,
    ``negative_eigenvalues`` False) and:

    Attributes:
      num_levels: L, the Fenwick levels with weights of their own (levels from
        L - 1 up share the last); ``L >= bit_length(T - 1) + 1`` separates all
        of T tokens.
    """

    kind: str = "log_linear_mamba2"
    num_levels: int = NUM_LEVELS

    def check_fields(self) -> None:
        _check_log_linear(self, "log_linear_mamba2", LOG_LINEAR_FORMS)
        check_bool(self.negative_eigenvalues, "negative_eigenvalues")
        if self.negative_eigenvalues:
            why = "the log-linear forms take decays in [0, 1]"
            fail("negative_eigenvalues", f"False for kind='log_linear_mamba2' ({why})", "True")
        if self.num_kv_heads is not None:
            why = "B and C are shared by groups of heads; set groups"
            fail("num_kv_heads", f"None for kind='log_linear_mamba2' ({why})", self.num_kv_heads)
        super().check_fields()


@struct.dataclass
class LogLinearMamba2Cache:
    """Decode cache: the Fenwick states (``LogLinearState``: levels ``[B,N,L,H,E]``
    float32, the length so far ``[B]``) and the convolution's last W-1 inputs
    ``[B,W-1,NE+2RH]`` (x, B and C before the convolution), as ``Mamba2Cache``."""

    state: LogLinearState
    conv: jax.Array


@register_kind(
    "log_linear_mamba2",
    config=LogLinearMamba2Config,
    family="linear",
    sequence_parallel=NOT_SHARDED,
    in_order=True,
)
class LogLinearMamba2(LevelWeights, Mamba2):
    """Mamba-2's block (``Mamba2``: projection, convolution, dt, A, the gated RMSNorm)
    with log-linear attention in place of the SSD.

    ``y = log_linear_attention(C, B, dt x, dt A, lambda, scale=1) + D x`` with
    ``lambda = softplus(level_scale * (x W_level))`` from the layer input (see
    the module docstring). With all weights 1 it is ``Mamba2``.

    The decode cache (``LogLinearMamba2Cache``) is the Fenwick states and the
    convolution's last W-1 inputs; a chunk (prefill) runs the recurrent form
    from them. Captured weights (``sow_weights``) are M with ``y = M x`` before
    the norm (D on its diagonal), found as the outputs for one-hot x.
    """

    def __init__(
        self, cfg: LogLinearMamba2Config, width: int, *, causal: bool, dtype, param_dtype, rngs
    ):
        _refuse_encoder(causal, "log_linear_mamba2")
        super().__init__(cfg, width, causal=causal, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self._init_levels(width, cfg.num_heads, cfg.num_levels, param_dtype=param_dtype, rngs=rngs)

    def _mix(self, xs, *, dt, b, c, lam, segment_ids=None, **options):
        """``y [B,T,N,E]`` (xs' dtype) from x ``[B,T,N,E]``, dt ``[B,T,N]``, B and C
        ``[B,T,R,H]``, lambda ``[B,T,N,L]``: log-linear attention plus ``D x``; ``options``
        go to ``log_linear_attention`` (with ``return_state``, also the state)."""
        params = self._params()
        out = log_linear_attention(
            c,
            b,
            xs.astype(jnp.float32) * dt[..., None],
            dt * params["A"],
            lam,
            scale=1.0,
            q_segment_ids=segment_ids,
            kv_segment_ids=segment_ids,
            **options,
        )
        y, state = out if isinstance(out, tuple) else (out, None)
        skip = masks.drop_padding(xs, segment_ids).astype(jnp.float32)
        y = (y + params["D"][:, None] * skip).astype(xs.dtype)
        return y if state is None else (y, state)

    def _sequence(self, x, *, dt, b, c, segment_ids=None, sharded=False, **options):
        """``_mix`` with the level weights of x (no sharded form: ``sharded`` is unused)."""
        del sharded
        lam = self._level_weights(x)
        return functools.partial(
            self._mix, dt=dt, b=b, c=c, lam=lam, segment_ids=segment_ids, **options
        )

    def _step(self, x, state, xs, *, dt, b, c):
        """``log_linear_attention_step`` plus ``D x`` for the token ``x [B,1,D]``."""
        params = self._params()
        y, state = log_linear_attention_step(
            c,
            b,
            xs.astype(jnp.float32) * dt[..., None],
            dt * params["A"],
            self._level_weights(x)[:, 0],
            state,
            scale=1.0,
        )
        return (y + params["D"][:, None] * xs.astype(jnp.float32)).astype(xs.dtype), state

    def init_cache(self, batch: int, max_len: int) -> LogLinearMamba2Cache:
        """Empty Fenwick states ``[B,N,L,H,E]`` and zero convolution inputs ``[B,W-1,NE+2RH]``."""
        del max_len
        cfg = self.cfg
        state = init_log_linear_state(
            batch, cfg.num_heads, cfg.state_dim, cfg.head_dim, cfg.num_levels
        )
        conv = jnp.zeros((batch, cfg.conv - 1, self.channels), self.dtype)
        return LogLinearMamba2Cache(state=state, conv=conv)


# ----------------------------------------------------------------------------
# Log-linear Gated DeltaNet

LOG_LINEAR_GATES = ("none", "head")


@dataclasses.dataclass(frozen=True)
class LogLinearDeltaConfig(DeltaConfig):
    """A log-linear Gated DeltaNet layer (kind ``"log_linear_gated_deltanet"``):
    ``DeltaConfig``'s fields (``form`` one of ``attn.LOG_LINEAR_DELTA_FORMS``,
    ``chunk_size`` a power of 2, ``gate`` ``"head"`` or ``"none"`` (log-linear
    DeltaNet), ``householder_steps`` 1) and:

    Attributes:
      num_levels: L, as ``LogLinearMamba2Config.num_levels``.
    """

    kind: str = "log_linear_gated_deltanet"
    num_levels: int = NUM_LEVELS

    def check_fields(self) -> None:
        kind = "log_linear_gated_deltanet"
        _check_log_linear(self, kind, LOG_LINEAR_DELTA_FORMS)
        if self.gate not in LOG_LINEAR_GATES:
            why = "attn.log_linear_delta_rule takes one gate per head, or none"
            fail("gate", f"one of {LOG_LINEAR_GATES} for kind={kind!r} ({why})", repr(self.gate))
        if self.householder_steps != 1:
            why = "attn.log_linear_delta_rule writes one key per token"
            fail("householder_steps", f"1 for kind={kind!r} ({why})", repr(self.householder_steps))
        if self.num_kv_heads is not None:
            why = "q and k share heads; set value_heads for more value heads"
            fail("num_kv_heads", f"None for kind={kind!r} ({why})", repr(self.num_kv_heads))
        super().check_fields()


@struct.dataclass
class LogLinearDeltaCache:
    """Decode cache: the Fenwick states (``LogLinearState``: levels ``[B,N,L,H,H]``
    float32, the length so far ``[B]``) and the last W-1 inputs of the q/k/v
    convolution ``[B,W-1,2KH+NH]`` (None without one), as ``DeltaCache``."""

    state: LogLinearState
    conv: jax.Array | None


@register_kind(
    "log_linear_gated_deltanet",
    config=LogLinearDeltaConfig,
    family="linear",
    sequence_parallel=NOT_SHARDED,
    in_order=True,
)
class LogLinearDeltaAttention(LevelWeights, DeltaAttention):
    """Gated DeltaNet's layer (``DeltaAttention``: q/k/v convolution, L2-normalized q
    and k, beta, the head decays, the output norm and gate) with
    ``attn.log_linear_delta_rule`` in place of the delta rule.

    Level weights ``lambda [B,T,N,L] = softplus(level_scale * (x W_level))`` per
    value head (see the module docstring); with all weights 1 it is
    ``DeltaAttention``. The decode cache (``LogLinearDeltaCache``) is the
    Fenwick states and the convolution's last W-1 inputs; a chunk (prefill)
    runs the recurrent form from them. Captured weights (``sow_weights``) are M
    with ``out = M V`` before the output norm, found as the outputs for one-hot
    values.
    """

    def __init__(
        self, cfg: LogLinearDeltaConfig, width: int, *, causal: bool, dtype, param_dtype, rngs
    ):
        _refuse_encoder(causal, "log_linear_gated_deltanet")
        super().__init__(cfg, width, causal=causal, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self._init_levels(
            width, cfg.num_value_heads, cfg.num_levels, param_dtype=param_dtype, rngs=rngs
        )

    def _rule_for(self, x):
        """``log_linear_delta_rule`` with the level weights of x, in the delta rule's signature."""
        lam = self._level_weights(x)

        def rule(q, k, v, beta, **options):
            return log_linear_delta_rule(q, k, v, beta, lam, **options)

        return rule

    def _step_for(self, x):
        """``log_linear_delta_rule_step`` with the level weights of the token ``x [B,1,D]``."""
        lam = self._level_weights(x)[:, 0]

        def step(q, k, v, beta, state, **options):
            return log_linear_delta_rule_step(q, k, v, beta, lam, state, **options)

        return step

    def init_cache(self, batch: int, max_len: int) -> LogLinearDeltaCache:
        """Empty Fenwick states ``[B,N,L,H,H]`` and zero convolution inputs ``[B,W-1,2KH+NH]``."""
        del max_len
        cfg = self.cfg
        N, H = cfg.num_value_heads, cfg.head_dim
        state = init_log_linear_state(batch, N, H, H, cfg.num_levels)
        conv = None
        if self.conv is not None:
            conv = jnp.zeros((batch, cfg.qkv_conv - 1, self.channels), self.dtype)
        return LogLinearDeltaCache(state=state, conv=conv)


# ----------------------------------------------------------------------------
# Presets


def _mamba2(sizes: PresetSizes) -> LogLinearMamba2Config:
    return LogLinearMamba2Config(
        num_heads=sizes.num_heads,
        head_dim=sizes.head_dim,
        state_dim=sizes.state_dim,
        chunk_size=sizes.chunk_size,
        conv=sizes.short_conv,
    )


def _gated_deltanet(sizes: PresetSizes) -> LogLinearDeltaConfig:
    return LogLinearDeltaConfig(
        num_heads=sizes.num_heads, head_dim=sizes.head_dim, chunk_size=sizes.chunk_size
    )


register_preset(
    "log_linear_mamba2",
    _mamba2,
    description="Log-linear Mamba-2: the SSD over a Fenwick tree of states (Guo et al. 2025)",
)
register_preset(
    "log_linear_gated_deltanet",
    _gated_deltanet,
    description="Log-linear Gated DeltaNet: the delta rule over a Fenwick tree of states",
)
