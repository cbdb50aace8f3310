"""Byte-level language modelling as a comparison: ``python -m train.compare --task bytes``.

    python -m train.compare --config configs/compare_lm.py     # the same as --task bytes
    python -m train.compare --task bytes --quick                # 2 variants, 1 seed, tiny
    python -m train.compare --task bytes --train.task.data PATH # any text file or folder

Regenerate the committed run (``docs/results/compare_lm/``) with

    python -m train.compare --task bytes --fresh --results-dir docs/results

The corpus is the Python standard library's own text (read from the
installed Python, nothing downloaded), split by file pieces into train and
test; every window starts with a BOS byte (as corpora packed with a BOS per
document). Every variant is a 4-layer decoder of width 96 (4 heads of dim 24)
trained for 160 steps at T = 256 bytes, batch 16 (655,360 training bytes),
AdamW with a 10% warmup and a cosine decay to a tenth. Its SwiGLU width is
the one that gives it MHA's parameter count at MLP width 384 (615,264; every
variant within 0.1%): the MLP absorbs what the attention layers add or save,
so every variant has the same depth, width and parameter count.

The sweep is 2 learning rates on seed 0, then seed 1 at each variant's better
rate; the table reports the better rate's mean bits per byte and range over
the 2 seeds, the standard error of the test estimate (24 x 16 held-out
windows, 98,304 bytes, the same windows for every run) and, with
``test_lengths``, as many test bytes in windows of 2, 4 and 8 times the
training length (train short, test long).

Sizes, from step times measured with both cores busy, one run on each
(``python bench/steps.py --config configs/compare_lm.py``): at width 128 a
step of MHA cost 1.08 s and Based's 1.87 s; at width 96, 0.59 s and 0.93 s.
12 variants x 3 runs in 60 minutes on 2 cores leave about 200 core-seconds
per run with its compilation (9 to 38 s a run) and evaluations, which at
width 128 would be about 120 steps (490K bytes) and at width 96 is 160 steps
with room to spare: the larger model would see fewer bytes than it has
parameters. Claim 12's sinks need more (about 0.7M parameters with a BOS),
so ``configs/sinks_streaming.py`` trains its own model at that size.

The committed run (``docs/results/compare_lm/``: table.md, results.json,
bits_vs_state.png, curves.png, lengths.png and timing.txt; 57 minutes), test
bits per byte, mean of the 2 seeds (range), test SE about 0.031 for each:

    mamba2 2.263 (2.241-2.285)    gated_deltanet 2.450 (2.422-2.479)
    fox 2.713 (2.696-2.731)       streaming 2.866 (2.861-2.871)
    alibi 2.868 (2.858-2.879)     moba 2.925 (2.906-2.944)
    mha 2.927 (2.908-2.946)       gqa 2.942 (2.937-2.948)
    hybrid 2.989 (2.910-3.068)    based 3.061 (3.001-3.121)
    mla 3.154 (3.147-3.162)       linear 3.475 (3.447-3.502)

The four 2025 families at the end of ``VARIANTS`` joined after that run;
``--variants rwkv7 path log_linear_mamba2 log_linear_gated_deltanet --name
compare_lm_2025`` ran them on the same sizes, data, seeds and matching
(``docs/results/compare_lm_2025/``, 25 minutes): log-linear Mamba-2 2.268,
log-linear Gated DeltaNet 2.478, RWKV-7 2.543, PaTH 2.940 (2.860 at 8T, where
MHA's RoPE reaches 3.630).

Every curve is still falling at step 160: these are short-training numbers, in
which the kinds with short convolutions or decays (Mamba-2, Gated DeltaNet,
FoX) learn the local statistics of bytes fastest. Tested at 8T = 2048 bytes,
RoPE's softmax models lose 0.5 to 0.9 bits (MHA 3.630, GQA 3.475, MLA 3.791,
MoBA 3.806; the hybrid, whose one softmax layer has RoPE, 3.369), while ALiBi
(2.765), FoX (2.599), the window with sinks (2.789) and the fixed states stay
within 0.03 of their 1x numbers at 2x and 4x and score about 0.1 lower at 8x,
all of them alike: each length draws its own random test windows, and the 8x
ones are an easier sample as well as a longer context.
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
# time, is one flag away: --variants ... nsa); then the 2025 families: RWKV-7, PaTH,
# and the log-linear Mamba-2 and Gated DeltaNet.
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
    "rwkv7",
    "path",
    "log_linear_mamba2",
    "log_linear_gated_deltanet",
)

SEQ_LEN = 256
STEPS = 160
LRS = (3e-3, 1e-2)

# The GPU scale (``--scale gpu``): 8 layers of width 512 (8 heads of 64), SwiGLU matched
# to MHA's at 4 x 512 (about 33.7M parameters), T = 1024 bytes, batch 32 (32,768 tokens
# an update), bf16 compute with float32 parameters, softmax statistics and states. The
# comparison's other sizes scale with it: the window T / 4, MLA's latent width / 2 and
# its RoPE key half a head. The device run's training phase (bench/_device_train.py)
# times one update of each variant at these sizes.
GPU = dict(width=512, num_heads=8, num_layers=8, seq_len=1024, batch=32, window=256,
           kv_rank=256, rope_head_dim=32, chunk_size=64)  # fmt: skip
# Sized to 8 minutes on one H200 by ``python -m train.compare --task bytes --scale gpu
# --dry-run`` (model FLOPs over an assumed quarter of its measured matmul rate, and 37 s
# to compile an 8-layer program: ``train.budget.H200``): 473 s. Compiling is 60% of it:
# 4 variants (the baseline and the CPU run's three best kinds) x 2 rates, 450 updates
# each (14.7M bytes: 1.5 passes over the Python corpus, 3 over Shakespeare), tested at
# 1x only (each longer length is one more program to compile).
GPU_VARIANTS = ("mha", "fox", "gated_deltanet", "mamba2")
GPU_STEPS = 450
GPU_LRS = (1e-3, 3e-3)


# ``--scale small``: about five minutes on 2 cores. Every variant, one learning rate
# (the committed runs' best for most), 2 seeds, at half the width, half the depth and
# half the context of ``cpu``, for the same 160 steps; tested at 1x only.
SMALL = dict(width=64, num_heads=4, num_layers=2, seq_len=128, batch=16, window=32,
             kv_rank=32, rope_head_dim=8, chunk_size=32)  # fmt: skip
SMALL_LR = 1e-2


def get_config(quick: bool = False, task: str = "bytes", scale: str = "cpu") -> CompareConfig:
    """The comparison at ``scale``: ``cpu`` (the committed run's), ``small`` (``SMALL``) or
    ``gpu`` (``GPU``)."""
    if scale not in ("cpu", "small", "gpu"):
        raise ValueError(f"scale: expected 'cpu', 'small' or 'gpu', got {scale!r}")
    if quick and scale != "cpu":  # the quick settings are one size: they would replace gpu's
        raise ValueError(f"scale: expected 'cpu' with --quick (its one size), got {scale!r}")
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
    if scale == "gpu":
        config = _gpu(config)
    if scale == "small":
        config = dataclasses.replace(
            at_size(config, SMALL, dtype="float32"),
            lrs=(SMALL_LR,),
            seeds=(0, 1),
            best_lr_seeds=(),
            test_lengths=(1,),
            name=config.name + "_small",
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
            lrs=LRS[:1],
            best_lr_seeds=(),
            name="compare_lm_quick",
        )
    return config


def at_size(config: CompareConfig, size: dict, dtype: str = "bfloat16") -> CompareConfig:
    """``config`` at ``size`` (``GPU``'s keys), computing in ``dtype`` with float32
    parameters; the MLP width 4 D before the matching."""
    width = size["width"]
    train = dataclasses.replace(
        config.train,
        task=dataclasses.replace(config.train.task, seq_len=size["seq_len"]),
        model=ModelConfig(width=width, mlp_width=4 * width, dtype=dtype, param_dtype="float32"),
        batch_size=size["batch"],
    )
    return dataclasses.replace(
        config,
        train=train,
        num_layers=size["num_layers"],
        num_heads=size["num_heads"],
        window=size["window"],
        kv_rank=size["kv_rank"],
        rope_head_dim=size["rope_head_dim"],
        chunk_size=size["chunk_size"],
    )


def _gpu(config: CompareConfig) -> CompareConfig:
    """``config`` at the GPU scale (``GPU``)."""
    config = at_size(config, GPU)
    train = dataclasses.replace(
        config.train,
        steps=GPU_STEPS,
        eval_every=GPU_STEPS // 2,
        eval_batches=8,
        final_eval_batches=32,
        ckpt_every=GPU_STEPS,
        log_every=20,
    )
    return dataclasses.replace(
        config,
        train=train,
        variants=GPU_VARIANTS,
        lrs=GPU_LRS,
        best_lr_seeds=(),
        test_lengths=(1,),
        name=config.name + "_gpu",
    )
