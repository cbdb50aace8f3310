"""The recall frontier: MQAR accuracy against decode-state size, one line per family.

    python -m analysis.experiments.recall_frontier [--scale cpu|zoology] [--only FAMILY,...]
        [--jobs N] [--out DIR] [--quick] [--dry-run]

Zoology's recall-memory trade-off (Arora et al. 2023, "Zoology: measuring and
improving recall in efficient language models"; the Based paper's Figure 2)
asks how much associative recall each family of sequence mixers buys per
element of state it keeps while decoding. Every family here sweeps one knob
that sets its state (``FAMILIES``): the width of softmax attention and of the
hybrid, the number of kv heads of GQA, the latent rank of MLA, the window of
sliding-window attention, the head dim (= feature dim) of linear attention,
gated linear attention and Gated DeltaNet, and the Taylor feature dim of
Based. Each point is a 2-layer decoder trained on MQAR at one (T, pairs)
setting for each learning rate of the scale's sweep (and each seed); the point
reports its final test accuracy (every pair queried, ``train.tasks``) at the
best learning rate, as Zoology does. Like Zoology's models, every layer has a
short convolution (the ``_conv`` presets; Based and Gated DeltaNet have their
own). Unlike Zoology, which trains one model on a mixture of the settings and
reports each slice, each setting trains models of its own, with training
examples of 1 to ``pairs`` pairs.

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

* ``cpu`` (default): (T, pairs) = (64, 4) and (128, 8), V = 64, one learning
  rate (1e-2), 1 seed, 9 families x 4 knob values: 72 runs of batch 32, at most
  500 updates at T = 64 and 350 at T = 128, stopping at 0.99. The committed run
  is in ``docs/results/recall_frontier/`` with its wall time (``runtime_s``).
* ``zoology``: V = 8192, (64, 4), (128, 8), (256, 16), (512, 64), 4 learning
  rates, batch 256, 12,500 updates at T = 64 and 2,500 at the others (32
  epochs of Zoology's 100,000 and 20,000 training examples), 1 seed, the same
  families over wider knobs: 9 x 4 x 4 x 4 = 576 runs.
  ``--dry-run --scale zoology --flops`` prints XLA's FLOP count of each point's
  update (forward + backward, not the optimizer) times its updates, and the
  total over the runs; what it printed, and the GPU time it implies, is in
  ``docs/results/recall_frontier/zoology-scale.md``.
* ``quick``: two runs of a few updates (the tests).

``--dry-run`` builds every run's config and model (shapes only) and prints
each point's parameters and state without training; with ``--scale zoology``
it also counts the FLOPs (``--flops``).
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports below run is one line
    from train.interrupt import exit_on_sigint

    exit_on_sigint("python -m analysis.experiments.recall_frontier")

import dataclasses
import json
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from analysis.experiments import _common
from attn.checks import fail
from models import ModelConfig, pattern, presets

NAME = "recall_frontier"
HEAD_DIM = 16  # of the softmax and hybrid families, whose knob is the width
REACHED = 0.9  # the accuracy the table's "reaches" column looks for


@dataclass(frozen=True)
class Family:
    """A family of the frontier: a label, its knob and the model each knob value gives.

    Attributes:
      label: the legend's name.
      knob: what the sweep changes, in words (the table's column).
      model: ``knob value -> ModelConfig`` (2 layers; vocabulary set by the task).
    """

    label: str
    knob: str
    model: Callable[[int], ModelConfig]


def _model(width: int, names: tuple[str, ...], **sizes) -> ModelConfig:
    """A decoder of ``width`` with layers ``names`` (``models.presets`` at ``sizes``).

    The MLP is a quarter of the width (recall lives in the mixers; the main
    job's width-64 models use 16).
    """
    sizes = {"num_heads": max(width // HEAD_DIM, 1), "head_dim": HEAD_DIM, **sizes}
    layers = pattern(names, presets(**sizes))
    return ModelConfig(width=width, mlp_width=max(width // 4, 8), layers=layers)


def _heads_of(width: int, names: tuple[str, ...]) -> Callable[[int], ModelConfig]:
    """``head dim -> model`` at a fixed width: width / H heads of dim H."""
    return lambda h: _model(width, names, num_heads=width // h, head_dim=h)


def _gated_deltanet(h: int) -> ModelConfig:
    """Gated DeltaNet of width 64 in heads of dim ``h``, in its fastest form at that dim.

    The forms compute the same function; what differs is the cost of a training
    step. The chunkwise form's triangular inverse costs C^2 per token and head
    against the recurrence's H x H, so chunks of 16 (not the default 64) suit
    these head dims, and at H = 8 the scan over tokens is faster still (the
    step times: ``docs/results/README.md``, trials behind defaults).
    """
    model = _heads_of(64, ("gated_deltanet",) * 2)(h)
    form = "recurrent" if h <= 8 else "chunkwise"
    layers = tuple(dataclasses.replace(c, form=form, chunk_size=16) for c in model.layers)
    return dataclasses.replace(model, layers=layers)


FAMILIES: dict[str, Family] = {
    "mha": Family("softmax MHA", "width", lambda d: _model(d, ("mha_conv",) * 2)),
    "gqa": Family(
        "softmax GQA (8 heads of 8)",
        "kv heads",
        lambda k: _model(64, ("gqa_conv",) * 2, num_heads=8, head_dim=8, gqa_kv_heads=k),
    ),
    "mla": Family(
        "MLA",
        "latent rank",
        lambda r: _model(64, ("mla_conv",) * 2, kv_rank=r, q_rank=None, rope_head_dim=4),
    ),
    "window": Family(
        "sliding window", "window", lambda w: _model(64, ("window_conv",) * 2, window=w)
    ),
    "linear": Family("linear (elu+1)", "head dim", _heads_of(64, ("linear_conv",) * 2)),
    "gla": Family("gated linear", "head dim", _heads_of(64, ("linear_gated_conv",) * 2)),
    "based": Family(
        "Based (Taylor)",
        "feature dim",
        lambda f: _model(64, ("based",) * 2, based_head_dim=f),
    ),
    "gated_deltanet": Family("Gated DeltaNet", "head dim", lambda h: _gated_deltanet(h)),
    # Mamba-2 at width 64 (4 heads of 16), its own convolution over x, B and C: the knob is
    # the SSD state dim H, so a layer's state is heads x head dim x H.
    "mamba2": Family("Mamba-2", "state dim", lambda h: _model(64, ("mamba2",) * 2, state_dim=h)),
    "hybrid": Family(
        "hybrid (softmax, then linear)", "width", lambda d: _model(d, ("mha_conv", "linear_conv"))
    ),
}


@dataclass(frozen=True)
class Scale:
    """A grid of the experiment.

    Attributes:
      name: ``cpu``, ``zoology`` or ``quick``.
      settings: the MQAR (T, pairs) settings, one panel each.
      steps: the update cap of each setting's runs.
      knobs: ``(family, knob values)`` pairs: the families and their sweeps.
      vocab_size: V of the task.
      lrs: the learning-rate sweep; each point reports its best.
      seeds: every (point, lr) trains once per seed.
      batch_size: examples per update.
      eval_every: updates between test evaluations (the early stop is checked there).
      eval_batches: test batches of ``batch_size`` per evaluation.
      target: stop a run once its test accuracy reaches this.
      min_pairs: training examples hold ``min_pairs`` to ``pairs`` pairs.
    """

    name: str
    settings: tuple[tuple[int, int], ...]
    steps: tuple[int, ...]
    knobs: tuple[tuple[str, tuple[int, ...]], ...]
    vocab_size: int
    lrs: tuple[float, ...]
    seeds: tuple[int, ...] = (0,)
    batch_size: int = 64
    eval_every: int = 50
    eval_batches: int = 4
    target: float = 0.99
    min_pairs: int | None = 1

    def __post_init__(self):
        if len(self.steps) != len(self.settings):
            fail("steps", f"one cap per setting ({len(self.settings)})", repr(self.steps))
        unknown = [f for f, _ in self.knobs if f not in FAMILIES]
        if unknown:
            fail("knobs", f"families from {sorted(FAMILIES)}", repr(unknown))

    def families(self) -> dict[str, tuple[int, ...]]:
        return dict(self.knobs)

    def only(self, names) -> Scale:
        """This grid restricted to the families ``names``."""
        unknown = [n for n in names if n not in self.families()]
        if unknown or not names:
            fail("only", f"family names from {sorted(self.families())}", repr(list(names)))
        return dataclasses.replace(self, knobs=tuple(k for k in self.knobs if k[0] in names))


SCALES: dict[str, Scale] = {
    "cpu": Scale(
        name="cpu",
        settings=((64, 4), (128, 8)),
        steps=(500, 350),
        knobs=(
            ("mha", (16, 32, 48, 64)),
            ("gqa", (1, 2, 4, 8)),
            ("mla", (4, 8, 16, 32)),
            ("window", (4, 8, 16, 32)),
            ("linear", (8, 16, 32, 64)),
            ("gla", (8, 16, 32, 64)),
            ("based", (4, 8, 12, 16)),
            ("gated_deltanet", (8, 16, 32, 64)),
            ("hybrid", (16, 32, 48, 64)),
            ("mamba2", (8, 16, 32, 64)),
        ),
        vocab_size=64,
        lrs=(1e-2,),
        batch_size=32,
    ),
    "zoology": Scale(
        name="zoology",
        settings=((64, 4), (128, 8), (256, 16), (512, 64)),
        steps=(12_500, 2_500, 2_500, 2_500),
        knobs=(
            ("mha", (64, 128, 256, 512)),
            ("gqa", (1, 2, 4, 8)),
            ("mla", (8, 16, 32, 64)),
            ("window", (8, 32, 128, 512)),
            ("linear", (8, 16, 32, 64)),
            ("gla", (8, 16, 32, 64)),
            ("based", (8, 16, 24, 32)),
            ("gated_deltanet", (8, 16, 32, 64)),
            ("hybrid", (64, 128, 256, 512)),
            ("mamba2", (16, 32, 64, 128)),
        ),
        vocab_size=8192,
        lrs=tuple(float(x) for x in np.logspace(-3, -1.5, 4)),
        batch_size=256,
        eval_every=250,
        eval_batches=4,
        min_pairs=None,
    ),
    "quick": Scale(
        name="quick",
        settings=((16, 2),),
        steps=(6,),
        knobs=(("mha", (16,)), ("linear", (16,))),
        vocab_size=32,
        lrs=(3e-3,),
        batch_size=8,
        eval_every=3,
        eval_batches=1,
    ),
}


@dataclass(frozen=True)
class Run:
    """One training run: a point (setting, family, knob) at a learning rate and seed."""

    setting: tuple[int, int]
    family: str
    knob: int
    lr: float
    seed: int

    @property
    def point(self) -> tuple[tuple[int, int], str, int]:
        return self.setting, self.family, self.knob

    @property
    def name(self) -> str:
        T, pairs = self.setting
        return f"T{T}-pairs{pairs}/{self.family}-{self.knob}/lr{self.lr:.1e}-seed{self.seed}"


def setting_key(setting) -> str:
    T, pairs = setting
    return f"T={T}, {pairs} pairs"


def train_config(scale: Scale, run: Run):
    """The ``TrainConfig`` of one run."""
    from train.config import OptimConfig, TrainConfig
    from train.tasks import TaskConfig

    T, pairs = run.setting
    steps = scale.steps[scale.settings.index(run.setting)]
    min_pairs = None if scale.min_pairs is None else min(scale.min_pairs, pairs)
    return TrainConfig(
        task=TaskConfig(
            name="mqar", seq_len=T, vocab_size=scale.vocab_size, num_pairs=pairs,
            min_pairs=min_pairs,
        ),
        model=FAMILIES[run.family].model(run.knob),
        optim=OptimConfig(lr=run.lr, warmup_fraction=0.02),
        steps=steps,
        batch_size=scale.batch_size,
        eval_every=scale.eval_every,
        eval_batches=scale.eval_batches,
        ckpt_every=max(scale.eval_every, 200),
        log_every=scale.eval_every,
        target_accuracy=scale.target,
        seed=run.seed,
    ).with_task_vocab()  # fmt: skip


def runs(scale: Scale) -> list[Run]:
    """Every run of the grid, learning rate first: the first wave compiles each point's
    programs and the later ones (other rates and seeds) find them in the cache."""
    return [
        Run(setting, family, knob, lr, seed)
        for lr in scale.lrs
        for seed in scale.seeds
        for setting in scale.settings
        for family, knobs in scale.knobs
        for knob in knobs
    ]


def sizes(scale: Scale, point) -> dict[str, int]:
    """``dict(params, state_elements, state_bytes)`` of a point, from shapes only."""
    from train.variants import param_count, state_bytes

    setting, family, knob = point
    config = train_config(scale, Run(setting, family, knob, scale.lrs[0], scale.seeds[0]))
    nbytes = state_bytes(config.model, setting[0])
    itemsize = np.dtype(config.model.dtype).itemsize
    return {
        "params": param_count(config.model),
        "state_elements": nbytes // itemsize,
        "state_bytes": nbytes,
    }


# ----------------------------------------------------------------------------
# Training


def _train(config, workdir: str, desc: str) -> dict[str, Any]:
    """One run (in a worker or in this process); a diverged run scores 0."""
    import train.loop

    try:
        summary = train.loop.train(config, workdir, progress=False, desc=desc)
    except train.loop.NonFiniteLossError as e:
        print(f"{desc}: {e}", file=sys.stderr)
        summary = {"test_accuracy": 0.0, "step": e.step, "diverged": True}
    return summary


def _finished(workdir: Path) -> dict[str, Any] | None:
    """A finished run's summary, read back (None: not finished, or unreadable)."""
    path = workdir / "summary.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # retrain: train.loop resumes from its checkpoints and rewrites it


def train_all(scale: Scale, out: Path, *, jobs: int, progress: bool) -> dict[Run, dict]:
    """Trains every unfinished run of ``scale`` under ``out/runs``; returns every summary."""
    from tqdm.auto import tqdm

    import train.compare
    from train import interrupt, plugins

    todo, summaries = [], {}
    for run in runs(scale):
        done = _finished(_common.run_dir(out, run.name))
        if done is None:
            todo.append(run)
        else:
            summaries[run] = done
    bar = tqdm(total=len(todo), desc=f"{NAME} ({scale.name})", disable=not progress)

    def report(run, summary):
        summaries[run] = summary
        bar.write(
            f"{run.name}: test accuracy {summary['test_accuracy']:.3f} at step {summary['step']}"
        )
        bar.update(1)

    args = [(train_config(scale, r), str(_common.run_dir(out, r.name)), r.name) for r in todo]
    if jobs == 1 or len(todo) <= 1:
        for run, a in zip(todo, args, strict=True):
            report(run, _train(*a))
    else:
        if interrupt.active():  # Ctrl-C stops the workers; their runs keep their checkpoints
            signal.signal(signal.SIGINT, train.compare.stop_workers)
            os.environ["PYTHONWARNINGS"] = "ignore:resource_tracker:UserWarning"
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(
            jobs,
            mp_context=context,
            initializer=train.compare.worker_init,
            initargs=(context.Value("i", 0), plugins.loaded()),
        ) as pool:
            futures = {pool.submit(_train, *a): run for run, a in zip(todo, args, strict=True)}
            for future in as_completed(futures):
                report(futures[future], future.result())
    bar.close()
    return summaries


# ----------------------------------------------------------------------------
# Summaries: points, the frontier, the claim


def points(scale: Scale, summaries: dict[Run, dict]) -> list[dict[str, Any]]:
    """Every point of the grid at its best learning rate (by mean final accuracy over seeds)."""
    rows = []
    for setting in scale.settings:
        for family, knobs in scale.knobs:
            for knob in knobs:
                by_lr = {
                    lr: [summaries[Run(setting, family, knob, lr, s)] for s in scale.seeds]
                    for lr in scale.lrs
                }
                mean = {
                    lr: float(np.mean([r["test_accuracy"] for r in v])) for lr, v in by_lr.items()
                }
                best = max(scale.lrs, key=lambda lr: mean[lr])
                rows.append({
                    "setting": list(setting),
                    "family": family,
                    "knob": knob,
                    **sizes(scale, (setting, family, knob)),
                    "best_lr": best,
                    "accuracy": mean[best],
                    "seed_accuracies": [r["test_accuracy"] for r in by_lr[best]],
                    "steps": [r["step"] for r in by_lr[best]],
                    "accuracy_by_lr": {f"{lr:.1e}": mean[lr] for lr in scale.lrs},
                })  # fmt: skip
    return rows


def pareto(rows: list[dict]) -> list[dict]:
    """The points no other point beats with no more state and at least the accuracy,
    by state (ties in state keep the more accurate)."""
    front, best = [], -1.0
    for r in sorted(rows, key=lambda r: (r["state_elements"], -r["accuracy"])):
        if r["accuracy"] > best:
            front.append(r)
            best = r["accuracy"]
    return front


def reach(rows: list[dict], family: str, level: float = REACHED) -> str:
    """Where ``family`` first reaches ``level``: the smallest state, or that it does not."""
    mine = sorted((r for r in rows if r["family"] == family), key=lambda r: r["state_elements"])
    hit = next((r for r in mine if r["accuracy"] >= level), None)
    if hit is not None:
        return f"{hit['state_elements']:.3g} ({FAMILIES[family].knob} {hit['knob']})"
    return f"not reached at {mine[-1]['state_elements']:.3g}"


def _largest_below(rows, family, level=0.5):
    """The largest state at which ``family`` stays below ``level`` (None: none does)."""
    low = [r["state_elements"] for r in rows if r["family"] == family and r["accuracy"] < level]
    return max(low) if low else None


def claim(scale: Scale, rows: list[dict]) -> dict[str, Any]:
    """The claim row: the frontier in one line, judged on the delta rule against linear attention.

    Criterion (fixed before the run): at every setting, Gated DeltaNet reaches
    0.9 with no more state than the largest at which linear attention (elu+1)
    stays below 0.5.
    """
    parts, holds = [], True
    for setting in scale.settings:
        mine = [r for r in rows if tuple(r["setting"]) == tuple(setting)]
        families = [f for f, _ in scale.knobs]
        reached = ", ".join(f"{f} {reach(mine, f)}" for f in families)
        parts.append(f"{setting_key(setting)}: 0.9 at state {reached}")
        if "gated_deltanet" in families and "linear" in families:
            low = _largest_below(mine, "linear")
            hits = [
                r["state_elements"]
                for r in mine
                if r["family"] == "gated_deltanet" and r["accuracy"] >= REACHED
            ]
            holds = holds and low is not None and bool(hits) and min(hits) <= low
        else:
            holds = False
    return _common.claim(
        "; ".join(parts),
        "at every setting Gated DeltaNet reaches 0.9 with no more state than the largest "
        "at which linear attention (elu+1) stays below 0.5",
        holds,
    )


# ----------------------------------------------------------------------------
# Reports


def _reach_rows(scale: Scale, mine: list[dict]) -> list[list]:
    """Per family: where it reaches 0.9, its best accuracy and that point's state."""
    out = []
    for family, _ in scale.knobs:
        best = max((r for r in mine if r["family"] == family), key=lambda r: r["accuracy"])
        label = FAMILIES[family].label
        out.append([label, reach(mine, family), best["accuracy"], f"{best['state_elements']:.3g}"])
    return out


def _point_row(r: dict, front: list[dict]) -> list:
    family = FAMILIES[r["family"]]
    return [
        family.label,
        f"{family.knob} {r['knob']}",
        f"{r['state_elements']:,}",
        f"{r['state_bytes']:,}",
        f"{r['params']:,}",
        f"{r['best_lr']:.1e}",
        r["accuracy"],
        " ".join(f"{a:.3f}" for a in r["seed_accuracies"]),
        " ".join(str(s) for s in r["steps"]),
        "yes" if r in front else "",
    ]


POINT_COLUMNS = (
    "family", "knob", "state (elements)", "state (bytes, f32)", "params", "best lr",
    "accuracy", "per seed", "steps", "on the frontier",
)  # fmt: skip


def table(scale: Scale, rows: list[dict]) -> str:
    """``table.md``'s body: per setting, where each family reaches 0.9, then every point."""
    lines = []
    for setting in scale.settings:
        mine = [r for r in rows if tuple(r["setting"]) == tuple(setting)]
        front = pareto(mine)
        reach_head = ["family", f"reaches {REACHED} at state (elements)", "best accuracy", "at"]
        ordered = sorted(mine, key=lambda r: (r["family"], r["state_elements"]))
        lines += [
            f"## {setting_key(setting)} (chance {1 / setting[1]:.3f})",
            "",
            _common.markdown_table(reach_head, _reach_rows(scale, mine)),
            _common.markdown_table(POINT_COLUMNS, [_point_row(r, front) for r in ordered]),
        ]
    return "\n".join(lines)


def plot(scale: Scale, rows: list[dict], path: Path) -> Path:
    """``frontier.png``: accuracy against state, a panel per setting."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    n = len(scale.settings)
    fig = Figure(figsize=(5.5 * n, 4.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, n, squeeze=False)[0]
    colors = {f: f"C{i}" for i, (f, _) in enumerate(scale.knobs)}
    for ax, setting in zip(axes, scale.settings, strict=True):
        mine = [r for r in rows if tuple(r["setting"]) == tuple(setting)]
        for family, _ in scale.knobs:
            pts = sorted(
                (r for r in mine if r["family"] == family), key=lambda r: r["state_elements"]
            )
            xs = [r["state_elements"] for r in pts]
            ax.plot(xs, [r["accuracy"] for r in pts], "-", color=colors[family], lw=1.4,
                    label=FAMILIES[family].label)  # fmt: skip
            for r in pts:
                ax.plot([r["state_elements"]] * len(r["seed_accuracies"]), r["seed_accuracies"],
                        "o", color=colors[family], ms=4, alpha=0.8)  # fmt: skip
        front = pareto(mine)
        ax.step([r["state_elements"] for r in front], [r["accuracy"] for r in front], "k--",
                where="post", lw=1, label="Pareto frontier")  # fmt: skip
        ax.axhline(1 / setting[1], color="gray", ls=":", lw=1, label="chance")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
        ax.xaxis.set_minor_formatter(NullFormatter())  # labels at every 2x, 3x, ... overlap
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("decode state (elements per sequence, log)")
        ax.set_ylabel("final test accuracy")
        ax.set_title(f"MQAR {setting_key(setting)}, V={scale.vocab_size}")
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


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

    The folder's points, runs and scale keep their other families; these
    families' points and runs replace any it had; the frontier, the claim,
    the table and the figure are drawn again from all of them, and the
    runtime is the sum. Both runs must share settings, rates and seeds.
    """
    path = Path(folder) / _common.RESULTS_FILE
    if not path.is_file():
        fail("add_to", f"a folder holding a {_common.RESULTS_FILE} of this experiment", str(folder))
    old = json.loads(path.read_text())

    def scale_of(d):
        fields = {**d, "settings": tuple(map(tuple, d["settings"]))}
        fields["knobs"] = tuple((f, tuple(k)) for f, k in d["knobs"])
        for key in ("steps", "lrs", "seeds"):
            fields[key] = tuple(d[key])
        return Scale(**fields)

    base, new = scale_of(old["scale"]), scale_of(results["scale"])
    for key in ("settings", "steps", "vocab_size", "lrs", "seeds", "batch_size"):
        if getattr(base, key) != getattr(new, key):
            fail("add_to", f"a run with the same {key} ({getattr(new, key)})", getattr(base, key))
    added = dict(new.knobs)
    knobs = tuple(k for k in base.knobs if k[0] not in added) + new.knobs
    rows = [r for r in old["points"] if r["family"] not in added] + results["points"]
    grid = [r for r in old["runs"] if r["family"] not in added] + results["runs"]
    scale = dataclasses.replace(base, knobs=knobs)
    return _write(scale, rows, grid, old["runtime_s"] + results["runtime_s"], Path(folder))


# ----------------------------------------------------------------------------
# Dry run: configs, models, parameters, state (and FLOPs) without training


def step_flops(scale: Scale, point) -> float:
    """XLA's FLOP count of one update's forward + backward at ``point`` (shapes only)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import train.steps

    setting, family, knob = point
    config = train_config(scale, Run(setting, family, knob, scale.lrs[0], scale.seeds[0]))
    model = nnx.eval_shape(lambda: train.steps.build_model(config, config.model.vocab_size))
    graphdef, params = nnx.split(model)
    B, T = scale.batch_size, setting[0]
    batch = {
        "tokens": jax.ShapeDtypeStruct((B, T), jnp.int32),
        "labels": jax.ShapeDtypeStruct((B, T), jnp.int32),
        "weights": jax.ShapeDtypeStruct((B, T), jnp.float32),
    }

    def loss(params, batch):
        logits = nnx.merge(graphdef, params)(batch["tokens"])
        return train.steps.weighted_metrics(logits, batch)[0]

    return float(jax.jit(jax.grad(loss)).lower(params, batch).cost_analysis()["flops"])


def dry_run(scale: Scale, *, flops: bool = False) -> dict[str, Any]:
    """Every run's config and every point's model, counted; nothing trained."""
    grid = runs(scale)
    for r in grid:
        train_config(scale, r)  # every run's config builds (and checks itself)
    rows = []
    for point in dict.fromkeys(r.point for r in grid):
        row = {
            "setting": list(point[0]),
            "family": point[1],
            "knob": point[2],
            **sizes(scale, point),
        }
        if flops:
            steps = scale.steps[scale.settings.index(point[0])]
            row["flops_per_step"] = step_flops(scale, point)
            row["flops_per_run"] = row["flops_per_step"] * steps
        rows.append(row)
    total = None
    if flops:
        per_point_runs = len(scale.lrs) * len(scale.seeds)
        total = sum(r["flops_per_run"] for r in rows) * per_point_runs
    return {"scale": scale.name, "runs": len(grid), "points": rows, "total_flops": total}


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


# ----------------------------------------------------------------------------
# Command line


@dataclass(frozen=True)
class Args:
    """The recall frontier: MQAR accuracy against decode state, one line per family.

    Attributes:
      scale: ``cpu`` (45 minutes on 2 cores) or ``zoology`` (Zoology's grid, an accelerator).
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

    scale: Literal["cpu", "zoology"] = "cpu"
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
    from train.compare import ComparisonInterrupted
    from train.interrupt import EXIT_INTERRUPTED, TrainingInterrupted

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
    except (TrainingInterrupted, ComparisonInterrupted) as e:
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
