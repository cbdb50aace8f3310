"""The SwiGLU ``MLP`` and the pre-norm residual ``Block`` every model stacks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from models.cache import CrossCache
from models.config import AttentionConfig, ModelConfig
from models.heads import dense
from models.latent import LatentAttention
from models.linear import LinearAttention
from models.softmax import CrossAttention, SelfAttention

ATTENTION_MODULES = {"softmax": SelfAttention, "mla": LatentAttention, "linear": LinearAttention}


class MLP(nnx.Module):
    """SwiGLU: ``W_down (silu(x W_gate) * (x W_up))``, hidden width M."""

    def __init__(self, width: int, hidden: int, *, dtype, param_dtype, rngs):
        linear = functools.partial(dense, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate = linear(width, hidden)
        self.up = linear(width, hidden)
        self.down = linear(hidden, width)

    def __call__(self, x):
        """``[B,T,D] -> [B,T,D]``."""
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    """Pre-norm residual block: ``x + attn(norm(x))`` [``+ cross(norm(x))``] ``+ mlp(norm(x))``.

    ``attn`` is the layer's attention module (``ATTENTION_MODULES[layer.kind]``,
    see ``models.heads`` for their common surface); ``cross`` the cross-attention
    of an encoder-decoder's decoder, else None.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer: AttentionConfig,
        *,
        causal: bool,
        cross: AttentionConfig | None = None,
        rngs: nnx.Rngs,
    ):
        D = config.width
        kw = dict(dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype))
        norm = functools.partial(nnx.RMSNorm, D, epsilon=config.norm_eps, rngs=rngs, **kw)
        self.kind = layer.kind
        self.attn_norm = norm()
        self.attn = ATTENTION_MODULES[layer.kind](layer, D, causal=causal, rngs=rngs, **kw)
        self.cross_norm = norm() if cross is not None else None
        self.cross = CrossAttention(cross, D, rngs=rngs, **kw) if cross is not None else None
        self.mlp_norm = norm()
        self.mlp = MLP(D, config.hidden_width, rngs=rngs, **kw)

    def _attention_input(self, x):
        """The attention's input ``[B,T,D]``: the pre-norm of the residual stream.

        The place for a per-layer input transform (e.g. a short causal
        convolution, ``attn.short_conv``): it would act here in both
        ``__call__`` (with the segment ids) and ``extend`` (carrying its decode
        state next to the attention's cache).
        """
        return self.attn_norm(x)

    def _rest(self, x, memory: CrossCache | None):
        """Cross-attention (if any) and the MLP after the self-attention residual."""
        if self.cross is not None:
            x = x + self.cross(self.cross_norm(x), memory)
        return x + self.mlp(self.mlp_norm(x))

    def __call__(self, x, *, positions=None, segment_ids=None, memory: CrossCache | None = None):
        """Args: x ``[B,T,D]``; positions, segment_ids ``[B,T]`` as the attention modules'
        ``__call__``; memory: the ``CrossCache`` of the source (with cross-attention).

        Returns:
          ``x [B,T,D]``.
        """
        h = self._attention_input(x)
        x = x + self.attn(h, positions=positions, segment_ids=segment_ids)
        return self._rest(x, memory)

    def extend(self, x, cache, start, lengths=None, *, memory: CrossCache | None = None):
        """Args: x ``[B,T,D]``, the layer's cache, start ``[B]``, lengths ``[B]`` or None.

        Returns:
          ``(x [B,T,D], cache)``.
        """
        a, cache = self.attn.extend(self._attention_input(x), cache, start, lengths)
        return self._rest(x + a, memory), cache
