"""The checked front of every fixed-state family: the arguments every recurrence takes, once.

Linear attention, the delta rule and DeltaProduct, the DPLR delta rule,
Mamba-2's SSD and both log-linear families take the same seven arguments
besides their own arrays: ``form``, ``chunk_size``, ``scale``,
``initial_state``, ``return_state``, ``q_segment_ids`` and
``kv_segment_ids``. They are declared here once (``RecurrenceArgs``, as
softmax declares ``CallArgs``), checked here once (``check_front``) into a
``Front`` that is all a family's forms receive of them, and defaulted here
once (``CHUNK_SIZE``, which ``models`` reads too).

What the check promises, the same in every family:

* ``form`` is one of the family's forms; ``chunk_size`` a positive int (a
  power of 2 where the family's levels align with chunks);
* segment ids ``[B,T]`` are int ids >= 0 (0 is padding), both or neither; in
  a causal recurrence q and k are the same tokens, so a query id may differ
  from its key's id only by being padding (0: the query reads nothing while
  its token still writes); two different real ids on one token are refused
  where the ids are concrete (under a trace nothing is seen, as for every
  value check);
* the initial state is refused unless it has the family's shape and a real
  floating dtype (it is carried in float32);
* ``scale`` is a positive finite number, None giving the family's default
  (``1/sqrt(H)`` unless the family says otherwise);
* the output dtype is the inputs' (``out_dtype``).
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple, TypedDict

import jax
import jax.numpy as jnp
import numpy as np

from attn import checks
from attn.checks import fail

__all__ = [
    "CHUNK_SIZE",
    "Front",
    "RecurrenceArgs",
    "check_chunk",
    "check_form",
    "check_front",
    "check_heads",
    "check_state",
    "out_dtype",
    "returned",
    "takes_recurrence_args",
]

# The chunk every chunkwise form and every fixed-state layer defaults to: long
# enough that the intra-chunk products are matmuls, short enough that the [C,C]
# squares (and a per-channel gate's C H floats per token) stay small.
CHUNK_SIZE = 64


class RecurrenceArgs(TypedDict, total=False):
    """The keyword arguments every fixed-state family takes, all optional.

    Attributes:
      form: one of the family's forms (``"chunkwise"`` by default: linear in T
        and made of matmuls); every form computes the same function.
      chunk_size: C for the chunkwise form (``CHUNK_SIZE``); T need not be a
        multiple of it.
      scale: multiplies q; a positive finite number, None the family's default.
      initial_state: the state the sequence continues from (zeros if None):
        the first segment's past, with segment ids; finite (refused by name where
        its values are known: a NaN would reach every output of its row).
      return_state: also return the final state (the last segment's).
      q_segment_ids: ``[B,T]`` ints, with ``kv_segment_ids`` (both or
        neither): packing and padding (id 0). The queries are the keys'
        tokens, so a query's id is its key's, or 0 (the query reads nothing).
      kv_segment_ids: ``[B,T]`` ints: a segment is a run of equal non-zero ids
        and starts from a zero state; padding (0) writes nothing and does not
        decay the state.
    """

    form: str
    chunk_size: int
    scale: float | None
    initial_state: Any
    return_state: bool
    q_segment_ids: Any
    kv_segment_ids: Any


SEGMENT_IDS = ("q_segment_ids", "kv_segment_ids")

# The defaults of RecurrenceArgs: every entry point's, shown in its signature.
DEFAULTS = dict(form="chunkwise", chunk_size=CHUNK_SIZE, scale=None, initial_state=None,
                return_state=False, q_segment_ids=None, kv_segment_ids=None)  # fmt: skip


def takes_recurrence_args(fn):
    """Shows an entry point's ``**front_args`` as the keywords of ``RecurrenceArgs`` (with
    ``DEFAULTS``) in its signature, so ``inspect.signature`` and ``help()`` list them."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d)
               for n, d in DEFAULTS.items()]  # fmt: skip
    fn.__signature__ = sig.replace(parameters=params)
    return fn


class Front(NamedTuple):
    """A recurrence's checked front arguments (``check_front``)."""

    form: str
    chunk_size: int
    scale: float  # the factor q is multiplied by
    q_seg: jax.Array | None  # [B,T] int32
    kv_seg: jax.Array | None  # [B,T] int32
    initial_state: Any  # as given (checked), or None
    return_state: bool


def check_form(form, forms: tuple[str, ...]) -> str:
    if form not in forms:
        fail("form", f"one of {forms}", repr(form))
    return form


def check_chunk(chunk_size, power_of_two: bool = False) -> int:
    """``chunk_size`` as an int: positive, and a power of 2 with ``power_of_two``."""
    bad = isinstance(chunk_size, bool) or not isinstance(chunk_size, int | np.integer)
    if bad or chunk_size < 1 or (power_of_two and chunk_size & (chunk_size - 1)):
        want = "a power of 2 (the levels align with chunks)" if power_of_two else "a positive int"
        fail("chunk_size", want, repr(chunk_size))
    return int(chunk_size)


def check_heads(q, k, v, step: bool, per_head: dict | None = None):
    """Checks q, k ``[B,(T,)K,H]`` (one shape), v ``[B,(T,)N,E]`` with N a multiple of K,
    and the ``per_head`` arrays ``[B,(T,)N]`` (by name; None passes): the heads every
    family's arrays share. Returns ``(B, T, K, N, H, E)``, T = 1 for a step."""
    t = "" if step else "T,"
    checks.float_array(q, "q", 3 if step else 4, f"[B,{t}K,H]")
    checks.float_array(k, "k", q.ndim, f"[B,{t}K,H]")
    checks.float_array(v, "v", q.ndim, f"[B,{t}N,E]")
    if k.shape != q.shape:
        fail("k", f"the shape of q {tuple(q.shape)} ([B,{t}K,H])", f"shape {tuple(k.shape)}")
    *lead, K, H = q.shape
    N, E = v.shape[-2:]
    if tuple(v.shape[:-2]) != tuple(lead) or N % K:
        want = f"shape ({', '.join(map(str, lead))}, N, E) with N a multiple of K={K}"
        fail("v", want, f"shape {tuple(v.shape)}")
    for name, x in (per_head or {}).items():
        if x is not None and np.shape(x) != (*lead, N):
            fail(name, f"shape {(*lead, N)} = [B,{t}N] (one per value head)", np.shape(x))
    return lead[0], 1 if step else lead[1], K, N, H, E


def check_state(state, name: str, shape: tuple, layout: str) -> None:
    """Refuses ``state`` unless it is a real floating array of ``shape`` (``layout`` its axes)
    of finite values (where they are known: a NaN or Inf in a row's state reaches every
    output of that row, and under a trace nothing is checked)."""
    if np.shape(state) != tuple(shape):
        fail(name, f"shape {tuple(shape)} = {layout}", f"shape {np.shape(state)}")
    dtype = jnp.result_type(state)
    if not jnp.issubdtype(dtype, jnp.floating):
        fail(name, "a real floating-point state (it is carried in float32)", f"dtype {dtype}")
    why = "finite values (a non-finite state reaches every output of its row)"
    checks.check_values(state, np.isfinite, name, why)


def check_front(
    forms: tuple[str, ...],
    *,
    batch: int,
    length: int,
    head_dim: int,
    form: str = "chunkwise",
    chunk_size: int = CHUNK_SIZE,
    scale: float | None = None,
    initial_state=None,
    return_state: bool = False,
    q_segment_ids=None,
    kv_segment_ids=None,
    default_scale: float | None = None,
    power_of_two: bool = False,
) -> Front:
    """Checks a causal recurrence's front arguments (``RecurrenceArgs``) into a ``Front``.

    The initial state's shape is the family's to check (``check_state``): its
    layout is the family's own. ``default_scale`` replaces ``1/sqrt(H)`` where
    the family's paper does (Mamba-2: 1).
    """
    form = check_form(form, forms)
    chunk_size = check_chunk(chunk_size, power_of_two)
    if scale is None and default_scale is not None:
        scale = default_scale
    root = checks.query_scale(scale, head_dim)
    q_seg, kv_seg = checks.same_token_segment_ids(q_segment_ids, kv_segment_ids, batch, length)
    if initial_state is not None:
        initial_state = jax.tree.map(jnp.asarray, initial_state)
    return Front(form, chunk_size, root, q_seg, kv_seg, initial_state, bool(return_state))


def out_dtype(*arrays):
    """The dtype of a family's output: that of its inputs taken together."""
    return jnp.result_type(*(x.dtype for x in arrays))


def returned(out, state, return_state: bool):
    """``(out, state)`` with ``return_state``, else ``out``: every family's return."""
    return (out, state) if return_state else out
