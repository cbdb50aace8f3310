"""``Rwkv7Attention``: RWKV-7 "Goose"'s time mixing (Peng et al. 2025), ``attn.dplr_delta_rule``.

One layer kind, ``"rwkv7"``, configured by ``Rwkv7Config``; the preset ``rwkv7``
is registered here. The state update is the DPLR delta rule
(``attn.linear.dplr``: ``a = -kappa_hat``, ``b = kappa_hat * a_in``, q the
receptance r, ``scale=1.0``); this module builds its inputs from the layer
input the way the paper does (token shift, LoRAs, removal and replacement
keys) and finishes with its per-head GroupNorm, bonus and gate.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import attn
from attn import masks
from attn.checks import fail
from attn.linear.dplr import DPLR_FORMS
from attn.linear.front import CHUNK_SIZE
from models.config import AttentionConfig, check_positive_int, register_kind
from models.heads import dense
from models.mesh import in_sequence
from models.patterns import PresetSizes, register_preset
from models.recurrent import Recurrent, one_hot_values

# The six token-shift mixes, in the order of ``Rwkv7Attention.mix``'s rows.
MIXES = ("r", "w", "k", "v", "a", "g")
RULE_ARGS = ("r", "k", "v", "a", "b", "log_w")  # attn.dplr_delta_rule's q, k, v, a, b, log_w
# log w = -exp(-1/2) sigmoid(d): decays in (exp(-e^{-1/2}), 1) = (0.545, 1), as the paper.
DECAY_SCALE = math.exp(-0.5)
# RWKV-7's ln_x: GroupNorm epsilon of 1e-5 per head channel (64e-5 at its head dim 64).
NORM_EPS_PER_CHANNEL = 1e-5
# Added to kappa's squared norm so a zero removal key (padding) stays finite, gradients too.
KAPPA_EPS = 1e-12


@dataclasses.dataclass(frozen=True)
class Rwkv7Config(AttentionConfig):
    """An RWKV-7 time-mixing layer (kind ``"rwkv7"``). ``num_heads`` are its heads,
    ``head_dim`` their key and value dim (RWKV's head size). Besides the common fields:

    Attributes:
      form: ``"chunkwise"`` or ``"recurrent"`` (``attn.linear.dplr.DPLR_FORMS``: the
        same function).
      chunk_size: C of the chunkwise form.
      decay_rank: rank of the decay's LoRA (``w0 + tanh(x A_w) B_w``).
      iclr_rank: rank of the in-context learning rate's LoRA (``a0 + x A_a B_a``).
      gate_rank: rank of the output gate's LoRA (``sigmoid(x G_1) G_2``).
    """

    kind: str = "rwkv7"
    rope: bool = False
    form: str = "chunkwise"
    chunk_size: int = CHUNK_SIZE
    decay_rank: int = 8
    iclr_rank: int = 8
    gate_rank: int = 16

    def check_fields(self) -> None:
        check_positive_int(self.chunk_size, "chunk_size")
        check_positive_int(self.decay_rank, "decay_rank")
        check_positive_int(self.iclr_rank, "iclr_rank")
        check_positive_int(self.gate_rank, "gate_rank")
        if self.form not in DPLR_FORMS:
            fail("form", f"one of {DPLR_FORMS} for kind='rwkv7'", repr(self.form))
        if self.rope:
            fail("rope", "False for kind='rwkv7' (the recurrence orders the tokens)", "True")
        if self.num_kv_heads is not None:
            why = "r, k and v share the heads"
            fail("num_kv_heads", f"None for kind='rwkv7' ({why})", repr(self.num_kv_heads))


def init_values(width: int, heads: int, head_dim: int) -> dict:
    """The initial per-channel parameters, float64 NumPy: fla's RWKV-7 scheme (after the
    paper's) at a middle layer (its layer ratios both 1/2), the same in every layer.

    Over the width, with ``u = n / D``: the mixes ``1 - u^p`` (in (0, 1], one exponent p
    per mix: 0.1 for r and g, 0.35 for k and v, 0.45 for w and a). Over the key channels
    c of ``C = N H``, with ``lin = c/(C-1) - 1/2`` and ``zz`` a signed square ramp in
    [-1, 1] over each head's channels: the decay bias
    ``w0 = -5.5 + 6 (c/(C-1))^1.81 + 2.5 zz`` (from about -8 to 3: decays
    ``exp(-e^{-1/2} sigmoid(w0))`` from about 0.56 to 0.9998 per token, memories of
    about 2 to 5000 tokens spread over the channels and within each head), the ICLR
    bias ``a0 = -0.19 + 0.3 zz + 0.4 lin`` (``a_in`` about 0.45), the removal-key
    scale ``k_k = 0.71 - 0.1 lin``, the replacement ``k_a = 1.02`` and the bonus
    ``r_k = -0.04``.
    """
    C = heads * head_dim
    u = np.arange(width) / width
    mix = np.stack([1.0 - u**p for p in (0.1, 0.45, 0.35, 0.35, 0.45, 0.1)])
    c = np.arange(C)
    lin = c / max(C - 1, 1) - 0.5
    half = max((head_dim - 1) / 2, 0.5)  # head_dim 1: a ramp of one channel is 0
    zz = ((c % head_dim) - (head_dim - 1) / 2) / half
    zz = zz * np.abs(zz)
    return dict(
        mix=mix,
        w0=-6.0 + 6.0 * (c / max(C - 1, 1)) ** (1.0 + 0.5**0.3) + 0.5 + 2.5 * zz,
        a0=-0.19 + 0.3 * zz + 0.4 * lin,
        k_k=0.71 - 0.1 * lin,
        k_a=np.full((C,), 1.02),
        r_k=np.full((heads, head_dim), -0.04),
    )


@register_kind(
    "rwkv7",
    config=Rwkv7Config,
    family="linear",
    sequence_parallel=True,
    in_order=True,
)
class Rwkv7Attention(Recurrent):
    """RWKV-7's time mixing, its value residual left out.

    Per token, with x the layer input ``[B,T,D]`` and ``x_prev`` the previous
    token's (0 at a segment's start, as RWKV's at the sequence start):
    ``delta = x_prev - x`` and six mixes ``x_* = x + delta * mix_*``; then
    ``r, k, v = x_r W_r, x_k W_k, x_v W_v`` (N heads of H; E = H); the log decay
    ``log_w = -e^{-1/2} sigmoid(w0 + tanh(x_w A_w) B_w)`` and the in-context
    learning rate ``a_in = sigmoid(a0 + x_a A_a B_a)``, per key channel; the
    removal key ``kappa_hat``, ``k * k_k`` L2-normalized per head; the
    replacement key ``k <- k (1 + (a_in - 1) k_a)``; the DPLR delta rule with
    ``a = -kappa_hat``, ``b = kappa_hat a_in``, q = r, ``scale=1.0`` (the paper's
    ``S_t = S_{t-1} (diag(w_t) - kappa_hat^T (a_in kappa_hat)) + v^T k``,
    ``o = S r``, in the library's transposed state). The output: ``ln_x``, a
    per-head GroupNorm of o (epsilon ``1e-5 H``, learned weight and bias
    ``[N*E]``), plus the bonus ``(sum_H r k r_k) v`` per head (``r_k [N,H]``),
    times the gate ``sigmoid(x_g G_1) G_2``; the head gates; ``o_proj``.

    Value residual learning (the paper mixes every layer's v towards the first
    layer's, ``v_first``) needs a tensor passed between layers, which this
    library's blocks do not pass: each layer uses its own v.

    Initialization: the per-channel parameters of ``init_values`` (fla's scheme
    at a middle layer, so layer-independent: mixes in (0, 1], decay biases
    spreading memory lengths over the channels, ``k_k``, ``k_a``, ``r_k`` as
    theirs); the decay and ICLR LoRAs' second factors zero (their first ones
    the projections' init), so the layer starts from the biases ``w0``, ``a0``;
    the gate LoRA's first factor zero and its second the projections' init, so
    the gate starts at ``colsum(G_2) / 2``, not zero, and the layer's output
    and gradients flow from the first step; the GroupNorm weight 1, bias 0;
    r, k, v and o projections as every layer's (``models.heads.dense``).

    The decode cache (``models.recurrent.RecurrentCache``) is the state and the
    last input (the token shift's window). The
    token shift is ``attn.short_conv`` with the fixed taps ``[1, 0]`` (the
    previous token, its state the last input), so padding and packing are
    segment ids passed to it and to ``attn.dplr_delta_rule`` (padding writes
    nothing and is zeroed where it enters: NaN there reaches nothing; a new
    segment starts from a zero state and a zero shift). Captured weights
    (``sow_weights``) are the matrix M with ``o = M v`` before the GroupNorm
    (the DPLR delta rule is linear in v for given r, w, k, a and b), found as
    the outputs for one-hot values; the bonus is not in M: it is added after
    the norm (it would be the diagonal ``r_t . (r_k k_t)`` of a matrix taken
    after it).
    """

    def __init__(self, cfg: Rwkv7Config, width: int, *, causal: bool, dtype, param_dtype, rngs):
        if not causal:
            why = "a recurrence needs an order"
            fail("cfg.kind", f"a causal layer for 'rwkv7' ({why})", "an encoder")
        self._init_heads(cfg, causal=causal, dtype=dtype)
        N, H = cfg.num_heads, cfg.head_dim
        C = N * H
        linear = functools.partial(dense, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        # The decay and ICLR LoRAs compute in float32: a decay near 1 is raised to the power
        # of every token after it, so its rounding compounds; the gate's is a plain product.
        lora = functools.partial(dense, dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs)
        zeros = dict(kernel_init=nnx.initializers.zeros_init())
        init = {n: jnp.asarray(x, param_dtype) for n, x in init_values(width, N, H).items()}
        self.mix = nnx.Param(init["mix"])  # [6, D], rows in MIXES order
        self.r_proj = linear(width, C)
        self.k_proj = linear(width, C)
        self.v_proj = linear(width, C)
        self.decay_down = lora(width, cfg.decay_rank)
        self.decay_up = lora(cfg.decay_rank, C, **zeros)
        self.w0 = nnx.Param(init["w0"])
        self.iclr_down = lora(width, cfg.iclr_rank)
        self.iclr_up = lora(cfg.iclr_rank, C, **zeros)
        self.a0 = nnx.Param(init["a0"])
        self.gate_down = linear(width, cfg.gate_rank, **zeros)
        self.gate_up = linear(cfg.gate_rank, C)
        self.k_k = nnx.Param(init["k_k"])
        self.k_a = nnx.Param(init["k_a"])
        self.r_k = nnx.Param(init["r_k"])
        self.norm_weight = nnx.Param(jnp.ones((C,), param_dtype))
        self.norm_bias = nnx.Param(jnp.zeros((C,), param_dtype))
        self.o_proj = linear(C, width)

    # Pieces (models.recurrent.Recurrent's) -----------------------------------

    def _front(self, x, positions, segment_ids):
        """x with its padding zeroed (it may hold NaN), twice: the token shift's input and
        what the projections read."""
        del positions  # the recurrence orders the tokens
        x = masks.drop_padding(x, segment_ids)
        return x, x

    def _conv_params(self):
        """The token shift as ``attn.short_conv`` taps ``[2, D]``: the previous token, exactly
        (its window, the decode cache's ``conv``, is the last input)."""
        return jnp.zeros((2, self.o_proj.out_features), jnp.float32).at[0].set(1.0), None

    def _conv_shape(self):
        return 2, self.o_proj.out_features

    def _inputs(self, x, prev, xd) -> dict:
        """The DPLR rule's inputs from x and the shifted ``prev`` (both ``[B,T,D]``): r, k
        ``[B,T,N,H]`` and v ``[B,T,N,E]`` (compute dtype), a, b and log_w ``[B,T,N,H]``
        float32, and the gate ``g [B,T,N,E]`` float32."""
        cfg, x = self.cfg, xd  # x with its padding zeroed (_front)
        B, T, _ = x.shape
        N, H = cfg.num_heads, cfg.head_dim
        heads = lambda y: y.reshape(B, T, N, H)  # noqa: E731
        mix = self.mix[...].astype(x.dtype)
        delta = prev - x
        xr, xw, xk, xv, xa, xg = (x + delta * mix[i] for i in range(len(MIXES)))
        r, k, v = heads(self.r_proj(xr)), heads(self.k_proj(xk)), heads(self.v_proj(xv))
        f32 = lambda p: p[...].astype(jnp.float32)  # noqa: E731
        per_head = lambda p: f32(p).reshape(N, H)  # noqa: E731
        d = f32(self.w0) + self.decay_up(jnp.tanh(self.decay_down(xw.astype(jnp.float32))))
        log_w = heads(-DECAY_SCALE * jax.nn.sigmoid(d))
        iclr = self.iclr_up(self.iclr_down(xa.astype(jnp.float32)))
        a_in = heads(jax.nn.sigmoid(f32(self.a0) + iclr))
        k32 = k.astype(jnp.float32)
        kappa = k32 * per_head(self.k_k)
        kappa = kappa * jax.lax.rsqrt(jnp.sum(kappa * kappa, axis=-1, keepdims=True) + KAPPA_EPS)
        k = (k32 * (1.0 + (a_in - 1.0) * per_head(self.k_a))).astype(k.dtype)
        g = heads(self.gate_up(jax.nn.sigmoid(self.gate_down(xg))).astype(jnp.float32))
        return dict(r=r, k=k, v=v, a=-kappa, b=kappa * a_in, log_w=log_w, g=g)

    def _finish(self, o, p, ctx):
        """``ln_x`` (GroupNorm per head), the bonus, the gate, the head gates and ``o_proj``."""
        N, E = o.shape[-2:]
        eps = NORM_EPS_PER_CHANNEL * self.cfg.head_dim
        o = o.astype(jnp.float32)
        mean = jnp.mean(o, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(o - mean), axis=-1, keepdims=True)
        normed = (o - mean) * jax.lax.rsqrt(var + eps)
        normed = normed * self.norm_weight[...].astype(jnp.float32).reshape(N, E)
        normed = normed + self.norm_bias[...].astype(jnp.float32).reshape(N, E)
        r, k, v = (p[n].astype(jnp.float32) for n in ("r", "k", "v"))
        bonus = jnp.sum(r * k * self.r_k[...].astype(jnp.float32), axis=-1, keepdims=True) * v
        return self._output(((normed + bonus) * p["g"]).astype(self.dtype))

    def _options(self) -> dict:
        return dict(form=self.cfg.form, chunk_size=self.cfg.chunk_size, scale=1.0)

    def _mix(self, p, *, segment_ids=None, sharded=False, **options):
        rule = in_sequence(attn.dplr_delta_rule) if sharded else attn.dplr_delta_rule
        return rule(*(p[n] for n in RULE_ARGS), q_segment_ids=segment_ids,
                    kv_segment_ids=segment_ids, **options)  # fmt: skip

    def _mix_step(self, p, state):
        return attn.dplr_delta_rule_step(*(p[n] for n in RULE_ARGS), state, scale=1.0)

    def _one_hot(self, p) -> dict:
        return {**p, "v": one_hot_values(p["v"])}

    def _zero_state(self, batch: int):
        """The state ``[B,N,H,E]`` float32."""
        N, H = self.cfg.num_heads, self.cfg.head_dim
        return attn.init_delta_state(batch, N, H, H)


def _rank(channels: int, factor: float) -> int:
    """fla's LoRA rank rule ``factor sqrt(C)`` (C = N H, its width), rounded to a multiple of
    8 and at least 8 (fla: of 32, at least 32; the lab's widths are small)."""
    return max(8, round(factor * math.sqrt(channels) / 8) * 8)


def _sized(sizes: PresetSizes) -> Rwkv7Config:
    C = sizes.num_heads * sizes.head_dim
    per_head = sizes.head_dim / 64  # fla widens the decay and ICLR LoRAs with the head dim
    return Rwkv7Config(
        num_heads=sizes.num_heads,
        head_dim=sizes.head_dim,
        chunk_size=sizes.chunk_size,
        decay_rank=_rank(C, 2.5 * per_head),
        iclr_rank=_rank(C, 2.5 * per_head),
        gate_rank=_rank(C, 5.0),
    )


register_preset(
    "rwkv7",
    _sized,
    description="RWKV-7 Goose time mixing: the DPLR delta rule, LoRA decays, bonus (no v_first)",
)
