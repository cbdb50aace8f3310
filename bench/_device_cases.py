"""The numerics phase's cases (``bench/_device_numerics.py``): shapes, inputs, the oracles, and
the fixed-state families' builders (linear attention, the delta rules, Mamba-2's SSD, the DPLR
rule, log-linear attention); softmax's, the sparse methods', decoding's and PaTH's are in
``bench/_device_cases_softmax.py``. A builder returns a ``Case``: the family's inputs, the
library's call and the reference from the equations (``attn.linear.reference``,
``attn.softmax.reference``).
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


def linear_case(dry_run: bool) -> Case:
    import jax.numpy as jnp

    import attn

    z = SIZES[dry_run]
    B, T, N, K, H = z["B"], z["T"], z["N"], z["K"], z["H"]
    rng = rng_for("linear/gated")
    arrays = dict(q=normal(rng, (B, T, N, H)), k=normal(rng, (B, T, K, H)),
                  v=normal(rng, (B, T, K, H)),
                  log_gates=-rng.uniform(0.0, 0.2, (B, T, N)).astype(np.float32))  # fmt: skip

    def run(form, a):
        return attn.linear_attention(a["q"], a["k"], a["v"], form=form, log_gates=a["log_gates"],
                                     chunk_size=z["chunk"], return_state=True)  # fmt: skip

    def oracle(a):
        G = N // K
        qf, kf = (ref_linear().feature_map("elu1", a[x]) for x in ("q", "k"))
        kf, v = (jnp.repeat(x, G, axis=2) for x in (kf, a["v"]))
        out, kv, zs = ref_linear().gated_linear(qf, kf, v, a["log_gates"], normalize=True)
        return out, (kv, zs)

    return Case("linear/gated", arrays, ("q", "k", "v"),
                ("q", "k", "v", "log_gates"), run, oracle)  # fmt: skip


def delta_case(variant: str, dry_run: bool) -> Case:
    import attn

    z = SIZES[dry_run]
    B, T, N, K, H = z["B"], z["T"], z["N"], z["K"], z["H"]
    product = variant == "product"
    n = (z["steps"],) if product else ()
    rng = rng_for(f"delta/{variant}")
    arrays = dict(q=unit(rng, (B, T, K, H)), k=unit(rng, (B, T, *n, K, H)),
                  v=normal(rng, (B, T, *n, N, H)),
                  beta=rng.uniform(0.05, 0.95, (B, T, *n, N)).astype(np.float32))  # fmt: skip
    gates = {"plain": None, "gated": (B, T, N), "kda": (B, T, N, H), "product": (B, T, N)}
    if gates[variant] is not None:
        arrays["log_gates"] = -rng.uniform(0.0, 0.2, gates[variant]).astype(np.float32)
    fn = attn.delta_product if product else attn.delta_rule

    def run(form, a):
        return fn(a["q"], a["k"], a["v"], a["beta"], log_gates=a.get("log_gates"), form=form,
                  chunk_size=z["chunk"], return_state=True)  # fmt: skip

    def oracle(a):
        return ref_linear().delta_rule(a["q"], a["k"], a["v"], a["beta"], a.get("log_gates"))

    diff = ("q", "k", "v", "beta") + (("log_gates",) if "log_gates" in arrays else ())
    name = "product/gated" if product else f"delta/{variant}"
    return Case(name, arrays, ("q", "k", "v"), diff, run, oracle)


def ssd_case(dry_run: bool) -> Case:
    import attn

    z = SIZES[dry_run]
    B, T, N, K, H = z["B"], z["T"], z["N"], z["K"], z["H"]
    rng = rng_for("ssd/mamba2")
    arrays = dict(
        x=normal(rng, (B, T, N, H)),
        dt=rng.uniform(0.01, 0.3, (B, T, N)).astype(np.float32),
        A=-rng.uniform(0.5, 1.5, N).astype(np.float32),
        B=normal(rng, (B, T, K, H)),
        C=normal(rng, (B, T, K, H)),
        D=rng.standard_normal(N).astype(np.float32),
    )

    def run(form, a):
        return attn.ssd(a["x"], a["dt"], a["A"], a["B"], a["C"], D=a["D"], form=form,
                        chunk_size=z["chunk"], return_state=True)  # fmt: skip

    def oracle(a):
        return ref_linear().ssd(a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"])

    return Case("ssd/mamba2", arrays, ("x", "B", "C"),
                ("x", "dt", "A", "B", "C", "D"), run, oracle)  # fmt: skip


def dplr_case(dry_run: bool) -> Case:
    import attn

    z = SIZES[dry_run]
    B, T, N, K, H = z["B"], z["T"], z["N"], z["K"], z["H"]
    rng = rng_for("dplr/rwkv7")
    # RWKV-7: a = -kappa (unit, per q/k head), b = kappa * a_in (per value head), log_w in
    # (-0.6, 0), r unscaled (scale 1).
    kappa = unit(rng, (B, T, K, H))
    a_in = rng.uniform(0.0, 1.0, (B, T, N, H))
    arrays = dict(q=normal(rng, (B, T, K, H)), k=bf16(0.5 * rng.standard_normal((B, T, K, H))),
                  v=normal(rng, (B, T, N, H)), a=-kappa,
                  b=bf16(np.repeat(kappa, N // K, axis=2) * a_in),
                  log_w=-rng.uniform(0.0, 0.6, (B, T, N, H)).astype(np.float32))  # fmt: skip
    scale = H**-0.5

    def run(form, a):
        return attn.dplr_delta_rule(a["q"], a["k"], a["v"], a["a"], a["b"], a["log_w"],
                                    form=form, chunk_size=z["chunk"], scale=scale,
                                    return_state=True)  # fmt: skip

    def oracle(a):
        return ref_linear().dplr_delta_rule(
            a["q"], a["k"], a["v"], a["a"], a["b"], a["log_w"], scale=scale
        )

    return Case("dplr/rwkv7", arrays, ("q", "k", "v", "a", "b"),
                ("q", "k", "v", "a", "b", "log_w"), run, oracle)  # fmt: skip


def log_linear_case(variant: str, dry_run: bool) -> Case:
    import attn

    z = SIZES[dry_run]
    B, T, N, K, H, L = z["B"], z["T"], z["N"], z["K"], z["H"], z["levels"]
    name = f"log-linear/{variant}"
    rng = rng_for(name)
    delta = variant == "gdn"
    arrays = dict(q=(unit if delta else normal)(rng, (B, T, K, H)),
                  k=(unit if delta else normal)(rng, (B, T, K, H)),
                  v=normal(rng, (B, T, N, H)),
                  log_a=-rng.uniform(0.0, 0.2, (B, T, N)).astype(np.float32),
                  lam=rng.uniform(0.1, 1.5, (B, T, N, L)).astype(np.float32))  # fmt: skip
    if delta:
        arrays["beta"] = rng.uniform(0.05, 0.95, (B, T, N)).astype(np.float32)
    scale = H**-0.5

    def run(form, a):
        common = dict(form=form, chunk_size=z["chunk"], scale=scale, return_state=True)
        if delta:
            out, state = attn.log_linear_delta_rule(a["q"], a["k"], a["v"], a["beta"], a["lam"],
                                                    log_gates=a["log_a"], **common)  # fmt: skip
        else:
            out, state = attn.log_linear_attention(a["q"], a["k"], a["v"], a["log_a"], a["lam"],
                                                   **common)  # fmt: skip
        return out, state.levels

    def oracle(a):
        if delta:
            args = (a["q"], a["k"], a["v"], a["beta"], a["lam"], a["log_a"])
            return ref_linear().log_linear_delta_rule(*args, scale=scale)
        return ref_linear().log_linear_attention(
            a["q"], a["k"], a["v"], a["log_a"], a["lam"], scale=scale
        )

    diff = ("q", "k", "v", "log_a", "lam") + (("beta",) if delta else ())
    return Case(name, arrays, ("q", "k", "v"), diff, run, oracle)
