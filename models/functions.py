"""Layer kinds declared from an attention function: the softmax layer around a pure function.

``attention_kind(name, fn, family=...)`` makes ``fn`` a layer kind. ``fn`` is a
pure function of the layer-kind signature::

    fn(q, k, v, *, mask, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
       kv_length) -> out [B,T,N,E]

(q ``[B,T,N,H]``, k ``[B,S,K,H]``, v ``[B,S,K,E]``; the arguments as
``attn.softmax.call.CallArgs`` names them, always given: positions ``[B,T]`` and
``[B,S]``, segment ids with 0 for padding and for a cache's empty slots), and
``kv_length [B,T]``: per query, how many keys its sequence holds up to it: in a
causal layer its own position + 1, in a bidirectional one the real tokens of
its segment. That count never depends on a cache's capacity, page size or
window, so a function built on it decodes as it trains. Settings a layer
config may switch on (``score``, ``softcap``, ``sink_logits``) reach ``fn`` as
``score_mod``, ``softcap`` and ``sink_logits`` when it takes them, and are
refused by name when it does not.

The layer checks what ``fn`` returns (a floating ``[B,T,N,E]`` array) and turns
an exception inside it into one ``ValueError`` naming the kind, the function
and its line (``checked_call``), at the first trace.

The layer (``FunctionAttention``, a ``models.SelfAttention``) supplies the
rest: the projections, RoPE, the masks of ``MaskedConfig``, every decode cache
(contiguous, ring buffer, paged), the batch sharding and the weights tap,
which evaluates ``fn`` on one-hot values: for any function of the form
``w(q, k) @ v`` that gives the weights ``w``. It never runs as ring attention
(a function need not decompose over key blocks).

Built in: ``sigmoid`` and ``softpick`` (``attn.functions``), with presets of
the same names.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import traceback
from typing import ClassVar

import jax.numpy as jnp

import attn
from attn.checks import fail
from attn.masks import PADDING
from attn.softmax import check_call
from models.config import register_kind
from models.patterns import PresetSizes, register_preset
from models.softmax import SelfAttention, SoftmaxConfig

# Config fields a function kind passes on, and the keyword its function must take for each.
OPTIONAL = {"score": "score_mod", "softcap": "softcap", "sink_logits": "sink_logits"}


@dataclasses.dataclass(frozen=True)
class FunctionConfig(SoftmaxConfig):
    """A layer of a function kind: ``SoftmaxConfig``'s fields (masks, RoPE, modifiers).

    ``impl`` stays ``"auto"``: the function computes itself.
    """

    kind: str = "function"

    def check_fields(self) -> None:
        super().check_fields()
        if self.impl != "auto":
            fail("impl", "'auto' for a function kind (its function computes itself)", self.impl)


class FunctionAttention(SelfAttention):
    """The softmax layer around ``fn`` (a class attribute set by ``attention_kind``)."""

    fn: ClassVar = None

    def _attention(self, q, k, v, *, impl="auto", return_weights=False, **call):
        del impl  # the function computes itself
        args = _layer_args(q, k, v, call, self.causal)
        fn = functools.partial(checked_call, type(self).fn, self.cfg.kind)
        out = fn(q, k, v, **args)
        if not return_weights:
            return out
        return out, probed_weights(fn, q, k, args)

    def _cached(self, positions, kv_pos) -> dict:
        """A cached call's arguments, with ``kv_length``: position + 1 (decoders are causal,
        and a cache holds its sequence from position 0, whatever it has dropped since)."""
        return dict(super()._cached(positions, kv_pos), kv_length=positions + 1)

    def _on_ring(self, T: int) -> bool:
        return False


def attention_kind(name: str, fn, *, family: str, config: type | None = None, takes=None):
    """Makes ``fn`` (the module docstring's signature) the layer kind ``name``.

    Args:
      name: the kind's name (the configs' ``kind``).
      fn: the attention function.
      family: what the comparison reports the kind as (``models.LayerKind.family``):
        ``"softmax"`` only for a function that is softmax attention; e.g. ``"sigmoid"``.
      config: the kind's config class, a subclass of ``FunctionConfig`` whose ``kind``
        defaults to ``name``; None makes one.
      takes: the optional keywords ``fn`` computes (of ``"score_mod"``, ``"softcap"``,
        ``"sink_logits"``); a layer config setting another is refused by name. None:
        those its signature names (all, with ``**kwargs``).

    Returns:
      The kind's module class.
    """
    if not callable(fn):
        fail("fn", "a callable attention function", repr(fn))
    if config is None:
        title = "".join(part.title() for part in name.split("_"))
        config = dataclasses.make_dataclass(
            f"{title}Config",
            [("kind", str, dataclasses.field(default=name))],
            bases=(FunctionConfig,),
            frozen=True,
        )
        config.__doc__ = f"A layer of kind {name!r}: {function_name(fn)} in the softmax layer."
        config.__module__ = _module_of(fn)
    if not (isinstance(config, type) and issubclass(config, FunctionConfig)):
        fail("config", "a dataclass subclass of models.FunctionConfig", repr(config))
    # Named after fn, so the registry tells a re-import (the same function) from a second
    # function of the same module under the same name (an error naming both).
    qualname = f"attention_kind({function_name(fn)})"
    module = type(f"{config.__name__.removesuffix('Config')}Attention", (FunctionAttention,),
                  {"fn": staticmethod(fn), "__module__": config.__module__,
                   "__qualname__": qualname})  # fmt: skip
    register_kind(name, module, config=config, family=family, check=_check_for(fn, takes))
    return module


def function_name(fn) -> str:
    """``fn``'s name, precise enough to tell two functions of one module apart and a
    re-import of a function from another one: its qualname, and for lambdas and nested
    functions (which share qualnames) its line and what it captured; a partial's function
    and arguments."""
    if isinstance(fn, functools.partial):
        args = [*map(_captured, fn.args), *(f"{k}={_captured(v)}" for k, v in fn.keywords.items())]
        return f"partial({function_name(fn.func)}, {', '.join(args)})"
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is not None and ("<lambda>" in name or "<locals>" in name):
        name += f" at line {code.co_firstlineno}"
    if cells:
        name += f" over ({', '.join(_captured(c.cell_contents) for c in cells)})"
    return name


def _captured(x) -> str:
    """A captured value as ``function_name`` names it: functions and classes by where they
    are defined (a re-import makes new ones), anything else by its repr."""
    if callable(x) and hasattr(x, "__qualname__"):
        return f"{getattr(x, '__module__', '?')}.{function_name(x)}"
    return repr(x)


def _module_of(fn) -> str:
    return getattr(fn.func if isinstance(fn, functools.partial) else fn, "__module__", __name__)


def _check_for(fn, takes):
    """The kind's config check: settings ``fn`` takes no keyword for are refused by name."""
    if takes is None:
        params = inspect.signature(fn).parameters
        takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
        takes = [k for k in OPTIONAL.values() if takes_all or k in params]
    unknown = sorted(set(takes) - set(OPTIONAL.values()))
    if unknown:
        fail("takes", f"keywords of {sorted(OPTIONAL.values())}", unknown)

    def check(cfg) -> None:
        for field, keyword in OPTIONAL.items():
            value = getattr(cfg, field)
            if value not in (None, False) and keyword not in takes:
                fail(field, f"unset ({function_name(fn)} takes no {keyword})", repr(value))

    return check


def checked_call(fn, kind: str, q, k, v, **args):
    """``fn(q, k, v, **args)``, its output checked where the layer receives it: a floating
    array ``[B,T,N,E]``. A wrong output, or an exception inside ``fn``, is one
    ``ValueError`` naming the kind and the function (and the function's line that raised),
    at the first trace, instead of a failure deep in the output projection."""
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    try:
        out = fn(q, k, v, **args)
    except Exception as e:
        where = _own_line(fn, e)
        text = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(
            f"kind {kind!r}: expected {name} to return its output, got {type(e).__name__}: "
            f"{text}{where}"
        ) from e
    want = (*q.shape[:3], v.shape[-1])
    shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
    if shape != want or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        got = f"{dtype} {shape}" if shape is not None else type(out).__name__
        fail(f"kind {kind!r}", f"{name} to return a floating array {want} = [B,T,N,E]", got)
    return out


def _own_line(fn, error: BaseException) -> str:
    """`` (at file:line)``: the last frame of ``error``'s traceback in ``fn``'s file, if any."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return ""
    frames = traceback.extract_tb(error.__traceback__)
    frames = [f for f in frames if f.filename == code.co_filename]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _layer_args(q, k, v, call: dict, causal: bool) -> dict:
    """The function's keyword arguments: the call's, with the defaults the call contract
    gives them (``check_call``) filled in; no segment ids means every token real. An
    optional setting the layer leaves unset (None) is not passed."""
    rows = ("q_positions", "kv_positions", "q_segment_ids", "kv_segment_ids")
    c = check_call(q, k, v, mask=call.get("mask"), **{n: call.get(n) for n in rows})
    B, T, S = c.dims.B, c.dims.T, c.dims.S
    given = {n: x for n, x in call.items() if not (n in OPTIONAL.values() and x is None)}
    args = dict(given, q_positions=c.q_positions, kv_positions=c.kv_positions)
    args["q_segment_ids"] = _or_ones(c.q_segment_ids, (B, T))
    args["kv_segment_ids"] = _or_ones(c.kv_segment_ids, (B, S))
    if args.get("kv_length") is None:
        args["kv_length"] = _whole_lengths(args, causal)
    return args


def _or_ones(ids, shape):
    return jnp.ones(shape, jnp.int32) if ids is None else ids


def _whole_lengths(args: dict, causal: bool):
    """``[B,T]``: the real keys of each query's segment, up to its position if causal."""
    q_seg, kv_seg = args["q_segment_ids"], args["kv_segment_ids"]
    same = (q_seg[:, :, None] == kv_seg[:, None, :]) & (kv_seg != PADDING)[:, None, :]
    if causal:
        same &= args["kv_positions"][:, None, :] <= args["q_positions"][:, :, None]
    return same.sum(-1).astype(jnp.int32)


def probed_weights(fn, q, k, args):
    """Weights ``[B,N,T,S]`` of a function of the form ``w(q, k) @ v``: ``fn`` on one-hot values."""
    B, S, K = k.shape[:3]
    one_hot = jnp.broadcast_to(jnp.eye(S, dtype=q.dtype)[None, :, None], (B, S, K, S))
    return fn(q, k, one_hot, **args).astype(jnp.float32).transpose(0, 2, 1, 3)


# Both refuse sink logits, which belong to softmax's denominator.
MODIFIERS = ("score_mod", "softcap")
attention_kind("sigmoid", attn.sigmoid_attention, family="sigmoid", takes=MODIFIERS)
attention_kind("softpick", attn.softpick_attention, family="softpick", takes=MODIFIERS)


@register_preset("sigmoid", description="sigmoid attention, bias -log(n) (Ramapuram et al. 2024)")
def sigmoid(sizes: PresetSizes):
    return sizes.function("sigmoid")


@register_preset("softpick", description="softpick: rectified softmax (Zuhri et al. 2025)")
def softpick(sizes: PresetSizes):
    return sizes.function("softpick")
