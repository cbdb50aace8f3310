"""The fixed-state families sharded over one mesh axis: bytes each exchange moves.

For ``bench/parallel.py``: one forward and backward pass of each family's
``attn.linear.sharded`` form over 8 devices, with each exchange
(``attn.linear.chain.EXCHANGES``), compiled; the collectives read from the
HLO (``collective_bytes``) and converted to bytes each device receives:
an all-gather of a p-byte operand delivers ``(P - 1) p``, a ring all-reduce
``2 (P - 1) / P p``, a reduce-scatter ``(P - 1) / P p``, a collective-permute
its operand. The state's bytes per row set the unit: the families differ in
what a transition costs (a scalar per head, a ``H x H`` matrix, window slots).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import attn
from attn.linear.chain import EXCHANGES

AXIS = "seq"
FAMILIES = ("linear_gated", "gated_deltanet", "kda", "gated_deltaproduct", "mamba2", "short_conv")


def _arrays(family: str, B: int, T: int, N: int, H: int):
    """``(float arrays to differentiate, call(arrays, fn, **kw) -> out, fns, state bytes)``."""
    rng = np.random.default_rng(0)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32))

    def unit(x):
        return x / jnp.linalg.norm(x, axis=-1, keepdims=True)

    if family == "linear_gated":
        arrays = dict(q=normal(B, T, N, H), k=normal(B, T, N, H), v=normal(B, T, N, H))
        arrays["log_gates"] = -jax.nn.softplus(normal(B, T, N))

        def call(a, fn, **kw):
            return fn(a["q"], a["k"], a["v"], log_gates=a["log_gates"], **kw)

        fns = (attn.linear_attention, attn.sharded_linear_attention)
        return arrays, call, fns, 4 * N * (H * H + H)
    if family in ("gated_deltanet", "kda", "gated_deltaproduct"):
        lead = (B, T, 2) if family == "gated_deltaproduct" else (B, T)
        arrays = dict(q=unit(normal(B, T, N, H)), k=unit(normal(*lead, N, H)))
        arrays.update(v=normal(*lead, N, H), beta=jax.nn.sigmoid(normal(*lead, N)))
        gates = (B, T, N, H) if family == "kda" else (B, T, N)
        arrays["log_gates"] = -jax.nn.softplus(normal(*gates))

        def call(a, fn, **kw):
            return fn(a["q"], a["k"], a["v"], a["beta"], log_gates=a["log_gates"], **kw)

        fns = (attn.delta_product, attn.sharded_delta_product)
        if family != "gated_deltaproduct":
            fns = (attn.delta_rule, attn.sharded_delta_rule)
        return arrays, call, fns, 4 * N * H * H
    if family == "mamba2":
        arrays = dict(x=normal(B, T, N, H), dt=jax.nn.softplus(normal(B, T, N)))
        arrays.update(A=-jnp.exp(normal(N)), Bm=normal(B, T, 1, H), C=normal(B, T, 1, H))

        def call(a, fn, **kw):
            return fn(a["x"], a["dt"], a["A"], a["Bm"], a["C"], **kw)

        return arrays, call, (attn.ssd, attn.sharded_ssd), 4 * N * H * H
    if family == "short_conv":
        D, W = N * H, 4
        arrays = dict(x=normal(B, T, D), weight=normal(W, D))

        def call(a, fn, **kw):
            return fn(a["x"], a["weight"], **kw)[0]

        return arrays, call, (attn.short_conv, attn.sharded_short_conv), 4 * (W - 1) * D
    raise KeyError(family)


def received_bytes(collectives: dict, num_devices: int) -> float:
    """Bytes one device receives, from ``collective_bytes``'s operand bytes per kind."""
    P = num_devices
    factor = {
        "all-gather": P - 1,
        "all-reduce": 2 * (P - 1) / P,
        "reduce-scatter": (P - 1) / P,
        "collective-permute": 1,
        "all-to-all": (P - 1) / P,
    }
    return sum(factor[kind] * v["bytes"] for kind, v in collectives.items())


def measure_family(family, exchange, collective_bytes, *, B=2, T=2048, N=4, H=64, repeats=3):
    """One family's sharded forward + backward over 8 devices: bytes, and time beside one device."""
    arrays, call, (single, sharded), state_bytes = _arrays(family, B, T, N, H)
    mesh = Mesh(np.array(jax.devices()), (AXIS,))

    def grad_of(fn, **kw):
        def loss(a):
            return jnp.sum(call(a, fn, **kw) ** 2)

        return jax.jit(jax.grad(loss))

    sharded_grad = grad_of(sharded, axis_name=AXIS, mesh=mesh, exchange=exchange)
    compiled = sharded_grad.lower(arrays).compile()
    coll = collective_bytes(compiled.as_text())
    P = len(jax.devices())

    def timed(fn):
        jax.block_until_ready(fn(arrays))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(arrays))
            times.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(times))

    received = received_bytes(coll, P)
    return {
        "family": family,
        "exchange": exchange,
        "devices": P,
        "B": B,
        "T": T,
        "state_bytes_per_row": state_bytes,
        "collectives": coll,
        "received_bytes": received,
        "received_states": received / (B * state_bytes),
        "sharded_ms": timed(compiled),
        "single_ms": timed(grad_of(single)),
    }


def family_rows(collective_bytes, quick: bool = False) -> list[dict]:
    """Every family with every exchange (quick: Gated DeltaNet, a short sequence)."""
    families = ("gated_deltanet",) if quick else FAMILIES
    size = dict(T=64, H=8, repeats=1) if quick else {}
    rows = []
    for family in families:
        for exchange in EXCHANGES:
            row = measure_family(family, exchange, collective_bytes, **size)
            rows.append(row)
            print(
                f"{family:>20} {exchange:>6}: {row['received_bytes'] / 2**10:9.1f} KiB received "
                f"per device ({row['received_states']:.2f} states), "
                f"{row['sharded_ms']:.0f} ms sharded, {row['single_ms']:.0f} ms one device",
                flush=True,
            )
    return rows


def markdown(rows: list[dict]) -> list[str]:
    """The family table's lines."""
    if not rows:
        return []
    r0 = rows[0]
    lines = [
        "",
        f"## The fixed-state families over seq={r0['devices']}: one forward + backward pass",
        "",
        f"Each family's `attn.linear.sharded` form on B = {r0['B']} rows of T = {r0['T']} "
        "tokens, every input differentiated. Received: bytes each device receives per pass "
        "pair (forward + backward), from the compiled HLO (an all-gather of p bytes delivers "
        "(P - 1) p, a ring all-reduce 2 (P - 1) / P p, a collective-permute p); states: that "
        "over B states (the state of one row: kv + z for linear attention, H x H per head for "
        "the delta rule and SSD, W - 1 inputs for the convolution). Times: the 8 fake devices "
        "share 2 cores, for sanity only.",
        "",
        "| family | exchange | all-gather | all-reduce | collective-permute | received KiB "
        "| states | sharded ms | one device ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = []
        for kind in ("all-gather", "all-reduce", "collective-permute"):
            v = r["collectives"].get(kind)
            cells.append("-" if v is None else f"{v['bytes'] / 2**10:.1f} ({v['count']})")
        lines.append(
            f"| {r['family']} | {r['exchange']} | {' | '.join(cells)} | "
            f"{r['received_bytes'] / 2**10:.1f} | {r['received_states']:.2f} | "
            f"{r['sharded_ms']:.0f} | {r['single_ms']:.0f} |"
        )
    lines += [
        "",
        "Collective cells: operand KiB (number of collectives). With P devices the all-gather "
        "exchange receives P - 1 (transition, state) pairs per pass; the scan receives log2 P "
        "pairs, then its predecessor's state (a permute) and the final state (an all-reduce).",
    ]
    return lines
