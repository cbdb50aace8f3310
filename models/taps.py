"""Taps on a model's attention modules: captured weights, per-head gates, head importance.

Nothing here changes a model's signature: ``model(tokens)`` returns logits,
always. The taps are NNX's own mechanisms on each attention module (see
``models.heads``):

* weights: ``capture_weights(model, *args)`` switches the modules'
  ``sow_weights`` on for one call run under ``nnx.capture``, so each module sows
  its ``[B,N,T,S]`` weights as ``nnx.Intermediate``; nothing is left on the
  model afterwards, and the default call never computes them.
* gates: each module's ``HeadGate`` variable ``[N]`` (ones) scales its heads'
  outputs before the output projection. ``set_head_gates`` ablates heads;
  ``head_importance`` is the gradient of a loss with respect to the gates
  (Michel et al. 2019, "Are Sixteen Heads Really Better than One?"), taken with
  ``nnx.grad(..., argnums=nnx.DiffState(0, HeadGate))``.

``which`` picks the attention modules of a stack: ``"self"`` (the decoder's,
or an ``Encoder``'s, self-attention; the default), ``"encoder"`` (an
``EncoderDecoder``'s encoder) or ``"cross"`` (its cross-attention). Everything
works under ``nnx.jit`` and inside ``jax.jit`` on a merged model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax.numpy as jnp
from flax import nnx

from attn.checks import fail
from models.heads import HeadGate, Heads

STACKS = ("self", "encoder", "cross")


def attention_modules(model: nnx.Module, which: str = "self") -> list[Heads]:
    """The attention modules of one stack of ``model``, one per layer (L of them).

    ``model`` may also be a single attention module (then ``[model]``).
    """
    if which not in STACKS:
        fail("which", f"one of {STACKS}", repr(which))
    if isinstance(model, Heads) and which == "self":
        return [model]
    if which == "encoder":
        blocks = getattr(model, "encoder_blocks", None)
        if blocks is None:
            fail("which", "'self' or 'cross' for a model without an encoder stack", "'encoder'")
        return [block.attn for block in blocks]
    if which == "cross":
        if not model.blocks[0].cross:
            fail("which", "'self' for a model without cross-attention", "'cross'")
        return [block.cross for block in model.blocks]
    return [block.attn for block in model.blocks]


def _module_paths(model: nnx.Module) -> dict[int, tuple]:
    """``id(module) -> path`` of every submodule (paths index ``nnx.State``)."""
    return {id(module): path for path, module in nnx.iter_modules(model)}


def capture_weights(model: nnx.Module, *args, **kwargs):
    """Calls ``model(*args, **kwargs)`` and captures every attention layer's weights.

    Softmax, MLA and cross-attention weights come from the dense implementation
    (which computes the same function as the others). Linear layers give the
    weights of their parallel form: row t holds ``phi(q_t).phi(k_s)`` times the
    decay, divided by the normalizer (rows sum to 1 up to ``eps`` with
    ``normalize``), computed as the outputs for one-hot values at ``O(T S^2)``
    per head, only when captured. Padding query rows of linear layers are 0.

    Returns:
      ``(logits, weights)``: the model's logits and, for a ``Decoder`` or an
      ``Encoder``, a list of L float32 arrays ``[B,N,T,S]`` (S = T), one per layer
      (for a single attention module: its output and ``[weights]``);
      for an ``EncoderDecoder`` a dict of such lists under ``"encoder"``
      (``[B,N,S,S]``), ``"decoder"`` (``[B,N,T,T]``) and ``"cross"`` (``[B,N,T,S]``).
    """
    stacks = ["self"]
    if hasattr(model, "encoder_blocks"):
        stacks = ["encoder", "self", "cross"]
    modules = {which: attention_modules(model, which) for which in stacks}
    flags = [m for ms in modules.values() for m in ms]
    for module in flags:
        module.sow_weights = True
    try:
        logits, sown = nnx.capture(model, nnx.Intermediate)(*args, **kwargs)
    finally:
        for module in flags:
            module.sow_weights = False
    values = dict(nnx.to_flat_state(sown))
    paths = _module_paths(model)

    def weights(ms):
        # One call per module: the sown tuple holds one entry.
        return [values[(*paths[id(m)], "weights")].get_value()[-1] for m in ms]

    if stacks == ["self"]:
        return logits, weights(modules["self"])
    names = {"encoder": "encoder", "self": "decoder", "cross": "cross"}
    return logits, {names[w]: weights(ms) for w, ms in modules.items()}


def head_gates(model: nnx.Module, which: str = "self") -> list:
    """The gates of one stack: a list of L float32 arrays ``[N]`` (ones unless set).

    ``jnp.stack`` makes them ``[L,N]`` when every layer has N heads.
    """
    return [m.head_gate[...] for m in attention_modules(model, which)]


def set_head_gates(model: nnx.Module, gates, which: str = "self") -> None:
    """Sets the gates of one stack in place: head n of layer l's output is scaled by
    ``gates[l][n]`` (0 removes the head's contribution, 1 restores it).

    Args:
      model: the model (changed in place).
      gates: ``[L,N]`` or a sequence of L ``[N]`` arrays (layers may differ in N).
      which: the stack (see the module docstring).
    """
    modules = attention_modules(model, which)
    L = len(modules)
    if not isinstance(gates, Sequence):
        gates = jnp.asarray(gates)
        if gates.ndim != 2:
            fail("gates", f"[L,N] with L = {L} or a sequence of {L} [N] arrays", gates.shape)
    if len(gates) != L:
        fail("gates", f"{L} per-layer entries", len(gates))
    for i, (module, g) in enumerate(zip(modules, gates, strict=True)):
        N = module.cfg.num_heads
        if jnp.shape(g) != (N,):
            fail(f"gates[{i}]", f"shape ({N},)", jnp.shape(g))
        module.head_gate.set_value(jnp.asarray(g, jnp.float32))


def head_importance(
    model: nnx.Module, loss_fn: Callable[..., jnp.ndarray], *args, which: str = "self", **kwargs
) -> list:
    """The gradient of ``loss_fn(model, *args, **kwargs)`` with respect to the head gates.

    Michel et al.'s importance of a head is the magnitude of this gradient at
    gates of one (averaged over data): how much the loss changes when the head
    is scaled. Only the gates are differentiated (``nnx.DiffState(0, HeadGate)``);
    parameters and the gates' values are left unchanged.

    Returns:
      A list of L float32 arrays ``[N]``, d loss / d gate, for the stack ``which``.
    """
    modules = attention_modules(model, which)
    grads = nnx.grad(lambda m: loss_fn(m, *args, **kwargs), argnums=nnx.DiffState(0, HeadGate))(
        model
    )
    values = dict(nnx.to_flat_state(grads))
    paths = _module_paths(model)
    return [values[(*paths[id(m)], "head_gate")].get_value() for m in modules]
