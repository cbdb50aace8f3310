"""Induction heads and the in-context-learning jump (Olsson et al. 2022), on repeated random tokens.

    python -m analysis.experiments.induction_heads [--quick] [--out DIR]

A 2-layer softmax decoder is trained on ``train``'s induction task, ``[BOS] r r``
with ``r`` of P = T/2 random tokens, scored on the second copy. ``ModelConfig``
has no attention-only option, so the blocks keep a SwiGLU MLP, made narrow
(``mlp_width`` 8) so that attention does the work. At step 0 and at every
checkpoint, on one fixed test batch, it measures:

- the loss on the first copy (random tokens: nothing to recall) and on the
  second copy (positions P+1 .. T-1, which an induction head can predict), and
  their difference;
- the in-context-learning score: the mean loss over the last quarter of the
  positions minus that over the first quarter (position 0 left out), Olsson et
  al.'s "loss at a late token minus loss at an early token" at this length;
- each head's induction score (``analysis.metrics.induction_score``: attention
  from a token of the copy to the token after its earlier occurrence) and
  previous-token score.

The jump step of a curve is the first checkpoint where it has covered half of
its change from step 0 to the end (``transition_step``); the claim compares
the best head's induction-score jump with the second-copy loss drop.

Its runtime is recorded in its results (``runtime_s``) and in docs/results/README.md.

Result (docs/results/induction_heads/): the best head's induction score rises
from 0.03 to 0.97 and the second-copy loss falls from 3.9 to 0.4 nats together
(half-way at steps 160 and 180). The previous-token score stays below 0.07: with
a fixed period and RoPE a single head can find the token to copy by its relative
position (P - 1 back), so on this task the induction pattern need not come from
Olsson et al.'s two-head (previous-token + induction) circuit.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports below run is one line
    from train.interrupt import exit_on_sigint

    exit_on_sigint("python -m analysis.experiments.induction_heads")

import dataclasses
from pathlib import Path

import numpy as np

import train
import train.config
import train.steps
import train.tasks
from analysis import metrics, plots
from analysis.experiments import _common

NAME = "induction_heads"


@dataclasses.dataclass(frozen=True)
class Config:
    """The experiment: one training run, analysed at every checkpoint.

    Attributes:
      train: the run (task ``induction``; ``ckpt_every`` sets the time
        resolution, and ``keep_checkpoints`` must keep them all).
      eval_batch: sequences of the fixed test batch the metrics use.
      half_fraction: a curve's jump is where it has covered this share of its change.
      tolerance: the jumps coincide when their steps differ by at most
        ``max(ckpt_every, tolerance * loss-drop step)``.
      min_induction: the best head's final induction score must reach this.
    """

    train: train.config.TrainConfig
    eval_batch: int = 16
    half_fraction: float = 0.5
    tolerance: float = 0.2
    min_induction: float = 0.5

    def __post_init__(self):
        t = self.train
        if t.task.name != "induction":
            raise ValueError(f"train.task.name: expected 'induction', got {t.task.name!r}")
        saved = len(checkpoint_steps(t))
        if t.keep_checkpoints < saved:
            raise ValueError(
                f"train.keep_checkpoints: expected >= {saved} (every checkpoint is analysed), "
                f"got {t.keep_checkpoints}"
            )


def checkpoint_steps(config) -> list[int]:
    """The steps ``train.loop.train`` saves: every ``ckpt_every`` and the last."""
    steps = list(range(config.ckpt_every, config.steps + 1, config.ckpt_every))
    return steps if steps and steps[-1] == config.steps else [*steps, config.steps]


def transition_step(steps, values, fraction: float = 0.5) -> int:
    """The first step where ``values`` has covered ``fraction`` of its change from first to last.

    Args:
      steps: increasing steps ``[C]``.
      values: a curve ``[C]`` over them (rising or falling).
      fraction: in ``(0, 1)``.

    Returns:
      The step, an int (the last step when the curve does not move).
    """
    values = np.asarray(values, np.float64)
    change = values[-1] - values[0]
    if change == 0:
        return int(steps[-1])
    progress = (values - values[0]) / change  # 0 at the start, 1 at the end
    return int(steps[int(np.argmax(progress >= fraction))])


def _eval_batch(config: Config):
    """Fixed test sequences ``[BOS] r r[:-1]`` and every position's next token."""
    t = config.train
    task = train.tasks.make_task(t.task)
    batch = task.batch(t.seed, "test", 0, config.eval_batch)
    tokens = batch["tokens"]
    # The task labels only the second copy; the analysis wants every next token.
    targets = np.concatenate([tokens[:, 1:], batch["labels"][:, -1:]], axis=1)
    return tokens, targets


def _measure(model, tokens, targets) -> dict:
    T = tokens.shape[1]
    P = T // 2
    losses = _common.token_losses(model, tokens, targets).mean(0)  # [T]
    _, w = _common.capture(model, tokens)
    ind = metrics.induction_score(w, P, start=P + 1, tokens=tokens)
    prev = metrics.previous_token_score(w)
    q = T // 4
    first, second = losses[:P].mean(), losses[P + 1 :].mean()
    return {
        "first_copy_loss": float(first),
        "second_copy_loss": float(second),
        "copy_loss_difference": float(second - first),
        "icl_score": float(losses[T - q :].mean() - losses[1:q].mean()),
        "induction_best": float(ind.max()),
        "previous_token_best": float(prev.max()),
        "induction": ind,
        "previous_token": prev,
        "weights_final": w,
    }


def run(config: Config, out_dir: Path) -> dict:
    """Trains, measures every checkpoint, writes results.json, table.md and PNGs."""
    timer = _common.Timer()
    out_dir = Path(out_dir)
    summary, workdir = _common.train_run(config.train, out_dir, "induction")
    tokens, targets = _eval_batch(config)
    t = config.train.with_task_vocab()
    model0, _ = train.steps.init_state(t, t.task.vocab)  # the run's step-0 parameters
    rows = [{"step": 0, **_measure(model0, tokens, targets)}]
    for step in checkpoint_steps(config.train):
        model, _ = train.load_run(workdir, step)
        rows.append({"step": step, **_measure(model, tokens, targets)})
    final_w = rows[-1].pop("weights_final")
    for r in rows:
        r.pop("weights_final", None)

    steps = [r["step"] for r in rows]
    curve = lambda key: [r[key] for r in rows]  # noqa: E731
    f = config.half_fraction
    ind_step = transition_step(steps, curve("induction_best"), f)
    loss_step = transition_step(steps, curve("second_copy_loss"), f)
    widths = {}
    for key in ("induction_best", "second_copy_loss"):
        lo, hi = (transition_step(steps, curve(key), x) for x in (0.1, 0.9))
        widths[key] = hi - lo
    allowed = max(config.train.ckpt_every, config.tolerance * loss_step)
    final_ind = rows[-1]["induction_best"]
    holds = abs(ind_step - loss_step) <= allowed and final_ind >= config.min_induction
    entry = _common.claim(
        f"induction score (best head) jumps at step {ind_step}, second-copy loss drops at "
        f"step {loss_step} (10-90% over {widths['induction_best']} and "
        f"{widths['second_copy_loss']} steps); final best induction score {final_ind:.2f}, "
        f"ICL score {rows[0]['icl_score']:.2f} -> {rows[-1]['icl_score']:.2f} nats",
        f"half-way steps within max({config.train.ckpt_every} steps, "
        f"{config.tolerance:.0%} of the loss-drop step) of each other and final best "
        f"induction score >= {config.min_induction}",
        holds,
    )

    L, N = rows[-1]["induction"].shape
    plots.curves(
        steps,
        {
            "best induction score": _fraction_of_change(curve("induction_best")),
            "second-copy loss drop": _fraction_of_change(curve("second_copy_loss")),
            "ICL score drop": _fraction_of_change(curve("icl_score")),
        },
        out_dir / "jump.png",
        "training step",
        "share of the change from step 0 to the end",
        hline=f,
    )
    plots.curves(
        steps,
        {
            "first copy": curve("first_copy_loss"),
            "second copy": curve("second_copy_loss"),
            "ICL score (late - early)": curve("icl_score"),
        },
        out_dir / "losses.png",
        "training step",
        "loss (nats)",
        hline=0.0,
    )
    plots.curves(
        steps,
        {
            "best induction score": curve("induction_best"),
            "best previous-token score": curve("previous_token_best"),
        },
        out_dir / "scores.png",
        "training step",
        "score",
    )
    plots.score_heatmap(rows[-1]["induction"], out_dir / "induction_final.png", "induction score")
    plots.score_heatmap(
        rows[-1]["previous_token"], out_dir / "previous_token_final.png", "previous-token score"
    )
    plots.attention_grid(final_w, list(range(L)), list(range(N)), out_dir / "attention.png")

    table = _common.markdown_table(
        [
            "step",
            "first-copy loss",
            "second-copy loss",
            "difference",
            "ICL score",
            "best induction",
            "best prev-token",
        ],
        [
            [
                r["step"],
                r["first_copy_loss"],
                r["second_copy_loss"],
                r["copy_loss_difference"],
                r["icl_score"],
                r["induction_best"],
                r["previous_token_best"],
            ]
            for r in rows
        ],
    )
    results = {
        "name": NAME,
        "claim": entry,
        "runtime_s": timer(),
        "induction_jump_step": ind_step,
        "loss_drop_step": loss_step,
        "transition_widths": widths,
        "period": tokens.shape[1] // 2,
        "train_summary": summary,
        "checkpoints": rows,
        "config": config,
    }
    return _common.write_results(out_dir, results, table)


def _fraction_of_change(values) -> list[float]:
    values = np.asarray(values, np.float64)
    change = values[-1] - values[0]
    return ((values - values[0]) / (change if change else 1.0)).tolist()


def main(argv=None) -> int:
    return _common.main(NAME, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
