"""Long-context recall with sparse attention: needles and MQAR, trained at 512, tested to 4096.

    python -m analysis.experiments.sparse            # this file's full grid
    python -m analysis.experiments.sparse --quick    # two tiny runs (the tests)

The full grid is 6 variants x 2 tasks, 2 layers of width 64, each trained for
800 updates of 16 examples at T = 512 (one rate, 3e-3, for every variant), 2
jobs on 2 cores; its measured runtime is in docs/results/sparse/table.md. The
window, MoBA and DSA read 64 keys per query at every length, MHA all of them.
"""

from analysis.experiments.sparse import Config


def get_config(quick: bool = False) -> Config:
    if quick:
        return Config(
            tasks=("needle",),
            variants=("window", "moba"),
            reads=16,
            block=8,
            train_len=32,
            factors=(1, 2),
            num_pairs=2,
            vocab_size=32,
            steps=3,
            batch_size=4,
            eval_batches=1,
            width=16,
            num_layers=1,
            num_heads=2,
            head_dim=8,
            jobs=1,
        )
    return Config()
