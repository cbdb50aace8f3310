"""``LightningAttention``: MiniMax-01's lightning attention, linear attention with a fixed decay.

MiniMax-01 (MiniMax 2025, "MiniMax-01: Scaling Foundation Models with Lightning
Attention"; the released ``MiniMaxText01LightningAttention``) reads, per head n::

    q, k, v = silu(x W_q), silu(x W_k), silu(x W_v)
    S_t = lambda_n S_{t-1} + k_t^T v_t,      o_t = q_t S_t        (no 1/sqrt(H), no normalizer)
    y = (sigmoid(x W_g) * RMSNorm_{N E}(o)) W_o

with ``lambda_n = exp(-s_n f)``: s_n ALiBi's slope of head n (``attn.scores.alibi_slopes``)
and f the layer's depth factor ``1 - l / (L - 1) + 1e-5`` for layer l of L (0-based),
so the first layer forgets fastest and the last remembers longest. The RMSNorm is
one over all heads' channels together (width N E), not per head. The recurrence is
``attn.linear_attention`` with the ``silu`` feature map, ``normalize=False`` and the
per-head gammas; this module adds the value map, the norm and the gate.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from attn.checks import fail
from attn.scores import alibi_slopes
from models.config import check_positive_float, register_kind
from models.linear import LinearAttention, LinearConfig
from models.patterns import PresetSizes, register_preset

# MiniMax-Text-01's rms_norm_eps.
NORM_EPS = 1e-5
# Added to the depth factor so the deepest layer still forgets a little (MiniMax's).
DEPTH_FLOOR = 1e-5


def depth_factor(index: int, num_layers: int) -> float:
    """MiniMax-01's decay factor of layer ``index`` (0-based) of ``num_layers``:
    ``1 - index / (num_layers - 1) + 1e-5`` (1 + 1e-5 in a one-layer model)."""
    return 1.0 - index / max(num_layers - 1, 1) + DEPTH_FLOOR


@dataclasses.dataclass(frozen=True)
class LightningConfig(LinearConfig):
    """A lightning-attention layer (kind ``"lightning"``): causal, no RoPE, SiLU maps.

    Attributes:
      decay_factor: f of ``lambda_n = exp(-s_n f)``; None: set by depth where
        ``models.pattern`` builds the layer (``depth_factor``), 1 + 1e-5 (the first
        layer's) where nothing sets it.

    ``LinearConfig``'s fields keep MiniMax's values: ``feature_map="silu"``,
    ``normalize=False``, ``rope=False``; ``decay`` and ``gating`` stay unset (the
    decay is the slopes').
    """

    kind: str = "lightning"
    rope: bool = False
    feature_map: str = "silu"
    normalize: bool = False
    decay_factor: float | None = None

    def check_fields(self) -> None:
        super().check_fields()
        check_positive_float(self.decay_factor, "decay_factor", allow_none=True)
        if self.decay is not None:
            why = "the decay is ALiBi's slopes"
            fail("decay", f"None for kind='lightning' ({why})", repr(self.decay))
        if self.gating:
            fail("gating", "False for kind='lightning' (its decay is fixed)", repr(self.gating))

    def check_direction(self, causal: bool, name: str = "layer") -> None:
        if not causal:
            fail(f"{name}.kind", "a causal stack for 'lightning' (its decay needs an order)",
                 "a bidirectional one")  # fmt: skip

    def at_depth(self, index: int, num_layers: int) -> LightningConfig:
        """Layer ``index`` of ``num_layers``: the depth factor, unless one is set."""
        if self.decay_factor is not None:
            return self
        return dataclasses.replace(self, decay_factor=depth_factor(index, num_layers))

    def decay_values(self) -> tuple[float, ...]:
        """``lambda_n = exp(-s_n f)`` per head ``[N]``."""
        f = depth_factor(0, 1) if self.decay_factor is None else self.decay_factor
        return tuple(math.exp(-float(s) * f) for s in alibi_slopes(self.num_heads))


@register_kind("lightning", config=LightningConfig, family="linear", sequence_parallel=True,
               in_order=True)  # fmt: skip
class LightningAttention(LinearAttention):
    """Lightning attention (see the module docstring): ``LinearAttention`` with SiLU values,
    an RMSNorm over the heads' N E channels and a sigmoid output gate from x.

    Parameters: q, k, v ``[D, N*H]``, the gate ``[D, N*H]``, the norm's scale ``[N*H]``,
    o ``[N*H, D]``; the decay is static config.
    """

    def __init__(self, cfg: LightningConfig, width: int, *, causal: bool, dtype, param_dtype,
                 rngs):  # fmt: skip
        super().__init__(cfg, width, causal=causal, dtype=dtype, param_dtype=param_dtype,
                         rngs=rngs)  # fmt: skip
        NE = cfg.num_heads * cfg.value_dim
        self.out_norm = nnx.RMSNorm(NE, epsilon=NORM_EPS, dtype=jnp.float32,
                                    param_dtype=param_dtype, rngs=rngs)  # fmt: skip
        self._init_output_gate(width, "elementwise", cfg.value_dim, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs)  # fmt: skip

    def _front(self, x, positions, segment_ids):
        """q, k, v and x (the gate's input)."""
        _, qkv = super()._front(x, positions, segment_ids)
        return None, (qkv, x)

    def _inputs(self, x, u, ctx) -> dict:
        q, k, v = ctx[0]
        return super()._inputs(x, u, (q, k, jax.nn.silu(v)))

    def _finish(self, out, inputs, ctx):
        """The RMSNorm over all heads, the gate, the head gates and ``o_proj``."""
        B, T, N, E = out.shape
        x = ctx[1]
        normed = self.out_norm(out.reshape(B, T, N * E).astype(jnp.float32))
        return self._output(self._gated(normed.astype(x.dtype).reshape(B, T, N, E), x))


def _sized(sizes: PresetSizes) -> LightningConfig:
    return LightningConfig(num_heads=sizes.num_heads, head_dim=sizes.head_dim,
                           chunk_size=sizes.chunk_size)  # fmt: skip


register_preset("lightning", _sized,
                description="MiniMax-01's lightning attention: SiLU maps, ALiBi-slope decay by "
                "depth, no normalizer")  # fmt: skip
