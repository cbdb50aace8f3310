"""Two RULER tasks beside the needles: sparse attention at 256 to 4096 tokens.

    python -m analysis.experiments.sparse --config configs/sparse_ruler.py \
        --out docs/results/sparse_ruler
    python -m analysis.experiments.sparse --config configs/sparse_ruler.py --quick

RULER (Hsieh et al. 2024) asks more of a long context than one needle: its
multi-key needle hides the queried needle among distractor needles, and its
variable tracking chains assignments (``x1 v``, ``x2 x1``), so the answer takes
one lookup per hop. The grid is 2 tasks (``multikey_needle``,
``variable_tracking``) x 5 variants (MHA, the window, MoBA, DSA, Gated DeltaNet;
NSA left out), at the sizes of configs/sparse.py: 2 layers of width 64 with short
convolutions, 1000 updates of 16 examples at T = 256, lr 3e-3, V = 64, 12 needles
(variable tracking: 6 chains of 2 assignments, 12 pairs too), tested at 256 to 4096.
The single needle's rows are the full grid's (``docs/results/sparse/``); this
grid's claim entry asks the same of the multi-key needle. The RULER tasks label
one position per example where the needles label 12, so each length is tested on
8 batches (128 answers: a standard error of at most 0.044) instead of 2.
"""

from analysis.experiments.sparse import Config


def get_config(quick: bool = False) -> Config:
    tasks = ("multikey_needle", "variable_tracking")
    if quick:
        return Config(
            tasks=tasks,
            variants=("window", "moba"),
            reads=16,
            block=8,
            train_len=32,
            factors=(1, 2),
            num_pairs=4,  # two chains of two
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
    variants = ("mha", "window", "moba", "dsa", "gated_deltanet")
    return Config(tasks=tasks, variants=variants, eval_batches=8)
