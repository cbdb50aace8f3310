"""``TTTAttention``: TTT-Linear and TTT-MLP (``attn.ttt_linear``, ``attn.ttt_mlp``) as the
authors build the layer (Sun et al. 2024; their JAX code, ttt-lm-jax).

Two layer kinds, ``"ttt_linear"`` and ``"ttt_mlp"``, configured by ``TTTConfig``;
the presets of the same names are registered here.
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
from models.config import (
    AttentionConfig,
    check_bool,
    check_positive_float,
    check_positive_int,
    register_kind,
)
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
      rope: rotate q and k by the position within the mini-batch (the authors').
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
    def hidden(self) -> int:
        """The inner model's hidden width: F for TTT-MLP, H for TTT-Linear."""
        return self.mlp_ratio * self.head_dim if self.mlp else self.head_dim

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
        w = self.qk_conv
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            fail("qk_conv", "a non-negative int (the width W; 0 for none)", repr(w))
        if self.num_kv_heads is not None:
            why = "the inner model's keys and values are one width per head"
            fail("num_kv_heads", f"None for kind={self.kind!r} ({why})", repr(self.num_kv_heads))


class TTTAttention(Recurrent):
    """A TTT layer: per token, from the layer input x,

    * q, k: ``conv_q(x W_qk)``, ``conv_k(x W_qk)`` (one shared projection, two causal
      convolutions with bias), or ``x W_q``, ``x W_k`` without ``qk_conv``; RoPE at the
      position within the mini-batch; v = ``x W_v``;
    * eta ``[B,T,N]`` = ``base_lr sigmoid(x theta + beta) / H``; the per-position rates
      ``relu(1 / (i + 1) + offset_i)`` with a learned offset (zeros at init);
    * the inner model's initial weights (``W1 ~ N(0, 0.02^2)``, biases 0) and LayerNorm
      (ones, zeros), learned per head;
    * the output ``LN(o) * gelu(x W_g)`` projected by ``W_o`` (LN over the N H channels).

    The decode cache (``models.recurrent.RecurrentCache``) is the ``TTTState`` and the
    convolution's last inputs; packed segments restart from the initial model.
    """

    def __init__(self, cfg: TTTConfig, width: int, *, causal: bool, dtype, param_dtype, rngs):
        if not causal:
            fail("cfg.kind", f"a causal layer for {cfg.kind!r} (TTT trains in order)",
                 "an encoder")  # fmt: skip
        self._init_heads(cfg, causal=causal, dtype=dtype)
        N, H, F = cfg.num_heads, cfg.head_dim, cfg.hidden
        C = N * H
        linear = functools.partial(dense, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.qk_proj = linear(width, C if cfg.qk_conv else 2 * C)
        self.conv = self.conv_bias = nnx.data(None)
        if cfg.qk_conv:  # a depthwise Conv1d's default init, for q's channels and k's
            bound = 1 / math.sqrt(cfg.qk_conv)
            uniform = jax.nn.initializers.uniform(2 * bound)
            self.conv = nnx.Param(uniform(rngs.params(), (cfg.qk_conv, 2 * C), param_dtype) - bound)
            self.conv_bias = nnx.Param(uniform(rngs.params(), (2 * C,), param_dtype) - bound)
        self.v_proj = linear(width, C)
        self.lr_proj = dense(width, N, dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs,
                             use_bias=True)  # fmt: skip
        self.lr_offset = nnx.Param(jnp.zeros((cfg.mini_batch,), param_dtype))
        self.norm_scale = nnx.Param(jnp.ones((N, H), param_dtype))
        self.norm_bias = nnx.Param(jnp.zeros((N, H), param_dtype))
        shapes = [(N, H, F), (N, F), (N, F, H), (N, H)] if cfg.mlp else [(N, H, H), (N, H)]
        keys = jax.random.split(rngs.params(), len(shapes))
        self.inner = nnx.List([
            nnx.Param((INIT_STD * jax.random.normal(key, s) if len(s) == 3
                       else jnp.zeros(s)).astype(param_dtype))
            for key, s in zip(keys, shapes, strict=True)
        ])  # fmt: skip
        self.post_norm = nnx.LayerNorm(C, epsilon=NORM_EPS, dtype=jnp.float32,
                                       param_dtype=param_dtype, rngs=rngs)  # fmt: skip
        self.gate_proj = linear(width, C)
        self.o_proj = linear(C, width)

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
        within = positions % cfg.mini_batch
        q, k = self._rope(q, within), self._rope(k, within)
        v = self.v_proj(x).reshape(B, T, cfg.num_heads, cfg.head_dim)
        eta = jax.nn.sigmoid(self.lr_proj(x.astype(jnp.float32)))
        return dict(q=q, k=k, v=v, eta=cfg.learning_rate * eta / cfg.head_dim)

    def _inner_args(self) -> dict:
        cfg = self.cfg
        position_lr = 1.0 / jnp.arange(1, cfg.mini_batch + 1) + self.lr_offset[...]
        norms = (self.norm_scale[...], self.norm_bias[...]) if cfg.inner_norm else (None, None)
        return dict(norm_scale=norms[0], norm_bias=norms[1], mini_batch=cfg.mini_batch,
                    position_lr=jax.nn.relu(position_lr.astype(jnp.float32)))  # fmt: skip

    def _mix(self, p, *, segment_ids=None, sharded=False, **options):
        """TTT over the sequence (no sharded form: ``sequence_parallel`` says why)."""
        del sharded
        fn = attn.ttt_mlp if self.cfg.mlp else attn.ttt_linear
        model = tuple(w[...] for w in self.inner)
        return fn(p["q"], p["k"], p["v"], p["eta"], model=model, q_segment_ids=segment_ids,
                  kv_segment_ids=segment_ids, **self._inner_args(), **options)  # fmt: skip

    def _mix_step(self, p, state):
        step = attn.ttt_mlp_step if self.cfg.mlp else attn.ttt_linear_step
        return step(p["q"], p["k"], p["v"], p["eta"], state, **self._inner_args())

    def _options(self) -> dict:
        return dict(form=self.cfg.form)

    def _weights(self, inputs, segment_ids):
        fail("sow_weights", "a layer whose output is a weighted sum of its values (TTT's "
             "inner model is trained on them: no weights exist)", self.cfg.kind)  # fmt: skip

    def _zero_state(self, batch: int):
        """A row's start: the initial inner model, at a mini-batch boundary."""
        cfg = self.cfg
        model = tuple(w[...] for w in self.inner)
        return attn.ttt_zero_state(batch, cfg.num_heads, cfg.head_dim, params=model)

    def _finish(self, out, inputs, ctx):
        """The LayerNorm over the heads' channels, the GELU gate and ``o_proj``."""
        x, _ = ctx
        B, T, N, H = out.shape
        normed = self.post_norm(out.reshape(B, T, N * H).astype(jnp.float32)).astype(x.dtype)
        gate = jax.nn.gelu(self.gate_proj(x), approximate=True)
        return self._output((normed * gate).reshape(B, T, N, H))


for _kind in BASE_LR:
    register_kind(_kind, TTTAttention, config=TTTConfig, family="linear",
                  sequence_parallel="a TTT state is a model trained on the sequence: its spans "
                  "exchange no transition")  # fmt: skip


def _sized(kind: str):
    def build(sizes: PresetSizes) -> TTTConfig:
        return TTTConfig(kind=kind, num_heads=sizes.num_heads, head_dim=sizes.head_dim)

    return build


PRESETS = {
    "ttt_linear": "TTT-Linear: a linear model trained on the sequence (Sun et al.)",
    "ttt_mlp": "TTT-MLP: a two-layer MLP trained on the sequence (Sun et al.)",
}
for _kind, _description in PRESETS.items():
    register_preset(_kind, _sized(_kind), description=_description)
