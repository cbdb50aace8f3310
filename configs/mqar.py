"""One model on multi-query associative recall: the comparison's softmax baseline, alone.

    python -m train --config configs/mqar.py --workdir runs/mqar

(``python -m train.compare`` trains every variant on this task.)

MQAR as in Zoology: 8 key-value pairs in 48 tokens (vocabulary 64), training
examples holding 1 to 8 pairs, test examples 8. A 2-layer softmax decoder of
width 64 (4 heads of dim 16, SwiGLU width 16).

Runtime: 58 s on a 2-core CPU (shared; load average 3). Result: test accuracy
at chance (0.13, guessing among the 8 values) until step 200, 0.43 at step
250, 0.94 at 300 and 1.00 from step 450: the recall circuit forms abruptly.
"""

from models import ModelConfig, pattern, presets
from train.config import OptimConfig, TrainConfig
from train.tasks import TaskConfig


def get_config() -> TrainConfig:
    return TrainConfig(
        task=TaskConfig(name="mqar", seq_len=48, vocab_size=64, num_pairs=8, min_pairs=1),
        model=ModelConfig(
            width=64,
            mlp_width=16,
            layers=pattern(("mha", "mha"), presets(num_heads=4, head_dim=16)),
        ),
        optim=OptimConfig(lr=3e-3),
        steps=600,
        batch_size=64,
        eval_every=50,
        eval_batches=4,
        ckpt_every=100,
        log_every=10,
    )
