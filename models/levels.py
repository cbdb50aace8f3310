"""Log-linear level weights (Guo et al. 2025): what turns a fixed-state layer's family into
its log-linear one.

As the paper's and fla's log-linear Mamba-2 parametrize them (fla's
``LogLinearMamba2``: its ``dl`` channels of the input projection and its ``L``
parameter): ``lambda [B,T,N,L] = softplus(level_scale * (x W_level))``,
``W_level [D, N*L]`` a bias-free projection of the layer input (in float32) and
``level_scale [N,L]`` a learned scale initialized to ones; so every weight is
positive and input-dependent, and at initialization near ``softplus(0) = log 2``.
A layer whose config has ``num_levels`` (``models.log_linear``'s configs) builds
them after its own parameters and runs its family's log-linear form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.heads import dense

__all__ = ["init_levels", "level_weights", "num_levels"]


def num_levels(cfg) -> int:
    """L of a log-linear config, 0 for any other (the layer keeps its family's one state)."""
    return getattr(cfg, "num_levels", 0)


def init_levels(layer: nnx.Module, width: int, heads: int, levels: int, *, param_dtype, rngs):
    """Adds ``level_proj [D, N*L]`` (float32, bias-free) and ``level_scale [N,L]`` (ones)."""
    layer.level_proj = dense(width, heads * levels, dtype=jnp.float32, param_dtype=param_dtype,
                             rngs=rngs)  # fmt: skip
    layer.level_scale = nnx.Param(jnp.ones((heads, levels), param_dtype))


def level_weights(layer: nnx.Module, x):
    """``x [B,T,D] -> lambda [B,T,N,L]`` float32: ``softplus(level_scale * (x W_level))``."""
    B, T, _ = x.shape
    N, L = layer.level_scale.shape
    raw = layer.level_proj(x.astype(jnp.float32)).reshape(B, T, N, L)
    return jax.nn.softplus(layer.level_scale[...].astype(jnp.float32) * raw)
