"""``python -m analysis.claims``: every claim the project reproduces, one measured row each.

    python -m analysis.claims                  # fast checks (1-9) + committed results (10-18)
    python -m analysis.claims --run            # also runs the comparison and the experiments
    python -m analysis.claims --only 1,5,10    # some rows only

Claims 1 to 9 are fast checks computed here with ``attn`` and ``models``
(``analysis.claim_checks``; under a minute on 2 CPU cores). Claim 10 reads the
main comparison's ``compare_mqar/results.json`` (``python -m train.compare``);
claims 11 to 18 read the experiments' ``<name>/results.json``
(``analysis.experiments``), each of which states its own measured value,
criterion and verdict. Without ``--run`` those files are read from
``--results`` (default: the committed ``docs/results/``); a file that is not
there gives a row "not run (use --run)", never a made-up value. With ``--run``
claim 10 runs ``python -m train.compare --quick`` and claims 11 to 18 run each
experiment with its full config (the state-tracking experiment once, for its
two rows), all into ``--out``, and the rows read what they wrote.

Writes ``<out>/table.md`` and ``<out>/results.json`` and prints the table. The
exit code is 0 whether or not each claim holds (the table is a report); it is
1 when a row could not be measured (an error: a check raised, a results file
is malformed, a run failed), with the traceback on stderr.

The fast checks take about 15 s on 2 CPU cores, and ``--run`` about 17.5
minutes for claims 10 to 14 plus the recall frontier's 45 (claim 15, its cpu
scale), the state-tracking experiment's (claims 16 and 17) and the sparse recall
experiment's (claim 18); the measured
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
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tyro

from analysis import claim_checks

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

REPO = Path(__file__).resolve().parent.parent
COMMITTED = REPO / "docs" / "results"

CLAIMS: dict[int, str] = {
    1: "The 3-token worked example (d_k = 2) has weights [[.40,.20,.40],[.20,.40,.40],"
    "[.25,.25,.50]] and outputs [[.6,.4],[.4,.6],[.5,.5]]",
    2: "q.k of random unit-variance 64-dim vectors has std ~8, ~1 after dividing by sqrt(64)",
    3: "softmax([1,2,3]) = [.09,.24,.67], softmax([8,16,24]) ~ [0,.0003,.9997], and the "
    "gradient through the saturated softmax is near zero",
    4: "Attention without positions is permutation-equivariant",
    5: "With a causal mask one forward pass gives the per-position losses of T separate "
    "prefix passes",
    6: "With RoPE the score of q at m and k at n depends only on m - n",
    7: "Llama 3 8B's KV cache is 128 KiB/token, 1 GiB at 8K, 16 GiB for 16 requests, 4x with "
    "MHA; GQA/MQA shrink it by N/K; MLA caches a latent",
    8: "Blockwise (FlashAttention) attention is exact and its memory is linear in T",
    9: "Causal linear attention is an RNN with a fixed-size state (parallel = recurrent = "
    "chunkwise)",
    10: "Linear attention is weaker than softmax attention at exact recall (MQAR, equal width)",
    11: "Induction heads form with a jump in in-context learning",
    12: "Heads put mass on the first token; a window plus sinks keeps streaming perplexity "
    "stable past the training length, a plain window does not",
    13: "Many heads can be pruned with little loss",
    14: "Window layers interleaved with global layers keep long-range paths",
    15: "What a fixed state buys in recall: the delta rule reaches attention's MQAR accuracy "
    "at a state where linear attention stays near chance (Zoology's recall-memory frontier)",
    16: "State tracking needs negative eigenvalues: a linear RNN with transitions in (0, 1] "
    "does not learn parity at every length, one with transitions reaching -1 does "
    "(Grazzi et al. 2025)",
    17: "S5's word problem (not solvable) separates the families: products of Householders "
    "(DeltaProduct) can track it, fixed-depth attention and diagonal SSMs cannot "
    "(Merrill et al. 2024, Siems et al. 2025)",
    18: "Trainable sparse attention (MoBA, NSA, DSA) keeps exact long-range lookups where a "
    "window reading as many keys per query does not",
}

# Claims 11-18: the experiment (module analysis.experiments.<name>, config
# configs/<name>.py) whose results.json holds the row, in its entry "claim"
# unless CLAIM_KEYS names another (one experiment may hold two rows).
EXPERIMENTS: dict[int, str] = {
    11: "induction_heads",
    12: "sinks_streaming",
    13: "head_pruning",
    14: "windows_global",
    15: "recall_frontier",
    16: "state_tracking",
    17: "state_tracking",
    18: "sparse",
}
CLAIM_KEYS: dict[int, str] = {17: "claim_s5"}
COMPARE = "compare_mqar"  # the main job's results folder (python -m train.compare)
COMPARE_QUICK = "compare_mqar_quick"  # what --run trains (python -m train.compare --quick)
# Claim 10's criterion, fixed before reading any result: softmax MHA recalls at
# least 10 accuracy points more than linear attention at the same width.
RECALL_GAP = 0.10
# The delta-rule variants claim 10's row places between softmax and linear attention.
DELTA_VARIANTS = ("deltanet", "gated_deltanet", "kda")

NOT_RUN = "not run (use --run)"


@dataclass(frozen=True)
class Row:
    """One claim's line of the table.

    Attributes:
      number: the claim's number, 1 to 18.
      claim: the claim in a short sentence.
      measured: what was measured (or why nothing was).
      criterion: what the measurement is judged by.
      holds: True, False, or None when not run or not measurable.
      status: ``"holds"``, ``"does not hold"``, ``"not run"`` or ``"error"``.
      source: where the value comes from (a fast check, or a results file).
      seconds: how long this row took here (a check's run, or reading a file);
        for a file, its own ``runtime_s`` is in ``runtime_s``.
      runtime_s: the experiment's or comparison's recorded runtime, if any.
      values: the numbers behind ``measured`` (a fast check's, or claim 10's accuracies).
    """

    number: int
    claim: str
    measured: str
    criterion: str
    holds: bool | None
    status: str
    source: str
    seconds: float = 0.0
    runtime_s: float | None = None
    values: dict[str, Any] = dataclasses.field(default_factory=dict)


def _shown(path: Path) -> str:
    """``path`` relative to the repository when inside it (committed tables name no machine)."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _status(holds: bool | None) -> str:
    return {True: "holds", False: "does not hold", None: "not run"}[holds]


def _row(number, measured, criterion, holds, source, **kw) -> Row:
    return Row(number, CLAIMS[number], measured, criterion, holds, _status(holds), source, **kw)


def _error_row(number: int, source: str, error: BaseException, criterion: str = "") -> Row:
    traceback.print_exception(error, file=sys.stderr)
    return Row(
        number,
        CLAIMS[number],
        f"error: {type(error).__name__}: {error}",
        criterion,
        None,
        "error",
        source,
    )


# ----------------------------------------------------------------------------
# Claims 1-9: the fast checks


def check_row(number: int) -> Row:
    """Runs fast check ``number`` (1-9) of ``analysis.claim_checks``."""
    fn = claim_checks.CHECKS[number]
    source = f"analysis.claim_checks.{fn.__name__}"
    t0 = time.perf_counter()
    try:
        check = fn()
    except Exception as e:
        return _error_row(number, source, e)
    seconds = time.perf_counter() - t0
    return _row(
        number,
        check.measured,
        check.criterion,
        bool(check.holds),
        source,
        seconds=seconds,
        values=dict(check.values),
    )


# ----------------------------------------------------------------------------
# Claim 10: the main comparison


def compare_accuracies(results: dict[str, Any]) -> dict[str, float]:
    """``{variant: mean final test accuracy over seeds}`` from a ``train.compare`` results.json.

    The one place that knows the comparison's format:
    ``results["variants"][name]["accuracy"]["mean"]`` (``train.compare_report``).

    Raises:
      ValueError: another layout, or an accuracy that is not a number.
    """
    try:
        return {
            name: float(entry["accuracy"]["mean"]) for name, entry in results["variants"].items()
        }
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(
            f"results.json: expected variants.<name>.accuracy.mean numbers, got {e!r}"
        ) from None


def _width(results: dict[str, Any]) -> int | None:
    try:
        return int(results["config"]["train"]["model"]["width"])
    except (KeyError, TypeError, ValueError):
        return None


def compare_row(path: Path) -> Row:
    """Claim 10 from a comparison's ``results.json``: MHA's recall against linear attention's."""
    criterion = f"mha - linear >= {RECALL_GAP:g} test accuracy (same task, width and budget)"
    source = _shown(path)
    if not path.is_file():
        return _row(10, NOT_RUN, criterion, None, source)
    t0 = time.perf_counter()
    try:
        results = json.loads(path.read_text())
        acc = compare_accuracies(results)
        missing = [v for v in ("mha", "linear") if v not in acc]
        if missing:
            raise ValueError(f"{path}: expected variants mha and linear, missing {missing}")
    except Exception as e:
        return _error_row(10, source, e, criterion)
    gap = acc["mha"] - acc["linear"]
    shown = [v for v in ("mha", "linear", "hybrid", *DELTA_VARIANTS) if v in acc]
    measured = ", ".join(f"{v} {acc[v]:.2f}" for v in shown) + f"; gap {gap:.2f}"
    delta = [v for v in DELTA_VARIANTS if v in acc]
    closed = {v: (acc[v] - acc["linear"]) / gap for v in delta} if gap > 0 else {}
    if closed:  # where the delta rule's fixed state sits between the two
        measured += "; the delta rule closes " + ", ".join(
            f"{share:.0%} of it ({v})" for v, share in closed.items()
        )
    width, chance = _width(results), results.get("chance_accuracy")
    extra = [s for s in (f"width {width}" if width else "", _chance(chance)) if s]
    if extra:
        measured += f" ({', '.join(extra)})"
    runtime = results.get("wall_s")
    return _row(
        10,
        measured,
        criterion,
        bool(gap >= RECALL_GAP),
        source,
        seconds=time.perf_counter() - t0,
        runtime_s=float(runtime) if isinstance(runtime, int | float) else None,
        values={"accuracy": acc, "gap": gap, "width": width, "delta_rule_closes": closed},
    )


def _chance(chance) -> str:
    return f"chance {chance:.2f}" if isinstance(chance, int | float) else ""


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


# ----------------------------------------------------------------------------
# Claims 11-18: the experiments


def experiment_row(number: int, path: Path) -> Row:
    """Claim ``number`` (11-18) from its experiment's ``results.json``.

    The file holds ``"claim": {"measured": str, "criterion": str, "holds":
    bool}`` (or the entry ``CLAIM_KEYS`` names) and ``"runtime_s"``; the row
    shows them as they are.
    """
    name = EXPERIMENTS[number]
    key = CLAIM_KEYS.get(number, "claim")
    source = _shown(path)
    if not path.is_file():
        return _row(number, NOT_RUN, f"set by analysis.experiments.{name}", None, source)
    t0 = time.perf_counter()
    try:
        results = json.loads(path.read_text())
        claim = results.get(key) if isinstance(results, dict) else None
        if not isinstance(claim, dict):
            raise ValueError(f"{path}: expected a {key!r} object, got {type(claim).__name__}")
        for field, kind in (("measured", str), ("criterion", str), ("holds", bool)):
            if not isinstance(claim.get(field), kind):
                raise ValueError(
                    f"{path}: expected {key}.{field} to be a {kind.__name__}, "
                    f"got {claim.get(field)!r}"
                )
        runtime = results.get("runtime_s")
        if runtime is not None and not isinstance(runtime, int | float):
            raise ValueError(f"{path}: expected runtime_s to be a number, got {runtime!r}")
    except Exception as e:
        return _error_row(number, source, e)
    return _row(
        number,
        claim["measured"],
        claim["criterion"],
        claim["holds"],
        source,
        seconds=time.perf_counter() - t0,
        runtime_s=None if runtime is None else float(runtime),
    )


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
    """Runs ``analysis.experiments.<name>`` with its full config into ``out/<name>``."""
    import train.cli  # only --run trains: the fast checks import no train

    module = importlib.import_module(f"analysis.experiments.{name}")
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
      numbers: claim numbers, 1 to 18.
      run: train the comparison and run the experiments (into ``out``) first,
        and read their results from ``out``; else read them from ``results``.
      results: where the results of claims 10-18 are read without ``run``.
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
                    rows.append(_error_row(10, "python -m train.compare --quick", e))
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
                    rows.append(_error_row(number, f"analysis.experiments.{name}", e))
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
        "main comparison (`python -m train.compare`), claims 11-18 the experiments of "
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
      only: comma-separated claim numbers, e.g. ``1,5,10``; empty: all 18.
      results: where claims 10-18 are read from without ``run`` (the committed results).
    """

    run: bool = False
    out: Path = Path("results/claims")
    only: str = ""
    results: Path = COMMITTED


def _numbers(only: str) -> list[int]:
    if not only.strip():
        return list(CLAIMS)
    try:
        numbers = [int(x) for x in only.split(",") if x.strip()]
    except ValueError:
        numbers = []
    if not numbers or any(n not in CLAIMS for n in numbers):
        raise ValueError(f"--only: expected comma-separated claim numbers 1 to 18, got {only!r}")
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
            "results_read_from": _shown(Path(args.out) if args.run else Path(args.results)),
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
