"""``python -m analysis.claims``: every claim the project reproduces, one measured row each.

    python -m analysis.claims                  # fast checks (1-9) + committed results (10-19)
    python -m analysis.claims --run            # also runs the comparison and the experiments
    python -m analysis.claims --only 1,5,10    # some rows only

Claims 1 to 9 are fast checks computed here with ``attn`` and ``models``
(``analysis.claim_checks``; under a minute on 2 CPU cores). Claim 10 reads the
main comparison's ``compare_mqar/results.json`` (``python -m train.compare``);
claims 11 to 19 read the experiments' ``<name>/results.json``
(``analysis.experiments``), each of which states its own measured value,
criterion and verdict. Without ``--run`` those files are read from
``--results`` (default: the committed ``docs/results/``); a file that is not
there gives a row "not run (use --run)", never a made-up value. With ``--run``
claim 10 runs ``python -m train.compare --quick`` and claims 11 to 19 run each
experiment with its full config (the state-tracking experiment once, for its
two rows), all into ``--out``, and the rows read what they wrote.

Each row is made in ``analysis.claim_rows``; this module runs what ``--run``
asks for, collects the rows and writes the table.

Writes ``<out>/table.md`` and ``<out>/results.json`` and prints the table. The
exit code is 0 whether or not each claim holds (the table is a report); it is
1 when a row could not be measured (an error: a check raised, a results file
is malformed, a run failed), with the traceback on stderr.

The fast checks take about 15 s on 2 CPU cores, and ``--run`` about 17.5
minutes for claims 10 to 14 plus the recall frontier's 45 (claim 15, its cpu
scale), the state-tracking experiment's (claims 16 and 17) and the sparse recall
experiment's (claim 18) and the gated sink experiment's (claim 19); the measured
runtimes are in docs/results/README.md.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tyro

from analysis import claim_checks
from analysis.claim_rows import (
    CLAIMS,
    COMPARE,
    COMPARE_QUICK,
    EXPERIMENT_MODULES,
    EXPERIMENTS,
    RECALL_GAP,
    REPO,
    Row,
    check_row,
    compare_accuracies,
    compare_row,
    error_row,
    experiment_row,
    shown_path,
)

__all__ = [
    "CLAIMS",
    "COMPARE",
    "COMPARE_QUICK",
    "EXPERIMENTS",
    "RECALL_GAP",
    "Args",
    "Row",
    "collect",
    "compare_accuracies",
    "compare_row",
    "experiment_row",
    "format_table",
    "main",
    "write",
]

COMMITTED = REPO / "docs" / "results"


# ----------------------------------------------------------------------------
# --run: the comparison and the experiments, trained into --out


# The plugins of --plugin (train.plugins), which --run's comparison process loads too.
PLUGINS: list[str] = []
PLUGIN_HELP = (
    "--plugin MODULE (repeatable): import a module or .py file of one's own first "
    "(docs/extending.md); --run's comparison and experiments see what it adds."
)


def run_compare(out: Path) -> Path:
    """Trains ``python -m train.compare --quick`` into ``out``; returns its results.json.

    A separate process (the comparison spawns its own workers, and analysis
    uses only train's public entry points); its runs go to ``out/runs``. It
    gets this process's ``PLUGINS``, found from the current folder as here.
    """
    out = Path(out).resolve()  # the process runs in the repository, wherever we are
    cmd = [
        sys.executable,
        "-m",
        "train.compare",
        *(arg for name in PLUGINS for arg in ("--plugin", name)),
        "--quick",
        "--name",
        COMPARE_QUICK,
        "--results-dir",
        str(out),
        "--runs-dir",
        str(out / "runs"),
    ]
    print("$", " ".join(cmd), flush=True)
    path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": path})
    return out / COMPARE_QUICK / "results.json"


def _load_config(name: str):
    """``configs/<name>.py``'s ``get_config()``, loaded by path (configs are files, not imports)."""
    path = REPO / "configs" / f"{name}.py"
    if not path.is_file():
        raise ValueError(f"experiment {name}: expected a config file {path}, got none")
    spec = importlib.util.spec_from_file_location(f"_claims_config_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()  # the full config: the claim is judged on it


def run_experiment(name: str, out: Path) -> Path:
    """Runs experiment ``name`` (``analysis.experiments.<name>``, or the module
    ``EXPERIMENT_MODULES`` names) with its full config (``configs/<name>.py``) into
    ``out/<name>``."""
    import train.cli  # only --run trains: the fast checks import no train

    module = importlib.import_module(f"analysis.experiments.{EXPERIMENT_MODULES.get(name, name)}")
    # What the experiments' own command line does: a later experiment, or a
    # rerun, finds the programs it shares with an earlier one compiled.
    train.cli.enable_compilation_cache()
    out_dir = out / name
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"running analysis.experiments.{name} into {out_dir}", flush=True)
    module.run(_load_config(name), out_dir)
    return out_dir / "results.json"


# ----------------------------------------------------------------------------
# The table


def collect(
    numbers, *, run: bool = False, results: Path = COMMITTED, out: Path = Path("results/claims")
) -> list[Row]:
    """The rows of claims ``numbers``, in order.

    Args:
      numbers: claim numbers, 1 to 19.
      run: train the comparison and run the experiments (into ``out``) first,
        and read their results from ``out``; else read them from ``results``.
      results: where the results of claims 10-19 are read without ``run``.
      out: where ``run`` writes them.
    """
    rows, ran = [], {}
    for number in sorted(set(numbers)):
        if number in claim_checks.CHECKS:
            rows.append(check_row(number))
        elif number == 10:
            path = Path(results) / COMPARE / "results.json"
            if run:
                try:
                    path = run_compare(Path(out))
                except Exception as e:
                    rows.append(error_row(10, "python -m train.compare --quick", e))
                    continue
            rows.append(compare_row(path))
        else:
            name = EXPERIMENTS[number]
            path = Path(results) / name / "results.json"
            if run:
                try:
                    if name not in ran:  # one run serves every row of the experiment
                        ran[name] = run_experiment(name, Path(out))
                    path = ran[name]
                except Exception as e:
                    module = EXPERIMENT_MODULES.get(name, name)
                    rows.append(error_row(number, f"analysis.experiments.{module}", e))
                    continue
            rows.append(experiment_row(number, path))
    return rows


def _cell(text: str) -> str:
    """A markdown table cell: pipes escaped (|q||k| would end the cell), no newlines."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def format_table(rows: list[Row], *, header: str = "") -> str:
    """The markdown table: one row per claim."""
    lines = ["# Claims about self-attention, measured", ""]
    if header:
        lines += [header, ""]
    lines += [
        "| # | claim | measured | criterion | result |",
        "|---:|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.number} | {_cell(r.claim)} | {_cell(r.measured)} | {_cell(r.criterion)} "
            f"| {r.status} |"
        )
    lines += [
        "",
        "Claims 1-9 are measured by `analysis.claim_checks` on every run; claim 10 reads the "
        "main comparison (`python -m train.compare`), claims 11-19 the experiments of "
        '`analysis.experiments`, which state their own criterion and verdict. "not run": no '
        "results file yet (`python -m analysis.claims --run` produces them).",
        "",
    ]
    return "\n".join(lines)


def _finite(x):
    """``x`` with NaN and infinities as None, recursively (strict JSON has neither)."""
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write(rows: list[Row], out: Path, meta: dict[str, Any]) -> tuple[Path, Path]:
    """Writes ``out/table.md`` and ``out/results.json``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    header = meta.get("header", "")
    table, data = out / "table.md", out / "results.json"
    table.write_text(format_table(rows, header=header))
    record = {
        **{k: v for k, v in meta.items() if k != "header"},
        "rows": [_finite(dataclasses.asdict(r)) for r in rows],
    }
    data.write_text(json.dumps(record, indent=1, allow_nan=False) + "\n")
    return table, data


@dataclass(frozen=True)
class Args:
    """Measure every claim; print and write a table (table.md, results.json).

    Attributes:
      run: also train the comparison (``train.compare --quick``, a few minutes)
        and run the four experiments with their full configs, into ``out``.
      out: where table.md and results.json (and, with ``run``, the runs) go.
      only: comma-separated claim numbers, e.g. ``1,5,10``; empty: all 19.
      results: where claims 10-19 are read from without ``run`` (the committed results).
      no_compilation_cache: ``run`` compiles afresh, without the persistent compilation
        cache (``train.cli.compilation_cache_dir``).
    """

    run: bool = False
    out: Path = Path("results/claims")
    only: str = ""
    results: Path = COMMITTED
    no_compilation_cache: bool = False


def _numbers(only: str) -> list[int]:
    if not only.strip():
        return list(CLAIMS)
    try:
        numbers = [int(x) for x in only.split(",") if x.strip()]
    except ValueError:
        numbers = []
    if not numbers or any(n not in CLAIMS for n in numbers):
        raise ValueError(f"--only: expected comma-separated claim numbers 1 to 19, got {only!r}")
    return numbers


def main(argv=None) -> int:
    """``python -m analysis.claims [--plugin M] [--run] [--out D] [--only 1,2] [--results D]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--plugin" or a.startswith("--plugin=") for a in argv):
        import train.plugins  # only then: the fast checks import no train

        try:
            loaded, argv = train.plugins.from_argv(argv)
            PLUGINS.extend(loaded)  # --run's comparison and experiments see them too
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    args = tyro.cli(
        Args,
        args=argv,
        prog="python -m analysis.claims",
        description=f"{Args.__doc__.splitlines()[0]}\n\n{PLUGIN_HELP}",
    )
    numbers = _numbers(args.only)
    if args.no_compilation_cache:
        import train.cli

        train.cli.disable_compilation_cache()
    t0 = time.perf_counter()
    rows = collect(numbers, run=args.run, results=args.results, out=args.out)
    total = time.perf_counter() - t0
    fast = sum(r.seconds for r in rows if r.number in claim_checks.CHECKS)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    cpu = time.process_time()  # this process's CPU time since it started, imports included
    header = (
        f"`python -m analysis.claims{' --run' if args.run else ''}`: fast checks "
        f"{fast:.1f} s, all rows {total:.1f} s (wall clock; {cpu:.0f} s of CPU time for the "
        f"whole process, imports included) on {os.cpu_count()} CPU cores, load average {load} "
        "at the end."
    )
    table, data = write(
        rows,
        Path(args.out),
        {
            "header": header,
            "run": args.run,
            "results_read_from": shown_path(Path(args.out) if args.run else Path(args.results)),
            "fast_checks_s": fast,
            "total_s": total,
            "process_cpu_s": cpu,
            "load_average": load,
            "cpu_count": os.cpu_count(),
        },
    )
    print(format_table(rows, header=header))
    print(f"wrote {table} and {data}")
    return 1 if any(r.status == "error" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
