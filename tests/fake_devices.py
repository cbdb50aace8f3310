"""Checks that need several CPU devices run in a subprocess, once per test session.

The device count must be set before JAX starts, so a file of checks (the ring
checks, the sharded-training cases) runs in its own process with
``--xla_force_host_platform_device_count=8`` and prints one JSON line per case.
``results`` runs it once per session: the first caller runs it and the others,
pytest-xdist workers included, read its results, written next to the session's
temporary folders under a file lock (xdist's recipe for a session fixture that
runs once), so a worker never runs it again, whichever of its tests it gets.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]
DEVICES = "--xla_force_host_platform_device_count=8"


def results(tmp_path_factory, key: str, argv: list[str], timeout: float) -> dict[str, dict]:
    """``{case: result}`` of ``python argv...`` on 8 fake CPU devices, run once per session.

    Args:
      tmp_path_factory: pytest's fixture.
      key: names the run's files in the shared folder.
      argv: the command after ``python``, run from the repository root; it prints
        one JSON object per line, each with a ``"case"``.
      timeout: seconds.

    Raises:
      AssertionError: the subprocess reported no case (its stderr is in the message).
    """
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    with open(shared / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = shared / f"{key}.json"
        if not done.exists():
            done.write_text(json.dumps(_run(argv, timeout)))
        found = json.loads(done.read_text())
    assert "error" not in found, found["error"]
    return found


def _run(argv: list[str], timeout: float) -> dict[str, dict]:
    env = {
        **os.environ,
        # The device count, after the flags of the tests' own process (tests/conftest.py).
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {DEVICES}",
        "JAX_PLATFORMS": "cpu",
    }
    if jax.config.jax_compilation_cache_dir:  # the tests' cache (tests/train/conftest.py)
        env["JAX_COMPILATION_CACHE_DIR"] = jax.config.jax_compilation_cache_dir
    out = subprocess.run(
        [sys.executable, *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    found = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if not found:  # the others then fail at once instead of rerunning
        return {"error": f"no result (exit {out.returncode}):\n{out.stderr[-3000:]}"}
    return {r["case"]: r for r in found}


def run_cases(cases: dict, names) -> int:
    """Runs the named cases (all if none) of a checks file, one JSON line each; the exit status.

    A case returns a dict with ``"ok"``; one that raises is reported (with its
    traceback) and the others still run.
    """
    failed = 0
    for name in names or cases:
        start = time.perf_counter()
        try:
            result = cases[name]()
        except Exception:  # report and go on: one broken case must not hide the others
            result = {"ok": False, "exception": traceback.format_exc()}
        result = {"case": name, **result, "seconds": round(time.perf_counter() - start, 2)}
        failed += not result["ok"]
        print(json.dumps(result), flush=True)
    return 1 if failed else 0


def mesh_of(num_devices: int, explicit: bool = False, axis: str = "seq"):
    """A one-axis mesh of the first devices: Auto axis types (``Mesh``) or Explicit ones
    (``jax.make_mesh``)."""
    from jax.sharding import AxisType, Mesh

    devices = jax.devices()[:num_devices]
    if explicit:
        mesh = jax.make_mesh((num_devices,), (axis,), devices=devices)
        assert mesh.axis_types == (AxisType.Explicit,)
        return mesh
    import numpy as np

    return Mesh(np.array(devices), (axis,))
