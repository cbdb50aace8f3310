"""Train short, test long: a trained run's test loss on windows k times its training length.

The comparison ALiBi's paper (Press, Smith and Lewis 2022) and FoX's (Lin et al.
2025) print: a model trained at T tokens is evaluated at 2T, 4T, 8T. Every
layer runs its own forward pass at the longer length, which is what it computes
when it decodes (each kind's prefill + decode equals its forward pass): RoPE
rotates past the positions it trained on, ALiBi's and FoX's biases keep
decaying, windows keep their width, and the fixed states run on.

Each length reads the same number of test tokens: ``batch_size * eval_batches``
windows of T become ``1 / k`` as many windows of ``k T`` (the batch shrinks
first, then the batches).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from attn.checks import fail
from train.config import TrainConfig
from train.run import load_run
from train.steps import evaluate
from train.tasks import make_task

__all__ = ["at_length", "loss_at_lengths"]


def at_length(config: TrainConfig, multiple: int) -> TrainConfig:
    """The run's config evaluated at ``multiple`` x its training length, the same test
    tokens in all (``batch_size`` and ``eval_batches`` divided by the multiple, at least 1).

    Raises:
      ValueError: naming ``multiple``, unless it is an int >= 1.
    """
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        fail("multiple", "an int >= 1", repr(multiple))
    batch = max(1, config.batch_size // multiple)
    windows = config.batch_size * config.eval_batches
    return dataclasses.replace(
        config,
        task=dataclasses.replace(config.task, seq_len=multiple * config.task.seq_len),
        batch_size=batch,
        eval_batches=max(1, windows // (multiple * batch)),
    )


def loss_at_lengths(workdir: str | Path, multiples) -> dict[str, dict]:
    """The newest checkpoint's test loss at each multiple of the training length.

    Args:
      workdir: a finished run's folder (``train.loop.train``'s).
      multiples: ints >= 1, e.g. ``(1, 2, 4, 8)``.

    Returns:
      ``{str(k): dict(seq_len, windows, test_loss, test_loss_se, test_accuracy)}``.
    """
    model, config = load_run(workdir)
    out = {}
    for k in multiples:
        long = at_length(config, k)
        result = evaluate(model, make_task(long.task), long)
        windows = long.batch_size * long.eval_batches
        out[str(k)] = {"seq_len": long.task.seq_len, "windows": windows, **result}
    return out
