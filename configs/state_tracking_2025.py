"""State tracking for the 2025 families: ``configs/state_tracking.py``'s grid, seven variants.

    python -m analysis.experiments.state_tracking --config configs/state_tracking_2025.py \
        --out results/state_tracking_2025

RWKV-7, PaTH, PaTH-FoX, log-linear Mamba-2 and log-linear Gated DeltaNet on
parity, addition mod 5, S3 and S5 at the sizes, updates and rates of the
committed grid (``docs/results/state_tracking/``), beside Mamba-2 with and
without negative eigenvalues (the parity claim's pair, rerun on this code); the
other variants are not rerun (``docs/results/state_tracking_2025/``). The pair
does not give that grid's numbers everywhere: run on the code of 2026-12-04
(115255a), the same seeds gave Mamba-2 0.960 and Mamba-2 with negative
eigenvalues 0.532 on addition mod 5, here 0.504 and 0.901 (parity and S3/S5
agree within 0.01). These runs sit at the edge of learning the task, where the
numerics changed since (the SSD's forms, the train step) flip the outcome: one
seed at 2 layers x 32 cannot tell these families apart on modular sums.
"""

import dataclasses

from analysis.experiments.state_tracking import Config
from configs import state_tracking

# Mamba-2 with and without negative eigenvalues again: the claim's pair, beside the new families.
VARIANTS = (
    "mamba2",
    "mamba2_negative",
    "rwkv7",
    "path",
    "path_fox",
    "log_linear_mamba2",
    "log_linear_gated_deltanet",
)


def get_config(quick: bool = False) -> Config:
    return dataclasses.replace(state_tracking.get_config(quick), variants=VARIANTS)
