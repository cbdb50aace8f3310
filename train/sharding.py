"""Sharded training on JAX's own SPMD: a device mesh, sharding rules, sharded batches.

A run with ``TrainConfig.mesh`` set (e.g. ``"data=2,fsdp=4"``) trains on a
``jax.sharding.Mesh`` with the fixed axes ``("data", "fsdp", "seq")``:

- parameters: ``fsdp`` shards each parameter of at least ``FSDP_MIN_SIZE``
  elements along its largest dimension that the ``fsdp`` size divides (the
  first such one on ties); smaller parameters, and those with no divisible
  dimension, are replicated. ``data`` and ``seq`` replicate parameters.
- optimizer state: the same rule, applied to each array's shape. Adam's moments
  have their parameter's shape, so they follow its sharding; scalars (the step
  count, the injected learning rate) are replicated.
- batches: the batch axis (B) is split over ``("data", "fsdp")``; B must be a
  multiple of ``data * fsdp``.

The rules are functions of the array shapes and the mesh only, so a run saved
on one mesh restores onto another (orbax reshards to the restore target's
shardings) and continues with the same result up to float rounding: the
reductions over sharded axes may add in another order.

``seq > 1`` (sequence parallelism) needs ring attention (``attn.ring``) inside
the models, which is not wired yet; such a mesh is refused with a ``ValueError``.

``jit`` does the rest: XLA inserts the collectives (all-gathers of fsdp shards,
reductions of gradients over ``data``) from the input shardings, and the step
constrains the updated state back to the rules, so the layout never drifts.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = [
    "AXES",
    "FSDP_MIN_SIZE",
    "batch_sharding",
    "check_batch_size",
    "constrain",
    "make_mesh",
    "mesh_shape",
    "param_spec",
    "place",
    "shard_batch",
    "shardings",
]

AXES = ("data", "fsdp", "seq")
BATCH_AXES = ("data", "fsdp")

# Parameters below this many elements are replicated: sharding them saves little
# memory and costs a collective each (norm scales, biases, small embeddings).
FSDP_MIN_SIZE = 2**12


def mesh_shape(spec: str | None, num_devices: int | None = None) -> dict[str, int]:
    """The axis sizes of a mesh string like ``"data=2,fsdp=2,seq=2"``.

    Axes not named have size 1; sizes of 1 are allowed. With ``num_devices``
    given, the product must equal it, and ``None`` (or ``""``) puts every device
    on ``data``.

    Args:
      spec: ``"AXIS=SIZE,..."`` over ``AXES``, each axis at most once, or None.
      num_devices: the device count the mesh must cover; None checks the syntax only.

    Returns:
      ``{"data": ..., "fsdp": ..., "seq": ...}``.

    Raises:
      ValueError: naming ``mesh``, for bad syntax, unknown or repeated axes,
        sizes < 1, a product other than ``num_devices``, or ``seq > 1``.
    """
    sizes = dict.fromkeys(AXES, 1)
    if spec is None or not spec.strip():
        if num_devices is not None:
            sizes["data"] = num_devices
        return sizes
    seen = set()
    for part in spec.split(","):
        name, eq, value = part.strip().partition("=")
        name = name.strip()
        if not eq or name not in AXES or name in seen or not value.strip().isdigit():
            raise ValueError(
                f"mesh: expected comma-separated AXIS=SIZE with each axis of {AXES} at most "
                f"once, e.g. 'data=2,fsdp=4', got {spec!r}"
            )
        seen.add(name)
        sizes[name] = int(value)
        if sizes[name] < 1:
            raise ValueError(f"mesh: expected sizes >= 1, got {spec!r}")
    if sizes["seq"] > 1:
        raise ValueError(
            f"mesh: seq > 1 (sequence parallelism) needs impl='ring' attention, which is not "
            f"wired into the models yet; use data and fsdp axes only, got {spec!r}"
        )
    if num_devices is not None and math.prod(sizes.values()) != num_devices:
        raise ValueError(
            f"mesh: expected axis sizes whose product is the device count {num_devices}, "
            f"got {spec!r} (product {math.prod(sizes.values())})"
        )
    return sizes


def make_mesh(spec: str | None, devices=None) -> Mesh:
    """A ``Mesh`` with axes ``AXES`` over ``devices`` (default ``jax.devices()``).

    Raises:
      ValueError: see ``mesh_shape``.
    """
    devices = jax.devices() if devices is None else list(devices)
    sizes = mesh_shape(spec, len(devices))
    grid = np.asarray(devices, dtype=object).reshape([sizes[a] for a in AXES])
    return Mesh(grid, AXES)


def param_spec(shape, fsdp: int, min_size: int = FSDP_MIN_SIZE) -> PartitionSpec:
    """Where an array of ``shape`` lives: its largest ``fsdp``-divisible dim on ``fsdp``.

    Args:
      shape: the array's shape.
      fsdp: the mesh's ``fsdp`` size.
      min_size: arrays with fewer elements are replicated.

    Returns:
      a ``PartitionSpec`` naming ``"fsdp"`` at most once; ``P()`` (replicated) when
      ``fsdp == 1``, the array is small, or no dimension is divisible.
    """
    shape = tuple(shape)
    if fsdp == 1 or math.prod(shape) < min_size:
        return PartitionSpec()
    dims = [i for i, n in enumerate(shape) if n % fsdp == 0]
    if not dims:
        return PartitionSpec()
    best = max(dims, key=lambda i: (shape[i], -i))
    return PartitionSpec(*(("fsdp" if i == best else None) for i in range(len(shape))))


def _sharding(mesh: Mesh, x) -> NamedSharding:
    return NamedSharding(mesh, param_spec(np.shape(x), mesh.shape["fsdp"]))


def shardings(mesh: Mesh, tree):
    """The ``NamedSharding`` of each array of ``tree`` (parameters or optimizer state)."""
    return jax.tree.map(lambda x: _sharding(mesh, x), tree)


def place(mesh: Mesh, tree):
    """``tree``'s arrays moved onto ``mesh`` with ``shardings``."""
    return jax.device_put(tree, shardings(mesh, tree))


def constrain(mesh: Mesh, tree):
    """Inside ``jit``: ``tree`` constrained to ``shardings`` (keeps the updated state's layout)."""
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, _sharding(mesh, x)), tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches split over ``("data", "fsdp")`` on their first (B) axis."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def check_batch_size(mesh: Mesh, batch_size: int) -> None:
    """Raises ``ValueError`` naming ``batch_size`` unless ``data * fsdp`` divides it."""
    ways = mesh.shape["data"] * mesh.shape["fsdp"]
    if batch_size % ways:
        raise ValueError(
            f"batch_size: expected a multiple of the mesh's data * fsdp = {ways}, got {batch_size}"
        )


def shard_batch(mesh: Mesh, batch):
    """A host batch (arrays ``[B, ...]``) placed on ``mesh`` with ``batch_sharding``."""
    return jax.device_put(batch, batch_sharding(mesh))
