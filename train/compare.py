"""The main job: train every attention variant on the same task, width, budget and seeds.

``python -m train.compare`` (default config ``configs/compare_mqar.py``) trains
each variant with each learning rate of a small sweep and each seed, keeps the
best learning rate per variant (by mean test accuracy, as Zoology does), and
writes ``results/<name>/``:

- ``table.md``: variant, layers, parameters, decode-cache bytes (per token for
  caches that grow, fixed for windows and recurrent states), test accuracy,
  best learning rate, train tokens/s and wall time; also printed at the end.
- ``results.json``: the config, every run's summary and curves, the best per variant.
- ``accuracy.png``: test accuracy per variant (bars; the sweep's other
  learning rates as dots).
- ``loss.png``: train loss and test accuracy against step, best run per variant.

Each run trains in ``runs/<name>/<variant>/lr<lr>_seed<seed>`` with
checkpoints, so an interrupted comparison picks up where it stopped
(``--fresh`` starts over). ``--quick`` uses the config file's quick settings
(``get_config(quick=True)``, about a minute); every field can still be
overridden, e.g. ``--quick --train.steps 20 --variants mha linear``.
"""

from __future__ import annotations

import dataclasses
import json
import math
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
    "VARIANTS",
    "CompareConfig",
    "cache_sizes",
    "chance_accuracy",
    "main",
    "run_comparison",
    "variant_layers",
]

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
    "hybrid": (
        "linear + one softmax layer, short convs",
        lambda L: ("linear_conv",) * (L - 1) + ("mha_conv",),
    ),
    "based": (
        "Taylor linear + one window layer, short convs",
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
    """Trains every (variant, lr, seed) and picks each variant's best learning rate.

    With ``jobs > 1`` the runs train in that many worker processes at once,
    each pinned to a core of its own (small models leave a core's threads idle anyway).
    The runs are ordered learning rate first, so the first wave compiles each
    variant and the later ones find it in the compilation cache.

    A run whose loss diverges counts as accuracy 0 for its learning rate (it is
    a legitimate outcome of a sweep, not an error).

    Returns:
      ``dict(config, runs, best, wall_s)``: ``runs`` lists every run's summary
      and curves; ``best`` maps each variant to its best learning rate's mean
      test accuracy, parameters, cache sizes, tokens/s and wall time.
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
                    f"{descs[i]}: test accuracy {s['test_accuracy']:.3f}"
                    + (f", {s['wall_s']:.0f} s" if "wall_s" in s else ", diverged")
                )
                bar.update(1)
    best = {}
    for variant in config.variants:
        per_lr = {
            lr: [r for r in runs if r["variant"] == variant and r["lr"] == lr] for lr in config.lrs
        }
        best[variant] = _best(config, variant, per_lr)
    return {
        "config": to_json(config),
        "runs": runs,
        "best": best,
        "chance_accuracy": chance_accuracy(config.train.task),
        "wall_s": time.perf_counter() - t0,
    }


def chance_accuracy(task) -> float | None:
    """Test accuracy of a model that knows the task's format but recalls nothing, or None.

    On MQAR every answer is one of the ``num_pairs`` values in its sequence, so
    picking one of them at random scores ``1 / num_pairs``: a fixed-state model
    that reaches only that has learned the format, not the associations.
    """
    return 1.0 / task.num_pairs if task.name == "mqar" else None


def _best(config: CompareConfig, variant: str, per_lr: dict[float, list]) -> dict[str, Any]:
    """The variant's entry of the table: its best learning rate's runs, averaged over seeds."""

    def score(lr):
        accs = [r["summary"]["test_accuracy"] or 0.0 for r in per_lr[lr]]
        losses = [r["summary"].get("test_loss") or math.inf for r in per_lr[lr]]  # None: diverged
        return (float(np.mean(accs)), -float(np.mean(losses)))

    lr = max(per_lr, key=score)
    chosen = [r for r in per_lr[lr] if r["diverged_at"] is None] or per_lr[lr]
    mean = lambda key: float(np.mean([r["summary"].get(key, math.nan) for r in chosen]))  # noqa: E731
    model_config = run_config(config, variant, lr, config.seeds[0]).model
    model_config = dataclasses.replace(model_config, vocab_size=config.train.task.vocab)
    per_token, fixed = cache_sizes(model_config)
    accs = [r["summary"]["test_accuracy"] or 0.0 for r in per_lr[lr]]
    return {
        "description": VARIANTS[variant][0],
        "layers": "+".join(VARIANTS[variant][1](config.num_layers)),
        "lr": lr,
        "test_accuracy": float(np.mean(accs)),
        "test_accuracy_std": float(np.std(accs)),
        "test_accuracy_per_lr": {f"{k:g}": score(k)[0] for k in per_lr},
        "params": param_count(model_config),
        "diverged": all(r["diverged_at"] is not None for r in per_lr[lr]),
        "cache_bytes_per_token": per_token,
        "cache_bytes_fixed": fixed,
        "tokens_per_s": mean("tokens_per_s"),
        "wall_s": mean("wall_s"),
        "sweep_wall_s": float(
            sum(r["summary"].get("wall_s", 0.0) for rs in per_lr.values() for r in rs)
        ),
    }


# ----------------------------------------------------------------------------
# Output


def _bytes(n: float) -> str:
    if n == 0:
        return "0"
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _task_line(config: CompareConfig) -> str:
    t, tr = config.train.task, config.train
    what = {
        "mqar": f"MQAR, {t.num_pairs} key-value pairs, T={t.seq_len}, V={t.vocab_size}"
        + (f" (training examples: {t.min_pairs} to {t.num_pairs} pairs)" if t.min_pairs else ""),
        "induction": f"induction, T={t.seq_len}, V={t.vocab_size}",
        "selective_copy": f"selective copying, {t.num_copy} tokens, T={t.seq_len}",
        "bytes": f"bytes, T={t.seq_len}",
    }[t.name]
    lrs = ", ".join(f"{x:g}" for x in config.lrs)
    return (
        f"{what}; width {tr.model.width}, {config.num_layers} layers, {config.num_heads} heads; "
        f"{tr.steps} steps of batch {tr.batch_size}; lr sweep {lrs}; "
        f"seeds {', '.join(map(str, config.seeds))}"
    )


def format_table(results: dict[str, Any], config: CompareConfig) -> str:
    """The markdown table of ``results`` (one row per variant, best learning rate)."""
    multi_seed = len(config.seeds) > 1
    lines = [
        f"# {config.name}",
        "",
        _task_line(config),
        "",
        "| variant | layers | params | cache B/token | fixed cache/state | test accuracy "
        "| best lr | train tokens/s | wall time |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for variant, b in results["best"].items():
        acc = f"{b['test_accuracy']:.3f}"
        if b["diverged"]:
            acc += " (diverged)"
        if multi_seed:
            acc += f" ± {b['test_accuracy_std']:.3f}"
        lines.append(
            f"| {variant} ({b['description']}) | {b['layers']} | {b['params']:,} "
            f"| {b['cache_bytes_per_token']:.0f} | {_bytes(b['cache_bytes_fixed'])} | {acc} "
            f"| {b['lr']:g} | {b['tokens_per_s']:,.0f} | {b['wall_s']:.0f} s |"
        )
    lines += [
        "",
        "Test accuracy: the fraction of labelled positions predicted exactly, on "
        f"{config.train.eval_batches} fixed test batches, for the best learning rate of the "
        "sweep (mean over seeds). Cache: decode-cache bytes per sequence in float32; full "
        "caches grow per token, windows and recurrent states are fixed. Tokens/s excludes "
        "compilation and evaluation; wall time is one run's, compilation included"
        + (f"; {config.jobs} runs trained at once, one core each." if config.jobs > 1 else "."),
    ]
    chance = results.get("chance_accuracy")
    if chance is not None:
        lines[-1] += (
            f" Chance is {chance:.3f}: a random one of the {config.train.task.num_pairs} values "
            "in the sequence (the format learned, no association recalled)."
        )
    lines += [
        "",
        f"Total wall time of the comparison: {results['wall_s']:.0f} s "
        f"({len(results['runs'])} runs).",
        "",
    ]
    return "\n".join(lines)


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    """Writes ``accuracy.png`` and ``loss.png`` under ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = results["best"]
    names = list(best)
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(names) + 2), 4))
    accs = [best[n]["test_accuracy"] for n in names]
    ax.bar(range(len(names)), accs, color="tab:blue", label="best lr")
    for i, n in enumerate(names):
        others = list(best[n]["test_accuracy_per_lr"].values())
        ax.scatter([i] * len(others), others, color="black", s=10, zorder=3)
        ax.text(i, accs[i] + 0.02, f"{accs[i]:.2f}", ha="center", fontsize=8)
    ax.scatter([], [], color="black", s=10, label="each lr")
    chance = results.get("chance_accuracy")
    if chance is not None:
        ax.axhline(chance, color="gray", ls="--", lw=1, label=f"chance ({chance:.2f})")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("test accuracy")
    ax.set_title(results["config"]["name"])
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    paths = [out / "accuracy.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    for n in names:
        runs = [r for r in results["runs"] if r["variant"] == n and r["lr"] == best[n]["lr"]]
        c = runs[0]["curves"]
        ax_loss.plot(c["train_step"], c["train_loss"], label=n)
        ax_acc.plot(c["eval_step"], c["test_accuracy"], marker=".", label=n)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("train loss")
    ax_loss.set_yscale("log")
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("test accuracy")
    ax_acc.set_ylim(0, 1.05)
    if chance is not None:
        ax_acc.axhline(chance, color="gray", ls="--", lw=1, label="chance")
    ax_acc.legend(fontsize=8)
    fig.suptitle(f"{results['config']['name']}: best learning rate per variant, seed 0")
    fig.tight_layout()
    paths.append(out / "loss.png")
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths


def _finite(tree):
    """``tree`` with NaN and infinities as None (strict JSON has neither)."""
    if isinstance(tree, dict):
        return {k: _finite(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [_finite(v) for v in tree]
    if isinstance(tree, float) and not math.isfinite(tree):
        return None
    return tree


def write_results(results: dict[str, Any], config: CompareConfig) -> Path:
    """Writes ``table.md``, ``results.json`` and the plots; returns the folder."""
    out = Path(config.results_dir) / config.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(format_table(results, config))
    (out / "results.json").write_text(json.dumps(_finite(results), indent=1, allow_nan=False))
    plot(results, out)
    return out


def main(argv=None) -> int:
    """``python -m train.compare [--config FILE] [--quick] [field overrides]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    quick = "--quick" in argv
    argv = [a for a in argv if a != "--quick"]
    config, _ = parse(
        "python -m train.compare",
        "Train every attention variant on the same task and budget; write results/<name>/. "
        "Flags of this command: --config FILE (default configs/compare_mqar.py), --quick "
        "(the config's quick settings); every field below overrides the config.",
        argv,
        default_config=str(Path(__file__).resolve().parent.parent / "configs" / "compare_mqar.py"),
        config_kwargs={"quick": quick},
    )
    enable_compilation_cache()
    results = run_comparison(config)
    out = write_results(results, config)
    print()
    print(format_table(results, config))
    print(f"wrote {out}/table.md, results.json, accuracy.png, loss.png")
    return 0


if __name__ == "__main__":
    # Run the importable module's main, not this __main__ copy: worker processes
    # unpickle the functions and configs they are sent by their module name.
    from train.compare import main as _main

    sys.exit(_main())
