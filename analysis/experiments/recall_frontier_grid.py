"""The recall frontier's grid: its families, scales and runs, and the dry run that counts them.

``FAMILIES`` (each family's knob and the model each knob value gives),
``SCALES`` (the grids), ``Run`` and ``train_config`` (one training run and its
config), ``sizes`` (a point's parameters and decode state) and ``dry_run``
(every config and model built and counted, FLOPs too, nothing trained).
``analysis.experiments.recall_frontier`` says what the experiment measures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from attn.checks import fail
from models import LAYOUTS, ModelConfig, layout, pattern, presets

# recall_frontier's NAME, defined here (below it) because the training's progress
# bar names the experiment too.
NAME = "recall_frontier"
HEAD_DIM = 16  # of the softmax and hybrid families, whose knob is the width


@dataclass(frozen=True)
class Family:
    """A family of the frontier: a label, its knob and the model each knob value gives.

    Attributes:
      label: the legend's name.
      knob: what the sweep changes, in words (the table's column).
      model: ``knob value -> ModelConfig`` (2 layers; vocabulary set by the task).
    """

    label: str
    knob: str
    model: Callable[[int], ModelConfig]


def _model(width: int, names: tuple[str, ...], **sizes) -> ModelConfig:
    """A decoder of ``width`` with layers ``names`` (``models.presets`` at ``sizes``).

    The MLP is a quarter of the width (recall lives in the mixers; the main
    job's width-64 models use 16).
    """
    sizes = {"num_heads": max(width // HEAD_DIM, 1), "head_dim": HEAD_DIM, **sizes}
    layers = pattern(names, presets(**sizes))
    return ModelConfig(width=width, mlp_width=max(width // 4, 8), layers=layers)


def _heads_of(width: int, names: tuple[str, ...]) -> Callable[[int], ModelConfig]:
    """``head dim -> model`` at a fixed width: width / H heads of dim H."""
    return lambda h: _model(width, names, num_heads=width // h, head_dim=h)


def _gated_deltanet(h: int) -> ModelConfig:
    """Gated DeltaNet of width 64 in heads of dim ``h``, in its fastest form at that dim.

    The forms compute the same function; what differs is the cost of a training
    step. The chunkwise form's triangular inverse costs C^2 per token and head
    against the recurrence's H x H, so chunks of 16 (not the default 64) suit
    these head dims, and at H = 8 the scan over tokens is faster still (the
    step times: ``docs/results/README.md``, trials behind defaults).
    """
    model = _heads_of(64, ("gated_deltanet",) * 2)(h)
    form = "recurrent" if h <= 8 else "chunkwise"
    layers = tuple(dataclasses.replace(c, form=form, chunk_size=16) for c in model.layers)
    return dataclasses.replace(model, layers=layers)


FAMILIES: dict[str, Family] = {
    "mha": Family("softmax MHA", "width", lambda d: _model(d, ("mha_conv",) * 2)),
    "gqa": Family(
        "softmax GQA (8 heads of 8)",
        "kv heads",
        lambda k: _model(64, ("gqa_conv",) * 2, num_heads=8, head_dim=8, gqa_kv_heads=k),
    ),
    "mla": Family(
        "MLA",
        "latent rank",
        lambda r: _model(64, ("mla_conv",) * 2, kv_rank=r, q_rank=None, rope_head_dim=4),
    ),
    "window": Family(
        "sliding window", "window", lambda w: _model(64, ("window_conv",) * 2, window=w)
    ),
    "linear": Family("linear (elu+1)", "head dim", _heads_of(64, ("linear_conv",) * 2)),
    "gla": Family("gated linear", "head dim", _heads_of(64, ("linear_gated_conv",) * 2)),
    "based": Family(
        "Based (Taylor)",
        "feature dim",
        lambda f: _model(64, ("based",) * 2, based_head_dim=f),
    ),
    "gated_deltanet": Family("Gated DeltaNet", "head dim", lambda h: _gated_deltanet(h)),
    # Mamba-2 at width 64 (4 heads of 16), its own convolution over x, B and C: the knob is
    # the SSD state dim H, so a layer's state is heads x head dim x H.
    "mamba2": Family("Mamba-2", "state dim", lambda h: _model(64, ("mamba2",) * 2, state_dim=h)),
    "hybrid": Family(
        "hybrid (softmax, then linear)", "width", lambda d: _model(d, ("mha_conv", "linear_conv"))
    ),
    # The 2025 families: RWKV-7 (its own token shift), PaTH (softmax over a full cache, its
    # transforms for positions), and the log-linear forms of Mamba-2 and Gated DeltaNet.
    "rwkv7": Family("RWKV-7", "head dim", _heads_of(64, ("rwkv7",) * 2)),
    "path": Family("PaTH", "width", lambda d: _model(d, ("path_conv",) * 2)),
    "log_linear_mamba2": Family(
        "log-linear Mamba-2",
        "state dim",
        lambda h: _model(64, ("log_linear_mamba2",) * 2, state_dim=h),
    ),
    "log_linear_gated_deltanet": Family(
        "log-linear Gated DeltaNet",
        "head dim",
        _heads_of(64, ("log_linear_gated_deltanet",) * 2),
    ),
    # The memories trained at test time (mini-batches of 16, their authors'): a layer's
    # state is its inner model's weights per head (TTT-MLP's and Titans' two layers of
    # hidden width 4 x head dim), MesaNet's the two gated sums per head.
    "ttt_linear": Family("TTT-Linear", "head dim", _heads_of(64, ("ttt_linear",) * 2)),
    "ttt_mlp": Family("TTT-MLP", "head dim", _heads_of(64, ("ttt_mlp",) * 2)),
    "titans": Family("Titans (MLP memory)", "head dim", _heads_of(64, ("titans",) * 2)),
    "mesanet": Family("MesaNet", "head dim", _heads_of(64, ("mesanet",) * 2)),
    # The production hybrids at two layers: each layout's linear layer, then its attention
    # layer (models.layouts; no short convolutions beyond their own, as released), width
    # in heads of 16 (GQA's 2 kv heads divide each).
    **{
        name: Family(f"{name} layout", "width", lambda d, name=name: _model(d, layout(name, 2)))
        for name in LAYOUTS
    },
}


@dataclass(frozen=True)
class Scale:
    """A grid of the experiment.

    Attributes:
      name: a key of ``SCALES``.
      settings: the MQAR (T, pairs) settings, one panel each.
      steps: the update cap of each setting's runs.
      max_steps: None, or per setting the most updates a run may take: a run that ends
        at its cap still learning (``recall_frontier_train.still_learning``) is extended,
        its cap doubled, up to this. The schedule's horizon is this, so an extended run
        equals an uninterrupted run of its final length.
      knobs: ``(family, knob values)`` pairs: the families and their sweeps.
      vocab_size: V of the task.
      lrs: the learning-rate sweep; each point reports its best.
      seeds: every (point, lr) trains once per seed.
      batch_size: examples per update.
      eval_every: updates between test evaluations (the early stop is checked there).
      eval_batches: test batches of ``batch_size`` per evaluation.
      target: stop a run once its test accuracy reaches this.
      min_pairs: training examples hold ``min_pairs`` to ``pairs`` pairs.
      dtype: the models' compute dtype (parameters, softmax statistics and states stay
        float32; state sizes are counted at float32 whatever it is).
    """

    name: str
    settings: tuple[tuple[int, int], ...]
    steps: tuple[int, ...]
    knobs: tuple[tuple[str, tuple[int, ...]], ...]
    vocab_size: int
    lrs: tuple[float, ...]
    seeds: tuple[int, ...] = (0,)
    batch_size: int = 64
    eval_every: int = 50
    eval_batches: int = 4
    target: float = 0.99
    min_pairs: int | None = 1
    dtype: str = "float32"
    max_steps: tuple[int, ...] | None = None

    def __post_init__(self):
        if len(self.steps) != len(self.settings):
            fail("steps", f"one cap per setting ({len(self.settings)})", repr(self.steps))
        most = self.max_steps
        if most is not None and (
            len(most) != len(self.steps)
            or any(m < s for m, s in zip(most, self.steps, strict=True))
        ):
            fail("max_steps", f"one per setting, each >= its steps {self.steps}", repr(most))
        unknown = [f for f, _ in self.knobs if f not in FAMILIES]
        if unknown:
            fail("knobs", f"families from {sorted(FAMILIES)}", repr(unknown))

    def cap(self, setting) -> int:
        """The first cap of ``setting``'s runs."""
        return self.steps[self.settings.index(tuple(setting))]

    def most(self, setting) -> int:
        """The most updates a run of ``setting`` may take (its cap without ``max_steps``)."""
        i = self.settings.index(tuple(setting))
        return self.steps[i] if self.max_steps is None else self.max_steps[i]

    def families(self) -> dict[str, tuple[int, ...]]:
        return dict(self.knobs)

    def only(self, names) -> Scale:
        """This grid restricted to the families ``names``."""
        unknown = [n for n in names if n not in self.families()]
        if unknown or not names:
            fail("only", f"family names from {sorted(self.families())}", repr(list(names)))
        return dataclasses.replace(self, knobs=tuple(k for k in self.knobs if k[0] in names))


SCALES: dict[str, Scale] = {
    # Every family at Zoology's two highest learning rates (at 3e-3 softmax stayed at chance
    # for 500 updates where 1e-2 reached 0.99), each run extended while it still learns
    # (500 updates, then 1,000, then 2,000): ``configs/recall_frontier.py``.
    "cpu": Scale(
        name="cpu",
        settings=((64, 4), (128, 8)),
        steps=(500, 500),
        max_steps=(2000, 2000),
        knobs=(
            ("mha", (16, 32, 48, 64)),
            ("gqa", (1, 2, 4, 8)),
            ("mla", (4, 8, 16, 32)),
            ("window", (4, 8, 16, 32)),
            ("linear", (8, 16, 32, 64)),
            ("gla", (8, 16, 32, 64)),
            ("based", (4, 8, 12, 16)),
            ("gated_deltanet", (8, 16, 32, 64)),
            ("hybrid", (16, 32, 48, 64)),
            ("mamba2", (8, 16, 32, 64)),
            ("rwkv7", (8, 16, 32, 64)),
            ("path", (16, 32, 48, 64)),
            ("log_linear_mamba2", (8, 16, 32, 64)),
            ("log_linear_gated_deltanet", (8, 16, 32, 64)),
            ("ttt_linear", (8, 16, 32, 64)),
            ("ttt_mlp", (8, 16, 32, 64)),
            ("titans", (8, 16, 32, 64)),
            ("mesanet", (8, 16, 32, 64)),
            *((name, (32, 64, 96, 128)) for name in LAYOUTS),
        ),
        vocab_size=64,
        lrs=(1e-2, float(10**-1.5)),
        batch_size=32,
    ),
    "zoology": Scale(
        name="zoology",
        settings=((64, 4), (128, 8), (256, 16), (512, 64)),
        steps=(12_500, 2_500, 2_500, 2_500),
        knobs=(
            ("mha", (64, 128, 256, 512)),
            ("gqa", (1, 2, 4, 8)),
            ("mla", (8, 16, 32, 64)),
            ("window", (8, 32, 128, 512)),
            ("linear", (8, 16, 32, 64)),
            ("gla", (8, 16, 32, 64)),
            ("based", (8, 16, 24, 32)),
            ("gated_deltanet", (8, 16, 32, 64)),
            ("hybrid", (64, 128, 256, 512)),
            ("mamba2", (16, 32, 64, 128)),
            ("rwkv7", (8, 16, 32, 64)),
            ("path", (64, 128, 256, 512)),
            ("log_linear_mamba2", (16, 32, 64, 128)),
            ("log_linear_gated_deltanet", (8, 16, 32, 64)),
            ("ttt_linear", (8, 16, 32, 64)),
            ("ttt_mlp", (8, 16, 32, 64)),
            ("titans", (8, 16, 32, 64)),
            ("mesanet", (8, 16, 32, 64)),
            *((name, (64, 128, 256, 512)) for name in LAYOUTS),
        ),
        vocab_size=8192,
        lrs=tuple(float(x) for x in np.logspace(-3, -1.5, 4)),
        batch_size=256,
        eval_every=250,
        eval_batches=4,
        min_pairs=None,
    ),
    # Zoology's task and training at the size one H200 does in 8 minutes (``--dry-run``
    # predicts it: ``train.budget.H200``): claim 15's families (softmax, linear, Based and
    # Gated DeltaNet) at 3 knob values each, at (T, pairs) = (128, 8) with Zoology's V and
    # batch, 2,000 updates (Zoology's 2,500 predicted 490 s; stopping at 0.99), its two
    # middle learning rates, bf16. Compiling is two thirds of the time: every point
    # compiles its own programs.
    "gpu": Scale(
        name="gpu",
        settings=((128, 8),),
        steps=(2000,),
        knobs=(
            ("mha", (64, 128, 256)),
            ("linear", (16, 32, 64)),
            ("based", (8, 16, 32)),
            ("gated_deltanet", (16, 32, 64)),
        ),
        vocab_size=8192,
        lrs=tuple(float(x) for x in np.logspace(-3, -1.5, 4)[1:3]),
        batch_size=256,
        eval_every=250,
        eval_batches=4,
        min_pairs=None,
        dtype="bfloat16",
    ),
    "quick": Scale(
        name="quick",
        settings=((16, 2),),
        steps=(6,),
        knobs=(("mha", (16,)), ("linear", (16,))),
        vocab_size=32,
        lrs=(3e-3,),
        batch_size=8,
        eval_every=3,
        eval_batches=1,
    ),
}


@dataclass(frozen=True)
class Run:
    """One training run: a point (setting, family, knob) at a learning rate and seed."""

    setting: tuple[int, int]
    family: str
    knob: int
    lr: float
    seed: int

    @property
    def point(self) -> tuple[tuple[int, int], str, int]:
        return self.setting, self.family, self.knob

    @property
    def name(self) -> str:
        T, pairs = self.setting
        return f"T{T}-pairs{pairs}/{self.family}-{self.knob}/lr{self.lr:.1e}-seed{self.seed}"


def setting_key(setting) -> str:
    T, pairs = setting
    return f"T={T}, {pairs} pairs"


def train_config(scale: Scale, run: Run, steps: int | None = None):
    """The ``TrainConfig`` of one run, to its first cap or to ``steps`` (an extension)."""
    from train.config import OptimConfig, TrainConfig
    from train.tasks import TaskConfig

    T, pairs = run.setting
    horizon = None if scale.max_steps is None else scale.most(run.setting)
    min_pairs = None if scale.min_pairs is None else min(scale.min_pairs, pairs)
    return TrainConfig(
        task=TaskConfig(
            name="mqar", seq_len=T, vocab_size=scale.vocab_size, num_pairs=pairs,
            min_pairs=min_pairs,
        ),
        model=dataclasses.replace(FAMILIES[run.family].model(run.knob), dtype=scale.dtype),
        optim=OptimConfig(lr=run.lr, warmup_fraction=0.02, decay_steps=horizon),
        steps=steps or scale.cap(run.setting),
        batch_size=scale.batch_size,
        eval_every=scale.eval_every,
        eval_batches=scale.eval_batches,
        ckpt_every=max(scale.eval_every, 200),
        log_every=scale.eval_every,
        target_accuracy=scale.target,
        seed=run.seed,
    ).with_task_vocab()  # fmt: skip


def runs(scale: Scale) -> list[Run]:
    """Every run of the grid, learning rate first: the first wave compiles each point's
    programs and the later ones (other rates and seeds) find them in the cache."""
    return [
        Run(setting, family, knob, lr, seed)
        for lr in scale.lrs
        for seed in scale.seeds
        for setting in scale.settings
        for family, knobs in scale.knobs
        for knob in knobs
    ]


def sizes(scale: Scale, point) -> dict[str, int]:
    """``dict(params, state_elements, state_bytes)`` of a point, from shapes only."""
    from train.variants import param_count, state_bytes

    setting, family, knob = point
    config = train_config(scale, Run(setting, family, knob, scale.lrs[0], scale.seeds[0]))
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="float32"))
    nbytes = state_bytes(config.model, setting[0])
    itemsize = np.dtype(config.model.dtype).itemsize
    return {
        "params": param_count(config.model),
        "state_elements": nbytes // itemsize,
        "state_bytes": nbytes,
    }


# ----------------------------------------------------------------------------
# Dry run: configs, models, parameters, state (and FLOPs) without training


def step_flops(scale: Scale, point) -> float:
    """XLA's FLOP count of one update's forward + backward at ``point`` (shapes only)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import train.steps

    setting, family, knob = point
    config = train_config(scale, Run(setting, family, knob, scale.lrs[0], scale.seeds[0]))
    model = nnx.eval_shape(lambda: train.steps.build_model(config, config.model.vocab_size))
    graphdef, params = nnx.split(model)
    B, T = scale.batch_size, setting[0]
    batch = {
        "tokens": jax.ShapeDtypeStruct((B, T), jnp.int32),
        "labels": jax.ShapeDtypeStruct((B, T), jnp.int32),
        "weights": jax.ShapeDtypeStruct((B, T), jnp.float32),
    }

    def loss(params, batch):
        logits = nnx.merge(graphdef, params)(batch["tokens"])
        return train.steps.weighted_metrics(logits, batch)[0]

    return float(jax.jit(jax.grad(loss)).lower(params, batch).cost_analysis()["flops"])


def predicted_seconds(scale: Scale, point, params: int, device=None) -> dict[str, float]:
    """A point's predicted time on a GPU (``train.budget.H200``): every run to its cap
    (its updates and evaluations), and its two programs' compiles (update, evaluation;
    its other rates and seeds reuse them)."""
    from train.budget import H200, model_flops

    device = device or H200
    setting, family, knob = point
    config = train_config(scale, Run(setting, family, knob, scale.lrs[0], scale.seeds[0]))
    flops = model_flops(config.model, params, setting[0], scale.batch_size)["flops"]
    steps = scale.most(setting)
    evals = -(-steps // scale.eval_every) * scale.eval_batches
    run_s = steps * device.step_seconds(flops) + evals * device.forward_seconds(flops)
    compile_s = 2 * device.compile_seconds(len(config.model.layers))
    return {"run_s": run_s, "compile_s": compile_s,
            "seconds": len(scale.lrs) * len(scale.seeds) * run_s + compile_s}  # fmt: skip


def dry_run(scale: Scale, *, flops: bool = False) -> dict[str, Any]:
    """Every run's config and every point's model, counted, and the grid's predicted time on
    a GPU (``predicted_seconds``); nothing trained."""
    grid = runs(scale)
    for r in grid:
        train_config(scale, r)  # every run's config builds (and checks itself)
    rows = []
    for point in dict.fromkeys(r.point for r in grid):
        row = {
            "setting": list(point[0]),
            "family": point[1],
            "knob": point[2],
            **sizes(scale, point),
        }
        row["gpu"] = predicted_seconds(scale, point, row["params"])
        if flops:
            steps = scale.most(point[0])
            row["flops_per_step"] = step_flops(scale, point)
            row["flops_per_run"] = row["flops_per_step"] * steps
        rows.append(row)
    total = None
    if flops:
        per_point_runs = len(scale.lrs) * len(scale.seeds)
        total = sum(r["flops_per_run"] for r in rows) * per_point_runs
    return {
        "scale": scale.name,
        "runs": len(grid),
        "points": rows,
        "total_flops": total,
        "gpu_seconds": sum(r["gpu"]["seconds"] for r in rows),
    }
