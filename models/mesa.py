"""``MesaAttention``: MesaNet (``attn.mesa_net``) as its authors' layer builds it (von Oswald et
al. 2025; fla's ``MesaNet`` layer).

One layer kind, ``"mesanet"``, configured by ``MesaConfig``; the preset ``mesanet``
is registered here.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

import attn
from attn.checks import fail
from attn.linear.front import CHUNK_SIZE
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
from models.mesh import in_sequence
from models.patterns import PresetSizes, register_preset
from models.recurrent import Recurrent, one_hot_values
from models.ttt import conv_init

NORM_EPS = 1e-6
LAMBDA_INIT = 1.0  # lambda = softplus(param) + floor starts here, as the authors'


@dataclasses.dataclass(frozen=True)
class MesaConfig(AttentionConfig):
    """A MesaNet layer (kind ``"mesanet"``). Besides the common fields:

    Attributes:
      form: ``"recurrent"`` or ``"chunkwise"`` (``attn.MESA_FORMS``: the same function).
      chunk_size: C for the chunkwise form.
      cg_steps: conjugate-gradient steps of the solve (the authors' 30), or None (exact).
      qk_conv: W of the causal convolutions (with SiLU) on q and k; 0: none.
      output_gate: gate the normalized output by ``SiLU(x W_g)`` (the authors' option, off
        by default).
      lambda_floor: the regularizer's lower bound (``lambda = softplus(.) + floor``).
    """

    kind: str = "mesanet"
    rope: bool = False
    form: str = "chunkwise"
    chunk_size: int = CHUNK_SIZE
    cg_steps: int | None = 30
    qk_conv: int = 4
    output_gate: bool = False
    lambda_floor: float = 0.25

    def check_fields(self) -> None:
        if self.form not in attn.MESA_FORMS:
            fail("form", f"one of {attn.MESA_FORMS} for kind='mesanet'", repr(self.form))
        check_positive_int(self.chunk_size, "chunk_size")
        check_positive_int(self.cg_steps, "cg_steps", allow_none=True)
        check_bool(self.output_gate, "output_gate")
        check_positive_float(self.lambda_floor, "lambda_floor")
        if self.lambda_floor >= LAMBDA_INIT:
            fail("lambda_floor", f"a floor below lambda's init {LAMBDA_INIT}", self.lambda_floor)
        check_width(self.qk_conv, "qk_conv")
        if self.rope:
            fail("rope", "False for kind='mesanet' (the recurrence orders the tokens)", "True")
        if self.num_kv_heads is not None:
            why = "one key per head: the gates and sums are per head"
            fail("num_kv_heads", f"None for kind='mesanet' ({why})", repr(self.num_kv_heads))


@register_kind("mesanet", config=MesaConfig, family="linear", sequence_parallel=True,
               in_order=True)  # fmt: skip
class MesaAttention(Recurrent):
    """MesaNet with the layer around it: per token, from the layer input x,
    ``q, k = SiLU(conv(x W_q)), SiLU(conv(x W_k))`` L2-normalized per head (q unscaled),
    ``v = x W_v``, ``beta = sigmoid(x W_b + b_b)``, ``gamma = sigmoid(x W_a + b_a)`` per head,
    ``lambda = softplus(l) + floor`` per head and key channel (1 at init); the output of each
    head RMS-normalized (a learned ``[E]`` weight shared by the heads), gated by
    ``SiLU(x W_g)`` with ``output_gate``, and projected by ``o_proj``.

    The decode cache is the ``MesaState`` (both sums) and the convolution's last inputs.
    Captured weights are M of ``out = M V`` (the read is linear in the values), found as
    the outputs for one-hot values.
    """

    def __init__(self, cfg: MesaConfig, width: int, *, causal: bool, dtype, param_dtype, rngs):
        if not causal:
            fail("cfg.kind", "a causal layer for 'mesanet' (a recurrence needs an order)",
                 "an encoder")  # fmt: skip
        self._init_heads(cfg, causal=causal, dtype=dtype)
        N, H = cfg.num_heads, cfg.head_dim
        linear = functools.partial(dense, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.qk_proj = linear(width, 2 * N * H)
        self.conv = nnx.data(None)
        if cfg.qk_conv:
            self.conv, _ = conv_init(cfg.qk_conv, 2 * N * H, param_dtype, rngs, bias=False)
        self.v_proj = linear(width, N * H)
        self.gate_projs = dense(width, 2 * N, dtype=jnp.float32, param_dtype=param_dtype,
                                rngs=rngs, use_bias=True)  # fmt: skip
        raw = jnp.log(jnp.expm1(LAMBDA_INIT - cfg.lambda_floor))  # softplus's inverse
        self.lambda_raw = nnx.Param(jnp.full((N, H), raw, param_dtype))
        self.out_gate = linear(width, N * H) if cfg.output_gate else nnx.data(None)
        self.out_norm = nnx.RMSNorm(H, epsilon=NORM_EPS, dtype=jnp.float32,
                                    param_dtype=param_dtype, rngs=rngs)  # fmt: skip
        self.o_proj = linear(N * H, width)

    # Pieces (models.recurrent.Recurrent's) -----------------------------------

    def _front(self, x, positions, segment_ids):
        del positions, segment_ids  # the recurrence orders the tokens
        return self.qk_proj(x), x

    def _conv_params(self):
        return None if self.conv is None else (self.conv[...], None)

    def _conv_shape(self):
        cfg = self.cfg
        return None if self.conv is None else (cfg.qk_conv, 2 * cfg.num_heads * cfg.head_dim)

    def _inputs(self, x, qk, _) -> dict:
        """q, k (unit norm), v ``[B,T,N,H]``; beta and log gamma ``[B,T,N]``."""
        cfg = self.cfg
        B, T, _ = x.shape
        q, k = (y.reshape(B, T, cfg.num_heads, cfg.head_dim)
                for y in jnp.split(jax.nn.silu(qk), 2, -1))  # fmt: skip
        v = self.v_proj(x).reshape(B, T, cfg.num_heads, cfg.head_dim)
        b, a = jnp.split(self.gate_projs(x.astype(jnp.float32)), 2, -1)
        return dict(q=l2_normalize(q, NORM_EPS), k=l2_normalize(k, NORM_EPS), v=v,
                    beta=jax.nn.sigmoid(b), log_g=jax.nn.log_sigmoid(a))  # fmt: skip

    def _lam(self):
        raw = self.lambda_raw[...].astype(jnp.float32)
        return jax.nn.softplus(raw) + self.cfg.lambda_floor

    def _mix(self, p, *, segment_ids=None, sharded=False, **options):
        fn = in_sequence(attn.mesa_net) if sharded else attn.mesa_net
        return fn(p["q"], p["k"], p["v"], p["beta"], self._lam(), log_gates=p["log_g"],
                  cg_steps=self.cfg.cg_steps, q_segment_ids=segment_ids,
                  kv_segment_ids=segment_ids, **options)  # fmt: skip

    def _mix_step(self, p, state):
        return attn.mesa_net_step(p["q"], p["k"], p["v"], p["beta"], self._lam(), state,
                                  log_gates=p["log_g"], cg_steps=self.cfg.cg_steps)  # fmt: skip

    def _one_hot(self, p) -> dict:
        return {**p, "v": one_hot_values(p["v"])}

    def _zero_state(self, batch: int):
        cfg = self.cfg
        return attn.init_mesa_state(batch, cfg.num_heads, cfg.head_dim, cfg.head_dim)

    def _finish(self, out, inputs, x):
        normed = self.out_norm(out.astype(jnp.float32)).astype(x.dtype)
        return self._output(self._gated(normed, x, jax.nn.silu))


def _sized(sizes: PresetSizes) -> MesaConfig:
    return MesaConfig(num_heads=sizes.num_heads, head_dim=sizes.head_dim,
                      chunk_size=sizes.chunk_size)  # fmt: skip


register_preset("mesanet", _sized,
                description="MesaNet: the in-context least-squares read, 30 CG steps")  # fmt: skip
