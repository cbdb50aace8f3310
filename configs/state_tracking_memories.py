"""State tracking for the trained memories: ``configs/state_tracking.py``'s grid, six variants.

    python -m analysis.experiments.state_tracking --config configs/state_tracking_memories.py \
        --out docs/results/state_tracking_memories

TTT-Linear, TTT-MLP, Titans and MesaNet on parity, addition mod 5, S3 and S5 at the
sizes, updates and rates of the committed grid (``docs/results/state_tracking/``),
beside Mamba-2 with and without negative eigenvalues (the parity claim's pair, rerun
on this code). TTT's and Titans' mini-batches are their papers' 16: the training
length, so within a training sequence the inner model trains in one mini-batch.
"""

import dataclasses

from analysis.experiments.state_tracking import Config
from configs import state_tracking

VARIANTS = ("mamba2", "mamba2_negative", "ttt_linear", "ttt_mlp", "titans", "mesanet")


def get_config(quick: bool = False) -> Config:
    return dataclasses.replace(state_tracking.get_config(quick), variants=VARIANTS)
