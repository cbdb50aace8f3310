"""The layers whose state is a model trained on the sequence: ``TTTAttention`` (TTT-Linear and
TTT-MLP, ``attn.ttt_linear`` and ``attn.ttt_mlp``, as the authors build the layer: Sun et al.
2024, their JAX code ttt-lm-jax) and ``TitansAttention`` (Titans' memory, ``attn.titans``, as
the paper describes its layer: Behrouz et al. 2025, no code published).

Layer kinds ``"ttt_linear"`` and ``"ttt_mlp"`` (``TTTConfig``) and ``"titans"``
(``TitansConfig``), and the presets of the same names, are registered here. Both
layers share their back (``Trained``): the inner model's learned initial weights and
LayerNorm, the output's LayerNorm over the heads' channels, a GELU gate and ``o_proj``.
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
from attn.linear.inner import MEMORIES
from models.config import (
    AttentionConfig,
    check_bool,
    check_positive_float,
    check_positive_int,
    check_width,
    register_kind,
)
from models.delta import l2_normalize
from models.heads import dense
from models.patterns import PresetSizes, register_preset
from models.recurrent import Recurrent

BASE_LR = {"ttt_linear": 1.0, "ttt_mlp": 0.1}  # the authors' inner learning rates
INIT_STD = 0.02  # the inner model's initial weights, N(0, 0.02^2)
NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class TTTConfig(AttentionConfig):
    """A TTT layer (kinds ``"ttt_linear"``, ``"ttt_mlp"``). Besides the common fields:

    Attributes:
      rope: rotate q and k by the position within the mini-batch, channels paired 2i with
        2i + 1 (the authors').
      form: one of ``attn.TTT_FORMS`` (``"dual"``, ``"primal"``, ``"recurrent"``: the
        same function).
      mini_batch: b, tokens per inner mini-batch (a hyperparameter of the function).
      base_lr: the inner rate's scale (eta = base_lr sigmoid(x theta) / H); None is the
        authors' (1.0 for TTT-Linear, 0.1 for TTT-MLP).
      qk_conv: W of the causal convolutions (with bias) that make q and k from one shared
        projection (the authors' Mamba backbone); 0: separate q and k projections.
      mlp_ratio: TTT-MLP's hidden width F over H.
      inner_norm: the inner model's LayerNorm (``f(x) = x + LN(f_res(x))``); False drops it.
    """

    kind: str = "ttt_linear"
    form: str = "dual"
    mini_batch: int = 16
    base_lr: float | None = None
    qk_conv: int = 4
    mlp_ratio: int = 4
    inner_norm: bool = True

    @property
    def mlp(self) -> bool:
        return self.kind == "ttt_mlp"

    @property
    def learning_rate(self) -> float:
        return BASE_LR[self.kind] if self.base_lr is None else self.base_lr

    def check_fields(self) -> None:
        if self.form not in attn.TTT_FORMS:
            fail("form", f"one of {attn.TTT_FORMS} for kind={self.kind!r}", repr(self.form))
        check_positive_int(self.mini_batch, "mini_batch")
        check_positive_float(self.base_lr, "base_lr", allow_none=True)
        check_positive_int(self.mlp_ratio, "mlp_ratio")
        check_bool(self.inner_norm, "inner_norm")
        if self.rope and self.head_dim % 2:
            fail("head_dim", "an even int for RoPE (pairs of channels)", repr(self.head_dim))
        check_width(self.qk_conv, "qk_conv")
        if self.num_kv_heads is not None:
            why = "the inner model's keys and values are one width per head"
            fail("num_kv_heads", f"None for kind={self.kind!r} ({why})", repr(self.num_kv_heads))


def conv_init(width: int, channels: int, param_dtype, rngs, bias: bool):
    """A depthwise Conv1d's default init, U(+-1/sqrt(W)) (fan-in W): ``(weight [W,C], bias
    [C] or None)`` as ``nnx.Param``."""
    bound = 1 / math.sqrt(width)
    uniform = jax.nn.initializers.uniform(2 * bound)
    weight = nnx.Param(uniform(rngs.params(), (width, channels), param_dtype) - bound)
    if not bias:
        return weight, nnx.data(None)
    return weight, nnx.Param(uniform(rngs.params(), (channels,), param_dtype) - bound)


class Trained(Recurrent):
    """The back the trained-memory layers share: the inner model's initial weights
    (``W ~ N(0, 0.02^2)``, biases 0) and LayerNorm (ones, zeros), learned per head, and the
    output ``LN(o) * gelu(x W_g)`` projected by ``W_o`` (LN over the N H channels)."""

    def _init_back(self, cfg, width: int, causal: bool, dtype, param_dtype, rngs):
        """The shared parameters; returns the bias-free projection maker."""
        if not causal:
            fail("cfg.kind", f"a causal layer for {cfg.kind!r} (its memory trains in order)",
                 "an encoder")  # fmt: skip
        self._init_heads(cfg, causal=causal, dtype=dtype)
        N, H = cfg.num_heads, cfg.head_dim
        linear = functools.partial(dense, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.norm_scale = nnx.Param(jnp.ones((N, H), param_dtype))
        self.norm_bias = nnx.Param(jnp.zeros((N, H), param_dtype))
        shapes = inner_shapes(cfg)
        keys = jax.random.split(rngs.params(), len(shapes))
        self.inner = nnx.List([
            nnx.Param((INIT_STD * jax.random.normal(key, s) if len(s) == 3
                       else jnp.zeros(s)).astype(param_dtype))
            for key, s in zip(keys, shapes, strict=True)
        ])  # fmt: skip
        self.post_norm = nnx.LayerNorm(N * H, epsilon=NORM_EPS, dtype=jnp.float32,
                                       param_dtype=param_dtype, rngs=rngs)  # fmt: skip
        self.gate_proj = linear(width, N * H)
        self.o_proj = linear(N * H, width)
        return linear

    def _model(self) -> tuple:
        """The inner model's initial weights (zeros of their shapes in a module built with
        shapes for arrays, whose caches are measured, not run: ``train.variants``)."""
        values = (w.get_value() for w in self.inner)
        return tuple(jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x
                     for x in values)  # fmt: skip

    def _norms(self) -> dict:
        on = self.cfg.inner_norm
        return dict(norm_scale=self.norm_scale[...] if on else None,
                    norm_bias=self.norm_bias[...] if on else None)  # fmt: skip

    def _options(self) -> dict:
        return dict(form=self.cfg.form)

    def _weights(self, inputs, segment_ids):
        fail("sow_weights", "a layer whose output is a weighted sum of its values (a trained "
             "memory's is not: no weights exist)", self.cfg.kind)  # fmt: skip

    def _finish(self, out, inputs, ctx):
        """The LayerNorm over the heads' channels, the GELU gate and ``o_proj``."""
        x = ctx[0]
        B, T, N, H = out.shape
        normed = self.post_norm(out.reshape(B, T, N * H).astype(jnp.float32)).astype(x.dtype)
        gate = jax.nn.gelu(self.gate_proj(x), approximate=True)
        return self._output((normed * gate).reshape(B, T, N, H))


def inner_shapes(cfg):
    """The inner model's per-head shapes: an MLP's ``(W1, b1, W2, b2)`` or ``(W, b)``."""
    N, H = cfg.num_heads, cfg.head_dim
    if cfg.mlp:
        F = cfg.mlp_ratio * H
        return [(N, H, F), (N, F), (N, F, H), (N, H)]
    return [(N, H, H), (N, H)]


class TTTAttention(Trained):
    """A TTT layer: per token, from the layer input x,

    * q, k: ``conv_q(x W_qk)``, ``conv_k(x W_qk)`` (one shared projection, two causal
      convolutions with bias), or ``x W_q``, ``x W_k`` without ``qk_conv``; RoPE at the
      position within the mini-batch; v = ``x W_v``;
    * eta ``[B,T,N]`` = ``base_lr sigmoid(x theta + beta) / H``; the per-position rates
      ``relu(1 / (i + 1) + offset_i)`` with a learned offset (zeros at init);
    * ``Trained``'s back: the inner model, its LayerNorm, the output's norm, gate, ``o_proj``.

    The decode cache (``models.recurrent.RecurrentCache``) is the ``TTTState`` and the
    convolution's last inputs; packed segments restart from the initial model.
    """

    def __init__(self, cfg: TTTConfig, width: int, *, causal: bool, dtype, param_dtype, rngs):
        linear = self._init_back(cfg, width, causal, dtype, param_dtype, rngs)
        N, H = cfg.num_heads, cfg.head_dim
        C = N * H
        self.qk_proj = linear(width, C if cfg.qk_conv else 2 * C)
        self.conv = self.conv_bias = nnx.data(None)
        if cfg.qk_conv:
            self.conv, self.conv_bias = conv_init(cfg.qk_conv, 2 * C, param_dtype, rngs, bias=True)
        self.v_proj = linear(width, C)
        self.lr_proj = dense(width, N, dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs,
                             use_bias=True)  # fmt: skip
        self.lr_offset = nnx.Param(jnp.zeros((cfg.mini_batch,), param_dtype))

    # Pieces (models.recurrent.Recurrent's) -----------------------------------

    def _front(self, x, positions, segment_ids):
        """The shared q/k projection, twice (the convolutions' input), or q and k."""
        del segment_ids
        qk = self.qk_proj(x)
        return (jnp.concatenate([qk, qk], -1) if self.cfg.qk_conv else qk), (x, positions)

    def _conv_params(self):
        return None if self.conv is None else (self.conv[...], self.conv_bias[...])

    def _conv_shape(self):
        cfg = self.cfg
        return None if self.conv is None else (cfg.qk_conv, 2 * cfg.num_heads * cfg.head_dim)

    def _inputs(self, x, qk, ctx) -> dict:
        """q, k, v ``[B,T,N,H]`` (RoPE at the position in the mini-batch) and eta ``[B,T,N]``."""
        cfg = self.cfg
        x, positions = ctx
        B, T, _ = x.shape
        q, k = (y.reshape(B, T, cfg.num_heads, cfg.head_dim) for y in jnp.split(qk, 2, -1))
        within = positions % cfg.mini_batch  # the authors' RoPE: interleaved pairs
        if cfg.rope:
            rotate = functools.partial(attn.apply_rope, positions=within, base=cfg.rope_base,
                                       layout="interleaved")  # fmt: skip
            q, k = rotate(q), rotate(k)
        v = self.v_proj(x).reshape(B, T, cfg.num_heads, cfg.head_dim)
        eta = jax.nn.sigmoid(self.lr_proj(x.astype(jnp.float32)))
        return dict(q=q, k=k, v=v, eta=cfg.learning_rate * eta / cfg.head_dim)

    def _inner_args(self) -> dict:
        cfg = self.cfg
        position_lr = 1.0 / jnp.arange(1, cfg.mini_batch + 1) + self.lr_offset[...]
        return dict(**self._norms(), mini_batch=cfg.mini_batch,
                    position_lr=jax.nn.relu(position_lr.astype(jnp.float32)))  # fmt: skip

    def _mix(self, p, *, segment_ids=None, sharded=False, **options):
        """TTT over the sequence (no sharded form: ``sequence_parallel`` says why)."""
        del sharded
        fn = attn.ttt_mlp if self.cfg.mlp else attn.ttt_linear
        return fn(p["q"], p["k"], p["v"], p["eta"], model=self._model(), q_segment_ids=segment_ids,
                  kv_segment_ids=segment_ids, **self._inner_args(), **options)  # fmt: skip

    def _mix_step(self, p, state):
        step = attn.ttt_mlp_step if self.cfg.mlp else attn.ttt_linear_step
        return step(p["q"], p["k"], p["v"], p["eta"], state, **self._inner_args())

    def _zero_state(self, batch: int):
        """A row's start: the initial inner model, at a mini-batch boundary."""
        cfg = self.cfg
        return attn.ttt_zero_state(batch, cfg.num_heads, cfg.head_dim, params=self._model())


NO_EXCHANGE = "the state is a model trained on the sequence: its spans exchange no transition"
for _kind in BASE_LR:
    register_kind(_kind, TTTAttention, config=TTTConfig, family="linear",
                  sequence_parallel=NO_EXCHANGE)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TitansConfig(AttentionConfig):
    """A Titans memory layer (kind ``"titans"``). Besides the common fields:

    Attributes:
      memory: ``"mlp"`` (the paper's deep memory, two layers) or ``"linear"``.
      form: one of ``attn.TITANS_FORMS`` (the same function).
      mini_batch: b, the tokens whose gradients share their weights (the paper's chunk).
      base_lr: the step's scale (theta = base_lr sigmoid(x W_theta) / H).
      qkv_conv: W of the causal convolutions on the q, k and v projections; 0: none.
      mlp_ratio: the MLP memory's hidden width F over H.
      inner_norm: the memory's LayerNorm (``f(x) = x + LN(f_res(x))``); False drops it.
    """

    kind: str = "titans"
    rope: bool = False
    memory: str = "mlp"
    form: str = "dual"
    mini_batch: int = 16
    base_lr: float = 0.1
    qkv_conv: int = 4
    mlp_ratio: int = 4
    inner_norm: bool = True

    @property
    def mlp(self) -> bool:
        return self.memory == "mlp"

    def check_fields(self) -> None:
        if self.memory not in MEMORIES:
            fail("memory", f"one of {MEMORIES}", repr(self.memory))
        if self.form not in attn.TITANS_FORMS:
            fail("form", f"one of {attn.TITANS_FORMS} for kind='titans'", repr(self.form))
        if self.rope:
            fail("rope", "False for kind='titans' (the recurrence orders the tokens)", "True")
        check_positive_int(self.mini_batch, "mini_batch")
        check_positive_float(self.base_lr, "base_lr")
        check_positive_int(self.mlp_ratio, "mlp_ratio")
        check_bool(self.inner_norm, "inner_norm")
        check_width(self.qkv_conv, "qkv_conv")
        if self.num_kv_heads is not None:
            why = "the memory's keys and values are one width per head"
            fail("num_kv_heads", f"None for kind='titans' ({why})", repr(self.num_kv_heads))


# Titans' gates at init: momentum eta ~ 0.9, weight decay alpha ~ 0.01 (sigmoid of the biases).
MOMENTUM_BIAS, DECAY_BIAS = math.log(9.0), -math.log(99.0)


class TitansAttention(Trained):
    """Titans' memory as a layer (the paper's section 4.4): per token, from the layer input x,

    * q, k, v: ``SiLU(conv(x W_qkv))`` (one causal depthwise convolution over the three
      projections' channels, as the paper's separable convolutions), q and k L2-normalized
      per head;
    * the gates per head: theta = ``base_lr sigmoid(x W_theta) / H``, eta =
      ``sigmoid(x W_eta + b_eta)`` (momentum, ~0.9 at init), alpha = ``sigmoid(x W_alpha +
      b_alpha)`` (weight decay, ~0.01 at init);
    * ``Trained``'s back: the memory's initial weights and LayerNorm, the output's norm,
      gate and ``o_proj``.

    The decode cache is the ``TitansState`` and the convolution's last inputs.
    """

    def __init__(self, cfg: TitansConfig, width: int, *, causal: bool, dtype, param_dtype,
                 rngs):  # fmt: skip
        linear = self._init_back(cfg, width, causal, dtype, param_dtype, rngs)
        N, H = cfg.num_heads, cfg.head_dim
        self.channels = 3 * N * H
        self.qkv_proj = linear(width, self.channels)
        self.conv = nnx.data(None)
        if cfg.qkv_conv:
            self.conv, _ = conv_init(cfg.qkv_conv, self.channels, param_dtype, rngs, bias=False)
        self.gate_projs = dense(width, 3 * N, dtype=jnp.float32, param_dtype=param_dtype,
                                rngs=rngs, use_bias=True)  # fmt: skip
        bias = jnp.concatenate([jnp.zeros(N), jnp.full(N, MOMENTUM_BIAS), jnp.full(N, DECAY_BIAS)])
        self.gate_projs.bias.set_value(bias.astype(param_dtype))

    def _front(self, x, positions, segment_ids):
        del positions, segment_ids  # the recurrence orders the tokens
        return self.qkv_proj(x), (x,)

    def _conv_params(self):
        return None if self.conv is None else (self.conv[...], None)

    def _conv_shape(self):
        return None if self.conv is None else (self.cfg.qkv_conv, self.channels)

    def _inputs(self, x, mixed, ctx) -> dict:
        """q, k (unit norm), v ``[B,T,N,H]`` and the gates ``[B,T,N]``."""
        cfg = self.cfg
        B, T, _ = x.shape
        q, k, v = (y.reshape(B, T, cfg.num_heads, cfg.head_dim)
                   for y in jnp.split(jax.nn.silu(mixed), 3, -1))  # fmt: skip
        theta, eta, alpha = jnp.split(self.gate_projs(x.astype(jnp.float32)), 3, -1)
        return dict(
            q=l2_normalize(q, NORM_EPS),
            k=l2_normalize(k, NORM_EPS),
            v=v,
            theta=cfg.base_lr * jax.nn.sigmoid(theta) / cfg.head_dim,
            log_momentum=jax.nn.log_sigmoid(eta),
            log_decay=jax.nn.log_sigmoid(-alpha),
        )

    def _gates(self, p):
        return p["q"], p["k"], p["v"], p["theta"], p["log_momentum"], p["log_decay"]

    def _mix(self, p, *, segment_ids=None, sharded=False, **options):
        """Titans over the sequence (no sharded form: ``sequence_parallel`` says why)."""
        del sharded
        return attn.titans(*self._gates(p), memory=self.cfg.memory, model=self._model(),
                           mini_batch=self.cfg.mini_batch, q_segment_ids=segment_ids,
                           kv_segment_ids=segment_ids, **self._norms(), **options)  # fmt: skip

    def _mix_step(self, p, state):
        return attn.titans_step(*self._gates(p), state, mini_batch=self.cfg.mini_batch,
                                **self._norms())  # fmt: skip

    def _zero_state(self, batch: int):
        cfg = self.cfg
        return attn.titans_zero_state(batch, cfg.num_heads, cfg.head_dim, memory=cfg.memory,
                                      params=self._model())  # fmt: skip


register_kind("titans", TitansAttention, config=TitansConfig, family="linear",
              sequence_parallel=NO_EXCHANGE)  # fmt: skip


def _sized(kind: str):
    def build(sizes: PresetSizes):
        cls = TitansConfig if kind == "titans" else TTTConfig
        return cls(kind=kind, num_heads=sizes.num_heads, head_dim=sizes.head_dim)

    return build


PRESETS = {
    "ttt_linear": "TTT-Linear: a linear model trained on the sequence (Sun et al.)",
    "ttt_mlp": "TTT-MLP: a two-layer MLP trained on the sequence (Sun et al.)",
    "titans": "Titans: an MLP memory trained with momentum and weight decay (Behrouz et al.)",
}
for _kind, _description in PRESETS.items():
    register_preset(_kind, _sized(_kind), description=_description)
