"""State tracking: which fixed-state families learn parity, modular sums, S3 and S5.

    python -m analysis.experiments.state_tracking            # configs/state_tracking.py
    python -m analysis.experiments.state_tracking --quick    # two tiny runs (the tests)

Every variant (``VARIANTS``) trains on each task (``train.tasks``' word
problems: ``parity``, ``modular``, ``s3``, ``s5``) at one length and is tested at
1x, 2x and 4x it, with the accuracy of every position. Each (variant, task)
trains at every learning rate of the config and the table shows the best
rate by 1x accuracy (recurrent models learn in a narrow window of rates,
Okpekpe and Orvieto 2025).

The two findings this reproduces, at the lab's scale:

- Grazzi et al. (ICLR 2025): a linear RNN whose state transitions have only
  positive eigenvalues (Mamba's decay in (0, 1], the delta rule's beta in
  (0, 1)) cannot learn parity at every length; allowing negative ones (decay
  in (-1, 1], beta in (0, 2)) lets it. The claim's row (``claim``) compares the
  two on parity at the longest test length.
- Merrill, Petty and Sabharwal (ICML 2024): S5's word problem (not solvable)
  is out of reach of fixed-depth transformers and diagonal SSMs, while
  products of Householders (DeltaProduct, Siems et al. 2025) can express it.
  The second row (``claim_s5``) says which families track S5 at 1x, beside
  those that track S3 (``configs/state_tracking_groups.py`` is the grid that
  decides it).
- The 2025 families that claim the same reach: RWKV-7 (Peng et al. 2025; a
  diagonal decay plus a rank-one removal, the DPLR delta rule) and PaTH
  attention (Yang et al. 2025; softmax attention whose positions are products
  of Householder-like transforms, beta in (0, 2)), alone and with FoX's gate;
  beside them log-linear Mamba-2 and Gated DeltaNet (Guo et al. 2025), whose
  Fenwick tree of states changes the memory and not the transitions.

Writes ``results.json`` (every run's accuracies per length and per position,
the best rate's, both claims), ``table.md`` and ``state_tracking.png``
(accuracy against test length, one panel per task).
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

NAME = "state_tracking"
TASKS = ("parity", "modular", "s3", "s5")
POSITIVE = ("mamba2", "gated_deltanet")  # transitions with positive eigenvalues only
NEGATIVE = ("mamba2_negative", "gated_deltanet_negative", "deltaproduct2", "deltaproduct3")
# Which variant of each family Grazzi et al.'s comparison pairs: (positive, negative).
PAIRS = (("mamba2", "mamba2_negative"), ("gated_deltanet", "gated_deltanet_negative"))
SOLVED = 0.9  # accuracy at which a task counts as tracked


def _variant_layers(name: str, num_layers: int, sizes: dict) -> tuple:
    """The layer configs of variant ``name`` (``VARIANTS``), ``num_layers`` of them."""
    import models

    p = models.presets(**sizes)
    negative_delta = dataclasses.replace(p["gated_deltanet"], negative_eigenvalues=True)
    layers = {
        "mha": p["mha"],
        "linear": p["linear"],
        "mamba2": p["mamba2"],
        "mamba2_negative": p["mamba2_negative"],
        "gated_deltanet": p["gated_deltanet"],
        "gated_deltanet_negative": negative_delta,
        "deltaproduct2": dataclasses.replace(negative_delta, householder_steps=2),
        "deltaproduct3": dataclasses.replace(negative_delta, householder_steps=3),
        "deltaproduct4": dataclasses.replace(negative_delta, householder_steps=4),
        "rwkv7": p["rwkv7"],
        "path": p["path"],
        "path_fox": p["path_fox"],
        "log_linear_mamba2": p["log_linear_mamba2"],
        "log_linear_gated_deltanet": p["log_linear_gated_deltanet"],
        "ttt_linear": p["ttt_linear"],
        "ttt_mlp": p["ttt_mlp"],
        "titans": p["titans"],
        "mesanet": p["mesanet"],
    }
    if name == "hybrid":  # the note's hybrid: Mamba layers, then attention
        return (p["mamba2"],) * (num_layers - 1) + (p["mha"],)
    if name not in layers:
        fail("variants", f"names in {VARIANTS}", repr(name))
    return (layers[name],) * num_layers


VARIANTS = (
    "mha",
    "linear",
    "mamba2",
    "mamba2_negative",
    "gated_deltanet",
    "gated_deltanet_negative",
    "deltaproduct2",
    "deltaproduct3",
    "deltaproduct4",
    "hybrid",
    "rwkv7",
    "path",
    "path_fox",
    "log_linear_mamba2",
    "log_linear_gated_deltanet",
    "ttt_linear",
    "ttt_mlp",
    "titans",
    "mesanet",
)
DESCRIPTIONS = {
    "mha": "softmax MHA with RoPE",
    "linear": "linear attention (elu+1)",
    "mamba2": "Mamba-2, decay in (0, 1]",
    "mamba2_negative": "Mamba-2, decay in (-1, 1]",
    "gated_deltanet": "Gated DeltaNet, beta in (0, 1)",
    "gated_deltanet_negative": "Gated DeltaNet, beta in (0, 2)",
    "deltaproduct2": "Gated DeltaProduct n_h = 2, beta in (0, 2)",
    "deltaproduct3": "Gated DeltaProduct n_h = 3, beta in (0, 2)",
    "deltaproduct4": "Gated DeltaProduct n_h = 4, beta in (0, 2)",
    "hybrid": "Mamba-2 layers, then one MHA layer",
    "rwkv7": "RWKV-7, the DPLR delta rule (a in [0, 1])",
    "path": "PaTH, softmax with Householder transforms, beta in (0, 2)",
    "path_fox": "PaTH-FoX, PaTH with a forget gate",
    "log_linear_mamba2": "log-linear Mamba-2, decay in (0, 1]",
    "log_linear_gated_deltanet": "log-linear Gated DeltaNet, beta in (0, 1)",
    "ttt_linear": "TTT-Linear, mini-batches of 16",
    "ttt_mlp": "TTT-MLP, mini-batches of 16",
    "titans": "Titans, an MLP memory with momentum and weight decay",
    "mesanet": "MesaNet, the least-squares read (30 CG steps)",
}


@dataclass(frozen=True)
class Config:
    """The experiment's grid and sizes.

    Attributes:
      tasks: names from ``TASKS``.
      variants: names from ``VARIANTS``.
      lrs: learning rates; every (variant, task) trains at each.
      train_len: T of training; tested at ``train_len * f`` for f in ``factors``.
      factors: the test lengths as multiples of ``train_len``.
      modulus: m of the ``modular`` task.
      steps: ``(task, updates)`` pairs: each task's runs take that many (parity is
        learned in a few hundred; the groups with more elements need more).
      batch_size: examples per update.
      eval_batches: test batches per length (of ``batch_size`` examples).
      width, num_layers, num_heads, head_dim, state_dim: every variant's sizes
        (heads x head dim = width; Mamba-2's state dim).
      seed: the runs' seed.
      jobs: runs trained at once, each pinned to a core.
    """

    tasks: tuple[str, ...] = TASKS
    variants: tuple[str, ...] = VARIANTS
    lrs: tuple[float, ...] = (3e-3, 1e-2)
    train_len: int = 16
    factors: tuple[int, ...] = (1, 2, 4)
    modulus: int = 5
    steps: tuple[tuple[str, int], ...] = (
        ("parity", 400),
        ("modular", 1200),
        ("s3", 1200),
        ("s5", 1200),
    )
    batch_size: int = 32
    eval_batches: int = 4
    width: int = 32
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 16
    state_dim: int = 16
    seed: int = 0
    jobs: int = 2

    def __post_init__(self):
        _common.check_names("tasks", self.tasks, TASKS)
        _common.check_names("variants", self.variants, VARIANTS)
        missing = [t for t in self.tasks if t not in dict(self.steps)]
        if missing:
            fail("steps", f"(task, updates) pairs for every task {self.tasks}", repr(self.steps))
        if not self.lrs or not self.factors or self.factors[0] != 1:
            fail(
                "factors",
                "a tuple of multiples starting at 1 (and lrs non-empty)",
                repr(self.factors),
            )


@dataclass(frozen=True)
class Run:
    task: str
    variant: str
    lr: float

    @property
    def name(self) -> str:
        return f"{self.task}/{self.variant}/lr{self.lr:.0e}"


def runs(config: Config) -> list[Run]:
    return [Run(t, v, lr) for lr in config.lrs for t in config.tasks for v in config.variants]


def train_config(config: Config, run: Run):
    """The ``TrainConfig`` of one run (evaluated once, at the end)."""
    from models import ModelConfig
    from train.config import OptimConfig, TrainConfig
    from train.tasks import TaskConfig

    sizes = dict(
        num_heads=config.num_heads,
        head_dim=config.head_dim,
        state_dim=config.state_dim,
        chunk_size=64,
    )
    layers = _variant_layers(run.variant, config.num_layers, sizes)
    steps = dict(config.steps)[run.task]
    return TrainConfig(
        task=TaskConfig(name=run.task, seq_len=config.train_len, modulus=config.modulus),
        model=ModelConfig(width=config.width, mlp_width=2 * config.width, layers=layers),
        optim=OptimConfig(lr=run.lr, warmup_fraction=0.05),
        steps=steps,
        batch_size=config.batch_size,
        eval_every=steps,
        eval_batches=config.eval_batches,
        ckpt_every=steps,
        log_every=steps,
        seed=config.seed,
    ).with_task_vocab()


def evaluate(model, train_cfg, config: Config) -> dict[str, Any]:
    """Accuracy per test length (mean over positions) and per position, on test batches."""
    from train.tasks import make_task

    out = {}
    for f in config.factors:
        T = config.train_len * f
        task = make_task(dataclasses.replace(train_cfg.task, seq_len=T, fingerprint=None))
        hits = []
        for i in range(config.eval_batches):
            batch = task.batch(config.seed, "test", i, config.batch_size)
            logits = _common.float32_logits(model, batch["tokens"])
            hits.append(np.asarray(logits).argmax(-1) == batch["labels"])
        per_position = np.concatenate(hits).mean(0)
        out[str(f)] = {"accuracy": float(per_position.mean()), "per_position": per_position}
    return out


def _train_and_test(config: Config, run: Run, *, out: str) -> dict[str, Any]:
    """One run (in a worker or here): train (or resume), then test at every length."""
    import train.loop
    from train.run import load_run

    workdir = _common.run_dir(Path(out), run.name)
    cfg = train_config(config, run)
    try:
        summary = train.loop.train(cfg, workdir, progress=False, desc=run.name)
    except train.loop.NonFiniteLossError as e:
        print(f"{run.name}: {e}", file=sys.stderr)
        return {"diverged": True, "lengths": {str(f): {"accuracy": 0.0} for f in config.factors}}
    model, cfg = load_run(workdir)
    return {
        "diverged": False,
        "train_loss": summary.get("train_loss"),
        "params": summary.get("params"),
        "lengths": evaluate(model, cfg, config),
    }


def train_all(config: Config, out: Path) -> dict[Run, dict]:
    """Every run, ``config.jobs`` at a time (each in a process pinned to a core)."""

    def report(run, result):
        print(f"{run.name}: accuracy at 1x {result['lengths']['1']['accuracy']:.3f}", flush=True)

    worker = functools.partial(_train_and_test, config, out=str(out))
    return _common.run_all(worker, runs(config), config.jobs, report, desc=NAME,
                           steps_of=lambda run: train_config(config, run).steps)  # fmt: skip


def best(config: Config, results: dict[Run, dict]) -> dict[str, dict[str, dict]]:
    """``best[task][variant]``: the rate with the best 1x accuracy, and its accuracies."""
    table: dict[str, dict[str, dict]] = {}
    for task in config.tasks:
        for variant in config.variants:
            tried = [(r, results[r]) for r in results if (r.task, r.variant) == (task, variant)]
            run, res = max(tried, key=lambda x: x[1]["lengths"]["1"]["accuracy"])
            table.setdefault(task, {})[variant] = {
                "lr": run.lr,
                "accuracy": {f: v["accuracy"] for f, v in res["lengths"].items()},
                "per_position": {f: v.get("per_position") for f, v in res["lengths"].items()},
            }
    return table


def parity_claim(config: Config, table: dict) -> dict[str, Any]:
    """Negative eigenvalues against positive-only transitions, on parity at the longest length."""
    longest = str(config.factors[-1])
    if "parity" not in table:
        return _common.claim("parity was not run", "needs the parity task", False)
    acc = {v: r["accuracy"][longest] for v, r in table["parity"].items()}
    pairs = [(p, n) for p, n in PAIRS if p in acc and n in acc]
    if not pairs:
        return _common.claim("no (positive, negative) pair was run", "needs a pair", False)
    shown = "; ".join(f"{n} {acc[n]:.2f} vs {p} {acc[p]:.2f}" for p, n in pairs)
    holds = all(acc[n] >= SOLVED and acc[p] < SOLVED for p, n in pairs)
    return _common.claim(
        f"parity at {longest}x the training length: {shown}",
        f"each family tracks parity (>= {SOLVED}) with negative eigenvalues and not without",
        holds,
    )


def s5_claim(config: Config, table: dict) -> dict[str, Any]:
    """Which families track S5 (>= ``SOLVED`` at the training length), beside which track S3;
    each with its accuracy at the longest tested length."""
    if "s5" not in table:
        return _common.claim("s5 was not run", "needs the s5 task", False)
    longest = str(config.factors[-1])

    def tracked(task: str) -> str:
        per = table.get(task, {})
        names = [v for v, r in per.items() if r["accuracy"]["1"] >= SOLVED]
        at = ", ".join(f"{v} {per[v]['accuracy']['1']:.2f} ({per[v]['accuracy'][longest]:.2f} "
                       f"at {longest}x)" for v in names)  # fmt: skip
        return at or "none"

    acc = {v: r["accuracy"]["1"] for v, r in table["s5"].items()}
    ranked = ", ".join(f"{v} {a:.2f}" for v, a in sorted(acc.items(), key=lambda x: -x[1]))
    s3_text = f"; S3 tracked by {tracked('s3')} (chance 0.17)" if "s3" in table else ""
    s5_tracked = [v for v, a in acc.items() if a >= SOLVED]
    updates = dict(config.steps)["s5"]
    return _common.claim(
        f"S5 tracked by {tracked('s5')} within {updates} updates (at 1x, chance 0.008; the "
        f"first of the {config.train_len} positions is its input: {ranked}){s3_text}",
        f"some family tracks S5 (>= {SOLVED} at 1x), and only Householder products "
        "(DeltaProduct) do",
        bool(s5_tracked) and all(v.startswith("deltaproduct") for v in s5_tracked),
    )


def table_md(config: Config, table: dict) -> str:
    rows = []
    for task, per in table.items():
        for variant, r in per.items():
            accs = [r["accuracy"][str(f)] for f in config.factors]
            rows.append([task, variant, DESCRIPTIONS[variant], f"{r['lr']:.0e}", *accs])
    heads = ["task", "variant", "what", "best lr", *(f"acc {f}x" for f in config.factors)]
    lengths = ", ".join(str(config.train_len * f) for f in config.factors)
    intro = (
        f"Trained at T = {config.train_len} (updates of {config.batch_size}: "
        f"{', '.join(f'{t} {n}' for t, n in config.steps if t in config.tasks)}), "
        f"tested at T = {lengths}; accuracy over every position, best of lr {config.lrs} "
        f"by 1x accuracy. {config.num_layers} layer{'s' * (config.num_layers > 1)} of width "
        f"{config.width}.\n\n"
    )
    return intro + _common.markdown_table(heads, rows)


def _group_order(config: Config, task: str) -> int:
    from train.tasks import TaskConfig

    return TaskConfig(name=task, seq_len=config.train_len, modulus=config.modulus).vocab


def plot(config: Config, table: dict, path: Path) -> Path:
    panels = {
        task: {v: [r["accuracy"][str(f)] for f in config.factors] for v, r in per.items()}
        for task, per in table.items()
    }
    chance = {task: 1 / _group_order(config, task) for task in table}
    lengths = [config.train_len * f for f in config.factors]
    return _common.plot_lengths(path, panels, lengths, dashed=POSITIVE, chance=chance,
                                ylabel="accuracy over positions (higher is better)")  # fmt: skip


def run(config: Config, out: Path) -> dict[str, Any]:
    """Trains and tests every run, writes results.json, table.md and the figure."""
    timer = _common.Timer()
    out = Path(out)
    results = train_all(config, out)
    table = best(config, results)
    plot(config, table, out / f"{NAME}.png")
    everything = {
        r.name: {"task": r.task, "variant": r.variant, "lr": r.lr, **res}
        for r, res in sorted(results.items(), key=lambda x: x[0].name)
    }
    s5 = s5_claim(config, table)
    payload = {
        "name": NAME,
        "config": config,
        # The table's headline: the parity claim, or S5's where parity was not run.
        "claim": parity_claim(config, table) if "parity" in config.tasks else s5,
        "claim_s5": s5,
        "best": table,
        "runs": everything,
        "runtime_s": timer(),
    }
    return _common.write_results(out, payload, table_md(config, table))


def main(argv=None) -> int:
    return _common.main(NAME, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
