"""The project's input checks: one ``ValueError`` format, and the checks every family shares.

Every public function of ``attn`` (and of ``models`` and ``analysis``, which
use this module too) checks the user's arrays explicitly and raises
``ValueError("<arg>: expected <what>, got <what>")`` through ``fail``. Shapes
are static under ``jit``, so shape checks cost nothing at run time; value
checks (signs, ranges) run where the values are known when tracing
(``concrete``) and are skipped under a trace.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "MAX_ID",
    "MAX_POSITION",
    "Dims",
    "as_arrays",
    "concrete",
    "default_positions",
    "fail",
    "float_array",
    "in_range",
    "positions",
    "positive_float",
    "positive_int",
    "qkv_dims",
    "query_scale",
    "same_token_segment_ids",
    "segment_ids",
    "segment_values",
]


def fail(arg: str, expected: str, got: object) -> None:
    """Raises the project's uniform ``ValueError`` for a bad argument."""
    raise ValueError(f"{arg}: expected {expected}, got {got}")


def positive_int(x, name: str) -> int:
    """``x`` as an int when it is a positive (non-bool) integer; else the uniform ``ValueError``."""
    if isinstance(x, bool) or not isinstance(x, int | np.integer) or x < 1:
        fail(name, "a positive int", repr(x))
    return int(x)


def positive_float(x, name: str, expected: str = "a positive finite number") -> float:
    """``x`` as a float when it is a finite real number > 0 (not a bool); else a ``ValueError``.

    NaN and Inf are refused: a NaN scale gives NaN everywhere, and an infinite
    one gives logits whose value depends on how a backend orders ``inf * 0``.
    """
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x) or x <= 0:
        fail(name, expected, repr(x))
    return float(x)


def concrete(x) -> np.ndarray | None:
    """The NumPy value of ``x``, or None under a trace (where value checks are skipped)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def real_values(x, ids=None) -> np.ndarray | None:
    """The NumPy values of ``x [B,T,...]`` at real tokens (``ids [B,T]`` != 0; every token
    without ids), or None under a trace. Padding holds anything: value checks skip it."""
    value = concrete(x)
    if value is None or ids is None:
        return value
    ids = concrete(ids)
    return None if ids is None else value[np.asarray(ids) != 0]


def check_values(x, ok, name: str, expected: str, ids=None) -> None:
    """A ``ValueError`` naming ``name`` where ``x``'s values at real tokens are known and
    ``ok(values)`` is not all true (``expected`` says what they should be); nothing is
    checked under a trace. The message gives the range, or the first non-finite value."""
    value = real_values(x, ids)
    if value is None or not value.size or np.all(ok(value)):
        return
    bad = value[~np.isfinite(value)]
    got = f"{bad.size} non-finite values (first {bad.flat[0]})" if bad.size else (
        f"min {value.min()}, max {value.max()}")  # fmt: skip
    fail(name, expected, got)


class Dims(NamedTuple):
    """Sizes of one attention call in the axis vocabulary."""

    B: int
    T: int
    S: int
    N: int
    K: int
    G: int
    H: int
    E: int


def as_arrays(*xs):
    """Each of ``xs`` as a JAX array where it is a NumPy array (or a list); others as they are.

    Public functions call this first, so a NumPy input takes the same path as a
    ``jnp`` one (a NumPy array indexed by a traced integer inside a kernel fails).
    """
    return tuple(jnp.asarray(x) if isinstance(x, np.ndarray | list) else x for x in xs)


def qkv_dims(q, k, v) -> Dims:
    """Checks q ``[B,T,N,H]``, k ``[B,S,K,H]``, v ``[B,S,K,E]`` and returns their sizes.

    Raises:
      ValueError: a rank other than 4; a dtype that is not floating (integer and
        bool inputs would be truncated, complex ones lose their imaginary part);
        an empty axis (B, T, S, N, H or E of 0, which no implementation defines);
        or sizes that do not fit together.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            fail(name, "a rank-4 array", f"shape {getattr(x, 'shape', type(x).__name__)}")
        dtype = jnp.dtype(x.dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            fail(name, "a real floating-point array (float32, bfloat16, float16, ...)", dtype)
        if 0 in x.shape:
            fail(name, "non-empty axes (no size 0)", f"shape {tuple(x.shape)}")
    B, T, N, H = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        fail("k/v", f"batch {B} like q", f"k {k.shape}, v {v.shape}")
    if k.shape[3] != H:
        fail("k", f"head dim {H} like q {q.shape}", f"shape {k.shape}")
    S, K = k.shape[1], k.shape[2]
    if v.shape[1] != S or v.shape[2] != K:
        fail("v", f"length {S} and {K} kv heads like k {k.shape}", f"shape {v.shape}")
    if K == 0 or N % K:
        fail("k", f"a number of kv heads dividing the {N} query heads", f"{K} kv heads")
    return Dims(B, T, S, N, K, N // K, H, v.shape[3])


def default_positions(length: int, offset: int = 0) -> np.ndarray:
    """``arange(length) + offset``: the positions an implementation assumes when none are given.

    Keys default to ``arange(S)`` and queries to the last T of them,
    ``arange(T) + S - T`` (bottom-right alignment), so a decode step or a
    prefill chunk attends like the last rows of the full pass.
    """
    return np.arange(length, dtype=np.int64) + offset


# Positions are int32, and so are the differences the masks and score
# modifiers take of them (windows, relative buckets, ALiBi distances): within
# +-2**30 no difference overflows. Token ids and segment ids: int32.
MAX_POSITION = 2**30
MAX_ID = 2**31


def in_range(x, name: str, low: int, high: int, what: str) -> None:
    """Refuses values of ``x`` outside ``[low, high)`` where they are known (not traced).

    Called on the array as given, before it becomes int32: an int64 value
    beyond int32 would otherwise wrap (ids of ``2**40`` becoming 0, padding).
    Under a trace nothing is checked (the docstrings state the range).
    """
    value = None if x is None else concrete(x)
    if value is None or value.size == 0 or not np.issubdtype(value.dtype, np.integer):
        return
    lo, hi = int(value.min()), int(value.max())
    if lo < low or hi >= high:
        fail(name, f"{what} in [{low}, {high})", f"values {lo}..{hi}")


def positions(x, name: str, batch: int, length: int, offset: int = 0):
    """Integer positions ``[B,L]`` from ``[L]``, ``[B,L]`` or ``None`` (``arange(L) + offset``),
    as int32; values in ``[-MAX_POSITION, MAX_POSITION)`` (checked where concrete)."""
    if x is None:
        x = default_positions(length, offset).astype(np.int32)
        return jnp.broadcast_to(jnp.asarray(x), (batch, length))
    in_range(x, name, -MAX_POSITION, MAX_POSITION, "positions")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        fail(name, "integer positions", f"dtype {x.dtype}")
    if x.shape == (length,):
        x = jnp.broadcast_to(x, (batch, length))
    if x.shape != (batch, length):
        fail(name, f"shape ({length},) or ({batch}, {length})", f"shape {x.shape}")
    return x.astype(jnp.int32)


def segment_ids(x, name: str, batch: int, length: int | None = None):
    """Integer segment ids ``[B,L]`` (or ``[B]`` for one token, ``length=None``) as int32.

    The convention of every implementation (``attn.masks.same_segment``): id 0
    is padding, ids >= 1 are segments. Negative ids are refused where the
    values are known (not under a trace). None passes through.
    """
    if x is None:
        return None
    segment_values(x, name)  # as given: int64 ids must not wrap first
    x = jnp.asarray(x)
    shape = (batch,) if length is None else (batch, length)
    if x.shape != shape or not jnp.issubdtype(x.dtype, jnp.integer):
        fail(name, f"integer ids of shape {shape}", f"{x.dtype} {x.shape}")
    return x.astype(jnp.int32)


def segment_values(x, name: str) -> None:
    """Refuses negative segment ids, and ids beyond int32, where their values are known
    (None passes)."""
    value = None if x is None else concrete(x)
    if value is not None and value.size and value.min() < 0:
        fail(name, "ids >= 0 (0 is padding, >= 1 a segment)", f"min {value.min()}")
    in_range(x, name, 0, MAX_ID, "ids (int32)")


def float_array(x, name: str, rank: int, layout: str) -> None:
    """Refuses ``x`` unless it is a rank-``rank`` real floating-point array with no empty
    axis (``layout`` names its axes, e.g. ``"[B,T,K,H]"``)."""
    if getattr(x, "ndim", None) != rank:
        fail(name, f"a rank-{rank} array {layout}", f"shape {getattr(x, 'shape', type(x))}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        fail(name, "a real floating-point array", f"dtype {x.dtype}")
    if 0 in x.shape:
        fail(name, "non-empty axes (no size 0)", f"shape {tuple(x.shape)}")


def query_scale(scale, H: int) -> float:
    """The fixed-state families' ``scale`` argument: None is ``1/sqrt(H)``."""
    if scale is None:
        return H**-0.5
    return positive_float(scale, "scale", "a positive finite number or None (1/sqrt(H))")


def same_token_segment_ids(q_segment_ids, kv_segment_ids, batch: int, length: int):
    """The ids ``([B,T], [B,T])`` int32 of a causal recurrence, whose queries and keys are the
    same tokens, or ``(None, None)``: both or neither, and on each token the same id unless the
    query's is padding (0: it reads nothing while its token still writes). Two different real
    ids on one token are refused where both are concrete (under a trace nothing is seen)."""
    q_seg = segment_ids(q_segment_ids, "q_segment_ids", batch, length)
    kv_seg = segment_ids(kv_segment_ids, "kv_segment_ids", batch, length)
    if (q_seg is None) != (kv_seg is None):
        fail("q_segment_ids/kv_segment_ids", "both or neither", "only one of them")
    q_ids, kv_ids = (None, None) if q_seg is None else (concrete(q_seg), concrete(kv_seg))
    if q_ids is not None and kv_ids is not None:
        differ = (q_ids != 0) & (kv_ids != 0) & (q_ids != kv_ids)
        if differ.any():
            b, t = np.argwhere(differ)[0]
            want = "the id of kv_segment_ids on each token (q and k are the same tokens), or 0"
            got = f"{int(q_ids[b, t])} against {int(kv_ids[b, t])} at [{b}, {t}]"
            fail("q_segment_ids", want, f"{int(differ.sum())} tokens differing, first {got}")
    return q_seg, kv_seg
