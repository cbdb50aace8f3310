"""The DPLR delta rule sharded over 2, 4 and 8 fake CPU devices, against one device.

As ``test_sharded_linear.py`` does for the other families: the output, the final
state and the gradient of every float input (the initial state included) equal
the single-device chunkwise form on the whole sequence, for a loss reading both
outputs, on 8 devices of an Explicit mesh (all-gather exchange) and 4 of an
Auto one (associative scan), both with packed segments crossing device
boundaries and NaN in the padding, and on 2 without segment ids (the tail
padded by the sharded form); T = 27 a multiple of none. RWKV-7's transition
(``a = -kappa`` per query/key head, ``b = kappa * a_in`` per value head). Then
the checks: values the one-device form refuses are refused alike, before any
device runs.
"""

from __future__ import annotations

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
    """Ids whose segments cross device boundaries of 2, 4 and 8 devices, with padding
    inside a segment, at a row's start and at a device's start."""
    row0 = [1] * 5 + [2] * 6 + [0] * 3 + [2] * 4 + [3] * 9
    row1 = [0] * 2 + [1] * 10 + [0] * 5 + [1] * 3 + [2] * 7
    return jnp.asarray(np.array([row0, row1], np.int32))


def inputs():
    kappa = normal(2, (B, T, K, H))
    kappa = kappa / jnp.linalg.norm(kappa, axis=-1, keepdims=True)
    a_in = jax.nn.sigmoid(normal(4, (B, T, N, H)))
    return dict(
        q=normal(1, (B, T, K, H)),
        k=0.5 * normal(3, (B, T, K, H)),
        v=normal(5, (B, T, N, E)),
        a=-kappa,
        b=jnp.repeat(kappa, N // K, axis=2) * a_in,
        log_w=-0.6 * jax.nn.sigmoid(normal(6, (B, T, N, H))),
        s0=normal(7, (B, N, H, E)),
    )


def values_and_grads(fn, arrays, seg, **kw):
    """``(out, final, grads)`` of a loss reading every output; NaN in the padding."""
    ids = dict(q_segment_ids=seg, kv_segment_ids=seg) if seg is not None else {}

    def loss(x):
        out, final = fn(
            x["q"],
            x["k"],
            x["v"],
            x["a"],
            x["b"],
            x["log_w"],
            initial_state=x["s0"],
            return_state=True,
            chunk_size=CHUNK,
            **ids,
            **kw,
        )
        return jnp.sum(out * jnp.cos(out)) + jnp.sum(jnp.sin(final)), (out, final)

    if seg is not None:  # nothing may read the padding
        pad = np.asarray(seg) == 0
        arrays = {
            n: jnp.where(pad.reshape(pad.shape + (1,) * (x.ndim - 2)), jnp.nan, x)
            if n != "s0"
            else x
            for n, x in arrays.items()
        }
    grads, (out, final) = jax.jit(jax.grad(loss, has_aux=True))(arrays)
    return out, final, grads


CASES = {  # name: (devices, Explicit mesh, packed segments, exchange)
    "8_explicit": (8, True, True, "gather"),
    "4_auto_scan": (4, False, True, "scan"),
    "2_auto_unpacked": (2, False, False, "gather"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_equals_one_device(case):
    devices, explicit, packed, exchange = CASES[case]
    seg = crossing_segments() if packed else None
    arrays = inputs()
    want_out, want_final, want_grads = values_and_grads(attn.dplr_delta_rule, arrays, seg)
    kw = dict(axis_name=AXIS, mesh=mesh_of(devices, explicit), exchange=exchange)
    out, final, grads = values_and_grads(attn.sharded_dplr_delta_rule, arrays, seg, **kw)
    errors = {"out": rel_err(out, want_out), "final": rel_err(final, want_final)}
    for n, want in want_grads.items():
        g = np.asarray(grads[n])
        errors[f"d{n}"] = rel_err(g, want) if np.isfinite(g).all() else float("inf")
    ok = all(e <= (GRAD_TOL if k.startswith("d") else FORWARD_TOL) for k, e in errors.items())
    assert ok, json.dumps(errors, indent=1)
    if packed:
        assert not np.asarray(out)[np.asarray(seg) == 0].any()


def test_values_are_refused_as_one_device_refuses_them():
    arrays = inputs()
    mesh = mesh_of(4, explicit=True)
    args = [arrays[n] for n in ("q", "k", "v", "a", "b", "log_w")]
    for i, name, bad in (
        (5, "log_w", -args[5] + 0.1),
        (3, "a", jnp.full_like(args[3], jnp.nan)),
        (4, "b", args[4][:, :, :1]),
    ):
        changed = [*args[:i], bad, *args[i + 1 :]]
        with pytest.raises(ValueError, match=f"^{name}: expected") as one:
            attn.dplr_delta_rule(*changed)
        with pytest.raises(ValueError, match=f"^{name}: expected") as sharded:
            attn.sharded_dplr_delta_rule(*changed, axis_name=AXIS, mesh=mesh)
        assert str(sharded.value) == str(one.value)
    with pytest.raises(ValueError, match=r"^axis_name: expected"):
        attn.sharded_dplr_delta_rule(*args, axis_name="model", mesh=mesh)
