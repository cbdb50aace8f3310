"""The fixed-state families sharded over 2, 4 and 8 fake CPU devices, against one device.

Each case compares the output, the final state and the gradient of every float
input (the initial state and replicated parameters included) with the
single-device chunkwise form on the whole sequence, for a loss that reads both
outputs: every family on 8 devices of an Explicit mesh (all-gather exchange) and
4 of an Auto one (associative scan), both with packed segments crossing device
boundaries and NaN in the padding, and each function on 2 without segments; T =
27 a multiple of none.

Then whole, unsharded arrays (forward only): every function on an Explicit mesh
(``jax.make_mesh``) called eagerly, one family per other cell of {Explicit,
Auto} x {eager, jitted, in ``jax.set_mesh``}, and an Auto mesh of two axes
eagerly. And the checks: every value a one-device form refuses (where it is
concrete) is refused by every sharded function taking that argument, with the
same one-line message; a bad mesh, axis or batch axes, in one line naming it.
The argument checks that need no devices are in
``tests/attn/linear/test_sharded.py``.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

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
                **{**ids, **kw},  # kw may set ids of its own
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
                **{**ids, **kw},  # kw may set ids of its own
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


# ----------------------------------------------------------------------------
# Isolation: junk in the padding changes no bit; query ids of their own


@pytest.mark.parametrize("name", FAMILIES)
def test_junk_in_the_padding_changes_no_bit(name):
    """Random values, then NaN, +Inf and -Inf in turn, at every padding token of every
    ``[B,T,...]`` input, on 4 devices: the same output, final state and gradients, bit for
    bit (zeros at padding)."""
    arrays, call, (_, sharded), seg = family(name, True)
    pad = np.asarray(seg) == 0
    kw = dict(axis_name=AXIS, mesh=mesh_of(4, explicit=True))

    def loss(a):
        out, final = call(a, sharded, **kw)
        return jnp.sum(out * jnp.cos(out)) + sum(
            jnp.sum(jnp.sin(f)) for f in jax.tree.leaves(final)
        )

    run = jax.jit(jax.value_and_grad(loss))
    rng = np.random.default_rng(0)
    results = []
    for fill in ("random", "junk"):
        filled = {}
        for n, x in arrays.items():
            if x.ndim >= 2 and x.shape[:2] == (B, T):
                junk = np.resize(np.array([np.nan, np.inf, -np.inf], np.float32), x.shape)
                values = junk if fill == "junk" else rng.normal(size=x.shape)
                where = pad.reshape(pad.shape + (1,) * (x.ndim - 2))
                x = jnp.where(where, jnp.asarray(values, x.dtype), x)
            filled[n] = x
        results.append(run(filled))
    (clean, clean_grads), (got, grads) = results
    assert np.isfinite(clean)
    np.testing.assert_array_equal(got, clean)
    for n in arrays:
        np.testing.assert_array_equal(grads[n], clean_grads[n], err_msg=n)


@pytest.mark.parametrize("name", ["gated_deltanet", "deltaproduct"])
def test_query_ids_of_their_own_are_read_as_one_device_reads_them(name):
    """Queries whose id is padding (their tokens still write) read nothing, on 4 devices as
    on one: the sharded delta forms pass ``q_segment_ids`` on, not the kv ids twice."""
    arrays, call, (single, sharded), seg = family(name, True)
    q_seg = jnp.where(jnp.arange(T) % 3 == 0, 0, seg)
    call_ids = functools.partial(call, q_segment_ids=q_seg, kv_segment_ids=seg)
    want, _ = call_ids(arrays, single)
    got, _ = call_ids(arrays, sharded, axis_name=AXIS, mesh=mesh_of(4, explicit=True))
    assert not np.asarray(want)[np.asarray(q_seg) == 0].any()
    assert rel_err(got, want) <= FORWARD_TOL


# ----------------------------------------------------------------------------
# Whole, unsharded arrays on either kind of mesh: eager, jitted, in jax.set_mesh

SHARDED = {  # a family of ``family`` for each sharded function
    "sharded_linear_attention": "linear",
    "sharded_delta_rule": "gated_deltanet",
    "sharded_delta_product": "deltaproduct",
    "sharded_ssd": "mamba2",
    "sharded_short_conv": "short_conv",
}


def in_mode(run, arrays, mesh, mode: str):
    """``run(arrays, mesh=...)`` eagerly, jitted, or in ``jax.set_mesh(mesh)`` with no mesh."""
    if mode == "eager":
        return run(arrays, mesh=mesh)
    if mode == "jit":
        return jax.jit(functools.partial(run, mesh=mesh))(arrays)
    with jax.set_mesh(mesh):
        return run(arrays)


def forward_errors(name: str, mesh, mode: str) -> dict:
    """Relative errors of the output and final state against one device, forward only.

    ``mode``: ``"eager"``, ``"jit"`` (mesh passed to both) or ``"set_mesh"``
    (eager in ``jax.set_mesh(mesh)``, ``mesh=None``: the context mesh).
    """
    arrays, call, (_, sharded), _ = family(name, True)
    run = functools.partial(call, fn=sharded, axis_name=AXIS)
    out, final = in_mode(run, arrays, mesh, mode)
    want_out, want_final, _ = reference(name, True)
    errors = {"out": rel_err(out, want_out)}
    for i, (s, w) in enumerate(
        zip(jax.tree.leaves(final), jax.tree.leaves(want_final), strict=True)
    ):
        errors[f"final{i}"] = rel_err(s, w)
    return errors


@pytest.mark.parametrize("fn", sorted(SHARDED))
def test_every_function_takes_whole_arrays_on_a_make_mesh_eagerly(fn):
    errors = forward_errors(SHARDED[fn], mesh_of(8, explicit=True), "eager")
    assert max(errors.values()) <= FORWARD_TOL, errors


# One family per cell: the modes do not depend on the family (the cell above, Explicit and
# eager, is every function's).
MODES = {
    ("explicit", "jit"): "mamba2",
    ("explicit", "set_mesh"): "kda",
    ("auto", "eager"): "short_conv",
    ("auto", "jit"): "gated_deltanet",
    ("auto", "set_mesh"): "linear",
}


@pytest.mark.parametrize(("kind", "mode"), sorted(MODES))
def test_whole_arrays_on_both_mesh_kinds_in_every_mode(kind, mode):
    errors = forward_errors(MODES[kind, mode], mesh_of(8, explicit=kind == "explicit"), mode)
    assert max(errors.values()) <= FORWARD_TOL, errors


def test_an_auto_mesh_of_two_axes_eagerly_without_batch_axes():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", AXIS))
    errors = forward_errors("short_conv", mesh, "eager")
    assert max(errors.values()) <= FORWARD_TOL, errors


# ----------------------------------------------------------------------------
# The checks: the one-device forms' on the values, the sharded forms' own on the mesh


def small(fn: str):
    """``(one-device function, sharded function, args, kwargs)``: a valid tiny call of ``fn``."""
    b, t, n, h = 2, 8, 2, 4
    q, k, v = normal(1, (b, t, n, h)), normal(2, (b, t, n, h)), normal(3, (b, t, n, h))
    beta = jax.nn.sigmoid(normal(4, (b, t, n)))
    ids = jnp.ones((b, t), jnp.int32)
    if fn == "sharded_linear_attention":
        return attn.linear_attention, attn.sharded_linear_attention, (q, k, v), {}
    if fn == "sharded_delta_rule":
        kw = dict(q_segment_ids=ids, kv_segment_ids=ids)
        return attn.delta_rule, attn.sharded_delta_rule, (q, k, v, beta), kw
    if fn == "sharded_delta_product":
        args = (q, k[:, :, None], v[:, :, None], beta[:, :, None])
        return attn.delta_product, attn.sharded_delta_product, args, {}
    if fn == "sharded_ssd":
        args = (v, jax.nn.softplus(beta), -jnp.ones((n,)), q, k)
        return attn.ssd, attn.sharded_ssd, args, {}
    if fn == "sharded_short_conv":
        return attn.short_conv, attn.sharded_short_conv, (q[..., 0], normal(5, (4, n))), {}
    raise KeyError(fn)


POSITIONAL = {"dt": 1, "A": 2, "beta": 3}  # of ssd and the delta forms; the others: keywords
POSITIVE = np.full((2, 8, 2), 0.5, np.float32)
IDS = np.ones((2, 8), np.int32)
NEGATIVE_IDS = np.array([[1] * 8, [1] * 4 + [-1] * 4], np.int32)


def swap(args: tuple, kw: dict, name: str, value):
    """The call with the argument ``name`` replaced by ``value``: ``(args, kw)``."""
    if name in POSITIONAL:
        args = list(args)
        args[POSITIONAL[name]] = value
        return tuple(args), kw
    if name in ("q_segment_ids", "kv_segment_ids"):  # both or neither
        kw = dict(kw, q_segment_ids=IDS, kv_segment_ids=IDS)
    return args, {**kw, name: value}


# Every value a one-device form refuses, for every sharded function taking the argument.
VALUES = {
    ("sharded_linear_attention", "log_gates"): POSITIVE,
    ("sharded_linear_attention", "decay"): np.array([0.5, 1.5], np.float32),
    ("sharded_linear_attention", "q_segment_ids"): NEGATIVE_IDS,
    ("sharded_linear_attention", "kv_segment_ids"): NEGATIVE_IDS,
    ("sharded_delta_rule", "log_gates"): POSITIVE,
    ("sharded_delta_rule", "q_segment_ids"): NEGATIVE_IDS,
    ("sharded_delta_rule", "kv_segment_ids"): NEGATIVE_IDS,
    ("sharded_delta_rule", "beta"): np.where(POSITIVE > 0, np.inf, 0.5),
    ("sharded_delta_product", "beta"): np.full((2, 8, 1, 2), np.nan, np.float32),
    ("sharded_delta_product", "log_gates"): POSITIVE,
    ("sharded_delta_product", "kv_segment_ids"): NEGATIVE_IDS,
    ("sharded_ssd", "A"): np.array([-np.inf, 0.5], np.float32),
    ("sharded_ssd", "dt"): -POSITIVE,
    ("sharded_ssd", "segment_ids"): NEGATIVE_IDS,
    ("sharded_short_conv", "segment_ids"): NEGATIVE_IDS,
}


@pytest.mark.parametrize(("fn", "name"), sorted(VALUES))
def test_values_are_refused_as_one_device_refuses_them(fn, name):
    single, sharded, args, kw = small(fn)
    args, kw = swap(args, kw, name, VALUES[fn, name])
    with pytest.raises(ValueError, match=f"^{name}: expected") as want:
        single(*args, **kw)
    with pytest.raises(ValueError) as got:
        sharded(*args, axis_name=AXIS, mesh=mesh_of(2), **kw)
    assert str(got.value) == str(want.value)
    assert "\n" not in str(got.value)


def test_traced_values_are_not_checked():
    _, sharded, args, _ = small("sharded_delta_rule")
    run = functools.partial(sharded, *args, axis_name=AXIS, mesh=mesh_of(2))
    jax.eval_shape(lambda gates: run(log_gates=gates), POSITIVE)  # as one device: no error


# A bad mesh argument per case, over the functions in turn (the width-1 convolution, which
# skips the chain, included); each refused in one line naming it.
MESH_ARGS = {
    "mesh_not_a_mesh": ("sharded_linear_attention", dict(mesh=AXIS), "mesh"),
    "mesh_none_outside_set_mesh": ("sharded_delta_rule", dict(mesh=None), "mesh"),
    "axis_name_not_an_axis": ("sharded_delta_product", dict(axis_name="model"), "axis_name"),
    "axis_name_width_1_conv": ("sharded_short_conv", dict(axis_name="model"), "axis_name"),
    "batch_axes_is_axis_name": ("sharded_ssd", dict(batch_axes=(AXIS,)), "batch_axes"),
    "batch_axes_not_an_axis": ("sharded_short_conv", dict(batch_axes=("model",)), "batch_axes"),
    "batch_axes_a_string": ("sharded_linear_attention", dict(batch_axes="data"), "batch_axes"),
    "batch_axes_twice": ("sharded_delta_rule", dict(batch_axes=("data", "data")), "batch_axes"),
    "batch_not_divided": ("sharded_ssd", dict(batch_axes=("data",)), r"batch_axes: .* B=2,"),
}


@pytest.mark.parametrize("case", sorted(MESH_ARGS))
def test_mesh_arguments_are_refused_naming_them(case):
    fn, bad, refused = MESH_ARGS[case]
    _, sharded, args, kw = small(fn)
    if case == "axis_name_width_1_conv":
        args = (args[0], args[1][:1])  # weight [1,D]
    grid = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", AXIS))
    kw = dict(kw, axis_name=AXIS, mesh=grid) | bad
    with pytest.raises(ValueError, match=f"^{refused}") as got:
        sharded(*args, **kw)
    assert "\n" not in str(got.value)
