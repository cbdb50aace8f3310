"""Long-context recall: trainable sparse attention against a window that reads as many keys.

    python -m analysis.experiments.sparse            # configs/sparse.py
    python -m analysis.experiments.sparse --quick    # two tiny runs (the tests)
    python -m analysis.experiments.sparse --config configs/sparse_ruler.py \
        --out docs/results/sparse_ruler              # the RULER tasks beside the needles

Every variant (``VARIANTS``, all at one width and depth, each layer with a
short convolution) trains on MQAR with uniformly spread query gaps and on the
needle task (``train.tasks``: pairs anywhere in filler, queried at the end) at
one length, 256 by default, and is tested at 1x to 16x it (256 to 4096).
Two tasks of RULER (Hsieh et al. 2024) can join them: ``multikey_needle``
(the needle task's haystack, one of its keys queried at the end, the other
needles distractors) and ``variable_tracking`` (chains ``x1 v``, ``x2 x1``, ...
of ``hops`` assignments in filler, the last variable of one chain queried, so
the answer takes ``hops`` lookups); ``configs/sparse_ruler.py`` runs them.
Beside each accuracy the table gives the keys a query at the last position
reads (``keys_read``): all of them for MHA, the window's for the window,
``top_k`` blocks or tokens for MoBA and DSA, NSA's three branches (its
compressed tokens counted as keys), a fixed state for Gated DeltaNet.

The claim (the note's closing one): sparse attention keeps exact long-range
lookups where a window reading as many keys per query does not. Its row
compares, on the needle task at the training length, the sparse kinds that
read no more keys than the window with the window itself.

Writes ``results.json`` (every run's accuracy per length, the keys read, the
claim), ``table.md`` and ``sparse.png`` (accuracy against test length, one
panel per task).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from analysis.experiments import _common
from attn.checks import fail

NAME = "sparse"
TASKS = ("needle", "mqar", "multikey_needle", "variable_tracking")
ONE_QUERY = ("multikey_needle", "variable_tracking")  # one labelled position per example
VARIANTS = ("mha", "window", "moba", "nsa", "dsa", "gated_deltanet")
SPARSE = ("moba", "nsa", "dsa")
DESCRIPTIONS = {
    "mha": "softmax MHA (every key)",
    "window": "sliding window of `reads` keys",
    "moba": "MoBA: top_k blocks of reads/top_k",
    "nsa": "NSA: compressed + selected + window",
    "dsa": "DSA: top `reads` tokens by the indexer",
    "gated_deltanet": "Gated DeltaNet (fixed state)",
}
SOLVED, CHANCE_LIKE = 0.9, 0.5


@dataclass(frozen=True)
class Config:
    """The experiment's grid and sizes.

    Attributes:
      tasks: names from ``TASKS``; variants: names from ``VARIANTS``.
      reads: keys a query of the window, MoBA and DSA reads (the budget they share);
        NSA reads its own block, ``reads / 2`` keys in blocks chosen by score and a window
        of ``reads / 4``, plus its compressed tokens.
      block: MoBA's and NSA's block (MoBA reads ``reads / block`` of them).
      train_len: T of training; tested at ``train_len * f`` for f in ``factors``.
      num_pairs: MQAR's pairs, the needles of ``needle`` and ``multikey_needle``, and the
        assignments of ``variable_tracking``: its haystack holds ``num_pairs // hops``
        chains of ``hops``, as many pairs as the needles (so V = 64 holds their variables).
      hops: ``variable_tracking``'s assignments per chain. vocab_size: V of every task.
      lr, steps, batch_size: training (one rate for every variant).
      eval_batches: test batches per length (of ``batch_size`` examples).
      width, num_layers, num_heads, head_dim: every variant's sizes.
      short_conv: every layer's short causal convolution (0: none); it hands each token
        its predecessors, so one attention layer can find a key's value (Zoology's and
        Based's finding that short convolutions speed up learning recall).
      seed: the runs' seed. jobs: runs trained at once, each pinned to a core.
    """

    tasks: tuple[str, ...] = ("needle", "mqar")
    variants: tuple[str, ...] = VARIANTS
    reads: int = 64
    block: int = 16
    train_len: int = 256
    factors: tuple[int, ...] = (1, 2, 4, 8, 16)
    num_pairs: int = 12
    hops: int = 2
    vocab_size: int = 64
    lr: float = 3e-3
    steps: int = 1000
    batch_size: int = 16
    eval_batches: int = 2
    width: int = 64
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 32
    short_conv: int = 4
    seed: int = 0
    jobs: int = 2

    def __post_init__(self):
        _common.check_names("tasks", self.tasks, TASKS)
        _common.check_names("variants", self.variants, VARIANTS)
        if self.reads % (2 * self.block):
            fail("reads", f"a multiple of 2 * block = {2 * self.block}", self.reads)
        if not self.factors or self.factors[0] != 1:
            fail("factors", "a tuple of multiples starting at 1", repr(self.factors))
        if "variable_tracking" in self.tasks and not 1 <= self.hops <= self.num_pairs:
            fail("hops", f"1 <= hops <= num_pairs = {self.num_pairs} (one chain at least)",
                 self.hops)  # fmt: skip
        for task in self.tasks:
            task_config(self, task)  # the task's own checks, before any run trains


def layer(config: Config, variant: str):
    """The layer config of ``variant`` at the experiment's sizes."""
    import models

    p = models.presets(num_heads=config.num_heads, head_dim=config.head_dim)
    R, b = config.reads, config.block
    layers = {
        "mha": p["mha"],
        "window": dataclasses.replace(p["window"], window=R),
        "moba": dataclasses.replace(p["moba"], block_size=b, top_k=R // b),
        "nsa": dataclasses.replace(
            p["nsa"],
            compress_block=b,
            compress_stride=b // 2,
            select_block=b,
            num_selected=R // (2 * b) + 1,  # its own block and R / 2b chosen by score
            initial_blocks=0,
            local_blocks=1,
            branch_window=R // 4,
            compress_hidden=2 * b,
        ),
        "dsa": dataclasses.replace(p["dsa"], top_k=R),
        "gated_deltanet": p["gated_deltanet"],
    }
    return dataclasses.replace(layers[variant], short_conv=config.short_conv)


def keys_read(config: Config, variant: str, T: int) -> int | None:
    """Keys the query at position ``T - 1`` reads (None: a fixed state, no keys).

    NSA's count adds its branches: the window, its selected blocks outside the
    window (the query's own block lies inside it), and its compressed tokens.
    """
    cfg = layer(config, variant)
    if variant == "mha":
        return T
    if variant == "window":
        return min(cfg.window, T)
    if variant == "moba":
        own = (T - 1) % cfg.block_size + 1
        return min(T, own + (cfg.top_k - 1) * cfg.block_size)
    if variant == "dsa":
        return min(cfg.top_k, T)
    if variant == "nsa":
        window = min(cfg.branch_window, T)
        selected = (cfg.num_selected - cfg.local_blocks) * cfg.select_block
        compressed = max(0, (T - cfg.compress_block) // cfg.compress_stride + 1)
        return min(T, window + selected) + compressed
    return None


@dataclass(frozen=True)
class Run:
    task: str
    variant: str

    @property
    def name(self) -> str:
        return f"{self.task}/{self.variant}"


def runs(config: Config) -> list[Run]:
    return [Run(t, v) for t in config.tasks for v in config.variants]


def pairs(config: Config, task: str) -> int:
    """``task.num_pairs`` of ``task``: the chains of ``variable_tracking``, else ``num_pairs``."""
    return config.num_pairs // config.hops if task == "variable_tracking" else config.num_pairs


def task_config(config: Config, task: str):
    """The ``TaskConfig`` of ``task`` at the training length."""
    from train.tasks import TaskConfig

    return TaskConfig(
        name=task, seq_len=config.train_len, vocab_size=config.vocab_size,
        num_pairs=pairs(config, task), hops=config.hops, power_a=1.0,
    )  # fmt: skip


def train_config(config: Config, run: Run):
    """The ``TrainConfig`` of one run (evaluated once, at the end)."""
    from models import ModelConfig
    from train.config import OptimConfig, TrainConfig

    task = task_config(config, run.task)
    layers = (layer(config, run.variant),) * config.num_layers
    return TrainConfig(
        task=task,
        model=ModelConfig(width=config.width, mlp_width=2 * config.width, layers=layers),
        optim=OptimConfig(lr=config.lr, warmup_fraction=0.05),
        steps=config.steps,
        batch_size=config.batch_size,
        eval_every=config.steps,
        eval_batches=config.eval_batches,
        ckpt_every=config.steps,
        log_every=config.steps,
        seed=config.seed,
    ).with_task_vocab()


def evaluate(model, train_cfg, config: Config) -> dict[str, Any]:
    """Accuracy over the labelled positions per test length."""
    from train.tasks import IGNORE, make_task

    out = {}
    for f in config.factors:
        T = config.train_len * f
        task = make_task(dataclasses.replace(train_cfg.task, seq_len=T, fingerprint=None))
        hits, count = 0, 0
        for i in range(config.eval_batches):
            batch = task.batch(config.seed, "test", i, config.batch_size)
            logits = _common.float32_logits(model, batch["tokens"])
            scored = batch["labels"] != IGNORE
            hits += int((np.asarray(logits).argmax(-1) == batch["labels"])[scored].sum())
            count += int(scored.sum())
        out[str(f)] = hits / count
    return out


def _train_and_test(config: Config, run: Run, *, out: str) -> dict[str, Any]:
    """One run (in a worker or here): train (or resume), then test at every length."""
    import train.loop
    from train.run import load_run

    workdir = _common.run_dir(Path(out), run.name)
    cfg = train_config(config, run)
    timer = _common.Timer()
    try:
        summary = train.loop.train(cfg, workdir, progress=False, desc=run.name)
    except train.loop.NonFiniteLossError as e:
        print(f"{run.name}: {e}", file=sys.stderr)
        return {"diverged": True, "accuracy": {str(f): 0.0 for f in config.factors}}
    train_s = timer()
    model, cfg = load_run(workdir)
    return {
        "diverged": False,
        "train_loss": summary.get("train_loss"),
        "params": summary.get("params"),
        "accuracy": evaluate(model, cfg, config),
        "seconds": train_s,
    }


def train_all(config: Config, out: Path) -> dict[Run, dict]:
    def report(run, result):
        print(f"{run.name}: accuracy at 1x {result['accuracy']['1']:.3f}", flush=True)

    worker = functools.partial(_train_and_test, config, out=str(out))
    return _common.run_all(worker, runs(config), config.jobs, report, desc=NAME,
                           steps_of=lambda run: train_config(config, run).steps)  # fmt: skip


def claim(config: Config, results: dict[Run, dict]) -> dict[str, Any]:
    """Sparse kinds reading at most the window's keys, against the window, on the needle task
    at the training length (without it, on the first RULER task run)."""
    task = next((t for t in ("needle", *ONE_QUERY) if t in config.tasks), "needle")
    acc = {r.variant: res["accuracy"]["1"] for r, res in results.items() if r.task == task}
    T = config.train_len
    window_reads = keys_read(config, "window", T)
    lean = [v for v in SPARSE if v in acc and keys_read(config, v, T) <= window_reads]
    if "window" not in acc or not lean:
        return _common.claim("the needle task, the window and a sparse kind reading as few "
                             "keys were not all run", "needs them", False)  # fmt: skip
    shown = ", ".join(f"{v} {acc[v]:.2f}" for v in (*lean, "window", "mha") if v in acc)
    holds = max(acc[v] for v in lean) >= SOLVED and acc["window"] < CHANCE_LIKE
    what = "needle" if task == "needle" else task.replace("_", " ")
    return _common.claim(
        f"{what} accuracy at T = {T}, {window_reads} keys read per query: {shown}",
        f"a sparse kind reading at most the window's keys reaches >= {SOLVED} where the "
        f"window stays below {CHANCE_LIKE}",
        holds,
    )


def table_md(config: Config, results: dict[Run, dict]) -> str:
    rows = []
    last = config.train_len * config.factors[-1]
    for run, res in results.items():
        accs = [res["accuracy"][str(f)] for f in config.factors]
        reads = [
            keys_read(config, run.variant, config.train_len * f) for f in (1, config.factors[-1])
        ]
        reads_text = "state" if reads[0] is None else f"{reads[0]} / {reads[1]}"
        rows.append([run.task, run.variant, DESCRIPTIONS[run.variant], reads_text, *accs,
                     f"{res.get('seconds', float('nan')):.0f}"])  # fmt: skip
    heads = ["task", "variant", "what", f"keys read (T={config.train_len} / {last})",
             *(f"acc {config.train_len * f}" for f in config.factors), "train s"]  # fmt: skip
    examples = config.eval_batches * config.batch_size
    intro = (
        f"Trained at T = {config.train_len} ({config.steps} updates of {config.batch_size}, "
        f"lr {config.lr}), tested at T = "
        f"{', '.join(str(config.train_len * f) for f in config.factors)}; accuracy over the "
        f"labelled positions ({labelled_text(config)}, {examples} examples "
        f"per length; chance {', '.join(f'{t} {chance(config, t):.3f}' for t in config.tasks)})."
        f"{chains_text(config)} {config.num_layers} layers of width {config.width} for every "
        "variant; keys read by the query at the last position.\n\n"
    )
    return intro + _common.markdown_table(heads, rows)


def labelled(config: Config, task: str) -> int:
    """Labelled positions per example: one query for the RULER tasks, ``num_pairs`` else."""
    return 1 if task in ONE_QUERY else config.num_pairs


def labelled_text(config: Config) -> str:
    """``"12 per example"``, or per task where the tasks differ."""
    counts = {t: labelled(config, t) for t in config.tasks}
    if len(set(counts.values())) == 1:
        return f"{counts[config.tasks[0]]} per example"
    return ", ".join(f"{t} {k}" for t, k in counts.items()) + " per example"


def chains_text(config: Config) -> str:
    """The variable-tracking sizes, a sentence (empty without the task)."""
    if "variable_tracking" not in config.tasks:
        return ""
    chains = pairs(config, "variable_tracking")
    return (f" variable_tracking: {chains} chain{'s' * (chains != 1)} of "
            f"{config.hops} assignments.")  # fmt: skip


def chance(config: Config, task: str) -> float:
    """Accuracy by guessing: a value among those of ``[V/2, V)`` (MQAR) or of
    ``[V/4, V/2)`` (the others)."""
    V = config.vocab_size
    return 1 / (V - V // 2 if task == "mqar" else V // 2 - V // 4)


def plot(config: Config, results: dict[Run, dict], path: Path) -> Path:
    panels = {}
    for run, res in results.items():
        title = f"{run.task} (trained at T = {config.train_len})"
        panels.setdefault(title, {})[run.variant] = [
            res["accuracy"][str(f)] for f in config.factors
        ]
    levels = {f"{t} (trained at T = {config.train_len})": chance(config, t) for t in config.tasks}
    lengths = [config.train_len * f for f in config.factors]
    dashed = [v for v in VARIANTS if v not in SPARSE]
    return _common.plot_lengths(path, panels, lengths, dashed=dashed, chance=levels,
                                ylabel="recall accuracy (higher is better)")  # fmt: skip


def run(config: Config, out: Path) -> dict[str, Any]:
    """Trains and tests every run, writes results.json, table.md and the figure."""
    timer = _common.Timer()
    out = Path(out)
    results = train_all(config, out)
    results = {r: results[r] for r in runs(config)}  # the grid's order
    plot(config, results, out / f"{NAME}.png")
    reads = {
        v: {str(config.train_len * f): keys_read(config, v, config.train_len * f)
            for f in config.factors}
        for v in config.variants
    }  # fmt: skip
    payload = {
        "name": NAME,
        "config": config,
        "claim": claim(config, results),
        "keys_read": reads,
        "runs": {
            r.name: {"task": r.task, "variant": r.variant, **res} for r, res in results.items()
        },
        "runtime_s": timer(),
    }
    return _common.write_results(out, payload, table_md(config, results))


def main(argv=None) -> int:
    return _common.main(NAME, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
