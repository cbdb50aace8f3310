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
from flax import nnx, struct

import attn
from attn import masks
from attn.checks import fail
from attn.linear.front import CHUNK_SIZE
from models.config import AttentionConfig, check_bool, check_positive_int, register_kind
from models.delta import decay_init
from models.heads import Heads, dense
from models.mesh import in_sequence
from models.patterns import PresetSizes, register_preset

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


@struct.dataclass
class Mamba2Cache:
    """Decode cache: the SSD state ``[B,N,H,E]`` float32 and the convolution's last
    W-1 inputs ``[B,W-1,NE+2RH]`` (x, B and C before the convolution)."""

    state: jax.Array
    conv: jax.Array


@register_kind(
    "mamba2",
    config=Mamba2Config,
    family="linear",
    sequence_parallel=True,
    in_order=True,
)
class Mamba2(Heads):
    """Mamba-2's block as its paper and reference code build it.

    From the layer input: one projection to ``(z, x, B, C, dt_raw)``; a causal
    convolution of width W (with bias) and SiLU over the channels of x, B and
    C; ``dt = softplus(dt_raw + dt_bias)`` and ``A = -exp(A_log)`` per head;
    ``y = ssd(x, dt, A, B, C, D)``; the gated RMSNorm ``norm(y * silu(z))``
    (the reference's default, the gate before the norm; over each group's
    channels, with a learned weight); the head gates; the output projection.
    Initialization: A uniform in [1, 16], dt log-uniform in [1e-3, 1e-1]
    (through softplus's inverse), D = 1, as the reference.

    The decode cache (``Mamba2Cache``) is the SSD state and the
    convolution's last W-1 inputs. Padding and packing are segment ids, for
    the convolution and for ``attn.ssd``. Captured weights (``sow_weights``)
    are M with ``y = M x`` before the norm (SSD is linear in x for given dt,
    B and C), found as the outputs for one-hot x.
    """

    def __init__(self, cfg: Mamba2Config, width: int, *, causal: bool, dtype, param_dtype, rngs):
        if not causal:
            why = "a recurrence needs an order"
            fail("cfg.kind", f"a causal layer for 'mamba2' ({why})", "an encoder")
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

    # Pieces ------------------------------------------------------------------

    def _split(self, x):
        """The projection's ``z [B,T,NE]``, unconvolved ``xBC`` and ``dt [B,T,N]`` float32."""
        cfg = self.cfg
        z, xbc, dt_raw = jnp.split(self.in_proj(x), [cfg.inner, cfg.inner + self.channels], -1)
        dt = jax.nn.softplus(dt_raw.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        return z, xbc, dt

    def _ssd_inputs(self, xbc):
        """Convolved ``xBC`` -> x ``[B,T,N,E]``, B and C ``[B,T,R,H]``."""
        cfg = self.cfg
        B, T, _ = xbc.shape
        R, H = cfg.groups, cfg.state_dim
        xbc = jax.nn.silu(xbc)
        x, b, c = jnp.split(xbc, [cfg.inner, cfg.inner + R * H], axis=-1)
        shape = (B, T, R, H)
        return x.reshape(B, T, cfg.num_heads, cfg.head_dim), b.reshape(shape), c.reshape(shape)

    def _params(self) -> dict:
        """``A [N]`` and ``D [N]`` float32, and the layer's SSD options."""
        cfg = self.cfg
        return dict(
            A=-jnp.exp(self.A_log[...].astype(jnp.float32)),
            D=self.D[...].astype(jnp.float32),
            negative_eigenvalues=cfg.negative_eigenvalues,
        )

    def _sequence(self, x, *, dt, b, c, segment_ids=None, sharded=False, **options):
        """``f(xs) -> y [B,T,N,E]`` (``(y, state)`` with ``return_state``): the mixer over a
        sequence with layer input ``x``, ``attn.ssd`` here (its sharded form with
        ``sharded``, under a mesh); ``options`` are the form's. Subclasses read more of x."""
        del x
        ssd = in_sequence(attn.ssd) if sharded else attn.ssd
        return functools.partial(
            ssd, dt=dt, B=b, C=c, segment_ids=segment_ids, **self._params(), **options
        )

    def _step(self, x, state, xs, *, dt, b, c):
        """``(y [B,N,E], state)``: the mixer advanced by one token with input ``x [B,1,D]``."""
        del x
        return attn.ssd_step(state, xs, dt, B=b, C=c, **self._params())

    def _extend_options(self) -> dict:
        """The form of a prefill's call from a cached state (a subclass's may differ)."""
        return dict(form=self.cfg.form, chunk_size=self.cfg.chunk_size)

    def _finish(self, y, z):
        """``norm(y * silu(z))`` per group of channels, the head gates and ``o_proj``."""
        cfg = self.cfg
        B, T, N, E = y.shape
        gated = y.astype(jnp.float32).reshape(B, T, -1) * jax.nn.silu(z.astype(jnp.float32))
        groups = gated.reshape(B, T, cfg.groups, -1)
        normed = groups * jax.lax.rsqrt(jnp.mean(groups**2, axis=-1, keepdims=True) + NORM_EPS)
        normed = normed.reshape(B, T, -1) * self.norm_weight[...].astype(jnp.float32)
        return self._output(normed.reshape(B, T, N, E).astype(self.dtype))

    # Surface -----------------------------------------------------------------

    def __call__(self, x, *, positions=None, segment_ids=None):
        """``x [B,T,D] -> [B,T,D]``; segment_ids ``[B,T]`` (id 0 padding) or None."""
        del positions  # the recurrence orders the tokens
        z, xbc, dt = self._split(x)
        conv = in_sequence(attn.short_conv)(
            xbc, self.conv_weight[...], self.conv_bias[...], segment_ids=segment_ids
        )[0]
        xs, b, c = self._ssd_inputs(conv)
        call = self._sequence(
            x, dt=dt, b=b, c=c, segment_ids=segment_ids, sharded=True,
            form=self.cfg.form, chunk_size=self.cfg.chunk_size,
        )  # fmt: skip
        if self.sow_weights:
            self._sow(self._weights(call, xs))
        return self._finish(call(xs), z)

    def _weights(self, call, xs):
        """``[B,N,T,S]`` float32: the outputs for one-hot x ``e_s`` (M of ``y = M x``)."""
        B, S, N, _ = xs.shape
        one_hot = jnp.broadcast_to(jnp.eye(S, dtype=jnp.float32)[None, :, None], (B, S, N, S))
        return jnp.transpose(call(one_hot), (0, 2, 1, 3))

    def init_cache(self, batch: int, max_len: int) -> Mamba2Cache:
        """Zero SSD state ``[B,N,H,E]`` float32 and convolution inputs ``[B,W-1,NE+2RH]``."""
        del max_len
        cfg = self.cfg
        state = attn.init_ssd_state(batch, cfg.num_heads, cfg.state_dim, cfg.head_dim)
        conv = jnp.zeros((batch, cfg.conv - 1, self.channels), self.dtype)
        return Mamba2Cache(state=state, conv=conv)

    def extend(self, x, cache: Mamba2Cache, start, lengths=None):
        """Continues over T new tokens. Arguments as ``SelfAttention.extend``."""
        del start
        T = x.shape[1]
        step = T == 1 and lengths is None
        segment_ids = None if lengths is None else masks.segment_ids_from_lengths(lengths, T)
        z, xbc, dt = self._split(x)
        weight, bias = self.conv_weight[...], self.conv_bias[...]
        if step:
            conv, conv_state = attn.short_conv_step(cache.conv, xbc[:, 0], weight, bias)
            xs, b, c = self._ssd_inputs(conv[:, None])
            y, state = self._step(x, cache.state, xs[:, 0], dt=dt[:, 0], b=b[:, 0], c=c[:, 0])
            y = y[:, None]
        else:
            conv, conv_state = attn.short_conv(
                xbc, weight, bias, state=cache.conv, segment_ids=segment_ids
            )
            xs, b, c = self._ssd_inputs(conv)
            call = self._sequence(
                x, dt=dt, b=b, c=c, segment_ids=segment_ids, initial_state=cache.state,
                return_state=True, **self._extend_options(),
            )  # fmt: skip
            y, state = call(xs)
        return self._finish(y, z), cache.replace(state=state, conv=conv_state)


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
