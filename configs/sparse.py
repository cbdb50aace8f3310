"""Long-context recall with sparse attention: needles and MQAR, trained at 256, tested to 4096.

    python -m analysis.experiments.sparse            # this file's full grid
    python -m analysis.experiments.sparse --quick    # two tiny runs (the tests)

The full grid is 6 variants x 2 tasks, 2 layers of width 64 with short
convolutions, each trained for 1000 updates of 16 examples at T = 256 (one rate,
3e-3, for every variant; V = 64, 12 pairs or needles), tested at 256 to 4096, 2
jobs on 2 cores; its measured runtime is in docs/results/sparse/table.md. The
window, MoBA and DSA read 64 keys per query at every length, MHA all of them.

Why 256: on this CPU at T = 512, 300 updates left MHA at 0.19 on the needles (chance
0.06) and MoBA at 0.15; at T = 256, 600 updates took MHA to 1.00 and MoBA to 0.65
(training at 512 long enough to learn would take the grid past an hour). The long contexts
(512 to 4096) are test lengths.
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
