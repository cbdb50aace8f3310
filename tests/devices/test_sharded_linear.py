"""The fixed-state families sharded over 2, 4 and 8 fake CPU devices, against one device.

Each case compares the output, the final state and the gradient of every float
input (the initial state and replicated parameters included) with the
single-device chunkwise form on the whole sequence, for a loss that reads both
outputs: every family on 8 devices of an Explicit mesh (all-gather exchange) and
4 of an Auto one (associative scan), both with packed segments crossing device
boundaries and NaN in the padding, and each function on 2 without segments; T =
27 a multiple of none. The argument checks that need no devices are in
``tests/attn/linear/test_sharded.py``.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from tests.util import mesh_of, normal, rel_err

pytestmark = pytest.mark.devices

FORWARD_TOL = 1e-5
GRAD_TOL = 1e-4
AXIS = "seq"
B, T, N, K, H, E = 2, 27, 4, 2, 4, 4  # T a multiple of none of 2, 4, 8
CHUNK = 4


def crossing_segments():
    """Ids whose segments cross every device boundary of 2, 4 and 8 devices, with padding.

    Row 0: three segments, padding inside the second; row 1: padding, one
    segment spanning devices, padding, a new segment, a run of padding at a
    device's start that the segment continues across.
    """
    row0 = [1] * 5 + [2] * 6 + [0] * 3 + [2] * 4 + [3] * 9
    row1 = [0] * 2 + [1] * 10 + [0] * 5 + [1] * 3 + [2] * 7
    return jnp.asarray(np.array([row0, row1], np.int32))


def poisoned(x, ids):
    """NaN at the padding tokens of ``x [B,T,...]``: nothing may read them."""
    pad = (ids == 0).reshape(ids.shape + (1,) * (x.ndim - 2))
    return jnp.where(pad, jnp.nan, x)


def unit(x):
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def family(name: str, segments: bool):
    """``(arrays to differentiate, fixed ids, call(arrays, fn, **kw) -> (out, final), fns)``."""
    seg = crossing_segments() if segments else None
    ids = dict(q_segment_ids=seg, kv_segment_ids=seg) if segments else {}
    if name == "linear":  # the normalizer, decay and gates; negative gates: in "mamba2"
        arrays = dict(
            q=normal(1, (B, T, N, H)),
            k=normal(2, (B, T, K, H)),
            v=normal(3, (B, T, K, E)),
            kv0=jnp.abs(normal(4, (B, N, H, E))),
            z0=jnp.abs(normal(5, (B, N, H))),
            log_gates=-jax.nn.softplus(normal(6, (B, T, N))),
            decay=jnp.asarray([0.9, 0.95, 0.99, 1.0]),
        )

        def call(a, fn, **kw):
            return fn(
                a["q"],
                a["k"],
                a["v"],
                log_gates=a["log_gates"],
                decay=a["decay"],
                initial_state=attn.LinearState(a["kv0"], a["z0"]),
                return_state=True,
                feature_map="elu1",
                chunk_size=CHUNK,
                **ids,
                **kw,
            )

        return arrays, call, (attn.linear_attention, attn.sharded_linear_attention), seg
    if name in ("gated_deltanet", "kda", "deltaproduct"):
        steps = 2 if name == "deltaproduct" else 1
        lead = (B, T, steps) if steps > 1 else (B, T)
        arrays = dict(
            q=unit(normal(1, (B, T, K, H))),
            k=unit(normal(2, (*lead, K, H))),
            v=normal(3, (*lead, N, E)),
            beta=2 * jax.nn.sigmoid(normal(4, (*lead, N))),  # (0, 2): negative eigenvalues
            s0=normal(5, (B, N, H, E)),
        )
        gate_shape = (B, T, N, H) if name == "kda" else (B, T, N)
        arrays["log_gates"] = -jax.nn.softplus(normal(6, gate_shape))
        fns = (attn.delta_product, attn.sharded_delta_product) if steps > 1 else None
        fns = fns or (attn.delta_rule, attn.sharded_delta_rule)

        def call(a, fn, **kw):
            return fn(
                a["q"],
                a["k"],
                a["v"],
                a["beta"],
                log_gates=a["log_gates"],
                initial_state=a["s0"],
                return_state=True,
                chunk_size=CHUNK,
                **ids,
                **kw,
            )

        return arrays, call, fns, seg
    if name == "mamba2":
        arrays = dict(
            x=normal(1, (B, T, N, E)),
            dt=jax.nn.softplus(normal(2, (B, T, N))),
            A=-jnp.exp(normal(3, (N,))),
            Bm=normal(4, (B, T, K, H)),
            C=normal(5, (B, T, K, H)),
            D=normal(6, (N,)),
            s0=normal(7, (B, N, H, E)),
        )

        def call(a, fn, **kw):
            return fn(
                a["x"],
                a["dt"],
                a["A"],
                a["Bm"],
                a["C"],
                D=a["D"],
                negative_eigenvalues=True,
                initial_state=a["s0"],
                return_state=True,
                chunk_size=CHUNK,
                segment_ids=seg,
                **kw,
            )

        return arrays, call, (attn.ssd, attn.sharded_ssd), seg
    if name == "short_conv":
        W, D = 4, 6
        arrays = dict(
            x=normal(1, (B, T, D)),
            weight=normal(2, (W, D)),
            bias=normal(3, (D,)),
            state=normal(4, (B, W - 1, D)),
        )

        def call(a, fn, **kw):
            return fn(a["x"], a["weight"], a["bias"], state=a["state"], segment_ids=seg, **kw)

        return arrays, call, (attn.short_conv, attn.sharded_short_conv), seg
    raise KeyError(name)


def values_and_grads(call, fn, arrays, seg, **kw):
    """``(out, final, grads)`` for a loss reading every output (finite entries only)."""

    def loss(a):
        out, final = call(a, fn, **kw)
        terms = [jnp.sum(out * jnp.cos(out))]
        terms += [jnp.sum(jnp.sin(s)) for s in jax.tree.leaves(final)]
        return sum(terms), (out, final)

    if seg is not None:  # padding holds NaN: nothing may read it
        arrays = {
            name: poisoned(x, seg) if x.ndim >= 2 and x.shape[:2] == (B, T) else x
            for name, x in arrays.items()
        }
    grads, (out, final) = jax.jit(jax.grad(loss, has_aux=True))(arrays)
    if seg is not None:  # the padding's own gradients are zero by definition; compare the rest
        grads = {
            n: jnp.nan_to_num(g) if g.ndim >= 2 and g.shape[:2] == (B, T) else g
            for n, g in grads.items()
        }
    return out, final, grads


@functools.cache
def reference(name: str, segments: bool):
    arrays, call, (single, _), seg = family(name, segments)
    return values_and_grads(call, single, arrays, seg)


def equal_case(
    name: str, num_devices: int, explicit: bool, segments: bool = True, exchange: str = "gather"
):
    arrays, call, (_, sharded), seg = family(name, segments)
    mesh = mesh_of(num_devices, explicit)
    kw = dict(axis_name=AXIS, mesh=mesh, exchange=exchange)
    out, final, grads = values_and_grads(call, sharded, arrays, seg, **kw)
    want_out, want_final, want_grads = reference(name, segments)
    errors = {"out": rel_err(out, want_out)}
    for i, (s, w) in enumerate(
        zip(jax.tree.leaves(final), jax.tree.leaves(want_final), strict=True)
    ):
        errors[f"final{i}"] = rel_err(s, w)
    for n in want_grads:
        g = np.asarray(grads[n], np.float64)
        errors[f"d{n}"] = rel_err(g, want_grads[n]) if np.isfinite(g).all() else float("inf")
    ok = all(e <= (FORWARD_TOL if not k.startswith("d") else GRAD_TOL) for k, e in errors.items())
    finite = bool(np.isfinite(np.asarray(out)).all())
    return {"ok": ok and finite, "errors": errors, "finite": finite}


FAMILIES = ("linear", "gated_deltanet", "kda", "deltaproduct", "mamba2", "short_conv")
# Every function on 8 devices of an Explicit mesh with the all-gather exchange and on 4 of an
# Auto one with the associative scan (both with packed segments); on 2 without segment ids
# (the tail padded by the sharded form itself), once per function.
CASES = {}
for _name in FAMILIES:
    CASES[f"{_name}_8_explicit"] = functools.partial(equal_case, _name, 8, True)
    CASES[f"{_name}_4_auto_scan"] = functools.partial(equal_case, _name, 4, False, True, "scan")
for _name in ("linear", "gated_deltanet", "mamba2", "short_conv"):
    CASES[f"{_name}_2_auto_unpacked"] = functools.partial(equal_case, _name, 2, False, False)


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_case(case):
    result = CASES[case]()
    assert result["ok"], json.dumps(result, indent=1)
    assert result["errors"]["out"] <= FORWARD_TOL


def test_every_family_is_checked_on_both_mesh_types():
    for name in FAMILIES:
        assert f"{name}_8_explicit" in CASES and f"{name}_4_auto_scan" in CASES
