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
- ``recall_vs_state.png``: final test accuracy against decode-state bytes per
  sequence (log x), one point per variant and every seed shown (Zoology's and
  Based's plot).
- ``curves.png``: train loss and test accuracy against step, every seed of the
  best learning rate.

``--task induction|selective_copy|bytes`` runs the same comparison on another
task (the config's ``get_config(task=...)``); ``bytes`` reports bits per byte
(test loss / ln 2) instead of accuracy and trains to the cap.

Each run trains in ``runs/<name>/<variant>/lr<lr>_seed<seed>`` with
checkpoints, so an interrupted comparison picks up where it stopped, and a run
that reached its target stays stopped (``--fresh`` starts over). ``--quick``
uses the config file's quick settings (``get_config(quick=True)``, about a
minute); every field can still be overridden, e.g. ``--quick --train.steps 20
--variants mha linear``.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from models import Decoder, ModelConfig, cache_bytes, pattern, presets
from models.patterns import SHORT_CONV
from train.cli import enable_compilation_cache, parse
from train.config import TrainConfig, to_json
from train.loop import NonFiniteLossError, read_metrics, train

__all__ = [
    "MILESTONES",
    "TASKS",
    "VARIANTS",
    "CompareConfig",
    "cache_sizes",
    "chance_accuracy",
    "main",
    "metric",
    "run_comparison",
    "state_bytes",
    "variant_layers",
]

# The accuracies whose first step the table reports.
MILESTONES = (0.5, 0.9)
# ``--task`` values: the config file's get_config(task=...) builds each.
TASKS = ("mqar", "induction", "selective_copy", "bytes")

# name -> (description, layer pattern for L layers). The names of the pattern
# are the presets of models.presets, and ``<preset>_conv`` for a preset with a
# short convolution of width models.patterns.SHORT_CONV on its input.
VARIANTS: dict[str, tuple[str, Any]] = {
    "mha": ("softmax, multi-head", lambda L: ("mha",) * L),
    "gqa": ("softmax, grouped-query", lambda L: ("gqa",) * L),
    "mqa": ("softmax, multi-query", lambda L: ("mqa",) * L),
    "mla": ("multi-head latent", lambda L: ("mla",) * L),
    "window": ("sliding window", lambda L: ("window",) * L),
    "streaming": ("sliding window + initial tokens", lambda L: ("streaming",) * L),
    "local_global": ("windows + one global layer", lambda L: ("window",) * (L - 1) + ("mha",)),
    "linear": ("linear, elu+1", lambda L: ("linear",) * L),
    "linear_decay": ("linear, RetNet decay", lambda L: ("linear_decay",) * L),
    "linear_gated": ("linear, data-dependent gates", lambda L: ("linear_gated",) * L),
    # Softmax first: its short conv hands each value token its key, so that one
    # layer does the lookup on the token embeddings. In a one-seed trial (MQAR,
    # 4 pairs in 24 tokens, lr 1e-2; not committed) it reached 0.9 test accuracy
    # in 150 steps, and with the softmax layer last (reading the linear layer's
    # mix of the prefix) in 325.
    "hybrid": (
        "softmax in the first layer, then linear; short convs",
        lambda L: ("mha_conv",) + ("linear_conv",) * (L - 1),
    ),
    "based": (
        "Taylor linear, window in the last layer, short convs",
        lambda L: ("based",) * (L - 1) + ("based_window",),
    ),
}


@dataclass(frozen=True)
class CompareConfig:
    """A comparison: one base run, the variants, the learning-rate sweep, the seeds.

    Attributes:
      train: the shared task, model width, budget and bookkeeping. Its
        ``model.layers`` is replaced per variant; its ``optim.lr`` by the sweep.
      variants: names from ``VARIANTS``: mha, gqa, mqa, mla, window, streaming,
        local_global, linear, linear_decay, linear_gated, hybrid, based.
      lrs: the learning-rate sweep; the best per variant is reported.
      seeds: every (variant, lr) trains once per seed; accuracies are averaged.
      num_layers: L, layers of every variant.
      num_heads: N query heads; head dim is ``width / N``.
      gqa_kv_heads: K for ``gqa``.
      window: sliding-window length (itself included) for window variants.
      num_initial_tokens: the always-visible first positions of ``streaming``.
      kv_rank: MLA latent rank R.
      q_rank: MLA query latent rank (None: direct query projection).
      rope_head_dim: MLA decoupled RoPE key width.
      chunk_size: C of the chunkwise linear attention.
      name: results go to ``results_dir/name`` and runs to ``runs_dir/name``.
        The test metric, the step cap and the early stop are the train config's:
        ``train.steps`` caps every run and ``train.target_accuracy`` (checked at
        each evaluation) stops it once reached.
      results_dir: where tables and plots go.
      runs_dir: where the runs' checkpoints and metrics go.
      fresh: delete this comparison's runs first instead of resuming them.
      progress: show progress (a bar per run, or with ``jobs > 1`` one over the runs).
      jobs: runs trained at once, each in its own process pinned to one core
        (1: one after another in this process, XLA using every core).
    """

    train: TrainConfig = field(default_factory=TrainConfig)
    variants: tuple[str, ...] = ("mha", "linear")
    lrs: tuple[float, ...] = (1e-3,)
    seeds: tuple[int, ...] = (0,)
    num_layers: int = 2
    num_heads: int = 4
    gqa_kv_heads: int = 2
    window: int = 16
    num_initial_tokens: int = 4
    kv_rank: int = 16
    q_rank: int | None = None
    rope_head_dim: int = 4
    chunk_size: int = 32
    name: str = "compare"
    results_dir: str = "results"
    runs_dir: str = "runs"
    fresh: bool = False
    progress: bool = True
    jobs: int = 2

    def __post_init__(self):
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or not self.variants:
            raise ValueError(f"variants: expected names from {sorted(VARIANTS)}, got {unknown}")
        if len(set(self.variants)) != len(self.variants):
            raise ValueError(f"variants: expected distinct names, got {self.variants}")
        if not self.lrs or any(not lr > 0 for lr in self.lrs):
            raise ValueError(f"lrs: expected positive learning rates, got {self.lrs}")
        if not self.seeds:
            raise ValueError(f"seeds: expected at least one seed, got {self.seeds}")
        if self.jobs < 1:
            raise ValueError(f"jobs: expected an int >= 1, got {self.jobs}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers: expected an int >= 1, got {self.num_layers}")
        width = self.train.model.width
        if self.num_heads < 1 or width % self.num_heads:
            raise ValueError(
                f"num_heads: expected a divisor of model.width={width}, got {self.num_heads}"
            )
        if self.gqa_kv_heads < 1 or self.num_heads % self.gqa_kv_heads:
            raise ValueError(
                f"gqa_kv_heads: expected a divisor of num_heads={self.num_heads}, "
                f"got {self.gqa_kv_heads}"
            )
        if not self.name or "/" in self.name:
            raise ValueError(f"name: expected a folder name, got {self.name!r}")


def variant_layers(config: CompareConfig, variant: str):
    """The ``ModelConfig.layers`` of one variant under the comparison's shared sizes."""
    registry = presets(
        num_heads=config.num_heads,
        head_dim=config.train.model.width // config.num_heads,
        gqa_kv_heads=config.gqa_kv_heads,
        window=config.window,
        num_initial_tokens=config.num_initial_tokens,
        kv_rank=config.kv_rank,
        q_rank=config.q_rank,
        rope_head_dim=config.rope_head_dim,
        chunk_size=config.chunk_size,
    )
    registry |= {
        f"{name}_conv": dataclasses.replace(layer, short_conv=SHORT_CONV)
        for name, layer in registry.items()
        if not layer.short_conv
    }
    return pattern(VARIANTS[variant][1](config.num_layers), registry)


def run_config(config: CompareConfig, variant: str, lr: float, seed: int) -> TrainConfig:
    """The ``TrainConfig`` of one run of the comparison."""
    base = config.train
    return dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, layers=variant_layers(config, variant)),
        optim=dataclasses.replace(base.optim, lr=lr),
        seed=seed,
    )


def _abstract_model(model_config: ModelConfig) -> Decoder:
    """The model with shapes instead of arrays: sizes without initializing anything."""
    return nnx.eval_shape(lambda: Decoder(model_config, rngs=nnx.Rngs(0)))


def param_count(model_config: ModelConfig) -> int:
    """Trainable parameters of a ``Decoder`` with this config."""
    state = nnx.state(_abstract_model(model_config), nnx.Param)
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))


def cache_sizes(model_config: ModelConfig) -> tuple[float, int]:
    """Decode-cache bytes of one sequence: ``(per token, fixed)``.

    Measured on the model's own ``init_cache`` (shapes only, nothing allocated)
    at two lengths past any window: full caches grow by ``per token`` bytes,
    ring buffers, linear states and short-convolution states stay at ``fixed`` bytes.
    """
    model = _abstract_model(model_config)
    short, long = 1 << 16, 1 << 17  # longer than any window in a comparison
    size = {
        n: cache_bytes(jax.eval_shape(lambda n=n: model.init_cache(1, n))) for n in (short, long)
    }
    per_token = (size[long] - size[short]) / (long - short)
    return per_token, int(size[short] - per_token * short)


def _run_dir(config: CompareConfig, variant: str, lr: float, seed: int) -> Path:
    return Path(config.runs_dir) / config.name / variant / f"lr{lr:g}_seed{seed}"


def state_bytes(model_config: ModelConfig, seq_len: int) -> int:
    """Decode-state bytes of one sequence of ``seq_len`` tokens (full caches at that length)."""
    per_token, fixed = cache_sizes(model_config)
    return round(per_token * seq_len) + fixed


def softmax_layers(config: CompareConfig, variant: str) -> list[int]:
    """1-based indices of the variant's softmax (and MLA) layers, windows included."""
    return [i + 1 for i, c in enumerate(variant_layers(config, variant)) if c.kind != "linear"]


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
        summary = {"test_accuracy": 0.0, "test_loss": None}
        diverged = e.step
    return {
        "variant": variant,
        "lr": lr,
        "seed": seed,
        "workdir": str(workdir),
        "diverged_at": diverged,
        "summary": summary,
        "curves": _curves(workdir),
    }


def _worker_init(started) -> None:
    """A worker process: one core of its own (the runs share the machine), cached compilation.

    XLA:CPU sizes its thread pools by the cores the process may run on, so
    worker i is pinned to core i (modulo the cores it was given) before JAX
    starts its backend. No XLA flag does this: ``--xla_cpu_multi_thread_eigen=false``
    still kept 1.9 of 2 cores busy on a jitted matmul, and flags without a
    leading ``--`` are silently ignored.

    Args:
      started: a shared counter of the workers started so far.
    """
    with started.get_lock():
        index = started.value
        started.value += 1
    if hasattr(os, "sched_setaffinity"):  # Linux; elsewhere the workers share the cores
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[index % len(cores)]})
    enable_compilation_cache()


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
    if config.fresh:
        shutil.rmtree(Path(config.runs_dir) / config.name, ignore_errors=True)
    specs = [
        (variant, lr, seed)
        for lr in config.lrs
        for seed in config.seeds
        for variant in config.variants
    ]
    descs = [f"[{i + 1}/{len(specs)}] {v} lr={lr:g} seed={s}" for i, (v, lr, s) in enumerate(specs)]
    if config.jobs == 1:
        runs = [
            _train_one(config, *spec, desc, config.progress)
            for spec, desc in zip(specs, descs, strict=True)
        ]
    else:
        runs = [None] * len(specs)
        context = multiprocessing.get_context("spawn")  # fork and XLA's threads do not mix
        with (
            ProcessPoolExecutor(
                config.jobs,
                mp_context=context,
                initializer=_worker_init,
                initargs=(context.Value("i", 0),),
            ) as pool,
            tqdm(total=len(specs), desc=config.name, disable=not config.progress) as bar,
        ):
            futures = {
                pool.submit(_train_one, config, *spec, desc, False): i
                for i, (spec, desc) in enumerate(zip(specs, descs, strict=True))
            }
            for future in as_completed(futures):
                i = futures[future]
                runs[i] = future.result()
                s = runs[i]["summary"]
                bar.write(
                    f"{descs[i]}: test accuracy {s['test_accuracy']:.3f} at step {s['step']}"
                    + (f", {s['wall_s']:.0f} s" if "wall_s" in s else ", diverged")
                )
                bar.update(1)
    from train.compare_report import summarize_variant  # it imports this module

    variants = {}
    for variant in config.variants:
        per_lr = {
            lr: [r for r in runs if (r["variant"], r["lr"]) == (variant, lr)] for lr in config.lrs
        }
        variants[variant] = summarize_variant(config, variant, per_lr)
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


def chance_accuracy(task) -> float | None:
    """Test accuracy of a model that knows the task's format but recalls nothing, or None.

    On MQAR every answer is one of the ``num_pairs`` values in its sequence, so
    picking one of them at random scores ``1 / num_pairs``: a fixed-state model
    that reaches only that has learned the format, not the associations.
    """
    return 1.0 / task.num_pairs if task.name == "mqar" else None


def metric(task) -> str:
    """The table's headline metric: bits per byte on ``bytes``, accuracy elsewhere."""
    return "bits_per_byte" if task.name == "bytes" else "accuracy"


def main(argv=None) -> int:
    """``python -m train.compare [--config FILE] [--quick] [--task T] [field overrides]``."""
    from train.compare_report import format_table, write_results

    argv = list(sys.argv[1:] if argv is None else argv)
    quick = "--quick" in argv
    argv = [a for a in argv if a != "--quick"]
    config_kwargs = {"quick": quick}
    if "--task" in argv:
        i = argv.index("--task")
        if i + 1 >= len(argv) or argv[i + 1] not in TASKS:
            got = argv[i + 1] if i + 1 < len(argv) else "nothing"
            raise SystemExit(f"--task: expected one of {', '.join(TASKS)}, got {got}")
        config_kwargs["task"] = argv[i + 1]
        del argv[i : i + 2]
    config, _ = parse(
        "python -m train.compare",
        "Train every attention variant on the same task to its target accuracy or step cap; "
        "write results/<name>/. Flags of this command: --config FILE (default "
        "configs/compare_mqar.py), --quick (the config's quick settings), --task "
        f"{'|'.join(TASKS)} (default mqar); every field below overrides the config.",
        argv,
        default_config=str(Path(__file__).resolve().parent.parent / "configs" / "compare_mqar.py"),
        config_kwargs=config_kwargs,
    )
    enable_compilation_cache()
    results = run_comparison(config)
    out, paths = write_results(results, config)
    print()
    print(format_table(results, config))
    print(f"wrote {out}/: " + ", ".join(p.name for p in paths))
    return 0


if __name__ == "__main__":
    # Run the importable module's main, not this __main__ copy: worker processes
    # unpickle the functions and configs they are sent by their module name.
    from train.compare import main as _main

    sys.exit(_main())
