"""``Recurrent``: the one base of the fixed-state layer kinds (``__call__``, ``extend``,
``init_cache``).

A fixed-state layer reads its input in four steps: projections of x, an
optional short causal convolution over some of their channels, the family's
mixer (``attn.linear_attention``, ``attn.delta_rule``, ``attn.ssd``, ...) over
the sequence or one token, and the output path. The base owns the order, the
segment ids, the decode cache and the choice between a sequence and a step; a
kind supplies its pieces:

* ``_front(x, positions, segment_ids) -> (u, ctx)``: the convolution's input
  ``[B,T,C]`` (None without one) and whatever later pieces need;
* ``_conv_params() -> (weight [W,C], bias [C] | None)`` or None, and its
  ``_conv_shape() -> (W, C)`` or None (read without the parameters' values,
  so ``init_cache`` runs on abstract modules);
* ``_inputs(x, u, ctx) -> inputs``: the mixer's per-token arrays, a pytree of
  ``[B,T,...]`` leaves (a step reads ``[:, 0]`` of each);
* ``_mix(inputs, *, segment_ids, sharded, **options)``: the family over the
  sequence (``(out, state)`` with ``return_state``; ``sharded`` under a
  "seq" mesh), and ``_mix_step(inputs_t, state) -> (out [B,N,E], state)``;
* ``_finish(out, inputs, ctx) -> y [B,T,D]``;
* ``_zero_state(batch)``, the options of a forward and of a prefill
  (``_options``, ``_extend_options``) and the one-hot values of the captured
  weights (``_one_hot``).

A decode cache is ``RecurrentCache(state, conv)``: the family's state and the
convolution's last W-1 inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

import attn
from attn import masks
from models.heads import Heads, step_positions
from models.mesh import in_sequence

__all__ = ["Recurrent", "RecurrentCache", "one_hot_values"]


@struct.dataclass
class RecurrentCache:
    """Decode cache of a fixed-state layer: the family's state (float32) and the last W-1
    inputs of its short convolution ``[B,W-1,C]`` (None without one)."""

    state: object
    conv: jax.Array | None


def one_hot_values(v):
    """One-hot values ``e_s`` in the layout of ``v [B,S,...,N,E]``: ``[B,S,...,N,S]`` float32,
    so a mixer linear in its values returns M of ``out = M v`` as ``[B,T,N,S]``."""
    S = v.shape[1]
    eye = jnp.eye(S, dtype=jnp.float32).reshape(1, S, *(1,) * (v.ndim - 3), S)
    return jnp.broadcast_to(eye, (*v.shape[:-1], S))


class Recurrent(Heads):
    """The base of the fixed-state kinds (see the module docstring for what a kind supplies)."""

    def _conv_params(self):
        return None

    def _conv_shape(self):
        return None

    def _options(self) -> dict:
        return dict(form=self.cfg.form, chunk_size=self.cfg.chunk_size)

    def _extend_options(self) -> dict:
        """The options of a prefill from a cached state (a family's form may differ)."""
        return self._options()

    def _weight_options(self) -> dict:
        """The options of the captured weights' call."""
        return self._options()

    def __call__(self, x, *, positions=None, segment_ids=None):
        """``x [B,T,D] -> [B,T,D]``; segment_ids ``[B,T]`` (id 0 padding) or None."""
        if positions is None:
            positions = jnp.arange(x.shape[1])
        u, ctx = self._front(x, positions, segment_ids)
        conv = self._conv_params()
        if conv is not None:
            u = in_sequence(attn.short_conv)(u, *conv, segment_ids=segment_ids)[0]
        inputs = self._inputs(x, u, ctx)
        out = self._mix(inputs, segment_ids=segment_ids, sharded=True, **self._options())
        if self.sow_weights:
            self._sow(self._weights(inputs, segment_ids))
        return self._finish(out, inputs, ctx)

    def _weights(self, inputs, segment_ids):
        """``[B,N,T,S]`` float32: the outputs for one-hot values (M of ``out = M v``)."""
        out = self._mix(self._one_hot(inputs), segment_ids=segment_ids, sharded=True,
                        **self._weight_options())  # fmt: skip
        return jnp.transpose(out, (0, 2, 1, 3)).astype(jnp.float32)

    def init_cache(self, batch: int, max_len: int) -> RecurrentCache:
        """The zero state and zero convolution inputs ``[B,W-1,C]`` (no length axis)."""
        del max_len
        shape = self._conv_shape()
        window = None
        if shape is not None:
            W, C = shape
            window = jnp.zeros((batch, W - 1, C), self.dtype)
        return RecurrentCache(state=self._zero_state(batch), conv=window)

    def extend(self, x, cache: RecurrentCache, start, lengths=None):
        """Continues over T new tokens: one token by the family's step (T == 1, no
        ``lengths``), else the sequence form from the cached state. Arguments as
        ``SelfAttention.extend``."""
        T = x.shape[1]
        step = T == 1 and lengths is None
        segment_ids = None if lengths is None else masks.segment_ids_from_lengths(lengths, T)
        u, ctx = self._front(x, step_positions(start, T), segment_ids)
        conv, window = self._conv_params(), cache.conv
        if conv is not None and step:
            u, window = attn.short_conv_step(window, u[:, 0], *conv)
            u = u[:, None]
        elif conv is not None:
            u, window = attn.short_conv(u, *conv, state=window, segment_ids=segment_ids)
        inputs = self._inputs(x, u, ctx)
        if step:
            first = jax.tree.map(lambda a: a[:, 0], inputs)
            out, state = self._mix_step(first, cache.state)
            out = out[:, None]
        else:
            out, state = self._mix(inputs, segment_ids=segment_ids, initial_state=cache.state,
                                   return_state=True, **self._extend_options())  # fmt: skip
        return self._finish(out, inputs, ctx), RecurrentCache(state=state, conv=window)
