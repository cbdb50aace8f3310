"""What every experiment shares: the results files, the claim entry, timing and the CLI.

Each experiment writes ``out_dir/results.json`` (its data, a ``"claim"`` entry
``{"measured", "criterion", "holds"}`` and ``"runtime_s"``), ``out_dir/table.md``
and its PNGs; ``python -m analysis.claims`` reads the JSON. Training runs go to
``out_dir/runs/<run>/`` (``train.loop.train`` resumes from their checkpoints,
so an interrupted experiment keeps what it saved).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from flax import nnx

import train.cli
import train.interrupt
import train.loop
import train.plugins
from attn.checks import fail
from models import capture_weights
from train.interrupt import EXIT_INTERRUPTED

RESULTS_FILE = "results.json"
TABLE_FILE = "table.md"
REPO_ROOT = Path(__file__).resolve().parents[2]


def check_names(field: str, names, allowed) -> None:
    """Refuses an empty tuple or a name outside ``allowed``, naming the config ``field``."""
    if not names or any(n not in allowed for n in names):
        fail(field, f"a non-empty tuple of names in {allowed}", repr(names))


def claim(measured: str, criterion: str, holds: bool) -> dict[str, Any]:
    """The claim entry of ``results.json``: the measured value, the rule, the verdict."""
    if not isinstance(measured, str) or not measured:
        fail("measured", "a non-empty str", repr(measured))
    if not isinstance(criterion, str) or not criterion:
        fail("criterion", "a non-empty str", repr(criterion))
    return {"measured": measured, "criterion": criterion, "holds": bool(holds)}


def _jsonable(x):
    """NumPy and JAX values as plain JSON (non-finite floats become None)."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, jax.Array | np.ndarray):
        return _jsonable(np.asarray(x).tolist())
    if isinstance(x, np.bool_ | bool):
        return bool(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, float | np.floating):
        return float(x) if math.isfinite(x) else None
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _jsonable(dataclasses.asdict(x))
    return x


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats with 3 significant decimals."""

    def cell(v):
        if isinstance(v, float | np.floating):
            return f"{v:.3f}" if math.isfinite(v) else "n/a"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_results(out_dir: Path, results: dict[str, Any], table: str) -> dict[str, Any]:
    """Writes ``results.json`` and ``table.md`` (the claim first, then ``table``).

    Returns the results as written (JSON types).
    """
    entry = results.get("claim")
    if not isinstance(entry, dict) or set(entry) != {"measured", "criterion", "holds"}:
        fail("results", "a 'claim' entry {measured, criterion, holds}", repr(entry))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = _jsonable(results)
    (out_dir / RESULTS_FILE).write_text(json.dumps(results, indent=2) + "\n")
    verdict = "holds" if entry["holds"] else "does not hold"
    head = (
        f"# {results['name']}\n\n"
        f"- measured: {entry['measured']}\n- criterion: {entry['criterion']}\n"
        f"- verdict: **{verdict}**\n- runtime: {results['runtime_s']:.0f} s\n\n"
    )
    (out_dir / TABLE_FILE).write_text(head + table)
    return results


class Timer:
    """Wall-clock seconds since construction."""

    def __init__(self):
        self.start = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.start


def run_dir(out_dir: Path, name: str) -> Path:
    """Where a training run of the experiment lives (resumable)."""
    return Path(out_dir) / "runs" / name


def train_run(config, out_dir: Path, name: str, *, progress: bool | None = None
              ) -> tuple[dict, Path]:  # fmt: skip
    """Trains (or resumes, or finds finished) one run under ``out_dir/runs/name``, with
    ``train.loop``'s bar (its steps, their rate and the run's time left) where ``progress``
    (None: when stderr is a terminal, so logs and pipes get the results' lines only); the
    grids' experiments train in a ``train.pool.Pool`` instead (one bar).

    Returns ``(summary, workdir)``.
    """
    workdir = run_dir(out_dir, name)
    if progress is None:
        progress = sys.stderr.isatty()
    summary = train.loop.train(config, workdir, progress=progress, desc=name)
    return summary, workdir


def run_all(worker, todo: Sequence, jobs: int, report=None, *, steps_of, desc: str,
            progress: bool = True) -> dict:  # fmt: skip
    """``{item: worker(item)}`` for every item of ``todo``, ``jobs`` at a time, under one
    bar over the runs' steps (``train.pool.Pool``; ``steps_of(item)``: the steps its run
    trains at most).

    With ``jobs > 1`` (and several items) each runs in a spawned process pinned
    to a core (``train.pool.worker_init``; ``worker`` must be picklable, a
    module-level function or a ``functools.partial`` of one), and Ctrl-C stops
    the workers (their runs keep their checkpoints); ``report(item, result)`` is
    called as each finishes.
    """
    from train.pool import Pool

    todo = list(todo)
    with Pool(jobs if len(todo) > 1 else 1, desc, progress) as pool:
        results = pool.run(worker, todo, steps_of, report,
                           labels=[getattr(item, "name", str(item)) for item in todo])  # fmt: skip
    return dict(zip(todo, results, strict=True))


def plot_lengths(path: Path, panels: dict, lengths, *, ylabel: str, dashed=(), chance=None):
    """Accuracy against test length, one panel per entry of ``panels``.

    Args:
      panels: title -> {label: accuracies at ``lengths``}.
      dashed: labels drawn dashed (the baselines).
      chance: title -> the chance level, drawn dotted (None: none).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, (title, lines) in zip(axes[0], panels.items(), strict=True):
        for label, accs in lines.items():
            ax.plot(lengths, accs, "--" if label in dashed else "-", marker="o", label=label)
        if chance and title in chance:
            ax.axhline(chance[title], color="gray", ls=":", lw=1, label="chance")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(t) for t in lengths])
        ax.set_ylim(0, 1.02)
        ax.set_title(title)
        ax.set_xlabel("test length (trained at the first)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def token_losses(model: nnx.Module, tokens, targets) -> np.ndarray:
    """Cross-entropy of each next-token prediction, ``[B,T]`` float32 (nats).

    Args:
      model: a ``Decoder``.
      tokens: ``[B,T]`` inputs.
      targets: ``[B,T]`` the token each position should predict.
    """
    logits = float32_logits(model, jnp.asarray(tokens))
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(targets))
    return np.asarray(ce, np.float32)


@nnx.jit
def float32_logits(model, tokens):
    """``model(tokens)`` as float32 ``[B,T,V]``, jitted."""
    return model(tokens).astype(jnp.float32)


def capture(model: nnx.Module, tokens) -> tuple[np.ndarray, np.ndarray]:
    """``(logits [B,T,V], weights [L,B,N,T,T])`` of a decoder, as float32 NumPy."""
    logits, weights = _capture(model, jnp.asarray(tokens))
    return np.asarray(logits), np.stack([np.asarray(w) for w in weights])


@nnx.jit
def _capture(model, tokens):
    return capture_weights(model, tokens)


@dataclasses.dataclass(frozen=True)
class Args:
    """Runs one experiment and writes results.json, table.md and PNGs.

    Attributes:
      quick: the tiny settings the tests use (seconds, numbers not meaningful).
      out: the output folder; default ``results/<name>``.
      config: the experiment's config file; default ``configs/<name>.py``.
      no_compilation_cache: compile afresh, without the persistent compilation cache
        (``train.cli.compilation_cache_dir``).
    """

    quick: bool = False
    out: Path | None = None
    config: Path | None = None
    no_compilation_cache: bool = False


def main(name: str, doc: str | None, argv=None) -> int:
    """The command line of experiment ``name``:
    ``[--plugin MODULE ...] [--quick] [--out DIR] [--config FILE]``."""
    try:
        # Before the config file, which may use what they add.
        _, argv = train.plugins.from_argv(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = tyro.cli(
        Args,
        args=argv,
        prog=f"python -m analysis.experiments.{name}",
        description=f"{doc or ''}\n\n{train.plugins.FLAG_HELP}.",
    )
    # Under ``python -m`` the experiment runs as ``__main__``, a second copy of its module,
    # while its config file builds the classes of ``analysis.experiments.<name>``: the run
    # must be that module's, or equal dataclasses from the two copies compare unequal.
    run = importlib.import_module(f"analysis.experiments.{name}").run
    if args.no_compilation_cache:
        train.cli.disable_compilation_cache()
    train.cli.enable_compilation_cache()  # later runs and checkpoint loads skip compiling
    path = args.config or REPO_ROOT / "configs" / f"{name}.py"
    config = train.cli.load_config(path, quick=args.quick)
    out = args.out or Path("results") / name
    try:
        results = run(config, Path(out))
    except train.interrupt.TrainingInterrupted as e:  # Ctrl-C in a training loop: saved, stopped
        print(
            f"python -m analysis.experiments.{name}: {e}; run it again to resume", file=sys.stderr
        )
        return EXIT_INTERRUPTED
    entry = results["claim"]
    verdict = "holds" if entry["holds"] else "does not hold"
    print(f"{name}: {entry['measured']} ({entry['criterion']}: {verdict})")
    print(f"runtime {results['runtime_s']:.0f} s")
    print(f"wrote {Path(out) / RESULTS_FILE} and {Path(out) / TABLE_FILE}")
    return 0
