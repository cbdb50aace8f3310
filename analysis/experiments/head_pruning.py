"""Head importance and pruning (Michel et al. 2019, "Are Sixteen Heads Really Better than One?").

    python -m analysis.experiments.head_pruning [--quick] [--out DIR]

A 4-layer, 8-head softmax decoder is trained (in the committed config, a
byte-level LM; the quick config uses MQAR). Each head's importance is
``E |d loss / d gate|`` (``models.head_importance`` on the head gates at 1),
averaged over ``importance_batches`` held-out minibatches of
``importance_batch_size`` sequences (Michel et al. average per example; small
minibatches stand in for that), then L2-normalized per layer
(``analysis.normalize_importance``). The pruning curve masks the least important
heads first (``analysis.pruning_order``) at each fraction and measures test
(next-token) accuracy (``train.steps.evaluate``, the run's fixed test batches, which the
importance never sees); the baseline masks random heads at the same fractions,
averaged over ``random_orders`` orders.

Its runtime is recorded in its results (``runtime_s``) and in docs/results/README.md.

Result (docs/results/head_pruning/, byte LM, next-byte accuracy 0.565 unpruned):
masking the 8 least important of 32 heads (25%) costs 0.043 (0.522); 4 heads
cost 0.007. Random orders lose 0.09 and 0.13 at the same budgets. Past half of
the heads the two orders are alike (about 0.30 to 0.34); with every head masked
each position sees only its own byte, a bigram predictor, which keeps 0.27.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports below run is one line
    from train.interrupt import exit_on_sigint

    exit_on_sigint("python -m analysis.experiments.head_pruning")

import dataclasses
import itertools
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

import train
import train.config
import train.steps
import train.tasks
from analysis import importance, plots
from analysis.experiments import _common
from models import head_importance, set_head_gates

NAME = "head_pruning"


@dataclasses.dataclass(frozen=True)
class Config:
    """The experiment.

    Attributes:
      train: the run (any task; MQAR in the committed config).
      fractions: shares of all heads masked, increasing, starting at 0.
      importance_batches: held-out minibatches the importance averages over.
      importance_batch_size: sequences per such minibatch.
      random_orders: random pruning orders averaged for the baseline.
      max_drop: "little loss": accuracy at most this far (absolute) below the
        unpruned model's.
      min_prunable: the claim needs at least this share of heads maskable by
        importance with at most ``max_drop`` lost.
    """

    train: train.config.TrainConfig
    fractions: tuple[float, ...] = (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)
    importance_batches: int = 16
    importance_batch_size: int = 8
    random_orders: int = 3
    max_drop: float = 0.05
    min_prunable: float = 0.25

    def __post_init__(self):
        f = self.fractions
        if not f or f[0] != 0.0 or any(b <= a for a, b in itertools.pairwise(f)):
            raise ValueError(f"fractions: expected increasing shares starting at 0.0, got {f}")
        if f[-1] > 1.0:
            raise ValueError(f"fractions: expected shares in [0, 1], got {f}")


def _loss(model, batch):
    loss, _, _ = train.steps.weighted_metrics(model(batch["tokens"]), batch)
    return loss


@nnx.jit
def _gate_grads(model, batch):
    return jnp.stack(head_importance(model, _loss, batch))  # [L,N]


def head_scores(model, task, config: Config) -> np.ndarray:
    """``E |d loss / d gate|`` over held-out minibatches, ``[L,N]`` (before normalization).

    The minibatches are test batches numbered after the evaluation's, so the
    pruning curve is measured on data the importance did not see.
    """
    t = config.train
    total = 0.0
    for i in range(config.importance_batches):
        batch = task.batch(t.seed, "test", t.eval_batches + i, config.importance_batch_size)
        total = total + np.abs(np.asarray(_gate_grads(model, batch), np.float64))
    return total / config.importance_batches


def accuracy_curve(model, task, config: Config, order) -> list[float]:
    """Test accuracy with the first heads of ``order`` masked, at each fraction."""
    gates = importance.pruning_masks(order, list(config.fractions))
    accs = []
    for g in gates:
        set_head_gates(model, g)
        accs.append(train.steps.evaluate(model, task, config.train)["test_accuracy"])
    set_head_gates(model, np.ones_like(gates[0]))
    return accs


def prunable_fraction(fractions, accs, max_drop: float) -> float:
    """The largest fraction up to which accuracy stays within ``max_drop`` of the unpruned one."""
    best = 0.0
    for f, a in zip(fractions, accs, strict=True):
        if a < accs[0] - max_drop:
            break
        best = f
    return float(best)


def run(config: Config, out_dir: Path) -> dict:
    """Trains, scores the heads, draws both pruning curves, writes the results."""
    timer = _common.Timer()
    out_dir = Path(out_dir)
    summary, workdir = _common.train_run(config.train, out_dir, "model")
    model, _ = train.load_run(workdir)
    task = train.tasks.make_task(config.train.task)
    raw = head_scores(model, task, config)
    scores = importance.normalize_importance(raw)
    by_importance = accuracy_curve(model, task, config, importance.pruning_order(scores))
    randoms = [
        accuracy_curve(model, task, config, importance.pruning_order(scores, "random", seed=s))
        for s in range(config.random_orders)
    ]
    by_random = np.mean(randoms, axis=0).tolist()
    fr = list(config.fractions)
    prunable = prunable_fraction(fr, by_importance, config.max_drop)
    prunable_random = prunable_fraction(fr, by_random, config.max_drop)
    inner = slice(1, len(fr) - 1 if fr[-1] == 1.0 else len(fr))  # fractions strictly inside
    mean_imp, mean_rand = float(np.mean(by_importance[inner])), float(np.mean(by_random[inner]))
    L, N = scores.shape
    holds = prunable >= config.min_prunable and mean_imp >= mean_rand
    entry = _common.claim(
        f"{prunable:.0%} of the {L * N} heads masked by importance keep accuracy within "
        f"{config.max_drop} of {by_importance[0]:.3f} (random order: {prunable_random:.0%}); "
        f"mean accuracy over the inner fractions {mean_imp:.3f} by importance vs "
        f"{mean_rand:.3f} at random",
        f"at least {config.min_prunable:.0%} of heads maskable by importance with at most "
        f"{config.max_drop} accuracy lost, and importance order at least as good as random on "
        "average",
        holds,
    )
    plots.curves(
        fr,
        {"by importance (low first)": by_importance, f"random (mean of {len(randoms)})": by_random},
        out_dir / "pruning_curve.png",
        "fraction of heads masked",
        "test accuracy",
        hline=by_importance[0] - config.max_drop,
    )
    plots.score_heatmap(scores, out_dir / "importance.png", "head importance (L2-normalized)")
    table = _common.markdown_table(
        ["fraction masked", "heads masked", "accuracy by importance", "accuracy random (mean)"],
        [
            [f, int(np.floor(f * L * N + 0.5)), a, b]
            for f, a, b in zip(fr, by_importance, by_random, strict=True)
        ],
    )
    results = {
        "name": NAME,
        "claim": entry,
        "runtime_s": timer(),
        "fractions": fr,
        "accuracy_by_importance": by_importance,
        "accuracy_random_mean": by_random,
        "accuracy_random_orders": randoms,
        "prunable_fraction_importance": prunable,
        "prunable_fraction_random": prunable_random,
        "importance_raw": raw,
        "importance": scores,
        "train_summary": summary,
        "config": config,
    }
    return _common.write_results(out_dir, results, table)


def main(argv=None) -> int:
    return _common.main(NAME, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
