"""What the phases of ``bench/device.py`` share: the phase protocol and timing one program.

A phase is a module ``bench/_device_<phase>.py`` with:

* ``TITLE: str``, its section's heading, and ``WEIGHT: float``, its share of the
  run's budget (the shares of phases that finish early pass to the next ones);
* ``items(dry_run: bool) -> list[dict]``: its work, JSON-able dicts each with a
  ``"name"`` unique in the phase, most important first (a budget cut drops the tail);
* ``run_item(item: dict, ctx: Context) -> dict``: one item, in the phase's child
  process; returns ``{"status": "ok" | "failed: ..." | "not measured: ...", ...}``
  (an exception it raises is recorded as ``failed: Type: message``);
* ``markdown(rows: list[dict], info: dict) -> str``: its section of the report
  (``rows``: each item merged with its result; ``info``: the device, its
  measured matmul rate and peak, whether this is a dry run);
* optionally ``finish(rows, info, out_dir: Path) -> list[Path]``: files of its
  own (a figure, the Pallas kernel's tuning cache), written by the parent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

GiB = 2**30


@dataclass(frozen=True)
class Context:
    """What a phase's ``run_item`` knows of the run."""

    dry_run: bool  # a CPU, tiny shapes, interpret mode: the script is checked, not the device
    platform: str  # jax.default_backend(): "gpu" or "cpu"
    device_kind: str  # e.g. "NVIDIA H200"
    matmul_tflops: float  # measured: one bf16 n x n x n product (n = 8192 on a GPU)
    peak_tflops: float | None  # the data sheet's dense bf16 peak, where known
    deadline: float  # time.time() past which the phase's items are not started
    fla_path: str | None  # a folder holding fla's source (the ``fla`` package), or None
    repeats: int = 10  # timed runs after the warm-up (fewer for slow programs)

    def left(self) -> float:
        return self.deadline - time.time()


def interpreted(impl: str = "pallas") -> dict:
    """The setting ``impl`` takes here: ``{"interpret": True}`` for a Pallas kernel (``impl``
    ``"pallas"``, ``"splash"`` or ``"mosaic"``) on a CPU backend, where a dry run asks for
    the interpreter (the library never picks it in silence); else nothing."""
    import jax

    kernel = impl in ("pallas", "splash", "mosaic")
    return {"interpret": True} if kernel and jax.default_backend() == "cpu" else {}


def program_bytes(compiled) -> int | None:
    """Device memory XLA's buffer assignment gives a compiled program (args + outputs + temps)."""
    memory = compiled.memory_analysis()
    if memory is None:
        return None
    return (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        + memory.temp_size_in_bytes
        - memory.alias_size_in_bytes
    )


def best_seconds(run, repeats: int, max_seconds: float = 1.0) -> float:
    """Best wall time of ``run()`` (which blocks until done) over ``repeats`` runs after a
    warm-up; a slow program gets fewer runs (they stop once ``max_seconds`` were spent)."""
    run()
    times = []
    while len(times) < repeats:
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
        if sum(times) > max_seconds:
            break
    return min(times)


def time_jax(fn, args, repeats: int) -> dict:
    """Compiles ``fn`` on ``args`` ahead of time and times it: ms, compile seconds, bytes."""
    import jax

    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_seconds = time.perf_counter() - start
    seconds = best_seconds(lambda: jax.block_until_ready(compiled(*args)), repeats)
    return {
        "ms": seconds * 1e3,
        "compile_seconds": compile_seconds,
        "program_bytes": program_bytes(compiled),
    }


def grad_step(fn, argnums):
    """``fn``'s forward + backward: the gradient of ``sum(fn(*args) * ct)`` w.r.t. ``argnums``.

    The cotangent ``ct`` is the last argument; ``fn``'s output (or its first
    output) is cast to float32 before the product.
    """
    import jax
    import jax.numpy as jnp

    def step(*args):
        *inputs, ct = args

        def loss(*inputs):
            out = fn(*inputs)
            out = out[0] if isinstance(out, tuple) else out
            return (out.astype(jnp.float32) * ct).sum()

        return jax.grad(loss, argnums=argnums)(*inputs)

    return step
