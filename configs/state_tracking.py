"""State tracking: parity, addition mod 5, S3 and S5, trained at T = 16, tested to 64.

    python -m analysis.experiments.state_tracking            # this file's full grid
    python -m analysis.experiments.state_tracking --quick    # two tiny runs (the tests)

The full grid is 9 variants x 4 tasks x 2 learning rates = 72 runs of 32
examples per update (2 layers of width 32): 400 updates on parity, 1200 on
the others (at 400 no variant learned addition mod 5, S3 or S5 beyond the
first positions), 2 jobs on 2 cores; its measured runtime is in
docs/results/state_tracking/table.md. The lengths follow
Grazzi et al.'s length-generalization protocol at a CPU's scale (they train
at length 40 and test to 256 on a GPU).
"""

from analysis.experiments.state_tracking import Config


def get_config(quick: bool = False) -> Config:
    if quick:
        return Config(
            tasks=("parity",),
            variants=("mamba2", "mamba2_negative"),
            lrs=(1e-2,),
            train_len=8,
            factors=(1, 2),
            steps=(("parity", 3),),
            batch_size=8,
            eval_batches=1,
            width=16,
            num_layers=1,
            num_heads=2,
            head_dim=8,
            state_dim=8,
            jobs=1,
        )
    return Config()
