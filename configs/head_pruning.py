"""Experiment 3, head pruning: ``python -m analysis.experiments.head_pruning``.

A 4-layer, 8-head byte-level decoder of width 64 (head dim 8) on the standard
library's sources at T = 64, 600 steps; pruning is scored by next-byte test
accuracy. (The same model on MQAR, 8 pairs in 48 tokens, stayed at chance,
0.13, for 500 steps, so there was nothing to prune.)
"""

import dataclasses

from analysis.experiments.head_pruning import Config
from models import ModelConfig, pattern, presets
from train.config import OptimConfig, TrainConfig
from train.tasks import TaskConfig


def get_config(quick: bool = False) -> Config:
    run = TrainConfig(
        task=TaskConfig(name="bytes", seq_len=64),
        model=ModelConfig(
            width=64,
            mlp_width=128,
            layers=pattern(("mha",) * 4, presets(num_heads=8, head_dim=8)),
        ),
        optim=OptimConfig(lr=3e-3),
        steps=600,
        batch_size=32,
        eval_every=100,
        eval_batches=8,
        ckpt_every=100,
        log_every=20,
    )
    if quick:
        run = dataclasses.replace(
            run,
            task=TaskConfig(name="mqar", seq_len=16, vocab_size=16, num_pairs=2),
            model=ModelConfig(
                width=16,
                mlp_width=8,
                layers=pattern(("mha",) * 2, presets(num_heads=4, head_dim=4)),
            ),
            steps=10,
            batch_size=8,
            eval_every=10,
            eval_batches=1,
            ckpt_every=10,
        )
        return Config(train=run, fractions=(0.0, 0.5, 1.0), importance_batches=2, random_orders=1)
    return Config(train=run)
