"""Gated attention and the sink on English: ``python -m analysis.experiments.sinks_gated``.

Claim 12's model and budget (``configs/sinks_streaming.py``: 4 layers of MHA,
T = 64 with a BOS first, 800 steps of 32 windows, lr 3e-3, checkpoints every 200
steps) on English text (the English comparison's corpus, Shakespeare's plays, 15%
held out). The onset sweeps widths 32, 64, 128 and 192 (2 x 2, 4 x 4, 4 x 8 and
4 x 12 layers x heads, head dim 16 from width 64 on) and stops at the first with a
sink; the gated model (elementwise, the paper's best and Qwen3-Next's) trains at
that size.
"""

import dataclasses

from analysis.experiments.sinks_gated import Config
from analysis.experiments.sinks_streaming import Size
from configs import sinks_streaming

ENGLISH = dict(data="shakespeare", val_percent=15, bos=True)


def get_config(quick: bool = False) -> Config:
    base = sinks_streaming.get_config(quick=quick)
    run = base.train
    run = dataclasses.replace(run, task=dataclasses.replace(run.task, **ENGLISH))
    if quick:
        run = dataclasses.replace(run, ckpt_every=5)
        sizes = (Size(16, 1, 2), Size(16, 2, 2))
    else:
        sizes = (Size(32, 2, 2), Size(64, 4, 4), Size(128, 4, 8), Size(192, 4, 12))
    return Config(dataclasses.replace(base, train=run, sizes=sizes))
