"""``Mamba2``: Mamba-2's layer (Dao and Gu, ICML 2024) around ``attn.ssd``.

One layer kind, ``"mamba2"``, configured by ``Mamba2Config``; the preset
``mamba2`` is registered here, and the comparison's ``mamba2_hybrid`` variant
puts a softmax layer after Mamba layers (the hybrids the paper and its
successors train).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

import attn
from attn import masks
from attn.checks import fail
from attn.linear.front import CHUNK_SIZE
from models.config import AttentionConfig, check_bool, check_positive_int, register_kind
from models.delta import decay_init
from models.heads import dense
from models.levels import init_levels, level_weights, num_levels
from models.mesh import in_sequence
from models.patterns import PresetSizes, register_preset
from models.recurrent import Recurrent, one_hot_values

NORM_EPS = 1e-5  # Mamba-2's gated RMSNorm epsilon


@dataclasses.dataclass(frozen=True)
class Mamba2Config(AttentionConfig):
    """A Mamba-2 layer (kind ``"mamba2"``). ``num_heads`` are its heads, ``head_dim``
    their dim (Mamba's ``headdim``; the inner width is their product). Besides:

    Attributes:
      state_dim: H of the SSD state ``[H, head_dim]`` per head (Mamba's ``d_state``).
      groups: groups of heads sharing B and C (Mamba's ``ngroups``), dividing ``num_heads``.
      conv: width W of the causal convolution (with SiLU) over x, B and C.
      form: ``"recurrent"``, ``"chunkwise"`` or ``"quadratic"`` (``attn.SSD_FORMS``).
      chunk_size: C of the chunkwise form.
      negative_eigenvalues: decays ``2 exp(dt A) - 1`` in (-1, 1] (Grazzi et al., ICLR 2025).
    """

    kind: str = "mamba2"
    rope: bool = False
    state_dim: int = 16
    groups: int = 1
    conv: int = 4
    form: str = "chunkwise"
    chunk_size: int = CHUNK_SIZE
    negative_eigenvalues: bool = False

    def check_fields(self) -> None:
        check_positive_int(self.state_dim, "state_dim")
        check_positive_int(self.groups, "groups")
        check_positive_int(self.conv, "conv")
        check_positive_int(self.chunk_size, "chunk_size")
        check_bool(self.negative_eigenvalues, "negative_eigenvalues")
        if self.num_heads % self.groups:
            fail("groups", f"a divisor of num_heads={self.num_heads}", repr(self.groups))
        if self.form not in attn.SSD_FORMS:
            fail("form", f"one of {attn.SSD_FORMS} for kind='mamba2'", repr(self.form))
        if self.rope:
            fail("rope", "False for kind='mamba2' (the recurrence orders the tokens)", "True")
        if self.num_kv_heads is not None:
            why = "B and C are shared by groups of heads; set groups"
            fail("num_kv_heads", f"None for kind='mamba2' ({why})", repr(self.num_kv_heads))

    @property
    def inner(self) -> int:
        """The inner width: heads x head dim (Mamba's ``d_inner``)."""
        return self.num_heads * self.head_dim


@register_kind(
    "mamba2",
    config=Mamba2Config,
    family="linear",
    sequence_parallel=True,
    in_order=True,
)
class Mamba2(Recurrent):
    """Mamba-2's block as its paper and reference code build it.

    From the layer input: one projection to ``(z, x, B, C, dt_raw)``; a causal
    convolution of width W (with bias) and SiLU over the channels of x, B and
    C; ``dt = softplus(dt_raw + dt_bias)`` and ``A = -exp(A_log)`` per head;
    ``y = ssd(x, dt, A, B, C, D)``; the gated RMSNorm ``norm(y * silu(z))``
    (the reference's default, the gate before the norm; over each group's
    channels, with a learned weight); the head gates; the output projection.
    Initialization: A uniform in [1, 16], dt log-uniform in [1e-3, 1e-1]
    (through softplus's inverse), D = 1, as the reference.

    The decode cache (``models.recurrent.RecurrentCache``) is the SSD state
    and the convolution's last W-1 inputs. Padding and packing are segment ids, for
    the convolution and for ``attn.ssd``. Captured weights (``sow_weights``)
    are M with ``y = M x`` before the norm (SSD is linear in x for given dt,
    B and C), found as the outputs for one-hot x.
    """

    def __init__(self, cfg: Mamba2Config, width: int, *, causal: bool, dtype, param_dtype, rngs):
        if not causal:
            why = "a recurrence needs an order"
            fail("cfg.kind", f"a causal layer for {cfg.kind!r} ({why})", "an encoder")
        self._init_heads(cfg, causal=causal, dtype=dtype)
        N, R, H = cfg.num_heads, cfg.groups, cfg.state_dim
        linear = functools.partial(dense, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.channels = cfg.inner + 2 * R * H  # convolved: x, B, C
        self.in_proj = linear(width, cfg.inner + self.channels + N)
        bound = 1 / math.sqrt(cfg.conv)  # a depthwise Conv1d's default init, fan-in W
        init = jax.nn.initializers.uniform(2 * bound)
        conv_shapes = ((cfg.conv, self.channels), (self.channels,))
        weight, bias = (init(rngs.params(), s, param_dtype) - bound for s in conv_shapes)
        self.conv_weight, self.conv_bias = nnx.Param(weight), nnx.Param(bias)
        A_log, dt_bias = decay_init(N, N, rngs.params())
        self.A_log = nnx.Param(A_log.astype(param_dtype))
        self.dt_bias = nnx.Param(dt_bias.astype(param_dtype))
        self.D = nnx.Param(jnp.ones((N,), param_dtype))
        self.norm_weight = nnx.Param(jnp.ones((cfg.inner,), param_dtype))
        self.o_proj = linear(cfg.inner, width)
        self.levels = num_levels(cfg)
        if self.levels:  # log-linear Mamba-2 (models.log_linear): the level weights
            init_levels(self, width, N, self.levels, param_dtype=param_dtype, rngs=rngs)

    # Pieces (models.recurrent.Recurrent's) -----------------------------------

    def _front(self, x, positions, segment_ids):
        """The projection's unconvolved ``xBC`` and ``(z [B,T,NE], dt [B,T,N] float32)``."""
        del positions, segment_ids  # the recurrence orders the tokens
        cfg = self.cfg
        z, xbc, dt_raw = jnp.split(self.in_proj(x), [cfg.inner, cfg.inner + self.channels], -1)
        dt = jax.nn.softplus(dt_raw.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        return xbc, (z, dt)

    def _conv_params(self):
        return self.conv_weight[...], self.conv_bias[...]

    def _conv_shape(self):
        return self.cfg.conv, self.channels

    def _inputs(self, x, xbc, ctx) -> dict:
        """Convolved ``xBC`` -> x ``[B,T,N,E]``, B and C ``[B,T,R,H]``, with dt (and the
        level weights ``[B,T,N,L]`` of a log-linear layer)."""
        cfg = self.cfg
        B, T, _ = xbc.shape
        R, H = cfg.groups, cfg.state_dim
        xbc = jax.nn.silu(xbc)
        xs, b, c = jnp.split(xbc, [cfg.inner, cfg.inner + R * H], axis=-1)
        shape = (B, T, R, H)
        inputs = dict(x=xs.reshape(B, T, cfg.num_heads, cfg.head_dim), dt=ctx[1],
                      b=b.reshape(shape), c=c.reshape(shape))  # fmt: skip
        if self.levels:
            inputs["lam"] = level_weights(self, x)
        return inputs

    def _params(self) -> tuple:
        """``A [N]`` and ``D [N]`` float32."""
        return -jnp.exp(self.A_log[...].astype(jnp.float32)), self.D[...].astype(jnp.float32)

    def _mix(self, p, *, segment_ids=None, sharded=False, **options):
        """``attn.ssd`` (its sharded form with ``sharded``, under a mesh), or log-linear
        attention plus ``D x`` for a log-linear layer (no sharded form)."""
        A, D = self._params()
        if self.levels:
            out = attn.log_linear_attention(
                p["c"], p["b"], p["x"].astype(jnp.float32) * p["dt"][..., None], p["dt"] * A,
                p["lam"], scale=1.0, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                **options,
            )  # fmt: skip
            y, state = out if isinstance(out, tuple) else (out, None)
            skip = masks.drop_padding(p["x"], segment_ids).astype(jnp.float32)
            y = (y + D[:, None] * skip).astype(p["x"].dtype)
            return y if state is None else (y, state)
        ssd = in_sequence(attn.ssd) if sharded else attn.ssd
        return ssd(p["x"], p["dt"], A, p["b"], p["c"], D=D, segment_ids=segment_ids,
                   negative_eigenvalues=self.cfg.negative_eigenvalues, **options)  # fmt: skip

    def _mix_step(self, p, state):
        """``(y [B,N,E], state)``: the mixer advanced by one token."""
        A, D = self._params()
        if self.levels:
            xs = p["x"].astype(jnp.float32)
            y, state = attn.log_linear_attention_step(
                p["c"], p["b"], xs * p["dt"][..., None], p["dt"] * A, p["lam"], state, scale=1.0
            )
            return (y + D[:, None] * xs).astype(p["x"].dtype), state
        return attn.ssd_step(state, p["x"], p["dt"], A=A, B=p["b"], C=p["c"], D=D,
                             negative_eigenvalues=self.cfg.negative_eigenvalues)  # fmt: skip

    def _extend_options(self) -> dict:
        """A log-linear prefill continues the cached levels in the recurrent form (the
        chunkwise form's levels need the sequence to start at position 0)."""
        if self.levels:
            return dict(form="recurrent", chunk_size=self.cfg.chunk_size)
        return self._options()

    def _one_hot(self, p) -> dict:
        return {**p, "x": one_hot_values(p["x"])}

    def _zero_state(self, batch: int):
        """The SSD state ``[B,N,H,E]`` (log-linear: the Fenwick states ``[B,N,L,H,E]``)."""
        cfg = self.cfg
        N, H, E = cfg.num_heads, cfg.state_dim, cfg.head_dim
        if self.levels:
            return attn.init_log_linear_state(batch, N, H, E, self.levels)
        return attn.init_ssd_state(batch, N, H, E)

    def _finish(self, y, inputs, ctx):
        """``norm(y * silu(z))`` per group of channels, the head gates and ``o_proj``."""
        cfg = self.cfg
        z = ctx[0]
        B, T, N, E = y.shape
        gated = y.astype(jnp.float32).reshape(B, T, -1) * jax.nn.silu(z.astype(jnp.float32))
        groups = gated.reshape(B, T, cfg.groups, -1)
        normed = groups * jax.lax.rsqrt(jnp.mean(groups**2, axis=-1, keepdims=True) + NORM_EPS)
        normed = normed.reshape(B, T, -1) * self.norm_weight[...].astype(jnp.float32)
        return self._output(normed.reshape(B, T, N, E).astype(self.dtype))


def _sized(negative: bool):
    def build(sizes: PresetSizes) -> Mamba2Config:
        return Mamba2Config(
            num_heads=sizes.num_heads,
            head_dim=sizes.head_dim,
            state_dim=sizes.state_dim,
            chunk_size=sizes.chunk_size,
            conv=sizes.short_conv,
            negative_eigenvalues=negative,
        )

    return build


register_preset("mamba2", _sized(False), description="Mamba-2: SSD with decays in (0, 1]")
register_preset(
    "mamba2_negative",
    _sized(True),
    description="Mamba-2 with decays in (-1, 1] (negative eigenvalues, Grazzi et al. 2025)",
)
