"""Gated attention and the sink on English: ``python -m analysis.experiments.sinks_gated``.

Claim 12's model and budget (``configs/sinks_streaming.py``: 4 layers of MHA,
T = 64 with a BOS first, 800 steps of 32 windows, lr 3e-3) on English text (the
English comparison's corpus, Shakespeare's plays, 15% held out). The onset sweeps
widths 32, 64, 128 and 192 (2 x 2, 4 x 4, 4 x 8 and 4 x 12 layers x heads, head
dim 16 from width 64 on) and stops at the first with a sink; the gated model
(elementwise, the paper's best and Qwen3-Next's) trains at that size.
"""

import dataclasses

from analysis.experiments.sinks_gated import Config
from analysis.experiments.sinks_streaming import Config as SinksConfig
from analysis.experiments.sinks_streaming import Size
from models import ModelConfig, pattern, presets
from train.config import OptimConfig, TrainConfig
from train.tasks import TaskConfig

ENGLISH = dict(data="shakespeare", val_percent=15)


def get_config(quick: bool = False) -> Config:
    run = TrainConfig(
        task=TaskConfig(name="bytes", seq_len=64, bos=True, **ENGLISH),
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
    sizes = (Size(32, 2, 2), Size(64, 4, 4), Size(128, 4, 8), Size(192, 4, 12))
    if quick:
        run = dataclasses.replace(
            run,
            task=TaskConfig(name="bytes", seq_len=8, bos=True, **ENGLISH),
            model=ModelConfig(
                width=16, mlp_width=16, layers=pattern(("mha",), presets(num_heads=2, head_dim=8))
            ),
            steps=10,
            batch_size=4,
            eval_every=10,
            eval_batches=1,
            ckpt_every=5,
        )
        sizes = (Size(16, 1, 2), Size(16, 2, 2))
        return Config(SinksConfig(run, eval_batch=2, stream_factor=3, num_streams=2, sizes=sizes))
    return Config(SinksConfig(run, sizes=sizes))
