"""The recall frontier: every family's MQAR accuracy against its decode state.

    python -m analysis.experiments.recall_frontier                  # the cpu scale (this file)
    python -m analysis.experiments.recall_frontier --scale gpu      # 8 minutes on an H200
    python -m analysis.experiments.recall_frontier --scale zoology  # Zoology's grid
    python -m analysis.experiments.recall_frontier --quick          # two points, seconds

Four scales (``analysis.experiments.recall_frontier_grid.Scale``; the families
and their knobs are defined there):

* ``cpu`` (the default): what fits in 45 minutes on a 2-core CPU with 2 jobs.
  Zoology's two smallest settings, (T, pairs) = (64, 4) and (128, 8), with the
  main job's vocabulary of 64 instead of 8192: at 8192 the output layer alone
  (a [B*T, 64] x [64, 8192] product, forward and backward) costs 13 GFLOP a
  step at T = 64, 25 times the rest of a width-64 model, and with 4096 keys to
  tell apart a model needs far more updates before it recalls at all. One
  learning rate, 1e-2 (the third of Zoology's four): the 72 points at two
  rates would take about twice the 45 minutes, and at 3e-3 softmax MHA of
  every width stayed at chance (0.21 to 0.25) after 500 updates of batch 32 at
  (64, 4), where 1e-2 reaches 0.99 in 400. One seed, batch 32, at most 500
  updates at T = 64 and 350 at T = 128, stopping early at 0.99 test accuracy
  (checked every 50 updates). The committed run took 33 minutes; an earlier
  one with 400 updates at T = 128 and Gated DeltaNet in chunks of 64 took 59
  (``recall_frontier_grid._gated_deltanet`` says why its form changed).
* ``gpu``: Zoology's task (V = 8192, batch 256) at (T, pairs) = (128, 8) for claim
  15's families (softmax MHA, linear, Based, Gated DeltaNet) at 3 knob values each,
  2,000 updates at its two middle learning rates, bf16 compute: sized to 8 minutes
  on one H200 by ``--dry-run``'s prediction (454 s; ``train.budget.H200`` says what
  it assumes), not yet run on one.
* ``zoology``: Zoology's grid (Arora et al. 2023, the Based paper's Figure 2
  configs): V = 8192, (T, pairs) in (64, 4), (128, 8), (256, 16), (512, 64),
  learning rates ``logspace(-3, -1.5, 4)``, batch 256 and the step counts of
  32 epochs over Zoology's training sets (100,000 examples at T = 64, 20,000
  at the others), for an accelerator.
* ``quick``: two points for the tests.
"""

from analysis.experiments.recall_frontier_grid import SCALES


def get_config(quick: bool = False, scale: str = "cpu"):
    if scale not in SCALES:
        raise ValueError(f"scale: expected one of {sorted(SCALES)}, got {scale!r}")
    return SCALES["quick" if quick else scale]
