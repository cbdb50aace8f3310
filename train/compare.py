"""The main job: train every attention variant to convergence, over seeds, on one task.

``python -m train.compare`` (default config ``configs/compare_mqar.py``) trains
each variant with each learning rate of a small sweep and each seed, until its
test accuracy reaches ``train.target_accuracy`` (checked at each evaluation)
or ``train.steps`` (the cap) runs out. Each variant's best learning rate (by
mean final test accuracy over the seeds, as Zoology picks it; on ``bytes`` the
lowest bits per byte) is reported in ``results/<name>/``:

- ``table.md``: per variant its layers (where the softmax layers sit), params,
  decode-state bytes per sequence, final test accuracy (mean and range over
  seeds), the steps at which 0.5 and 0.9 were first reached, the steps run and
  the best learning rate; also printed at the end.
- ``results.json``: the config, every run (summary, curves, milestones) and
  ``variants[name]`` with ``accuracy = {mean, min, max, seeds}`` (see
  ``train.compare_report.summarize_variant`` for every key).

The variants and their metadata (``VARIANTS``, ``CompareConfig``, layers,
sizes) are in ``train.variants``.
- ``recall_vs_state.png``: final test accuracy against decode-state bytes per
  sequence (log x), one point per variant with a bar over its seeds' range and
  every seed shown (Zoology's and Based's plot); ``bits_vs_state.png`` on
  ``bytes`` (bits per byte from 0, lower is better).
- ``curves.png``: train loss and test accuracy against step, every seed of the
  best learning rate (both panels in bits per byte on ``bytes``).
- ``lengths.png`` with ``test_lengths`` (e.g. ``1 2 4 8``): each run's final
  model also tested on windows of that many times the training length
  (``train.lengths``), and a "Train short, test long" table in ``table.md``.

``lrs`` x ``seeds`` is the sweep; ``edge_lrs`` widens it per variant while the
best rate is at its edge; ``best_lr_seeds`` train afterwards at each
variant's best rate only, and ``match_params`` gives every variant the
parameter count of one of them through its MLP width (``train.variants``).

``--task induction|selective_copy`` runs the same comparison on another task
(the config's ``get_config(task=...)``). ``--task bytes`` is language
modelling, with its own default config (``configs/compare_lm.py``: its sizes,
matched parameters, two learning rates, train short and test long); it reports
bits per byte (test loss / ln 2) instead of accuracy and trains to the cap.

Each run trains in ``runs/<name>/<variant>/lr<lr>_seed<seed>`` with
checkpoints (by steps, and every ``train.ckpt_seconds``), so an interrupted
comparison picks up where it stopped, losing at most about a minute of each run,
and a run that reached its target stays stopped (``--fresh`` starts over). One
bar (``train.pool``) follows every run's steps, with the rate and the time left. ``--quick``
uses the config file's quick settings (``get_config(quick=True)``, about a
minute); every field can still be overridden, e.g. ``--quick --train.steps 20
--variants mha linear``.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports below run is one line
    from train.interrupt import exit_on_sigint

    exit_on_sigint("python -m train.compare")

import contextlib
import functools
import math
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from train import plugins
from train.cli import enable_compilation_cache, parse
from train.compare_report import (
    best_lr,
    format_table,
    summarize_variant,
    write_results,
)
from train.config import to_json
from train.interrupt import EXIT_INTERRUPTED, TrainingInterrupted
from train.lengths import loss_at_lengths
from train.loop import NonFiniteLossError, train
from train.metrics import read_metrics
from train.pool import Pool, WorkersInterrupted
from train.variants import (
    TASKS,
    VARIANTS,
    CompareConfig,
    chance_accuracy,
    metric,
    run_config,
)
from train.workdir import check_writable

__all__ = ["main", "run_comparison"]


def _run_dir(config: CompareConfig, variant: str, lr: float, seed: int) -> Path:
    return Path(config.runs_dir) / config.name / variant / f"lr{lr:g}_seed{seed}"


def _curves(workdir: Path) -> dict[str, list]:
    records = read_metrics(workdir)
    train_r = [r for r in records if r["kind"] == "train"]
    eval_r = [r for r in records if r["kind"] == "eval"]
    return {
        "train_step": [r["step"] for r in train_r],
        "train_loss": [r["loss"] for r in train_r],
        "eval_step": [r["step"] for r in eval_r],
        "test_accuracy": [r["test_accuracy"] for r in eval_r],
        "test_loss": [r["test_loss"] for r in eval_r],
    }


def _train_one(config: CompareConfig, variant: str, lr: float, seed: int, desc: str, bar: bool):
    """Trains one run of the comparison; returns its record (a diverged run included)."""
    workdir = _run_dir(config, variant, lr, seed)
    try:
        summary = train(run_config(config, variant, lr, seed), workdir, progress=bar, desc=desc)
        diverged = None
    except NonFiniteLossError as e:
        print(f"{desc}: {e}", file=sys.stderr)
        summary = {"test_accuracy": 0.0, "test_loss": None, "step": e.step}
        diverged = e.step
    record = {
        "variant": variant,
        "lr": lr,
        "seed": seed,
        "workdir": str(workdir),
        "diverged_at": diverged,
        "summary": summary,
        "curves": _curves(workdir),
    }
    if config.test_lengths and diverged is None:  # here: the workers test their own runs
        record["lengths"] = loss_at_lengths(workdir, config.test_lengths)
    return record


def _per_lr(variant: str, runs: list[dict]) -> dict[float, list[dict]]:
    """The variant's run records by learning rate, in increasing order of rate."""
    rates = sorted({r["lr"] for r in runs if r["variant"] == variant})
    return {lr: [r for r in runs if (r["variant"], r["lr"]) == (variant, lr)] for lr in rates}


def _beyond_edge(config: CompareConfig, variant: str, runs: list[dict]) -> float | None:
    """The next rate out when the variant's best so far is its highest or lowest, else None."""
    per_lr = _per_lr(variant, runs)
    best, rates = best_lr(config, per_lr), list(per_lr)
    ratio = config.edge_ratio or (max(config.lrs) / min(config.lrs)) ** (1 / (len(config.lrs) - 1))
    if best not in (rates[0], rates[-1]):
        return None
    return float(f"{best * ratio if best == rates[-1] else best / ratio:.2g}")


def _done_line(desc: str, summary: dict, bits: bool) -> str:
    """A finished run's progress line, in the task's own terms."""
    if "wall_s" not in summary:  # the stand-in summary of a diverged run
        return f"{desc}: diverged at step {summary['step']}"
    if bits:
        score = f"test bits/byte {summary['test_loss'] / math.log(2):.3f}"
    else:
        score = f"test accuracy {summary['test_accuracy']:.3f}"
    return f"{desc}: {score} at step {summary['step']}, {summary['wall_s']:.0f} s"


def _train_spec(config: CompareConfig, item) -> dict:
    """``_train_one`` of ``item = ((variant, lr, seed), label)`` (picklable for the workers)."""
    (variant, lr, seed), desc = item
    return _train_one(config, variant, lr, seed, desc, False)


@contextlib.contextmanager
def _runner(config: CompareConfig, planned: list[int]):
    """``run(specs) -> records``: trains ``(variant, lr, seed)`` specs in order of the list
    (numbered ``[i/n]`` across calls, ``n = planned[0]``, which the caller may raise
    between calls), in this process or in a pool of ``config.jobs`` workers kept for
    every call, under one bar over every run's steps (``train.pool``)."""
    count = [0]
    bits = metric(config.train.task) == "bits_per_byte"
    with Pool(config.jobs, config.name, config.progress) as pool:

        def run(specs):
            first = count[0]
            count[0] += len(specs)
            labels = [f"[{first + i + 1}/{planned[0]}] {v} lr={lr:g} seed={s}"
                      for i, (v, lr, s) in enumerate(specs)]  # fmt: skip
            return pool.run(
                functools.partial(_train_spec, config),
                list(zip(specs, labels, strict=True)),
                steps_of=lambda item: config.train.steps,
                done=lambda item, record: pool.write(_done_line(item[1], record["summary"], bits)),
                labels=[f"{v} s{s}" for v, _, s in specs],
            )

        yield run


def run_comparison(config: CompareConfig) -> dict[str, Any]:
    """Trains every (variant, lr, seed) and summarizes each variant at its best learning rate.

    With ``jobs > 1`` the runs train in that many worker processes at once,
    each pinned to a core of its own (small models leave a core's threads idle
    anyway). The runs are ordered learning rate first, so the first wave
    compiles each variant and the later ones find it in the compilation cache.

    A run whose loss diverges counts as accuracy 0 (and bits per byte None) for
    its learning rate: a legitimate outcome of a sweep, not an error.

    Returns:
      ``dict(config, task, metric, chance_accuracy, runs, variants, wall_s)``:
      ``runs`` lists every run's summary and curves; ``variants`` maps each
      variant to ``summarize_variant``'s entry.
    """
    t0 = time.perf_counter()
    # Both folders are written to, so both are checked before the first run trains.
    check_writable(Path(config.results_dir) / config.name, "results_dir")
    check_writable(Path(config.runs_dir), "runs_dir")
    if config.fresh:
        shutil.rmtree(Path(config.runs_dir) / config.name, ignore_errors=True)
    sweep = [
        (variant, lr, seed)
        for lr in config.lrs
        for seed in config.seeds
        for variant in config.variants
    ]
    planned = [len(sweep) + len(config.variants) * len(config.best_lr_seeds)]
    with _runner(config, planned) as run:
        runs = run(sweep)
        for _ in range(config.edge_lrs):  # the sweep widened where a best rate is at its edge
            edges = {v: _beyond_edge(config, v, runs) for v in config.variants}
            wider = [(v, lr, s) for s in config.seeds for v, lr in edges.items() if lr]
            planned[0] += len(wider)
            runs += run(wider)
        if config.best_lr_seeds:  # a second wave: more seeds at each variant's best rate
            best = {v: best_lr(config, _per_lr(v, runs)) for v in config.variants}
            runs += run([(v, best[v], s) for s in config.best_lr_seeds for v in config.variants])
    variants = {v: summarize_variant(config, v, _per_lr(v, runs)) for v in config.variants}
    task = config.train.task
    return {
        "config": to_json(config),
        "task": task.name,
        "metric": metric(task),
        "chance_accuracy": chance_accuracy(task),
        "runs": runs,
        "variants": variants,
        "wall_s": time.perf_counter() - t0,
    }


def main(argv=None) -> int:
    """``python -m train.compare [--plugin M] [--config FILE] [--quick] [--task T]
    [--scale S] [--dry-run] [overrides]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    dry_run = "--dry-run" in argv
    try:
        config = _parse([a for a in argv if a != "--dry-run"])
    except ValueError as e:  # a bad plugin, config file or override: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    if dry_run:  # every variant built (shapes only) and its GPU time predicted; nothing trains
        from train.budget import predict_comparison, prediction_text

        print(prediction_text(predict_comparison(config), config.name))
        return 0
    enable_compilation_cache()
    try:
        results = run_comparison(config)
        out, paths = write_results(results, config)
    except ValueError as e:  # an output folder that cannot be written, a busy run: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (TrainingInterrupted, WorkersInterrupted) as e:  # Ctrl-C: saved, stopped
        print(f"python -m train.compare: interrupted: {e}; run the same command to resume",
              file=sys.stderr)  # fmt: skip
        return EXIT_INTERRUPTED
    print()
    print(format_table(results, config))
    print(f"wrote {out}/: " + ", ".join(p.name for p in paths))
    return 0


def _parse(argv: list[str]) -> CompareConfig:
    _, argv = plugins.from_argv(argv)  # before the config: it may name the plugins' variants
    quick = "--quick" in argv
    argv = [a for a in argv if a != "--quick"]
    config_kwargs = {"quick": quick}
    if "--task" in argv:
        i = argv.index("--task")
        if i + 1 >= len(argv) or argv[i + 1] not in TASKS:
            got = argv[i + 1] if i + 1 < len(argv) else "nothing"
            raise ValueError(f"--task: expected one of {', '.join(TASKS)}, got {got}")
        config_kwargs["task"] = argv[i + 1]
        del argv[i : i + 2]
    if "--scale" in argv:  # a config file's sizes (configs/compare_lm.py: cpu, gpu)
        i = argv.index("--scale")
        if i + 1 >= len(argv):
            raise ValueError("--scale: expected a scale name, got nothing")
        config_kwargs["scale"] = argv[i + 1]
        del argv[i : i + 2]
    default = "compare_lm.py" if config_kwargs.get("task") == "bytes" else "compare_mqar.py"
    listed = "; ".join(f"{name} ({v.description})" for name, v in VARIANTS.items())
    config, _ = parse(
        "python -m train.compare",
        "Train every attention variant on the same task to its target accuracy or step cap; "
        "write results/<name>/. Flags of this command: --config FILE (default "
        "configs/compare_mqar.py; configs/compare_lm.py with --task bytes), --quick (the "
        f"config's quick settings), --task {'|'.join(TASKS)} (default mqar), --scale cpu|gpu "
        "(a config's sizes: configs/compare_lm.py and compare_lm_english.py have both), "
        "--dry-run (build every variant and print its predicted time on a GPU; nothing "
        "trains); every field below overrides the config. "
        f"Variants (--variants NAME ...): {listed}.",
        argv,
        default_config=str(Path(__file__).resolve().parent.parent / "configs" / default),
        config_kwargs=config_kwargs,
    )
    return config


if __name__ == "__main__":
    # Run the importable module's main, not this __main__ copy: worker processes
    # unpickle the functions and configs they are sent by their module name.
    from train.compare import main as _main

    status = _main()
    # A Ctrl-C in the teardown (which restores the default handler) must not change the
    # status; the teardown itself releases the worker pool's semaphores.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(status)
