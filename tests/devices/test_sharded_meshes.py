"""The sharded forms on every kind of mesh a user builds, against one device (forward).

``jax.sharding.Mesh`` (Auto) and ``jax.make_mesh`` (Explicit) meshes of one and
two axes, with T a multiple of the devices (the path that pads nothing) and
not, whole or pre-sharded arrays, with and without batch axes, eager, jitted
and in ``jax.set_mesh``: one family per cell. The families, their inputs and
the gradient checks are ``test_sharded_linear.py``'s.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import attn
from tests.devices.test_sharded_dplr import inputs as dplr_inputs
from tests.devices.test_sharded_linear import (
    AXIS,
    CHUNK,
    FORWARD_TOL,
    GRAD_TOL,
    B,
    T,
    family,
    in_mode,
)
from tests.util import mesh_of, normal, rel_err

pytestmark = pytest.mark.devices


# Every kind of mesh a user builds, one or two axes, with T a multiple of the devices (the
# path that pads nothing) and not: whole or pre-sharded arrays, with and without batch axes,
# eager, jitted and in jax.set_mesh; one family per cell, each against one device.
MESH_KINDS = {  # name -> (explicit, axes)
    "Mesh_1": (False, 1),
    "Mesh_2": (False, 2),
    "make_mesh_1": (True, 1),
    "make_mesh_2": (True, 2),
}
GRID = [  # (mesh kind, mode, arrays, batch_axes, family, T)
    ("Mesh_1", "jit", "whole", (), "gated_deltanet", 27),
    ("Mesh_2", "eager", "whole", ("data",), "linear", 24),
    ("Mesh_2", "jit", "presharded", ("data",), "mamba2", 24),  # laid out: T whole spans
    ("Mesh_2", "set_mesh", "whole", (), "deltaproduct", 24),
    ("make_mesh_1", "eager", "whole", (), "mamba2", 24),
    ("make_mesh_1", "set_mesh", "presharded", (), "short_conv", 24),
    ("make_mesh_2", "eager", "whole", ("data",), "linear", 24),
    ("make_mesh_2", "eager", "whole", (), "mamba2", 27),
    ("make_mesh_2", "jit", "presharded", ("data",), "kda", 24),
    ("make_mesh_2", "set_mesh", "whole", ("data",), "dplr", 27),
    ("make_mesh_2", "jit", "whole", (), "short_conv", 27),
]


def grid_mesh(kind: str):
    explicit, axes = MESH_KINDS[kind]
    if axes == 1:
        return mesh_of(8, explicit)
    if explicit:
        return jax.make_mesh((2, 4), ("data", AXIS))
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", AXIS))


def grid_family(name: str, length: int):
    """``(arrays, call, fns)`` of ``family`` (no segment ids) cut to ``length`` tokens; the DPLR
    rule from its own test's inputs."""
    if name == "dplr":
        arrays = {n: x[:, :length] for n, x in dplr_inputs().items()}
        return arrays, dplr_call, (attn.dplr_delta_rule, attn.sharded_dplr_delta_rule)
    arrays, call, fns, _ = family(name, False)
    cut = {
        n: x[:, :length] if x.ndim >= 2 and x.shape[:2] == (B, T) else x for n, x in arrays.items()
    }
    return cut, call, fns


def dplr_call(a, fn, **kw):
    return fn(a["q"], a["k"], a["v"], a["a"], a["b"], a["log_w"], return_state=True,
              chunk_size=CHUNK, **kw)  # fmt: skip


@pytest.mark.parametrize("cell", GRID, ids=lambda c: "-".join(map(str, c[:4])) + f"-{c[4]}")
def test_every_mesh_kind_layout_and_mode_equals_one_device(cell):
    kind, mode, layout, rows, name, length = cell
    mesh = grid_mesh(kind)
    arrays, call, (single, sharded) = grid_family(name, length)
    want_out, want_final = call(arrays, single)
    if layout == "presharded":
        spec = jax.sharding.PartitionSpec(rows or None, AXIS)
        place = jax.sharding.NamedSharding(mesh, spec)
        arrays = {
            n: jax.device_put(x, place) if x.ndim >= 2 and x.shape[1] == length else x
            for n, x in arrays.items()
        }
    run = functools.partial(call, fn=sharded, axis_name=AXIS, batch_axes=rows)
    out, final = in_mode(run, arrays, mesh, mode)
    assert rel_err(out, want_out) <= FORWARD_TOL
    for got, want in zip(jax.tree.leaves(final), jax.tree.leaves(want_final), strict=True):
        assert rel_err(got, want) <= FORWARD_TOL


def test_the_grid_covers_every_mesh_kind_mode_and_layout():
    assert {c[0] for c in GRID} == set(MESH_KINDS)
    for kind in MESH_KINDS:
        assert {c[1] for c in GRID if c[0] == kind} >= (
            {"eager", "jit", "set_mesh"} if "2" in kind else set()
        )
    assert {(c[2], c[3]) for c in GRID} == {
        ("whole", ()),
        ("whole", ("data",)),
        ("presharded", ()),
        ("presharded", ("data",)),
    }
    assert {24, 27} == {c[5] for c in GRID}


@pytest.mark.parametrize("kind, mode", [("make_mesh_2", "jit"), ("Mesh_1", "set_mesh")])
def test_comba_through_its_record_equals_one_device_forward_and_gradients(kind, mode):
    """A family added by its own module (``attn.linear.comba``): packed segments across the
    devices, an initial state, outputs, final state and every gradient."""
    from tests.attn.linear.test_comba import make_inputs

    q, k, v, p, beta, log_g, s0 = (jnp.asarray(x) for x in make_inputs(5, 24))
    seg = jnp.asarray(np.repeat([[1] * 10 + [2] * 11 + [0] * 3], 2, axis=0), jnp.int32)
    cot = normal(9, v.shape)

    def loss(arrays, fn, **kw):
        out, S = fn(*arrays[:5], log_gates=arrays[5], initial_state=arrays[6], chunk_size=CHUNK,
                    return_state=True, q_segment_ids=seg, kv_segment_ids=seg, **kw)  # fmt: skip
        return jnp.sum(out * cot) + jnp.sum(S), (out, S)

    arrays = (q, k, v, p, beta, log_g, s0)
    names = ("q", "k", "v", "p", "beta", "log_g", "s0")
    record_equals_one_device(loss, attn.comba, attn.sharded_comba, arrays, names, kind, mode)


def record_equals_one_device(loss, single, sharded, arrays, names, kind, mode):
    """``loss(arrays, fn, **mesh_kw) -> (scalar, outputs)`` through ``sharded`` on the grid's
    mesh ``kind`` in ``mode`` equals it through ``single``: outputs and every gradient."""
    mesh, rows = grid_mesh(kind), ("data",) if kind.endswith("_2") else ()
    grad = jax.grad(loss, has_aux=True)
    want_grads, want = jax.jit(functools.partial(grad, fn=single))(arrays)

    def run(a, mesh=None):
        return grad(a, sharded, axis_name=AXIS, batch_axes=rows, mesh=mesh)

    grads, got = in_mode(run, arrays, mesh, mode)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert rel_err(g, w) <= FORWARD_TOL
    for name, g, w in zip(names, grads, want_grads, strict=True):
        assert rel_err(g, w) <= GRAD_TOL, name


@pytest.mark.parametrize("cg_steps", [None, 4], ids=["exact", "cg4"])
@pytest.mark.parametrize("kind, mode", [("make_mesh_2", "jit"), ("Mesh_1", "set_mesh")])
def test_mesa_net_through_its_record_equals_one_device_forward_and_gradients(kind, mode, cg_steps):
    """MesaNet's sums are affine in a span's start, its outputs are not (a solve of the
    incoming G): the chain runs each span from its true state and takes the gradient there.
    Packed segments across the devices, an initial state, outputs, both sums, every gradient."""
    from tests.attn.linear.test_mesa import make_inputs

    arrays = tuple(jnp.asarray(x) for x in make_inputs(6))  # T = 21: the tail padded
    seg = jnp.asarray(np.repeat([[1] * 10 + [2] * 8 + [0] * 3], 2, axis=0), jnp.int32)
    cot = normal(9, arrays[2].shape)

    def loss(arrays, fn, **kw):
        q, k, v, beta, log_g, lam, S0, G0 = arrays
        out, state = fn(q, k, v, beta, lam, log_gates=log_g, cg_steps=cg_steps, chunk_size=CHUNK,
                        initial_state=attn.MesaState(S0, G0), return_state=True,
                        q_segment_ids=seg, kv_segment_ids=seg, **kw)  # fmt: skip
        return jnp.sum(out * cot) + jnp.sum(state.S) + jnp.sum(state.G), (out, state)

    names = ("q", "k", "v", "beta", "log_g", "lam", "S0", "G0")
    record_equals_one_device(loss, attn.mesa_net, attn.sharded_mesa_net, arrays, names, kind, mode)
