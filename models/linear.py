"""``LinearAttention``: ``phi(q).phi(k)`` attention (``attn.linear``) with a recurrent state."""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np

import attn
from attn.checks import fail
from attn.linear.front import CHUNK_SIZE
from models.config import (
    AttentionConfig,
    check_bool,
    check_positive_int,
    check_rotary,
    register_kind,
)
from models.heads import Buffer, dense
from models.mesh import in_sequence
from models.recurrent import Recurrent, one_hot_values

# Gated linear attention: gates are sigmoid(x W + b) ** (1 / 16) (Yang et al.
# 2023), so they start close to 1 (long memory) and learn to forget.
GATE_TEMPERATURE = 16.0
GATE_BIAS_INIT = 2.0


@dataclasses.dataclass(frozen=True)
class LinearConfig(AttentionConfig):
    """A linear-attention layer (kind ``"linear"``, ``attn.linear``).

    Attributes:
      rotary_dim: leading channels that rotate (partial RoPE); None means all H.
      feature_map: a name in ``attn.linear.FEATURE_MAPS``.
      form: ``"parallel"``, ``"recurrent"`` or ``"chunkwise"`` (``attn.LINEAR_FORMS``:
        the same function).
      decay: fixed per-head decay gamma in (0, 1]: a number, a tuple of N
        numbers, ``"retnet"`` (gamma_n = 1 - 2^(-5-n)), or None.
      gating: data-dependent per-head log-gates from a projection of the
        input (gated linear attention / Mamba-2 style); combines with ``decay``.
      chunk_size: C for the chunkwise form.
      normalize: divide by ``phi(q).z`` (use False with ``"identity"``).
      num_features: F for ``"favor"`` (random features).
    """

    kind: str = "linear"
    rotary_dim: int | None = None
    feature_map: str = "elu1"
    form: str = "chunkwise"
    decay: float | tuple[float, ...] | str | None = None
    gating: bool = False
    chunk_size: int = CHUNK_SIZE
    normalize: bool = True
    num_features: int | None = None

    def check_fields(self) -> None:
        check_rotary(self)
        if self.feature_map not in attn.FEATURE_MAPS:
            fail("feature_map", f"one of {sorted(attn.FEATURE_MAPS)}", repr(self.feature_map))
        if self.form not in attn.LINEAR_FORMS:
            fail("form", f"one of {attn.LINEAR_FORMS}", repr(self.form))
        check_positive_int(self.chunk_size, "chunk_size")
        check_bool(self.gating, "gating")
        check_bool(self.normalize, "normalize")
        check_positive_int(self.num_features, "num_features", allow_none=True)
        d = self.decay
        if d is not None and d != "retnet":
            values = d if isinstance(d, tuple) else (d,)
            ok = all(
                isinstance(x, numbers.Real) and not isinstance(x, bool) and 0 < x <= 1
                for x in values
            )
            if not ok or (isinstance(d, tuple) and len(d) != self.num_heads):
                fail(
                    "decay",
                    f"None, 'retnet', a number in (0, 1] or a tuple of {self.num_heads} of them",
                    repr(d),
                )
        if self.feature_map == "favor" and self.num_features is None:
            fail("num_features", "a positive int for feature_map='favor'", "None")

    def check_direction(self, causal: bool, name: str = "layer") -> None:
        """Decay and gates need an order: a bidirectional layer has neither."""
        if causal:
            return
        for field, off, why in (
            ("decay", None, "decay needs an order"),
            ("gating", False, "gates need an order"),
        ):
            if getattr(self, field) != off:
                fail(
                    f"{name}.{field}",
                    f"{off!r} in a bidirectional layer ({why})",
                    repr(getattr(self, field)),
                )

    def decay_values(self) -> tuple[float, ...] | None:
        """Per-head gammas ``[N]`` as a tuple, or None without fixed decay."""
        if self.decay is None:
            return None
        if self.decay == "retnet":
            # RetNet's multi-scale retention: head n forgets with 1 - 2^(-5-n).
            return tuple(1.0 - 2.0 ** (-5 - n) for n in range(self.num_heads))
        if isinstance(self.decay, tuple):
            return tuple(float(x) for x in self.decay)
        return (float(self.decay),) * self.num_heads


@register_kind(
    "linear",
    config=LinearConfig,
    family="linear",
    sequence_parallel=True,
    in_order=True,
)
class LinearAttention(Recurrent):
    """Linear attention ``phi(q).phi(k)`` (``attn.linear``), any feature map, form and decay.

    Parameters: q ``[D, N*H]``, k and v ``[D, K*H]``, o ``[N*H, D]``; with gating a
    gate projection ``[D, N]`` (+ bias) giving log-gates
    ``log_sigmoid(x W_g + b) / GATE_TEMPERATURE`` ``[B,T,N]``; for ``"favor"`` fixed
    random features ``[H, F]`` (a ``Buffer``, not trained). Fixed decay gammas
    are static config. The decode cache (``models.recurrent.RecurrentCache``) holds
    the recurrent ``LinearState``.

    Padding and packing are segment ids, handled by ``attn.linear_attention``
    itself: a padding token (id 0) adds nothing to the state and does not
    decay it, and the state restarts where a new segment starts.

    Captured weights (``sow_weights``) are those of the parallel form, the
    ``[B,N,T,S]`` matrix the output is a product of (``phi(q_t).phi(k_s)`` times
    the decay, over the normalizer): computed as the outputs for one-hot values,
    so ``attn.linear`` stays their one home. That costs ``O(T S^2)`` per head,
    paid only when captured.
    """

    def __init__(self, cfg: LinearConfig, width: int, *, causal: bool, dtype, param_dtype, rngs):
        self._init_heads(cfg, causal=causal, dtype=dtype)
        self._init_qkv(width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = (
            dense(
                width,
                cfg.num_heads,
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
            Buffer(attn.favor_projection(rngs.params(), cfg.head_dim, cfg.num_features))
            if cfg.feature_map == "favor"
            else None
        )

    @property
    def feature_dim(self) -> int:
        """F of the feature map."""
        proj = None if self.projection is None else self.projection[...]
        return attn.linear_feature_dim(self.cfg.feature_map, self.cfg.head_dim, projection=proj)

    def _features(self) -> dict:
        """The keyword arguments ``linear_attention`` and its step share."""
        gammas = self.cfg.decay_values()
        return dict(
            feature_map=self.cfg.feature_map,
            projection=None if self.projection is None else self.projection[...],
            normalize=self.cfg.normalize,
            decay=None if gammas is None else np.asarray(gammas, np.float32),
        )

    def _log_gates(self, x):
        """Data-dependent log-gates ``[B,T,N]`` float32 (<= 0), or None without gating."""
        if self.gate_proj is None:
            return None
        return jax.nn.log_sigmoid(self.gate_proj(x.astype(jnp.float32))) / GATE_TEMPERATURE

    # Pieces (models.recurrent.Recurrent's) -----------------------------------

    def _front(self, x, positions, segment_ids):
        """No convolution: q, k, v (RoPE at ``positions``) are the context."""
        del segment_ids  # attn.linear_attention takes them
        return None, self._qkv(x, positions)

    def _inputs(self, x, u, qkv) -> dict:
        q, k, v = qkv
        return dict(q=q, k=k, v=v, log_gates=self._log_gates(x))

    def _mix(self, p, *, segment_ids=None, sharded=False, **options):
        """``linear_attention`` over T tokens with this layer's options. A causal layer
        follows the mesh (sharded over "seq"), in a prefill too; a bidirectional one reads
        global sums, which XLA partitions."""
        del sharded
        fn = in_sequence(attn.linear_attention) if self.causal else attn.linear_attention
        out = fn(p["q"], p["k"], p["v"], causal=self.causal, log_gates=p["log_gates"],
                 q_segment_ids=segment_ids, kv_segment_ids=segment_ids, **self._features(),
                 **options)  # fmt: skip
        return (out[0], attn.LinearState(*out[1])) if isinstance(out, tuple) else out

    def _mix_step(self, p, state):
        return attn.linear_attention_step(state, p["q"], p["k"], p["v"], log_gate=p["log_gates"],
                                          **self._features())  # fmt: skip

    def _weight_options(self) -> dict:
        """The parallel form: its weights are the ``[B,N,T,S]`` matrix of the outputs."""
        return dict(form="parallel", chunk_size=self.cfg.chunk_size)

    def _one_hot(self, p) -> dict:
        return {**p, "v": one_hot_values(p["v"])}

    def _zero_state(self, batch: int) -> attn.LinearState:
        """Zero ``LinearState``: kv ``[B,N,F,E]``, z ``[B,N,F]`` float32."""
        cfg = self.cfg
        return attn.init_linear_state(batch, cfg.num_heads, self.feature_dim, cfg.value_dim)

    def _finish(self, out, inputs, ctx):
        return self._output(out)
