"""Score modifiers: how much a query attends to a key, beside masks (which keys it may see).

A modifier maps the scaled logits of a tile to new logits, before the mask and the softmax,
from the tile's absolute query and key positions (the ones masks see, so prefill, decode, ring
shards and ring-buffer caches need nothing extra), the query head, and for data-dependent
modifiers the tile's slice of their per-token data::

    alibi(alibi_slopes(N))                     # ALiBi (Press et al. 2022): -m_n |i - j|
    relative_bias(table, num_buckets=32,       # T5 (Raffel et al. 2020): a learned bias per
                  max_distance=128)            #   head and log-spaced distance bucket
    forgetting(log_forget)                     # FoX (Lin et al. 2025): sum_{l=j+1..i} log f_l
    softcap(30.0)                              # Gemma 2: 30 tanh(s / 30)
    softcap(30.0) + alibi(slopes)              # applied left to right

Every softmax implementation takes one as ``score_mod=``; dense attention
materializes it, the tiled ones evaluate it on each tile.

A modifier is a pytree. Its structure (the kind, the static settings) is
hashable aux data, so ``jit`` traces once per kind; its arrays are leaves, so
``jax.grad`` reaches slopes, tables and gates. Each leaf has a role that tells
an implementation how to lay it out for a tile:

* ``"head"``: ``[N, ...]``, one entry per query head (slopes, a bias table);
* ``"q"``: ``[B,T,N]``, one value per query token and head;
* ``"k"``: ``[B,S,N]``, one value per key token and query head.

``apply(s, q_pos, k_pos)`` is then elementwise: the implementation rebuilds the modifier with
each leaf as a view that broadcasts against its logits (a head leaf keeps its trailing axes
after the broadcast ones), so the same code runs on dense ``[B,K,G,T,S]`` logits, on blockwise
tiles in either orientation and inside a Pallas kernel.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attn.checks import Dims, fail, positive_float, positive_int

__all__ = [
    "ROLES",
    "Alibi",
    "Compose",
    "Entries",
    "Forgetting",
    "GateSums",
    "RelativeBias",
    "ScoreMod",
    "Softcap",
    "Structure",
    "additive",
    "alibi",
    "alibi_slopes",
    "check_score_mod",
    "check_type",
    "compose",
    "forgetting",
    "gate_sums",
    "relative_bias",
    "relative_buckets",
    "softcap",
    "split",
]

ROLES = ("head", "q", "k")


@jax.tree_util.register_pytree_node_class
class Entries:
    """A head leaf's trailing axis as separate arrays, for kernels that cannot slice values.

    Triton lowers no slice of a loaded value, so the Pallas kernels load a
    table's entries one by one from memory; ``x[..., b]`` reads entry b as it
    would of an array. A pytree, so ``jax.vjp`` differentiates through it.
    """

    def __init__(self, items):
        self.items = tuple(items)

    def __getitem__(self, index):
        if not (isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis):
            raise TypeError(f"Entries supports x[..., b] only, got {index!r}")
        return self.items[index[1]]

    def tree_flatten(self):
        return self.items, None

    @classmethod
    def tree_unflatten(cls, _, items):
        return cls(items)


class ScoreMod:
    """Base class of the modifiers; subclasses are frozen dataclasses.

    ``leaves`` names the array fields and their roles (see the module
    docstring); every other field is static. Subclasses define ``apply``.
    """

    leaves: ClassVar[dict[str, str]] = {}
    additive: ClassVar[bool] = False  # apply(s) is s plus a bias: it can be materialized

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        dataclasses.dataclass(frozen=True)(cls)
        fields = [f.name for f in dataclasses.fields(cls)]
        data = [f for f in fields if f in cls.leaves]
        meta = [f for f in fields if f not in cls.leaves]
        jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)

    def apply(self, s, q_pos, k_pos):
        """New float32 logits from ``s`` and int32 positions broadcastable to it."""
        raise NotImplementedError  # abstract: every modifier defines it

    def roles(self) -> tuple[str, ...]:
        """The role of each leaf, in ``jax.tree.leaves`` order (a None field has no leaf)."""
        return tuple(self.leaves[name] for name in self._arrays())

    def _arrays(self) -> list[str]:
        """The names of the array fields that hold an array, in field order."""
        names = [f.name for f in dataclasses.fields(self) if f.name in self.leaves]
        return [name for name in names if getattr(self, name) is not None]

    def check(self, dims: Dims) -> None:
        """Raises a ``ValueError`` naming the leaf whose shape does not fit the call."""
        want = {"q": (dims.B, dims.T, dims.N), "k": (dims.B, dims.S, dims.N)}
        for name in self._arrays():
            role, x = self.leaves[name], getattr(self, name)
            shape = tuple(jnp.shape(x))
            where = f"{type(self).__name__}.{name}"
            if role == "head" and shape[:1] != (dims.N,):
                fail(where, f"a leading axis of {dims.N} query heads", f"shape {shape}")
            if role in want and shape != want[role]:
                fail(where, f"shape {want[role]} ([B,{'T' if role == 'q' else 'S'},N])", shape)

    def __add__(self, other: ScoreMod) -> ScoreMod:
        return compose(self, other)


class Alibi(ScoreMod):
    """ALiBi: ``s - slopes[n] * |q_pos - k_pos|`` (causal: the paper's ``-m (i - j)``)."""

    slopes: jax.Array  # [N]
    leaves: ClassVar[dict[str, str]] = {"slopes": "head"}
    additive: ClassVar[bool] = True

    def apply(self, s, q_pos, k_pos):
        return s - self.slopes * jnp.abs(q_pos - k_pos).astype(jnp.float32)


class RelativeBias(ScoreMod):
    """T5's relative position bias: ``s + table[n, bucket(q_pos - k_pos)]``.

    The bucket rule is ``relative_buckets``'; the table is evaluated as one
    compare-and-select per bucket, which every backend lowers (no gather).
    """

    table: jax.Array  # [N, num_buckets]
    num_buckets: int
    max_distance: int
    bidirectional: bool
    leaves: ClassVar[dict[str, str]] = {"table": "head"}
    additive: ClassVar[bool] = True

    def apply(self, s, q_pos, k_pos):
        bucket = relative_buckets(q_pos - k_pos, self.num_buckets, self.max_distance,
                                  self.bidirectional)  # fmt: skip
        if isinstance(self.table, Entries):  # in a Pallas kernel: no custom_vjp there
            return s + _select(self.table, bucket)
        return s + _lookup(self.table, bucket)

    def check(self, dims: Dims) -> None:
        super().check(dims)
        shape = tuple(jnp.shape(self.table))
        if shape != (dims.N, self.num_buckets):
            want = f"shape ({dims.N}, {self.num_buckets}): one bias per head and bucket"
            fail("RelativeBias.table", want, shape)


def _select(table, bucket):
    """``table[..., bucket]`` as one select per entry (no gather: every backend lowers it).

    ``table`` is ``[..., nb]`` (or ``Entries``) broadcasting against ``bucket``.
    """
    out = jnp.zeros((), jnp.float32)
    for b in range(_entries(table)):
        out = jnp.where(bucket == b, table[..., b], out)
    return out


@jax.custom_vjp
def _lookup(table, bucket):
    """``_select`` whose VJP keeps only ``bucket``: autodiff of the select chain would
    keep one intermediate per entry, each the size of the logits (Triton lowers no
    custom VJP, so the Pallas kernels use ``_select``, in registers)."""
    return _select(table, bucket)


def _entries(table) -> int:
    return len(table.items) if isinstance(table, Entries) else table.shape[-1]


def _lookup_fwd(table, bucket):
    return _lookup(table, bucket), (table, bucket)


def _lookup_bwd(residuals, g):
    table, bucket = residuals
    d = [_unbroadcast(jnp.where(bucket == b, g, 0.0), jnp.shape(table[..., b]))
         for b in range(_entries(table))]  # fmt: skip
    return jnp.stack(d, axis=-1), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def _unbroadcast(x, shape):
    """Sums ``x`` down to ``shape`` (the transpose of broadcasting ``shape`` to ``x.shape``)."""
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and x.shape[lead + i] != 1
    )
    return x.sum(axes).reshape(shape) if axes else x.reshape(shape)


class Forgetting(ScoreMod):
    """The Forgetting Transformer's decay: ``s + q_cumulative[i, n] - kv_cumulative[j, n]``.

    With ``c`` the running sum of per-token log forget gates, ``c_i - c_j`` is
    ``sum_{l=j+1..i} log f_l``; both sides are given, since a decode step's
    queries and its cached keys come from different places. A gate of 0 (log
    gate ``-inf``) forgets everything before it: ``gate_sums`` keeps the finite
    logs' sum apart from the count of zero gates (``q_zeros``, ``kv_zeros``; None
    where no gate is 0), and a key with fewer zero gates than its query is
    weighted 0 (logit ``-inf``) instead of ``-inf - (-inf)``, a NaN.
    """

    q_cumulative: jax.Array  # [B,T,N] float32
    kv_cumulative: jax.Array  # [B,S,N] float32
    q_zeros: jax.Array | None = None  # [B,T,N] float32 counts
    kv_zeros: jax.Array | None = None  # [B,S,N] float32 counts
    leaves: ClassVar[dict[str, str]] = {
        "q_cumulative": "q", "kv_cumulative": "k", "q_zeros": "q", "kv_zeros": "k",
    }  # fmt: skip
    additive: ClassVar[bool] = True

    def apply(self, s, q_pos, k_pos):
        decay = self.q_cumulative - self.kv_cumulative
        if self.q_zeros is not None:  # counts: no gradient
            crossed = jax.lax.stop_gradient(self.q_zeros > self.kv_zeros)
            decay = jnp.where(crossed, -jnp.inf, decay)
        return s + decay

    @classmethod
    def between(cls, q: GateSums, kv: GateSums) -> Forgetting:
        """The decay from the queries' running sums to the keys'."""
        return cls(q.finite, kv.finite, q.zeros, kv.zeros)


class GateSums(NamedTuple):
    """Running sums of log forget gates along the sequence, a gate of 0 counted apart.

    Attributes:
      finite: float32, the sum of the finite log gates up to and including each token.
      zeros: float32, how many gates up to and including each token are 0 (log ``-inf``).
    """

    finite: jax.Array
    zeros: jax.Array


def gate_sums(log_forget, start: GateSums | None = None, axis: int = 1) -> GateSums:
    """``GateSums`` of log gates (each <= 0) along ``axis``, continuing ``start``'s totals
    (their shape without ``axis``) when given."""
    g = jnp.asarray(log_forget).astype(jnp.float32)
    zero = jnp.isneginf(g)
    sums = GateSums(jnp.cumsum(jnp.where(zero, 0.0, g), axis), jnp.cumsum(zero, axis, jnp.float32))
    if start is None:
        return sums
    return GateSums(*(x + jnp.expand_dims(s, axis) for x, s in zip(sums, start, strict=True)))


class Softcap(ScoreMod):
    """Gemma 2's soft-cap: ``cap * tanh(s / cap)``."""

    cap: float

    def apply(self, s, q_pos, k_pos):
        return self.cap * jnp.tanh(s / self.cap)


class Compose(ScoreMod):
    """Modifiers applied left to right (the sum of their biases, for additive ones)."""

    terms: tuple
    leaves: ClassVar[dict[str, str]] = {"terms": "terms"}

    def apply(self, s, q_pos, k_pos):
        for term in self.terms:
            s = term.apply(s, q_pos, k_pos)
        return s

    def roles(self) -> tuple[str, ...]:
        return tuple(role for term in self.terms for role in term.roles())

    def check(self, dims: Dims) -> None:
        for term in self.terms:
            term.check(dims)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi's fixed slopes for N heads (Press et al. 2022), float32 ``[N]``.

    For N a power of two, the geometric sequence ``2^(-8 i / N)``, i = 1..N.
    Otherwise the paper's rule: the slopes of the largest power of two n < N,
    then every other slope of 2n's sequence for the N - n heads left.
    """
    num_heads = positive_int(num_heads, "num_heads")

    def geometric(n):
        return [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]

    n = 2 ** math.floor(math.log2(num_heads))
    slopes = geometric(n) + geometric(2 * n)[0::2][: num_heads - n]
    return np.asarray(slopes, np.float32)


def alibi(slopes) -> Alibi:
    """ALiBi with per-head ``slopes [N]`` (``alibi_slopes(N)`` for the paper's; learnable)."""
    slopes = jnp.asarray(slopes, jnp.float32)
    if slopes.ndim != 1:
        fail("slopes", "a rank-1 array [N], one slope per query head", f"shape {slopes.shape}")
    return Alibi(slopes)


def relative_buckets(distance, num_buckets: int, max_distance: int, bidirectional: bool):
    """T5's bucket of each query-minus-key distance, int32 (Raffel et al. 2020).

    Without ``bidirectional`` keys after the query share bucket 0 with
    distance 0, and all ``num_buckets`` go to keys at or before it; with it,
    half the buckets go to each side. Within a side, the first half of the
    buckets are exact distances, the rest log-spaced up to ``max_distance``
    (and farther shares the last). The log-spaced boundaries are found once,
    in float64 NumPy, as integer thresholds, so every backend (and the
    reference) puts every distance in the same bucket.
    """
    half = num_buckets // 2 if bidirectional else num_buckets
    exact = half // 2
    d = jnp.asarray(distance)
    if bidirectional:
        offset = jnp.where(d < 0, half, 0)
        d = jnp.abs(d)
    else:
        offset = 0
        d = jnp.maximum(d, 0)
    bucket = jnp.minimum(d, exact)
    for threshold in _log_thresholds(half, exact, max_distance):
        bucket = bucket + (d >= threshold)
    return (offset + bucket).astype(jnp.int32)


def _log_thresholds(half: int, exact: int, max_distance: int) -> tuple[int, ...]:
    """The distances where the log-spaced buckets ``exact + 1 .. half - 1`` start."""
    if exact == 0:
        return ()
    n = np.arange(exact, max(max_distance, exact + 1) + 1, dtype=np.float64)
    large = exact + np.floor(np.log(n / exact) / np.log(max_distance / exact) * (half - exact))
    large = np.minimum(large, half - 1).astype(np.int64)
    starts = [b for b in range(exact + 1, half) if (large >= b).any()]
    return tuple(int(n[np.argmax(large >= b)]) for b in starts)


def relative_bias(table, *, num_buckets: int = 32, max_distance: int = 128,
                  bidirectional: bool = False) -> RelativeBias:  # fmt: skip
    """T5's learned relative position bias from ``table [N, num_buckets]``."""
    num_buckets = positive_int(num_buckets, "num_buckets")
    max_distance = positive_int(max_distance, "max_distance")
    exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    if exact < 1:
        least = 4 if bidirectional else 2
        fail("num_buckets", f"at least {least} (exact and log-spaced ones)", num_buckets)
    if max_distance <= exact:
        fail("max_distance", f"more than the {exact} exactly-bucketed distances", max_distance)
    table = jnp.asarray(table)
    if table.ndim != 2 or table.shape[1] != num_buckets:
        fail("table", f"shape [N, {num_buckets}] (num_buckets={num_buckets})", table.shape)
    return RelativeBias(table.astype(jnp.float32), num_buckets, max_distance, bool(bidirectional))


def forgetting(log_forget) -> Forgetting:
    """FoX's decay from per-token log forget gates ``[B,T,N]`` (each <= 0), for T == S.

    The running sums over the sequence (``gate_sums``) are both sides' data; a
    gate of 0 (log ``-inf``) hides every key before it (its zero counts are
    leaves of the modifier unless the gates are concrete and none is 0). For a decode step or a
    prefill chunk over a cache, build ``Forgetting.between(q_sums, kv_sums)``
    from the sums the cache keeps (or ``Forgetting(q_cumulative, kv_cumulative)``
    where no gate can be 0).
    """
    if log_forget is None:
        fail("log_forget", "per-token log forget gates [B,T,N] (FoX needs its data)", None)
    log_forget = jnp.asarray(log_forget)
    if log_forget.ndim != 3:
        fail("log_forget", "a rank-3 array [B,T,N]", f"shape {log_forget.shape}")
    sums = gate_sums(log_forget)
    if not isinstance(log_forget, jax.core.Tracer) and not np.isneginf(log_forget).any():
        # Concrete gates with no 0: no zero counts (the modifier's kernels are as before).
        return Forgetting(sums.finite, sums.finite)
    return Forgetting.between(sums, sums)


def softcap(cap: float) -> Softcap:
    """The tanh soft-cap at ``cap`` > 0."""
    return Softcap(positive_float(cap, "cap", "a positive finite float"))


def compose(*mods) -> ScoreMod | None:
    """The modifiers (None skipped) applied left to right; None if there are none."""
    terms = []
    for m in mods:
        if m is None:
            continue
        check_type(m)
        terms += m.terms if isinstance(m, Compose) else [m]
    if not terms:
        return None
    return terms[0] if len(terms) == 1 else Compose(tuple(terms))


class Structure(NamedTuple):
    """The static (hashable) part of a modifier: what a kernel is traced with."""

    treedef: jax.tree_util.PyTreeDef
    roles: tuple[str, ...]

    def rebuild(self, leaves) -> ScoreMod:
        """The modifier with ``leaves`` (in ``roles`` order) as its arrays."""
        return jax.tree.unflatten(self.treedef, list(leaves))

    def by_role(self, leaves) -> dict[str, list]:
        """``leaves`` grouped by role, each group in leaf order."""
        groups = {role: [] for role in ROLES}
        for x, role in zip(leaves, self.roles, strict=True):
            groups[role].append(x)
        return groups

    def merge(self, groups: dict[str, list]) -> list:
        """Inverse of ``by_role``: the leaves in leaf order."""
        its = {role: iter(groups[role]) for role in ROLES}
        return [next(its[role]) for role in self.roles]

    def apply(self, s, q_pos, k_pos, views: dict[str, list]):
        """The modifier on float32 logits ``s``, with ``views`` as its leaves.

        How every implementation evaluates a modifier: it lays each leaf out
        (by role, ``by_role``) as a view that broadcasts against its logits, a
        head leaf keeping its trailing axes after the broadcast ones.

        Args:
          s: float32 scaled logits, any layout.
          q_pos, k_pos: int32 positions broadcastable to ``s``.
          views: role -> that role's leaves as views, in leaf order.
        """
        return self.rebuild(self.merge(views)).apply(s, q_pos, k_pos)


def split(mod: ScoreMod | None) -> tuple[Structure | None, list]:
    """``(structure, leaves)`` of a modifier; ``(None, [])`` for None."""
    if mod is None:
        return None, []
    leaves, treedef = jax.tree.flatten(mod)
    return Structure(treedef, mod.roles()), leaves


def additive(mod: ScoreMod | None) -> bool:
    """Whether every term declares it only adds a bias (``ScoreMod.additive``): then the
    modifier can be materialized (not a soft-cap, nor a modifier that does not declare it)."""
    terms = mod.terms if isinstance(mod, Compose) else () if mod is None else (mod,)
    return all(t.additive for t in terms)


def check_type(score_mod) -> None:
    """Refuses anything but a ``ScoreMod`` or None, naming ``score_mod``."""
    if score_mod is not None and not isinstance(score_mod, ScoreMod):
        fail("score_mod", "an attn.scores.ScoreMod (e.g. scores.alibi(...)) or None",
             type(score_mod).__name__)  # fmt: skip


def check_score_mod(score_mod, dims: Dims) -> ScoreMod | None:
    """Checks a call's modifier against its sizes (None passes)."""
    check_type(score_mod)
    if score_mod is not None:
        score_mod.check(dims)
    return score_mod
