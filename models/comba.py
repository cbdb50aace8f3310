"""``CombaAttention``: Comba's layer (Hu et al. 2025) around ``attn.comba``.

One layer kind, ``"comba"``, configured by ``CombaConfig``; the preset ``comba``
is registered here. The layer is Gated DeltaNet's (``models.delta``: q/k/v
short convolutions with SiLU, ``beta = sigmoid(x W_beta)``, the decay
``-exp(A_log) softplus(x W_a + dt_bias)``, a per-head RMSNorm and an output
gate) with Comba's pieces, as fla's ``Comba`` layer builds them:

* the feedback key ``p = k sigmoid(d)``, ``d [K]`` per head (init 1: fla's
  ``use_inner_decay``);
* the output correction ``q <- q - D p``, ``D [K]`` per head (init
  ``correction``, fla's ``correction_factor``, 1 by default);
* q, k and p each L2-normalized after that (fla's ``use_qk_l2norm_in_kernel``);
  so p is k's direction whatever d is, as in fla's layer;
* the output gate ``sigmoid(x W_g)`` after the norm (fla's
  ``FusedRMSNormGated(activation="sigmoid")``), where Gated DeltaNet's is SiLU.

Left as Gated DeltaNet's here: value heads of the key's dim (fla expands them
2x) and A's initialization in [1, 16] (fla's [0, 16]).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

import attn
from attn.checks import fail
from models.config import register_kind
from models.delta import NORM_EPS, DeltaAttention, DeltaConfig, l2_normalize
from models.mesh import in_sequence
from models.patterns import PresetSizes, register_preset


@dataclasses.dataclass(frozen=True)
class CombaConfig(DeltaConfig):
    """A Comba layer (kind ``"comba"``): ``DeltaConfig``'s fields (``householder_steps`` 1)
    and:

    Attributes:
      correction: the output correction's initial ``D`` (fla's ``correction_factor``;
        its authors find 0.02 sometimes better at small scale).
    """

    kind: str = "comba"
    correction: float = 1.0

    def check_fields(self) -> None:
        if self.householder_steps != 1:
            why = "attn.comba writes one key per token"
            fail("householder_steps", f"1 for kind='comba' ({why})", repr(self.householder_steps))
        if self.negative_eigenvalues:
            fail("negative_eigenvalues", "False for kind='comba' (beta is sigmoid's)", "True")
        super().check_fields()


@register_kind("comba", config=CombaConfig, family="linear", sequence_parallel=True,
               in_order=True)  # fmt: skip
class CombaAttention(DeltaAttention):
    """Comba's layer: ``DeltaAttention`` with the feedback key, the output correction and
    the sigmoid output gate (see the module docstring), calling ``attn.comba``."""

    def __init__(self, cfg: CombaConfig, width: int, *, causal: bool, dtype, param_dtype, rngs):
        super().__init__(cfg, width, causal=causal, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        K = cfg.num_heads
        self.inner_decay = nnx.Param(jnp.ones((K,), param_dtype))
        self.D = nnx.Param(jnp.full((K,), cfg.correction, param_dtype))

    def _inputs(self, x, mixed, ctx) -> dict:
        """q (corrected), k, p ``[B,T,K,H]`` (unit norm), v ``[B,T,N,H]``, beta, log gates."""
        cfg = self.cfg
        B, T, _ = mixed.shape
        K, H, N = cfg.num_heads, cfg.head_dim, cfg.num_value_heads
        q, k, v = jnp.split(jax.nn.silu(mixed), [K * H, 2 * K * H], axis=-1)
        q, k = q.reshape(B, T, K, H), k.reshape(B, T, K, H)
        p = k * jax.nn.sigmoid(self.inner_decay[...]).astype(k.dtype)[:, None]
        q = q - self.D[...].astype(q.dtype)[:, None] * p
        unit = functools.partial(l2_normalize, eps=NORM_EPS)
        beta, log_g = self._beta_and_gates(x)
        return dict(q=unit(q), k=unit(k), v=v.reshape(B, T, N, H), p=unit(p), beta=beta,
                    log_g=log_g)  # fmt: skip

    def _mix(self, p, *, segment_ids=None, sharded=False, **options):
        fn = in_sequence(attn.comba) if sharded else attn.comba
        return fn(p["q"], p["k"], p["v"], p["p"], p["beta"], log_gates=p["log_g"],
                  q_segment_ids=segment_ids, kv_segment_ids=segment_ids, **options)  # fmt: skip

    def _mix_step(self, p, state):
        return attn.comba_step(p["q"], p["k"], p["v"], p["p"], p["beta"], state,
                               log_gates=p["log_g"])  # fmt: skip

    def _finish(self, out, inputs, x):
        """Per-head RMSNorm, the sigmoid output gate, the head gates and ``o_proj``."""
        normed = self.out_norm(out.astype(jnp.float32)).astype(x.dtype)
        return self._output(self._gated(normed, x))


def _sized(sizes: PresetSizes) -> CombaConfig:
    return CombaConfig(num_heads=sizes.num_heads, head_dim=sizes.head_dim,
                       chunk_size=sizes.chunk_size)  # fmt: skip


register_preset("comba", _sized, description="Comba: the delta rule with closed-loop control")
