"""Experiment 4, windows with global layers: ``python -m analysis.experiments.windows_global``.

MQAR with 4 pairs in 48 tokens (vocabulary 64, queries uniform over the query
region; training examples hold 1 to 4 pairs, test examples 4); two 3-layer
decoders of width 64 (4 heads of dim 16): windows of 8 only, or window, window,
global. 1000 steps of 64 examples each. (Without the 1-to-4-pair curriculum and
with 600 steps of 48, neither model learned recall at any gap: accuracy 0.2
within the window.)
"""

from analysis.experiments.windows_global import Config
from models import ModelConfig, pattern, presets
from train.config import OptimConfig, TrainConfig
from train.tasks import TaskConfig

WINDOW = 8


def _run(names, task, *, width, heads, head_dim, window, steps, batch, quick):
    return TrainConfig(
        task=task,
        model=ModelConfig(
            width=width,
            mlp_width=16,
            layers=pattern(names, presets(num_heads=heads, head_dim=head_dim, window=window)),
        ),
        optim=OptimConfig(lr=3e-3),
        steps=steps,
        batch_size=batch,
        eval_every=steps if quick else 200,
        eval_batches=1 if quick else 4,
        ckpt_every=steps if quick else 200,
        log_every=10 if quick else 20,
    )


def get_config(quick: bool = False) -> Config:
    if quick:
        task = TaskConfig(name="mqar", seq_len=16, vocab_size=16, num_pairs=2, power_a=1.0)
        size = dict(width=16, heads=2, head_dim=8, window=4, steps=10, batch=8, quick=True)
        return Config(
            window_only=_run(("window",) * 3, task, **size),
            hybrid=_run(("window", "window", "mha"), task, **size),
            window=4,
            eval_batches=1,
        )
    task = TaskConfig(name="mqar", seq_len=48, vocab_size=64, num_pairs=4, min_pairs=1, power_a=1.0)
    size = dict(width=64, heads=4, head_dim=16, window=WINDOW, steps=1000, batch=64, quick=False)
    return Config(
        window_only=_run(("window",) * 3, task, **size),
        hybrid=_run(("window", "window", "mha"), task, **size),
        window=WINDOW,
    )
