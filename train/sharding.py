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
- batches: the batch axis (B) is split over ``("data", "fsdp")`` and the
  sequence axis (T) over ``seq``; B must be a multiple of ``data * fsdp`` and
  T of ``seq``. On several hosts each process supplies only the block its
  devices hold (``train.distributed``).

The rules are functions of the array shapes and the mesh only, so a run saved
on one mesh restores onto another (orbax reshards to the restore target's
shardings) and continues with the same result up to float rounding: the
reductions over sharded axes may add in another order.

``seq > 1`` is sequence parallelism: every batch is laid out on the host in
the order of ``models.mesh.ring_layout`` with the tokens' real ``positions``
added to it, and the steps run under ``jax.set_mesh(mesh)``, where the models'
softmax layers (``impl="auto"`` or ``"ring"``) run as ring attention over
``seq`` and the recurrent layers (linear attention, the delta rule, Mamba-2)
and short convolutions as their sharded forms (``attn.linear.sharded``: each
device its span, the states chained across devices). The order is zigzag
(each seq device holds an early and a late chunk, which balances causal
attention) unless a layer runs in array order (``in_order``), which needs
contiguous spans. Everything else in a decoder works token by token and the
loss is a mean over tokens, so the order changes nothing but float rounding.
Layers that see the whole sequence another way (MLA, FoX, explicit other
impls) are refused by ``check_sequence_parallel`` with a ``ValueError`` naming
the layer.

``jit`` does the rest: XLA inserts the collectives (all-gathers of fsdp shards,
reductions of gradients over ``data``) from the input shardings, and the step
constrains the updated state back to the rules, so the layout never drifts.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from models import KINDS
from models.mesh import BATCH_AXES, SEQ_AXIS, ring_layout
from train import distributed

__all__ = [
    "AXES",
    "AXIS_TYPES",
    "FSDP_MIN_SIZE",
    "batch_sharding",
    "check_batch_size",
    "check_seq_len",
    "check_sequence_parallel",
    "constrain",
    "gather",
    "in_order",
    "is_explicit",
    "make_mesh",
    "mesh_shape",
    "param_spec",
    "place",
    "seq_layout",
    "shard_batch",
    "shardings",
]

AXES = (*BATCH_AXES, SEQ_AXIS)
# ``TrainConfig.mesh_axis_types``: the axis types of the run's mesh.
AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}

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
        sizes < 1, or a product other than ``num_devices``.
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
    if num_devices is not None and math.prod(sizes.values()) != num_devices:
        raise ValueError(
            f"mesh: expected axis sizes whose product is the device count {num_devices}, "
            f"got {spec!r} (product {math.prod(sizes.values())})"
        )
    return sizes


def make_mesh(spec: str | None, devices=None, axis_types: str = "auto") -> Mesh:
    """A ``Mesh`` with axes ``AXES`` over ``devices`` (default ``jax.devices()``).

    The devices fill the mesh in their order, ``data`` outermost; ``jax.devices()``
    lists them process by process, so on several hosts each process holds a
    block of ``data`` (and of ``fsdp`` and ``seq`` within it), and collectives on
    the inner axes stay within a host where the sizes allow.

    Args:
      spec: the axis sizes (``mesh_shape``).
      devices: the devices, in order.
      axis_types: ``"auto"`` (XLA shards every intermediate, as ``jax.sharding.Mesh``
        does) or ``"explicit"`` (arrays carry their sharding in their types, as
        from ``jax.make_mesh``; the steps then gather parameters themselves).

    Raises:
      ValueError: see ``mesh_shape``; ``axis_types`` not in ``AXIS_TYPES``.
    """
    if axis_types not in AXIS_TYPES:
        raise ValueError(
            f"mesh_axis_types: expected one of {tuple(AXIS_TYPES)}, got {axis_types!r}"
        )
    devices = jax.devices() if devices is None else list(devices)
    sizes = mesh_shape(spec, len(devices))
    grid = np.asarray(devices, dtype=object).reshape([sizes[a] for a in AXES])
    return Mesh(grid, AXES, axis_types=(AXIS_TYPES[axis_types],) * len(AXES))


def is_explicit(mesh: Mesh) -> bool:
    """Whether ``mesh``'s axes are Explicit (then every array states its sharding)."""
    return AxisType.Explicit in mesh.axis_types


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
    put = jax.sharding.reshard if is_explicit(mesh) else jax.lax.with_sharding_constraint
    return jax.tree.map(lambda x: put(x, _sharding(mesh, x)), tree)


def gather(mesh: Mesh, tree):
    """Inside ``jit``: every array of ``tree`` whole on every device of ``mesh``.

    What an Explicit mesh's step computes with (FSDP's all-gather of the
    parameters); its transpose leaves each gradient on its parameter's shards.
    """
    whole = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: jax.sharding.reshard(x, whole), tree)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Batch arrays ``[B,T,...]`` split over ``("data", "fsdp")`` on B and ``seq`` on T
    (``[B]`` arrays: B only)."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *((SEQ_AXIS,) if ndim > 1 else ())))


def check_batch_size(mesh: Mesh, batch_size: int) -> None:
    """Raises ``ValueError`` naming ``batch_size`` unless ``data * fsdp`` divides it."""
    ways = mesh.shape["data"] * mesh.shape["fsdp"]
    if batch_size % ways:
        raise ValueError(
            f"batch_size: expected a multiple of the mesh's data * fsdp = {ways}, got {batch_size}"
        )


def check_seq_len(mesh: Mesh, seq_len: int) -> None:
    """Raises ``ValueError`` naming ``task.seq_len`` unless the mesh's ``seq`` size divides it."""
    seq = mesh.shape[SEQ_AXIS]
    if seq_len % seq:
        raise ValueError(
            f"task.seq_len: expected a multiple of the mesh's seq = {seq}, got {seq_len}"
        )


def check_sequence_parallel(model, name: str = "model") -> None:
    """Raises ``ValueError`` naming the first layer that cannot run with the sequence sharded.

    Sequence-parallel steps feed the model its tokens in the ``ring_layout``
    order with their positions (see the module docstring). A softmax layer
    attends by position, as ring attention over ``seq``, and a recurrence or a
    short convolution runs sharded over contiguous spans; these cannot:

    - a kind not registered with ``sequence_parallel=True`` (``models.LayerKind``),
      e.g. ``"mla"``: no ring implementation (the registry says why);
    - ``score="forgetting"`` (FoX): its forget gates are summed in array order;
    - layers with an explicit ``impl`` other than ``"auto"``/``"ring"``:
      those kernels would gather the whole sequence on every device.

    Args:
      model: a ``models.ModelConfig`` (its ``layers`` and ``encoder_layers``).
      name: the field's name in the messages.
    """
    able = [k.name for k in KINDS.values() if k.sequence_parallel is True]
    for field in ("layers", "encoder_layers"):
        for i, layer in enumerate(getattr(model, field, ()) or ()):
            where = f"{name}.{field}[{i}]"
            why = KINDS[layer.kind].sequence_parallel
            if why is not True:
                why = why or "not registered with sequence_parallel=True"
                raise ValueError(
                    f"{where}.kind: expected one of {able} under a mesh with seq > 1, "
                    f"got {layer.kind!r} ({why})"
                )
            if getattr(layer, "score", None) == "forgetting":
                raise ValueError(
                    f"{where}.score: expected not 'forgetting' under a mesh with seq > 1 (FoX "
                    "sums its forget gates in array order, which the sequence-parallel layout "
                    "permutes)"
                )
            impl = getattr(layer, "impl", "auto")  # a kind with an impl field runs on the ring
            if impl not in ("auto", "ring"):
                raise ValueError(
                    f"{where}.impl: expected 'auto' or 'ring' under a mesh with seq > 1, got "
                    f"{impl!r} (sequence parallelism runs softmax attention on the ring)"
                )


def in_order(model) -> bool:
    """Whether a layer of ``model`` (a ``models.ModelConfig``) runs over its tokens in array
    order: a kind registered ``in_order`` (a recurrence) or a short convolution."""
    layers = (*(getattr(model, "layers", ()) or ()), *(getattr(model, "encoder_layers", ()) or ()))
    return any(KINDS[layer.kind].in_order or layer.short_conv for layer in layers)


def seq_layout(mesh: Mesh, batch: dict, ordered: bool = False) -> dict:
    """A host batch in the sequence-parallel layout: its ``[B,T,...]`` arrays reordered
    along T by ``ring_layout`` (contiguous when ``ordered``: see ``in_order``), with
    ``positions [B,T]`` int32 (the order) added.

    Unchanged when the mesh's ``seq`` is 1.
    """
    seq = mesh.shape[SEQ_AXIS]
    if seq == 1:
        return batch
    T = next(np.shape(x)[1] for x in batch.values() if np.ndim(x) > 1)
    order = ring_layout(T, seq, ordered)
    out = {k: np.asarray(x)[:, order] if np.ndim(x) > 1 else x for k, x in batch.items()}
    B = next(iter(out.values())).shape[0]
    out["positions"] = np.broadcast_to(order.astype(np.int32), (B, T)).copy()
    return out


def shard_batch(mesh: Mesh, batch, ordered: bool = False):
    """A host batch (arrays ``[B, ...]``) as global arrays on ``mesh``: in the ``seq_layout``
    (contiguous when ``ordered``), split by ``batch_sharding``, each process supplying its
    own block."""
    batch = seq_layout(mesh, batch, ordered)
    specs = {k: batch_sharding(mesh, np.ndim(x)) for k, x in batch.items()}
    return distributed.put_batch(mesh, batch, specs)
