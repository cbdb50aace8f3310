"""Experiment 1, induction heads: ``python -m analysis.experiments.induction_heads``.

A 2-layer, 4-head decoder of width 32 (narrow MLP) on ``[BOS] r r`` with P = 32
random tokens from a vocabulary of 32, analysed every 20 steps over 400.
"""

import dataclasses

from analysis.experiments.induction_heads import Config
from models import ModelConfig, pattern, presets
from train.config import OptimConfig, TrainConfig
from train.tasks import TaskConfig


def get_config(quick: bool = False) -> Config:
    run = TrainConfig(
        task=TaskConfig(name="induction", seq_len=64, vocab_size=32),
        model=ModelConfig(
            width=32,
            mlp_width=8,
            layers=pattern(("mha", "mha"), presets(num_heads=4, head_dim=8)),
        ),
        optim=OptimConfig(lr=1e-3),
        steps=400,
        batch_size=32,
        eval_every=100,
        ckpt_every=20,
        keep_checkpoints=100,
        log_every=10,
    )
    if quick:
        run = dataclasses.replace(
            run,
            task=TaskConfig(name="induction", seq_len=16, vocab_size=16),
            steps=20,
            batch_size=8,
            eval_every=20,
            eval_batches=1,
            ckpt_every=10,
        )
        return Config(train=run, eval_batch=4)
    return Config(train=run)
