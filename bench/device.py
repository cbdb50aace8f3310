"""One prepared run on one accelerator: every family's numerics and timings, the tuned kernel.

A device machine is lent now and then, for minutes at a time, so everything it
should measure is one command that keeps to a budget (9 minutes on one H200 in
all, the device's start excepted). It runs these phases, each a module
``bench/_device_<phase>.py`` (the protocol: ``bench/_device_common.py``), in
order:

1. ``numerics``: every family's forms on the device against float64 (float32
   where the device has no float64) on the same inputs: softmax in each impl,
   linear attention, the delta-rule family, SSD, the sparse families, decoding;
2. ``tune``: the Pallas (Triton) flash kernel's tiles and launch settings swept
   per case; the winners go to ``attn/pallas/tuned.json`` for the device's name,
   which ``impl="pallas"`` reads;
3. ``families``: each family's forms, forward and forward + backward at 2K to
   32K tokens, beside its peer in the same run (cuDNN for softmax, fla's Triton
   kernels through torch for the linear, delta and SSD families);
4. ``train``: a training step of the language-model comparison's models at a
   GPU size: tokens/s and model FLOP utilisation per variant.

Each phase runs in a child process of its own (a crash, a hang or an
out-of-memory in one leaves the others' numbers alone; a crashed child is
restarted on the items left). The budget is shared by the phases in proportion
to their ``WEIGHT``; a phase that finishes early leaves its time to the next
ones, and the items past a phase's share are listed as not measured. A child is
stopped ``GRACE_SECONDS`` after its share, and none runs past the budget by more
than that.

Writes ``bench/results/device-<device>.{json,md}`` (and the phases' own files:
figures, the tuning cache). On a device machine, from the repository root (the
device image has jax, flax, optax, orbax, chex and torch; tyro travels as
wheels, fla's source as a folder: ``tools/device_prep.sh`` fetches both here)::

    tools/device_prep.sh                        # here: .whl/ (tyro) and .peers/fla
    tools/device_run.sh                         # there: carry .whl and .peers; ~9 minutes
    python bench/device.py --dry-run            # a CPU, tiny shapes: checks the script

``--dry-run`` runs every phase on the CPU at tiny shapes (the Pallas kernels in
interpret mode; cuDNN and fla listed as not measured) and writes
``device-dry-run.*`` with the tuning cache beside them.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The repository first, always: run as a script, this folder leads sys.path, and with the
# root on PYTHONPATH too (as on a device machine) bench/models.py would shadow `models`.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT]

from bench._device_common import Context  # noqa: E402

PHASES = ("numerics", "tune", "families", "train")
GRACE_SECONDS = 45.0  # how long a child may run past its share (an item under way)
CHILD_VAR = "ATTN_DEVICE_CHILD"
# Dense bf16 tensor-core peaks (TFLOP/s, without sparsity), from the vendor's data sheets.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0}


@dataclass(frozen=True)
class Config:
    """The device run's settings (flags: --dry-run, --budget-seconds, --phases, ...)."""

    dry_run: bool = False  # a CPU, tiny shapes, interpret mode: checks the script, not a device
    budget_seconds: float = 480.0  # the probe and every phase; the report and GRACE_SECONDS on top
    phases: tuple[str, ...] = PHASES
    fla_path: str = ".peers/fla"  # fla's source (a folder holding the fla package), for the peers
    repeats: int = 10  # timed runs after each warm-up (fewer for slow programs)
    out_dir: str = "bench/results"


def phase_module(name: str):
    """``bench._device_<name>`` for a name in PHASES; a dotted name is a module path (a test's
    phase of its own)."""
    if "." in name:
        return importlib.import_module(name)
    if name not in PHASES:
        raise ValueError(f"phases: expected names from {PHASES} or a module path, got {name!r}")
    return importlib.import_module(f"bench._device_{name}")


def peak_tflops(device_kind: str) -> float | None:
    return next((v for k, v in PEAK_TFLOPS.items() if k in device_kind), None)


def shares(weights: list[float], left: float) -> list[float]:
    """Each phase's seconds out of ``left``, in proportion to the weights (what
    ``main`` gives the first phase; it recomputes the rest from what is left)."""
    total = sum(weights)
    return [left * w / total for w in weights] if total > 0 else [0.0] * len(weights)


# ----------------------------------------------------------------------------
# The children: the probe, and one phase's items each.


def probe(dry_run: bool) -> dict:
    """The device's platform, kind and measured bf16 matmul rate (an n x n x n product, best
    of 10 after a warm-up; n = 8192 on an accelerator, 256 in a dry run)."""
    import jax
    import jax.numpy as jnp

    from bench._device_common import best_seconds

    n = 256 if dry_run else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    product = jax.jit(lambda a, b: a @ b).lower(a, a).compile()
    seconds = best_seconds(lambda: jax.block_until_ready(product(a, a)), 10)
    device = jax.local_devices()[0]
    return dict(
        platform=jax.default_backend(),
        kind=device.device_kind,
        matmul_tflops=2 * n**3 / seconds / 1e12,
        jax=jax.__version__,
    )


def child_main(spec: dict) -> None:
    """Runs ``spec``'s work, printing one JSON line per item (the probe: one line)."""
    if spec["dry_run"]:
        os.environ["JAX_PLATFORMS"] = "cpu"
    if spec["phase"] == "probe":
        print(json.dumps(probe(spec["dry_run"])), flush=True)
        return
    module = phase_module(spec["phase"])
    ctx = Context(**spec["context"])
    for item in spec["items"]:
        if time.time() > ctx.deadline:
            result = {"status": "not measured: time budget"}
        else:
            try:
                result = module.run_item(item, ctx)
            except Exception as e:  # a lowering error or an out-of-memory: record it, go on
                result = {"status": f"failed: {type(e).__name__}: {str(e)[:300]}"}
        print(json.dumps(dict(item, **result), default=float), flush=True)


def run_child(spec: dict, timeout: float) -> list[dict]:
    """Runs one child on ``spec["items"]``, restarting it after a crash; one row per item."""
    todo, rows = list(spec["items"]), []
    while True:
        env = dict(os.environ, **{CHILD_VAR: json.dumps(dict(spec, items=todo))})
        if spec["dry_run"]:
            env["JAX_PLATFORMS"] = "cpu"
        try:
            run = subprocess.run(
                [sys.executable, str(Path(__file__).resolve())],
                env=env, capture_output=True, text=True, timeout=max(timeout, 1.0),
            )  # fmt: skip
            stdout, failure = run.stdout, None
            if run.returncode != 0:
                tail = (run.stderr.strip().splitlines() or [""])[-1][:300]
                failure = f"failed (exit {run.returncode})" + (f": {tail}" if tail else "")
        except subprocess.TimeoutExpired as e:
            out = e.stdout or ""
            stdout = out.decode() if isinstance(out, bytes) else out
            failure = f"not measured: stopped {timeout:.0f} s into the phase"
        for line in stdout.splitlines():
            if line.startswith("{"):
                rows.append(json.loads(line))
                if todo:
                    todo.pop(0)
        if failure is None or not todo or spec["phase"] == "probe":
            if failure and spec["phase"] == "probe":
                raise RuntimeError(f"probing the device: {failure}")
            return rows
        # The item it died on is recorded; the rest go to a fresh child, or are cut.
        rows.append(dict(todo.pop(0), status=failure))
        if failure.startswith("not measured"):
            return rows + [dict(item, status="not measured: time budget") for item in todo]


# ----------------------------------------------------------------------------
# The run and its report.


def main(cfg: Config) -> dict:
    started = time.time()
    modules = {name: phase_module(name) for name in cfg.phases}
    end = started + cfg.budget_seconds
    info = run_child(dict(phase="probe", dry_run=cfg.dry_run, items=[{}]), timeout=300)[0]
    if not cfg.dry_run and info["platform"] == "cpu":
        raise SystemExit(f"bench/device.py needs an accelerator (JAX sees {info['platform']}); "
                         "try --dry-run")  # fmt: skip
    info.update(peak_tflops=peak_tflops(info["kind"]), dry_run=cfg.dry_run)
    fla = Path(cfg.fla_path) if Path(cfg.fla_path).is_absolute() else ROOT / cfg.fla_path
    kind = "dry-run" if cfg.dry_run else info["kind"].replace(" ", "_")
    out = Path(cfg.out_dir) if Path(cfg.out_dir).is_absolute() else ROOT / cfg.out_dir
    out.mkdir(parents=True, exist_ok=True)
    phases, files = {}, []
    for n, name in enumerate(cfg.phases):
        module, begun = modules[name], time.time()
        weights = [modules[p].WEIGHT for p in cfg.phases[n:]]
        share = shares(weights, max(end - begun, 0.0))[0]
        context = Context(
            dry_run=cfg.dry_run,
            platform=info["platform"],
            device_kind=info["kind"],
            matmul_tflops=info["matmul_tflops"],
            peak_tflops=info["peak_tflops"],
            deadline=begun + share,
            fla_path=str(fla) if fla.is_dir() else None,
            repeats=2 if cfg.dry_run else cfg.repeats,
        )
        items = module.items(cfg.dry_run)
        spec = dict(phase=name, dry_run=cfg.dry_run, items=items,
                    context=dataclasses.asdict(context))  # fmt: skip
        timeout = min(share, end - begun) + GRACE_SECONDS
        rows = run_child(spec, timeout) if items else []
        # A phase's own files are written before the next phase starts: the families and
        # the training step then run the Pallas kernel with the settings just tuned.
        finish = getattr(module, "finish", None)
        files += [str(p) for p in finish(rows, info, out)] if finish else []
        phases[name] = dict(share_seconds=share, seconds=time.time() - begun, rows=rows)
        print(f"{name}: {count_statuses(rows)} in {phases[name]['seconds']:.0f} s "
              f"of {share:.0f}", flush=True)  # fmt: skip
    result = dict(device=info, config=dataclasses.asdict(cfg), phases=phases,
                  fla_commit=fla_commit(fla), files=files,
                  wall_seconds=time.time() - started)  # fmt: skip
    (out / f"device-{kind}.json").write_text(json.dumps(result, indent=2, default=float) + "\n")
    table = markdown(result, modules)
    (out / f"device-{kind}.md").write_text(table)
    print(table)
    print(f"wrote {out}/device-{kind}.{{json,md}} in {result['wall_seconds']:.0f} s")
    return result


def fla_commit(fla: Path) -> str | None:
    path = fla / "COMMIT"
    return path.read_text().strip() if path.is_file() else None


def count_statuses(rows: list[dict]) -> str:
    """``"3 ok, 1 failed, 2 not measured"``: an item's status up to its first colon."""
    counts: dict[str, int] = {}
    for row in rows:
        key = row["status"].split(":")[0].split(" (")[0]
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {key}" for key, n in counts.items()) or "no items"


def markdown(result: dict, modules: dict) -> str:
    info, cfg = result["device"], result["config"]
    peak = info["peak_tflops"]
    lines = [
        f"# Every family on {info['kind']} ({info['platform']})",
        "",
        f"`python bench/device.py{' --dry-run' if cfg['dry_run'] else ''}`: jax {info['jax']}, "
        f"{result['wall_seconds']:.0f} s of a {cfg['budget_seconds']:.0f} s budget. "
        f"Measured bf16 matmul rate: {info['matmul_tflops']:.3g} TFLOP/s"
        + (f" (data sheet peak {peak:.0f})." if peak else ".")
        + (f" fla at {result['fla_commit']}." if result["fla_commit"] else ""),
        "",
        "| phase | share (s) | used (s) | items |",
        "|---|---:|---:|---|",
    ]
    for name, phase in result["phases"].items():
        lines.append(f"| {name} | {phase['share_seconds']:.0f} | {phase['seconds']:.0f} | "
                     f"{count_statuses(phase['rows'])} |")  # fmt: skip
    for name, phase in result["phases"].items():
        module = modules[name]
        lines += ["", f"## {module.TITLE}", "", module.markdown(phase["rows"], info).rstrip()]
        cut = [r for r in phase["rows"] if r["status"] != "ok" and "FAIL" not in r["status"]]
        if cut:
            lines += ["", "Not measured or failed:", ""]
            lines += [f"- {r['name']}: {r['status']}" for r in cut]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if CHILD_VAR in os.environ:
        child_main(json.loads(os.environ[CHILD_VAR]))
    else:
        import tyro

        main(tyro.cli(Config))
