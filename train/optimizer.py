"""The optimizer of a run: AdamW on a warmup-cosine schedule, with global-norm clipping."""

from __future__ import annotations

import functools

import jax
import optax

from train.config import OptimConfig

__all__ = ["make_optimizer", "make_schedule"]


def make_schedule(optim: OptimConfig, steps: int, peak=None) -> optax.Schedule:
    """Linear warmup from 0 to the peak, then cosine decay to ``peak * final_lr_fraction``.

    The schedule spans ``optim.horizon(steps)`` updates (``optim.decay_steps``,
    default ``steps``) and holds its final value after them.

    Args:
      optim: the optimizer config.
      steps: the run's length.
      peak: the peak learning rate (a float or a traced scalar); default ``optim.lr``.
    """
    peak = optim.lr if peak is None else peak
    horizon = optim.horizon(steps)
    warmup = int(optim.warmup_fraction * horizon)
    # Shape of the schedule with peak 1; the peak multiplies it, so it may be an array.
    shape = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=1.0,
        warmup_steps=warmup,
        decay_steps=max(horizon, warmup + 1),
        end_value=optim.final_lr_fraction,
    )
    return lambda count: peak * shape(count)


@functools.lru_cache(maxsize=32)
def make_optimizer(optim: OptimConfig, steps: int) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on ``make_schedule(optim, steps)``.

    Cached: the transformation is part of the jitted step's static structure,
    so returning the same object for the same config lets a second run in the
    process (a resume, a repeat) reuse the compiled step.

    The peak learning rate lives in the optimizer state (``inject_hyperparams``)
    rather than in the compiled program, so runs that differ only in it (a
    learning-rate sweep) compile to the same program and share the persistent
    compilation cache. Weight decay applies to parameters of rank >= 2
    (matrices and embeddings): decaying norm scales toward 0 only hurts.
    """

    def chain(learning_rate):
        return optax.chain(
            optax.clip_by_global_norm(optim.clip_norm),
            optax.adamw(
                make_schedule(optim, steps, learning_rate),
                b1=optim.b1,
                b2=optim.b2,
                eps=optim.eps,
                weight_decay=optim.weight_decay,
                mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
            ),
        )

    return optax.inject_hyperparams(chain)(learning_rate=optim.lr)
