"""Byte-level language modelling as a comparison: ``python -m train.compare --task bytes``.

    python -m train.compare --config configs/compare_lm.py     # the same as --task bytes
    python -m train.compare --task bytes --quick                # 2 variants, 1 seed, tiny
    python -m train.compare --task bytes --train.task.data PATH # any text file or folder

Regenerate the committed run (``docs/results/compare_lm/``) with

    python -m train.compare --task bytes --fresh --results-dir docs/results

The corpus is the Python standard library's own text (read from the
installed Python, nothing downloaded), split by file pieces into train and
test; every window starts with a BOS byte (as corpora packed with a BOS per
document). Every variant is a 4-layer decoder of width 128 (4 heads of dim
32) trained at T = 256 bytes, batch 16, AdamW with a 10% warmup and a cosine
decay over the run; its SwiGLU width is the one that gives it MHA's parameter
count at MLP width 512 (1.08M, within 0.1% for every variant: the MLP absorbs
what the attention layers add or save, the rule Gated DeltaNet's and Mamba's
papers use to compare at equal size).

The sweep is 2 learning rates on seed 0, then seed 1 at each variant's better
rate; the table reports the better rate's mean bits per byte and range over
the 2 seeds, the standard error of the test estimate (on 32 x 16 windows of
the held-out split, the same windows for every run) and, with
``test_lengths``, the same test tokens read as windows of 2, 4 and 8 times
the training length (train short, test long).

Sizes, from step times measured on one core of the 2-core machine
(``python bench/steps.py --config configs/compare_lm.py``): at width 128, T =
256 and batch 16 a step of MHA costs about 1 s, Gated DeltaNet's 1.6 s and
MoBA's 1.2 s; 12 variants x 3 runs on 2 cores in 60 minutes leaves about 200
core-seconds per run with its compilation and evaluations, hence ``STEPS``.
Width 128 and 4 layers is the smallest model here with room for what separates
the kinds on text (several heads per layer, two layers above the first
lookups); at width 64 a step is only half as cheap (1.1 s for NSA, 0.5 s for MHA).
"""

import dataclasses

from models import ModelConfig
from train.config import OptimConfig, TrainConfig
from train.tasks import TaskConfig
from train.variants import CompareConfig

# Every kind the comparison has, one variant each: RoPE, ALiBi and FoX for how
# positions enter, GQA and MLA for smaller caches, the window with initial tokens
# (StreamingLLM's cache), the fixed states (linear, Gated DeltaNet, Based, Mamba-2),
# the hybrid, and MoBA for trainable sparse attention (NSA, at twice MoBA's step
# time, is one flag away: --variants ... nsa).
VARIANTS = (
    "mha",
    "alibi",
    "fox",
    "gqa",
    "mla",
    "streaming",
    "linear",
    "gated_deltanet",
    "based",
    "hybrid",
    "mamba2",
    "moba",
)

SEQ_LEN = 256
STEPS = 160
LRS = (3e-3, 1e-2)


def get_config(quick: bool = False, task: str = "bytes") -> CompareConfig:
    if task != "bytes":
        raise ValueError(
            f"task: expected 'bytes' (configs/compare_mqar.py has the synthetic tasks), "
            f"got {task!r}"
        )
    train = TrainConfig(
        task=TaskConfig(name="bytes", seq_len=SEQ_LEN, bos=True),
        model=ModelConfig(width=96, mlp_width=384),
        optim=OptimConfig(lr=LRS[0]),
        steps=STEPS,
        batch_size=16,
        eval_every=80,
        eval_batches=24,
        ckpt_every=80,
        log_every=10,
    )
    config = CompareConfig(
        train=train,
        variants=VARIANTS,
        lrs=LRS,
        seeds=(0,),
        best_lr_seeds=(1,),
        num_layers=4,
        num_heads=4,
        gqa_kv_heads=2,
        # StreamingLLM's cache: a window plus the first 4 tokens.
        window=SEQ_LEN // 4,
        num_initial_tokens=4,
        kv_rank=48,
        rope_head_dim=8,
        chunk_size=64,
        test_lengths=(1, 2, 4, 8),
        match_params="mha",
        name="compare_lm",
    )
    if quick:
        train = dataclasses.replace(
            train,
            task=dataclasses.replace(train.task, seq_len=32),
            model=ModelConfig(width=32, mlp_width=64),
            steps=20,
            batch_size=4,
            eval_every=10,
            eval_batches=2,
            ckpt_every=10,
        )
        config = dataclasses.replace(
            config,
            train=train,
            variants=("mha", "gated_deltanet"),
            num_layers=2,
            window=8,
            kv_rank=16,
            rope_head_dim=4,
            chunk_size=16,
            test_lengths=(1, 2),
            best_lr_seeds=(),
            name="compare_lm_quick",
        )
    return config
