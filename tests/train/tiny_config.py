"""A run small enough for tests: MQAR with 2 pairs in 16 tokens, one softmax layer of width 16."""

from models import ModelConfig, pattern, presets
from train.config import OptimConfig, TrainConfig
from train.tasks import TaskConfig


def get_config():
    return TrainConfig(
        task=TaskConfig(name="mqar", seq_len=16, vocab_size=32, num_pairs=2),
        model=ModelConfig(
            width=16, mlp_width=32, layers=pattern(("mha",), presets(num_heads=2, head_dim=8))
        ),
        optim=OptimConfig(lr=3e-3),
        steps=40,
        batch_size=8,
        eval_every=20,
        eval_batches=2,
        ckpt_every=10,
        log_every=5,
    )
