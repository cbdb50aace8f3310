"""Experiment 2, attention sinks and streaming: ``python -m analysis.experiments.sinks_streaming``.

The main model is the sink onset's: a 4-layer, 8-head byte-level decoder of
width 128 (689,280 parameters) trained at T = 64 for 800 steps with a BOS
first, the smallest model in which the sweep below found a sink; streams of
8T = 512 bytes. The sink-onset sweep trains widths 32, 64 and 128 (2 x 2,
4 x 4 and 4 x 8 layers x heads; 28,832 to 689,280 parameters) the same way,
each with and without a BOS first (the main run is its largest with a BOS).
"""

import dataclasses

from analysis.experiments.sinks_streaming import Config, Size
from models import ModelConfig, pattern, presets
from train.config import OptimConfig, TrainConfig
from train.tasks import TaskConfig


def get_config(quick: bool = False) -> Config:
    run = TrainConfig(
        task=TaskConfig(name="bytes", seq_len=64, bos=True),
        model=ModelConfig(
            width=128,
            mlp_width=256,
            layers=pattern(("mha",) * 4, presets(num_heads=8, head_dim=16)),
        ),
        optim=OptimConfig(lr=3e-3),
        steps=800,
        batch_size=32,
        eval_every=200,
        eval_batches=4,
        ckpt_every=200,
        keep_checkpoints=100,
        log_every=20,
    )
    if quick:
        run = dataclasses.replace(
            run,
            task=TaskConfig(name="bytes", seq_len=8),
            model=ModelConfig(
                width=16, mlp_width=16, layers=pattern(("mha",), presets(num_heads=2, head_dim=8))
            ),
            steps=10,
            batch_size=4,
            eval_every=10,
            eval_batches=1,
            ckpt_every=10,
        )
        # The sweep meets the main run at its size without a BOS: one more run, with one.
        return Config(
            train=run, eval_batch=2, stream_factor=3, num_streams=2, sizes=(Size(16, 1, 2),)
        )
    # The sink-onset sweep: 4x the parameters per step, each with and without a BOS.
    return Config(train=run, sizes=(Size(32, 2, 2), Size(64, 4, 4), Size(128, 4, 8)))
