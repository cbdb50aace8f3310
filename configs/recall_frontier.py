"""The recall frontier: every family's MQAR accuracy against its decode state.

    python -m analysis.experiments.recall_frontier                  # the cpu scale
    python -m analysis.experiments.recall_frontier --scale gpu      # 8 minutes on an H200
    python -m analysis.experiments.recall_frontier --scale zoology  # Zoology's grid
    python -m analysis.experiments.recall_frontier --quick          # two points, seconds

Four scales (``analysis.experiments.recall_frontier_grid.Scale``; the families
and their knobs are defined there):

* ``cpu`` (the default): Zoology's two smallest settings, (T, pairs) = (64, 4)
  and (128, 8), with the main job's vocabulary of 64 instead of 8192: at 8192
  the output layer alone (a [B*T, 64] x [64, 8192] product, forward and
  backward) costs 13 GFLOP a step at T = 64, 25 times the rest of a width-64
  model, and with 4096 keys to tell apart a model needs far more updates
  before it recalls at all. Every point at Zoology's two highest learning
  rates, 1e-2 and 10^-1.5 (at 3e-3, the main job's rate, softmax MHA of every
  width stayed at chance, 0.21 to 0.25, after 500 updates at (64, 4), where
  1e-2 reaches 0.99 in 400), reporting its best. One seed, batch 32. A run
  stops at 0.99 test accuracy (checked every 50 updates) or at 500 updates;
  one still learning there (its test loss down by more than 5% or its
  accuracy up by more than 0.02 over its second half) goes on to 1,000, then
  to 2,000, on a schedule whose horizon is 2,000 throughout. So no point's
  number is its cap's unless the table says so (its last column). An
  earlier grid at one rate (1e-2) and fixed caps of 500 and 350 updates (33
  minutes, in the git history of ``docs/results/recall_frontier/``) left most
  (128, 8) points still learning: Gated DeltaNet's best there was 0.14.
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
    if quick and scale != "cpu":  # quick is a scale of its own: it would replace this one
        raise ValueError(f"scale: expected 'cpu' with --quick (its one size), got {scale!r}")
    return SCALES["quick" if quick else scale]
