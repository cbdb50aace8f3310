"""The numerics phase's cases (``bench/_device_numerics.py``): shapes, inputs, the oracles, and
the fixed-state families' cases, built from their records (``attn.linear.FAMILIES``: each
family's example inputs, its run and its float64 reference), none spelled here; softmax's, the
sparse methods', decoding's and PaTH's are in ``bench/_device_cases_softmax.py``. A case is a
``Case``: the inputs, the library's call and the reference from the equations
(``attn.linear.reference``, ``attn.softmax.reference``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

# Shapes: on the device T is not a multiple of any chunk or block; a dry run is tiny.
SIZES = {
    False: dict(
        B=2, T=1000, N=4, K=2, H=64, chunk=64, window=128, sinks=4, softcap=2.0,
        blockwise_block=256, pallas_block=None, moba_block=64, moba_top_k=4,
        nsa=dict(compress_block=32, compress_stride=16, select_block=64, num_selected=6,
                 window=128, initial_blocks=1, local_blocks=2),
        dsa_top_k=128, index_heads=2, index_dim=32, decode_T=2, lengths=(1000, 613),
        splits=4, page=8, steps=2, levels=8,
    ),
    True: dict(
        B=2, T=40, N=4, K=2, H=8, chunk=16, window=12, sinks=4, softcap=2.0,
        blockwise_block=16, pallas_block=16, moba_block=8, moba_top_k=2,
        nsa=dict(compress_block=8, compress_stride=4, select_block=8, num_selected=3,
                 window=12, initial_blocks=1, local_blocks=1),
        dsa_top_k=12, index_heads=2, index_dim=8, decode_T=2, lengths=(40, 23),
        splits=3, page=4, steps=2, levels=5,
    ),
}  # fmt: skip


@dataclass
class Case:
    """One family's inputs and functions, shared by the items of its forms and dtypes.

    ``arrays``: NumPy float32 (bfloat16 numbers), int and bool arrays; ``data``: the names a
    form gets in the item's dtype (the rest stay float32, as a model keeps its gates);
    ``diff``: the names differentiated (none: forward only); ``run(form, arrays)``: the
    library; ``oracle(arrays)``: the same outputs from the equations, in the arrays' dtype;
    ``reference_only``: arrays only the oracle reads; ``select(form, arrays)``: extra oracle
    arrays from the library's selection on the item's own inputs (sparse methods).
    """

    name: str
    arrays: dict
    data: tuple
    diff: tuple
    run: Callable
    oracle: Callable
    reference_only: tuple = ()
    select: Callable | None = field(default=None)


def rng_for(name: str):
    return np.random.default_rng(
        int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    )


def bf16(x):
    """``x`` rounded to bfloat16 numbers, held in float32."""
    import jax.numpy as jnp

    return np.asarray(x, np.float32).astype(jnp.bfloat16).astype(np.float32)


def normal(rng, shape):
    return bf16(rng.standard_normal(shape))


def unit(rng, shape):
    x = rng.standard_normal(shape)
    return bf16(x / np.linalg.norm(x, axis=-1, keepdims=True))


def packed_ids(B: int, T: int):
    """Segment ids ``[B,T]``: row 0 packs three sequences and ends in padding (id 0), row 1
    is one sequence and padding."""
    ids = np.zeros((B, T), np.int32)
    cuts = np.round(np.array([0, 0.3, 0.75, 0.95]) * T).astype(int)
    for i in range(3):
        ids[0, cuts[i] : cuts[i + 1]] = i + 1
    ids[1:, : int(0.9 * T)] = 1
    return ids


def visible(mask, q_pos, kv_pos, q_seg=None, kv_seg=None):
    """``[B,1,T,S]`` bool: the mask on positions (``Mask.allowed``), within segments, padding
    keys and queries seeing nothing."""
    ok = np.asarray(mask.allowed(np.asarray(q_pos), np.asarray(kv_pos)), bool)
    if q_seg is not None:
        ok = ok & (q_seg[:, :, None] == kv_seg[:, None, :]) & (kv_seg[:, None, :] != 0)
    return ok[:, None]


def reads(start, stop, S: int):
    """Key ranges ``[start, stop)`` ``[B,T,X,n]`` as a boolean ``[B,X,T,S]`` (ranges of one
    selection are disjoint)."""
    start, stop = np.asarray(start), np.asarray(stop)
    B, T, X, _ = start.shape
    count = np.zeros((B, T, X, S + 1), np.int32)
    used = stop > start
    where = np.nonzero(used)[:3]
    np.add.at(count, (*where, start[used]), 1)
    np.add.at(count, (*where, stop[used]), -1)
    return (np.cumsum(count, axis=-1)[..., :S] > 0).transpose(0, 2, 1, 3)


# The oracles (jnp, in the arrays' dtype: float64 under _x64)


def ref_linear():
    """``attn.linear.reference`` (imported when a reference runs: JAX starts late here)."""
    from attn.linear import reference

    return reference


def ref_softmax():
    """``attn.softmax.reference``, likewise."""
    from attn.softmax import reference

    return reference


# The builders: one per family, its cases by name in CASES


def fixed_state_cases() -> list[tuple[str, str]]:
    """``(family, variant)`` of every fixed-state family record (``attn.linear.FAMILIES``) with
    a reference, in the registry's order: what the numerics run of them, nothing spelled here."""
    from attn.linear import FAMILIES

    sizes = SIZES[True]
    return [(name, variant) for name, family in FAMILIES.items() if family.reference is not None
            for variant in family.examples(rng_for(name), sizes)]  # fmt: skip


def family_case(name: str, variant: str, dry_run: bool) -> Case:
    """A fixed-state family's case from its record: its ``examples`` (the data fields rounded
    to bfloat16 numbers), its ``run`` from a zero state and its ``reference``; the final
    state's floating leaves are compared, every floating input differentiated."""
    import jax
    import jax.numpy as jnp

    from attn.linear import FAMILIES
    from attn.linear.family import Ids

    family, z = FAMILIES[name], SIZES[dry_run]
    tokens, params, options = family.examples(rng_for(name), z)[variant]
    given = {**tokens._asdict(), **params._asdict()}
    arrays = {n: bf16(x) if n in family.data else x for n, x in given.items() if x is not None}

    def rebuild(a):
        return (type(tokens)(*(a.get(n) for n in tokens._fields)),
                type(params)(*(a.get(n) for n in params._fields)))  # fmt: skip

    def floats(final):
        return [x for x in jax.tree.leaves(final) if jnp.issubdtype(x.dtype, jnp.floating)]

    def run(form, a):
        kw = {**options, "form": form, "chunk_size": z["chunk"]}
        out, final = family.run(family.fn, *rebuild(a), Ids(), None, kw)
        return out, floats(final)

    def oracle(a):
        out, final = family.reference(*rebuild(a), options)
        return out, floats(final)

    data = tuple(n for n in family.data if n in arrays)
    return Case(f"{name}/{variant}", arrays, data, tuple(arrays), run, oracle)
