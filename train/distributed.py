"""Several hosts: ``jax.distributed`` from the environment, and each process's part of a batch.

On several hosts every process runs the same command (``python -m train ...``).
``initialize()`` joins them into one JAX runtime before anything else touches
JAX, so ``jax.devices()`` lists every host's devices and one mesh spans them.
It acts when the environment describes a multi-process job:

- explicitly: ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0, which JAX
  itself reads), ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` (which it does not:
  they are passed as arguments here);
- or a cluster JAX detects on its own (``jax.distributed.initialize()`` without
  arguments): a Slurm job step with ``SLURM_NTASKS > 1``, an Open MPI launch
  (``mpirun``) with ``OMPI_COMM_WORLD_SIZE > 1``, a Cloud TPU pod slice with
  several hosts in ``TPU_WORKER_HOSTNAMES``.

Otherwise (one process, the usual case) it does nothing. The processes wait
``ATTNLAB_JOIN_TIMEOUT`` seconds (60 by default, ``train.supervisor.join_timeout``)
for each other to join; then JAX aborts each, and ``python -m train`` says which
process did not join.

Batches. Every process builds the same global batch (the tasks' batches are a
function of ``(seed, step)``), takes the block its own devices hold
(``process_block``: rows over ``data * fsdp``, sequence columns over ``seq``)
and hands it to ``jax.make_array_from_process_local_data``. The global array is
then the same on every process count, so a run's result does not depend on
how its devices are spread over hosts. ``train.sharding.make_mesh`` orders the
devices process by process (``jax.devices()`` is sorted that way), so each
process holds one rectangle of every batch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import jax
import numpy as np

# EXIT_PEER_LOST: ``python -m train``'s exit status when another process of the job stopped.
from train.supervisor import EXIT_PEER_LOST, join_timeout

__all__ = [
    "EXIT_PEER_LOST",
    "initialize",
    "is_runtime_failure",
    "local_batch",
    "lost_peer",
    "multihost_settings",
    "process_block",
    "put_batch",
]

# The variables that make a launch explicit (JAX reads only the first itself).
EXPLICIT = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")

# Clusters JAX detects on its own: (a variable that marks it, the process count's variable).
CLUSTERS = (
    ("slurm", "SLURM_JOB_ID", "SLURM_NTASKS"),
    ("ompi", "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE"),
)


def _int(environ: Mapping[str, str], name: str, minimum: int) -> int:
    value = environ.get(name)
    if value is None or not value.strip().isdigit() or int(value) < minimum:
        raise ValueError(
            f"{name}: expected an int >= {minimum} (with JAX_COORDINATOR_ADDRESS set), "
            f"got {value!r}"
        )
    return int(value)


def multihost_settings(environ: Mapping[str, str] | None = None) -> dict | None:
    """The keyword arguments of ``jax.distributed.initialize`` this environment calls for.

    Args:
      environ: the environment (default ``os.environ``).

    Returns:
      None for a single process; ``{initialization_timeout}`` where JAX detects the
      cluster itself; ``{coordinator_address, num_processes, process_id,
      initialization_timeout}`` for an explicit launch.

    Raises:
      ValueError: naming the variable, for an explicit launch with
        ``JAX_NUM_PROCESSES`` or ``JAX_PROCESS_ID`` missing or out of range, or a
        malformed ``ATTNLAB_JOIN_TIMEOUT``.
    """
    environ = os.environ if environ is None else environ
    address = environ.get("JAX_COORDINATOR_ADDRESS")
    if address:
        count = _int(environ, "JAX_NUM_PROCESSES", 1)
        index = _int(environ, "JAX_PROCESS_ID", 0)
        if index >= count:
            raise ValueError(
                f"JAX_PROCESS_ID: expected an int in [0, JAX_NUM_PROCESSES={count}), got {index}"
            )
        return {
            "coordinator_address": address,
            "num_processes": count,
            "process_id": index,
            "initialization_timeout": join_timeout(environ),
        }
    for _, marker, count in CLUSTERS:
        value = environ.get(count, "")
        if marker in environ and value.isdigit() and int(value) > 1:
            return {"initialization_timeout": join_timeout(environ)}
    hosts = [h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    return {"initialization_timeout": join_timeout(environ)} if len(hosts) > 1 else None


def initialize(environ: Mapping[str, str] | None = None, *, init: Callable | None = None) -> bool:
    """Calls ``jax.distributed.initialize`` if the environment is a multi-process job.

    Call it first, before any JAX computation (``python -m train`` does).

    Args:
      environ: the environment (default ``os.environ``).
      init: the initializer (default ``jax.distributed.initialize``; tests pass a fake).

    Returns:
      True if it initialized the distributed runtime.
    """
    settings = multihost_settings(environ)
    if settings is None or (init is None and jax.distributed.is_initialized()):
        return False
    (init or jax.distributed.initialize)(**settings)
    return True


# The status codes XLA's runtime errors start with ("UNKNOWN: Gloo all-reduce failed: ...").
_STATUS_CODES = ("UNKNOWN", "UNAVAILABLE", "INTERNAL", "ABORTED", "DEADLINE_EXCEEDED", "CANCELLED")


def is_runtime_failure(error: BaseException) -> bool:
    """Whether ``error`` is a failure of XLA's runtime (a collective, the coordinator).

    ``jax.errors.JaxRuntimeError``, or the ``ValueError`` some dispatch paths
    raise with the same status-coded message (``multihost_utils``'s all-gather,
    which orbax's saves synchronize with); never one of attnlab's own
    ``ValueError`` s, which start with the argument's name.
    """
    if isinstance(error, jax.errors.JaxRuntimeError):
        return True
    return isinstance(error, ValueError) and str(error).split(":", 1)[0] in _STATUS_CODES


def lost_peer(error: BaseException) -> str:
    """The one line ``python -m train`` prints when a collective of a multi-process job fails.

    On CPU (gloo) a killed process closes its connections, so the others'
    next collective fails at once with this error; on accelerators the
    coordinator's heartbeat timeout ends the job.
    """
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"process {jax.process_index()} of {jax.process_count()}: a collective failed, so "
        f"another process of the job has stopped ({first}); restart every process with the "
        "same command to resume from the last checkpoint"
    )


def process_block(process_grid, process_index: int, shape) -> tuple[slice, slice]:
    """The block of a global ``[B,T]`` batch that one process's devices hold.

    The batch axis B is split over ``data * fsdp`` (row block ``d * fsdp + f``)
    and the sequence axis T over ``seq``, as ``train.sharding.batch_sharding``
    lays it out.

    Args:
      process_grid: ``[data, fsdp, seq]`` ints, the process index of each mesh device.
      process_index: the process.
      shape: ``(B, T)`` of the global batch (divisible by ``data * fsdp`` and ``seq``).

    Returns:
      ``(rows, cols)`` slices; the process's data is ``batch[rows, cols]``.

    Raises:
      ValueError: naming ``process_index`` if the process holds no device, or
        ``process_grid`` if its devices do not hold one rectangle of the batch.
    """
    grid = np.asarray(process_grid)
    if grid.ndim != 3:
        raise ValueError(f"process_grid: expected [data, fsdp, seq] ints, got shape {grid.shape}")
    data, fsdp, seq = grid.shape
    B, T = shape
    rows, cols = np.nonzero(grid.reshape(data * fsdp, seq) == process_index)
    if rows.size == 0:
        raise ValueError(
            f"process_index: expected a process holding devices of the mesh "
            f"(those in {sorted(set(grid.ravel().tolist()))}), got {process_index}"
        )
    r0, r1, c0, c1 = rows.min(), rows.max() + 1, cols.min(), cols.max() + 1
    if (r1 - r0) * (c1 - c0) != rows.size:
        raise ValueError(
            f"process_grid: expected each process's devices to hold one rectangle of the "
            f"batch (order the mesh's devices process by process), got process "
            f"{process_index} on blocks {sorted(zip(rows.tolist(), cols.tolist(), strict=True))}"
        )
    b, t = B // (data * fsdp), T // seq
    return slice(int(r0) * b, int(r1) * b), slice(int(c0) * t, int(c1) * t)


def _grid(mesh) -> np.ndarray:
    """``[data, fsdp, seq]`` process indices of ``mesh``'s devices."""
    return np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)


def local_batch(mesh, batch: dict, process_index: int | None = None) -> dict:
    """This process's part of a host batch (``[B,T,...]`` and ``[B]`` arrays): ``process_block``.

    Args:
      mesh: the ``train.sharding`` mesh (axes data, fsdp, seq).
      batch: the global batch, the same on every process.
      process_index: default ``jax.process_index()``.
    """
    index = jax.process_index() if process_index is None else process_index
    grid = _grid(mesh)
    out = {}
    for name, x in batch.items():
        x = np.asarray(x)
        shape = (x.shape[0], x.shape[1] if x.ndim > 1 else grid.shape[2])
        rows, cols = process_block(grid, index, shape)
        out[name] = x[rows, cols] if x.ndim > 1 else x[rows]
    return out


def put_batch(mesh, batch: dict, shardings: dict) -> dict:
    """Global arrays of a host batch, each process supplying only its own part.

    Args:
      mesh: the mesh; batch: the global host batch; shardings: one
        ``NamedSharding`` per array of ``batch``.
    """
    local = local_batch(mesh, batch)
    return {
        name: jax.make_array_from_process_local_data(shardings[name], local[name], x.shape)
        for name, x in batch.items()
    }
