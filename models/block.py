"""The pre-norm residual ``Block`` every model stacks, its SwiGLU ``MLP`` and ``ShortConv``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

import attn
from attn import masks
from models.cache import CrossCache
from models.config import KINDS, AttentionConfig, ModelConfig
from models.heads import dense, fused
from models.mesh import in_sequence
from models.softmax import CrossAttention


class MLP(nnx.Module):
    """SwiGLU: ``W_down (silu(x W_gate) * (x W_up))``, hidden width M."""

    def __init__(self, width: int, hidden: int, *, dtype, param_dtype, rngs):
        linear = functools.partial(dense, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate = linear(width, hidden)
        self.up = linear(width, hidden)
        self.down = linear(hidden, width)

    def __call__(self, x):
        """``[B,T,D] -> [B,T,D]``."""
        gate, up = fused(x, self.gate, self.up)
        return self.down(jax.nn.silu(gate) * up)


class ShortConv(nnx.Module):
    """Short causal depthwise convolution of a layer's input (``attn.short_conv``).

    ``y[t] = sum_{j<W} weight[j] * x[t - (W-1) + j]`` per channel: each token
    gets its W-1 predecessors' features, which the projections after it (q,
    k, v, latents, gates) can match on. Parameter: weight ``[W,D]``, oldest tap
    first. No bias and no activation (fla's ``ShortConvolution`` adds a SiLU), so
    that it can start as exactly the identity. The decode state is the last W-1
    inputs ``[B,W-1,D]``.
    """

    def __init__(self, kernel_size: int, channels: int, *, dtype, param_dtype):
        """kernel_size: W, the convolution's width (taps); channels: D."""
        # The identity (current-token tap 1, the others 0): a layer given a short
        # conv starts as the same layer without one, so adding it never makes a
        # model start worse, and it learns how much of each predecessor to mix in
        # (tap j's gradient, the sum over t of dL/dy[t] * x[t-W+1+j], is not zero).
        weight = jnp.zeros((kernel_size, channels), param_dtype).at[-1].set(1.0)
        self.weight = nnx.Param(weight)
        self.kernel_size, self.channels, self.dtype = kernel_size, channels, dtype

    def __call__(self, x, segment_ids=None):
        """``x [B,T,D] -> [B,T,D]``; segment_ids ``[B,T]`` keep packed sequences apart."""
        return in_sequence(attn.short_conv)(x, self.weight[...], segment_ids=segment_ids)[0]

    def init_state(self, batch: int):
        """Zeros ``[B,W-1,D]``: no input before the first token."""
        return jnp.zeros((batch, self.kernel_size - 1, self.channels), self.dtype)

    def extend(self, x, state, lengths=None):
        """T new inputs after ``state``; row b's first ``lengths[b]`` are real (None: all T).

        Returns:
          ``(y [B,T,D], state [B,W-1,D])``; padding leaves the state as it was.
        """
        T = x.shape[1]
        if T == 1 and lengths is None:
            y, state = attn.short_conv_step(state, x[:, 0], self.weight[...])
            return y[:, None], state
        segment_ids = None if lengths is None else masks.segment_ids_from_lengths(lengths, T)
        return attn.short_conv(x, self.weight[...], state=state, segment_ids=segment_ids)


class Block(nnx.Module):
    """Pre-norm residual block: ``x + attn(norm(x))`` [``+ cross(norm(x))``] ``+ mlp(norm(x))``.

    ``attn`` is the layer's attention module (``KINDS[layer.kind].module``, see
    ``models.heads`` for their common surface); ``cross`` the cross-attention
    of an encoder-decoder's decoder, else None. With ``layer.short_conv = W`` the
    attention's input is ``conv(norm(x))``, a ``ShortConv`` of width W.

    The convolution acts on the layer's input rather than on q, k and v after
    their projections (as fla and Mamba place it): one place serves every kind
    (MLA's latent and RoPE key, linear attention's gates, GQA's shared heads
    see the same shifted input), the attention modules stay unchanged, and the
    decode state is one ``[B,W-1,D]`` per layer instead of three of ``N*H`` and
    ``K*H`` channels.
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
        module = KINDS.lookup(layer.kind, "layer.kind").module
        self.attn = module(layer, D, causal=causal, rngs=rngs, **kw)
        self.conv = ShortConv(layer.short_conv, D, **kw) if layer.short_conv else None
        self.cross_norm = norm() if cross is not None else None
        self.cross = CrossAttention(cross, D, rngs=rngs, **kw) if cross is not None else None
        self.mlp_norm = norm()
        self.mlp = MLP(D, config.hidden_width, rngs=rngs, **kw)

    def _attention_input(self, x, segment_ids=None):
        """The attention's input ``[B,T,D]`` over a whole sequence: ``[conv](norm(x))``.

        The per-layer input transform (``ShortConv``) acts here and in
        ``_extend_input``, which carries its decode state.
        """
        h = self.attn_norm(x)
        return h if self.conv is None else self.conv(h, segment_ids)

    def _extend_input(self, x, conv_state, lengths):
        """``_attention_input`` for T new tokens after ``conv_state``: ``(h, conv_state)``."""
        h = self.attn_norm(x)
        if self.conv is None:
            return h, conv_state
        return self.conv.extend(h, conv_state, lengths)

    def init_conv_state(self, batch: int):
        """The ``ShortConv``'s zero decode state ``[B,W-1,D]``, or None without one."""
        return None if self.conv is None else self.conv.init_state(batch)

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
        h = self._attention_input(x, segment_ids)
        x = x + self.attn(h, positions=positions, segment_ids=segment_ids)
        return self._rest(x, memory)

    def extend(
        self, x, cache, start, lengths=None, *, memory: CrossCache | None = None, conv_state=None
    ):
        """Args: x ``[B,T,D]``, the layer's cache, start ``[B]``, lengths ``[B]`` or None;
        conv_state: the ``ShortConv``'s ``[B,W-1,D]`` (None without one).

        Returns:
          ``(x [B,T,D], cache, conv_state)``.
        """
        h, conv_state = self._extend_input(x, conv_state, lengths)
        a, cache = self.attn.extend(h, cache, start, lengths)
        return self._rest(x + a, memory), cache, conv_state
