"""State tracking for the 2025 families: ``configs/state_tracking.py``'s grid and sizes, five variants.

    python -m analysis.experiments.state_tracking --config configs/state_tracking_2025.py \
        --out results/state_tracking_2025

RWKV-7, PaTH, PaTH-FoX, log-linear Mamba-2 and log-linear Gated DeltaNet on
parity, addition mod 5, S3 and S5 at the sizes, updates and rates of the
committed grid (``docs/results/state_tracking/``), whose nine variants are not
rerun: each run depends on its own variant, task and rate only, so the rows
stand beside those (``docs/results/state_tracking_2025/``).
"""

import dataclasses

from analysis.experiments.state_tracking import Config
from configs import state_tracking

VARIANTS = ("rwkv7", "path", "path_fox", "log_linear_mamba2", "log_linear_gated_deltanet")


def get_config(quick: bool = False) -> Config:
    return dataclasses.replace(state_tracking.get_config(quick), variants=VARIANTS)
