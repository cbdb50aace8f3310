"""The recall frontier: MQAR accuracy against decode-state size, one line per family.

    python -m analysis.experiments.recall_frontier [--scale cpu|gpu|zoology] [--only F,...]
        [--jobs N] [--out DIR] [--quick] [--dry-run]

Zoology's recall-memory trade-off (Arora et al. 2023, "Zoology: measuring and
improving recall in efficient language models"; the Based paper's Figure 2)
asks how much associative recall each family of sequence mixers buys per
element of state it keeps while decoding. Every family here sweeps one knob
that sets its state (``FAMILIES``): the width of softmax attention, of the
hybrid and of the production hybrids' layouts, the number of kv heads of GQA,
the latent rank of MLA, the window of sliding-window attention, the head dim
(= feature dim) of linear attention, gated linear attention and Gated
DeltaNet, and the Taylor feature dim of Based. Each point is a 2-layer decoder
trained on MQAR at one (T, pairs) setting for each learning rate of the
scale's sweep (and each seed); the point reports its final test accuracy
(every pair queried, ``train.tasks``) at the best learning rate, as Zoology
does. Like Zoology's models, every layer has a short convolution (the
``_conv`` presets; Based and Gated DeltaNet have their own). Unlike Zoology,
which trains one model on a mixture of the settings and reports each slice,
each setting trains models of its own, with training examples of 1 to
``pairs`` pairs.

State (``state_elements``) is counted the way Zoology's ``state_size()``
counts it: the elements a decoder keeps per sequence after T tokens, summed
over layers: 2 x d x T for a softmax layer's K/V cache (K kv heads of dim H:
2 x K x H x T), the latent times T for MLA, 2 x d x window for a sliding
window, heads x features x head dim (+ the normalizer's heads x features) for
the linear family, heads x H x H for the delta rule, and, unlike Zoology, the
short convolutions' last inputs too (they are decode state as much as a cache
is). The table also gives it in bytes at float32 (``models.cache_bytes`` of
the model's own empty cache, so the count is the cache the code allocates).

Outputs (``--out``, default ``results/recall_frontier``): ``results.json``
(every run, every point, the frontier and the claim), ``table.md`` and
``frontier.png`` (accuracy against state, log x, a panel per setting, a line
per family through its points at their best learning rate, every seed as a
dot, chance as a dotted line, the Pareto frontier as a black step line).
Runs train under ``--out``/runs/ and resume from their checkpoints; a point
whose runs finished is read back from their ``summary.json``, not retrained.
``--jobs`` runs that many trainings at once, each pinned to its own core
(``train.compare``'s workers).

Scales (``SCALES``; ``configs/recall_frontier.py`` says why each is sized so):

* ``cpu`` (default): (T, pairs) = (64, 4) and (128, 8), V = 64, two learning
  rates (1e-2 and 10^-1.5, Zoology's two highest), 1 seed, 22 families x 4 knob
  values: 352 runs of batch 32, stopping at 0.99. A run stops at 500 updates;
  one still learning there (``recall_frontier_train.still_learning``) is
  extended to 1,000 and then to 2,000 (``Scale.max_steps``), on a schedule
  whose horizon is 2,000 throughout, so an extended run is an uninterrupted
  run of its final length; the table marks the points with a run still
  learning at 2,000. The committed run (``docs/results/recall_frontier/``, its wall
  time in ``runtime_s`` and ``timing.txt``) has ten of the families; the 2025
  ones join it with ``--only rwkv7,path,log_linear_mamba2,log_linear_gated_deltanet
  --add-to docs/results/recall_frontier``, the trained memories (TTT-Linear, TTT-MLP,
  Titans, MesaNet) with ``--only ttt_linear,ttt_mlp,titans,mesanet --add-to
  docs/results/recall_frontier``, the production hybrids (``models.LAYOUTS`` at two
  layers: the linear layer, then the attention layer) with ``--only
  qwen3_next,kimi_linear,nemotron_h,minimax01 --add-to docs/results/recall_frontier``.
* ``zoology``: V = 8192, (64, 4), (128, 8), (256, 16), (512, 64), 4 learning
  rates, batch 256, 12,500 updates at T = 64 and 2,500 at the others (32
  epochs of Zoology's 100,000 and 20,000 training examples), 1 seed, the same
  families over wider knobs: 22 x 4 x 4 x 4 = 1,408 runs.
  ``--dry-run --scale zoology --flops`` prints XLA's FLOP count of each point's
  update (forward + backward, not the optimizer) times its updates, and the
  total over the runs; what it printed, and the GPU time it implies, is in
  ``docs/results/recall_frontier/zoology-scale.md``.
* ``gpu``: claim 15's four families at (128, 8) with Zoology's V and batch, 2
  learning rates, 2,000 updates, bf16: 24 runs sized to 8 minutes on one H200.
* ``quick``: two runs of a few updates (the tests).

``--dry-run`` builds every run's config and model (shapes only) and prints
each point's parameters and state without training, and the grid's predicted
time on one H200 (``recall_frontier_grid.predicted_seconds``); with
``--flops`` it also counts XLA's FLOPs of each point's update.

The code is in four modules: ``recall_frontier_grid`` (the families, scales
and runs, and the dry run), ``recall_frontier_train`` (training the grid),
``recall_frontier_report`` (points, frontier, claim, table, figure) and this
one (``run``, the results files, ``add_to`` and the command line).
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports below run is one line
    from train.interrupt import exit_on_sigint

    exit_on_sigint("python -m analysis.experiments.recall_frontier")

import dataclasses
import json
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from analysis.experiments import _common
from analysis.experiments.recall_frontier_grid import (
    FAMILIES,
    NAME,
    SCALES,
    Run,
    Scale,
    dry_run,
    runs,
    setting_key,
)
from analysis.experiments.recall_frontier_report import claim, pareto, plot, points, table
from analysis.experiments.recall_frontier_train import train_all
from attn.checks import fail


def run(scale: Scale, out: Path, *, jobs: int = 2, progress: bool = True) -> dict[str, Any]:
    """Trains the grid (what is not trained yet) and writes results.json, table.md, frontier.png."""
    if jobs < 1:
        fail("jobs", "an int >= 1", repr(jobs))
    timer = _common.Timer()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summaries = train_all(scale, out, jobs=jobs, progress=progress)
    rows = points(scale, summaries)
    grid = [{**dataclasses.asdict(r), "name": r.name, "summary": summaries[r]} for r in runs(scale)]
    return _write(scale, rows, grid, timer(), out)


def _write(scale: Scale, rows: list[dict], grid: list[dict], runtime: float, out: Path) -> dict:
    """results.json (points, frontier per setting, claim, runs), table.md and frontier.png."""
    frontier = {
        setting_key(s): [
            {k: r[k] for k in ("family", "knob", "state_elements", "accuracy")}
            for r in pareto([r for r in rows if tuple(r["setting"]) == tuple(s)])
        ]
        for s in scale.settings
    }
    results = {
        "name": NAME,
        "scale": dataclasses.asdict(scale),
        "claim": claim(scale, rows),
        "points": rows,
        "frontier": frontier,
        "runs": grid,
        "runtime_s": runtime,
    }
    written = _common.write_results(out, results, table(scale, rows))
    plot(scale, rows, out / "frontier.png")
    return written


def add_to(folder: Path, results: dict[str, Any]) -> dict[str, Any]:
    """Adds the families of ``results`` (a run of some families) to the run in ``folder``.

    The folder's runs and scale keep their other families; these families'
    runs replace any it had; the points (by this version's ``points``), the
    frontier, the claim, the table and the figure are drawn again from all the
    runs, and the runtime is the sum. Both runs must share settings, caps,
    rates and seeds; the merged scale is the added run's (its name too) with
    every family.
    """
    path = Path(folder) / _common.RESULTS_FILE
    if not path.is_file():
        fail("add_to", f"a folder holding a {_common.RESULTS_FILE} of this experiment", str(folder))
    old = json.loads(path.read_text())

    def scale_of(d):
        fields = {**d, "settings": tuple(map(tuple, d["settings"]))}
        fields["knobs"] = tuple((f, tuple(k)) for f, k in d["knobs"])
        for key in ("steps", "lrs", "seeds", "max_steps"):
            fields[key] = None if d.get(key) is None else tuple(d[key])
        return Scale(**fields)

    base, new = scale_of(old["scale"]), scale_of(results["scale"])
    for key in ("settings", "steps", "max_steps", "vocab_size", "lrs", "seeds", "batch_size"):
        if getattr(base, key) != getattr(new, key):
            fail("add_to", f"a run with the same {key} ({getattr(new, key)})", getattr(base, key))
    added = dict(new.knobs)
    knobs = tuple(k for k in base.knobs if k[0] not in added) + new.knobs
    grid = [r for r in old["runs"] if r["family"] not in added] + results["runs"]
    scale = dataclasses.replace(new, knobs=knobs)
    summaries = {_run_of(r): r["summary"] for r in grid}
    return _write(scale, points(scale, summaries), grid, old["runtime_s"] + results["runtime_s"],
                  Path(folder))  # fmt: skip


def _run_of(entry: dict) -> Run:
    """The ``Run`` of a results file's run entry."""
    return Run(tuple(entry["setting"]), entry["family"], entry["knob"], entry["lr"], entry["seed"])


def _print_dry_run(result: dict) -> None:
    print(f"{result['runs']} runs, {len(result['points'])} points ({result['scale']} scale)")
    for r in result["points"]:
        extra = f", {r['flops_per_run']:.3g} FLOP per run" if "flops_per_run" in r else ""
        print(
            f"  {setting_key(r['setting'])}: {r['family']} {FAMILIES[r['family']].knob} "
            f"{r['knob']}: {r['params']:,} params, state {r['state_elements']:,} elements "
            f"({r['state_bytes']:,} B){extra}"
        )
    if result["total_flops"] is not None:
        print(f"total {result['total_flops']:.3g} FLOP (forward + backward, every run to its cap)")
    from train.budget import H200

    print(
        f"predicted on one {H200.name}: {result['gpu_seconds']:.0f} s, every run to its cap "
        f"({H200.assumptions()})"
    )


# ----------------------------------------------------------------------------
# Command line


@dataclass(frozen=True)
class Args:
    """The recall frontier: MQAR accuracy against decode state, one line per family.

    Attributes:
      scale: ``cpu`` (2 cores; ``timing.txt`` of the committed run), ``gpu`` (8 minutes
        on one H200, predicted) or ``zoology`` (Zoology's grid, hours on an accelerator).
      only: a comma-separated subset of the families.
      jobs: trainings at once, each on its own core.
      out: the output folder; default ``results/recall_frontier`` (``-quick`` with --quick).
      quick: two runs of a few updates (a smoke test).
      dry_run: build every config and model and count parameters and state; train nothing.
      flops: with --dry-run: also count each point's FLOPs per update (slower).
      progress: show a progress bar over the runs.
      add_to: after the run, add its families to the run in this folder (``add_to``),
        e.g. ``--only mamba2 --add-to docs/results/recall_frontier``.
    """

    scale: Literal["cpu", "gpu", "zoology"] = "cpu"
    only: str | None = None
    jobs: int = 2
    out: Path | None = None
    quick: bool = False
    dry_run: bool = False
    flops: bool = False
    progress: bool = True
    add_to: Path | None = None


def main(argv=None) -> int:
    import tyro

    import train.cli
    from train.interrupt import EXIT_INTERRUPTED, TrainingInterrupted
    from train.pool import WorkersInterrupted

    args = tyro.cli(Args, args=argv, prog=f"python -m analysis.experiments.{NAME}",
                    description=__doc__.split("\n\n")[0])  # fmt: skip
    try:
        scale = SCALES["quick" if args.quick else args.scale]
        if args.only:
            scale = scale.only([s.strip() for s in args.only.split(",") if s.strip()])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        _print_dry_run(dry_run(scale, flops=args.flops))
        return 0
    train.cli.enable_compilation_cache()
    out = args.out or Path("results") / (NAME + ("-quick" if args.quick else ""))
    try:
        results = run(scale, out, jobs=args.jobs, progress=args.progress)
    except (TrainingInterrupted, WorkersInterrupted) as e:
        print(f"python -m analysis.experiments.{NAME}: {e}; run it again to resume",
              file=sys.stderr)  # fmt: skip
        return EXIT_INTERRUPTED
    if args.add_to is not None:
        results = add_to(args.add_to, results)
        out = args.add_to
    entry = results["claim"]
    print(f"{NAME}: {entry['measured']}")
    print(f"({entry['criterion']}: {'holds' if entry['holds'] else 'does not hold'})")
    print(f"runtime {results['runtime_s']:.0f} s; wrote {out}/results.json, table.md, frontier.png")
    return 0


if __name__ == "__main__":
    # The importable module's main: workers unpickle what they are sent by module name.
    from analysis.experiments.recall_frontier import main as _main

    status = _main()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(status)
