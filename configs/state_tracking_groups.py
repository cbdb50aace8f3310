"""State tracking on S3 and S5 at the size where the families separate: claim 17's grid.

    python -m analysis.experiments.state_tracking --config configs/state_tracking_groups.py \
        --out docs/results/state_tracking_groups
    python -m analysis.experiments.state_tracking --config configs/state_tracking_groups.py --quick

The committed grid (``configs/state_tracking.py``: 2 layers of width 32, 1200
updates) separates nothing on S3 or S5. Trials on this CPU (one run each, T = 16,
batch 32, tested at 1x, 2x and 4x) chose these sizes:

- S3 with DeltaProduct n_h = 3 at width 64 (4 heads of 16), lr 1e-2: one layer
  learns it within 3,000 updates (a plateau at 0.48, then a jump near update
  1,600: 1.00 / 1.00 / 0.97 in 86 s); two layers also learn it (1.00 / 0.99 / 0.87,
  209 s); Gated DeltaNet with negative eigenvalues (one Householder a token) does
  not at one layer (0.43).
- S5 (120 elements) is learned by none of the trials: DeltaProduct n_h = 4 (the
  Householders a 5-cycle needs in one layer) stayed at loss 4.49 (0.07 accuracy,
  the first position only) for 6,000 updates at lr 1e-2 and at 3e-3, for 6,000 at
  T = 8 (0.13: the first of 8 positions), and through 6,800 updates of a 15,000-update
  trial at T = 16 (stopped there, its loss flat at 4.49 since update 1,000).

So the grid is one layer of width 64: every family of the claim at the same depth
(DeltaProduct with 2, 3 and 4 Householders, Gated DeltaNet and Mamba-2 with and
without negative eigenvalues, RWKV-7, PaTH and MHA), 3,000 updates on S3 and 6,000
on S5, both rates, one seed: 10 variants x 2 tasks x 2 rates = 40 runs.
"""

import dataclasses

from analysis.experiments.state_tracking import Config
from configs import state_tracking

VARIANTS = (
    "mha",
    "mamba2",
    "mamba2_negative",
    "gated_deltanet",
    "gated_deltanet_negative",
    "deltaproduct2",
    "deltaproduct3",
    "deltaproduct4",
    "rwkv7",
    "path",
)


def get_config(quick: bool = False) -> Config:
    if quick:
        quick_config = state_tracking.get_config(quick=True)
        return dataclasses.replace(
            quick_config, tasks=("s3",), steps=(("s3", 3),), variants=("deltaproduct2", "mha")
        )
    return Config(
        tasks=("s3", "s5"),
        variants=VARIANTS,
        lrs=(3e-3, 1e-2),
        steps=(("s3", 3000), ("s5", 6000)),
        width=64,
        num_layers=1,
        num_heads=4,
        head_dim=16,
        state_dim=16,
    )
