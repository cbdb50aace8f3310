"""The comparison's variants and their metadata: what ``train.compare`` trains and reports.

``VARIANTS`` names each variant's layer pattern; ``CompareConfig`` is one
comparison (a base run, the variants, the sweep, the seeds); the functions
here turn a (config, variant) into its layers, its ``TrainConfig`` and the
sizes the report shows (parameters, decode-state bytes, softmax layers), and
say which metric a task reports. ``train.compare`` runs the comparison and
``train.compare_report`` summarizes and draws it; both import this module.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np
from flax import nnx

from attn.checks import fail
from attn.registry import Registry
from models import KINDS, LAYOUTS, Decoder, ModelConfig, cache_bytes, pattern, presets
from train.config import TrainConfig

__all__ = [
    "MILESTONES",
    "TASKS",
    "VARIANTS",
    "CompareConfig",
    "Variant",
    "cache_sizes",
    "chance_accuracy",
    "matched_mlp_width",
    "metric",
    "param_count",
    "preset_sizes",
    "register_variant",
    "run_config",
    "softmax_layers",
    "state_bytes",
    "variant_layers",
    "variant_pattern",
]

# The accuracies whose first step the table reports.
MILESTONES = (0.5, 0.9)
# How far a variant's parameters may be from the reference's under ``match_params``.
MATCH_TOLERANCE = 0.02
# ``--task`` values: the config file's get_config(task=...) builds each.
TASKS = ("mqar", "induction", "selective_copy", "bytes")


@dataclass(frozen=True)
class Variant:
    """A comparison variant: a description and its layers' preset names for L layers.

    Attributes:
      description: a few words for the table.
      layers: ``layers(L) -> L preset names`` (``models.presets``' names, including
        the ``<preset>_conv`` twins).
    """

    description: str
    layers: Callable[[int], tuple[str, ...]]


VARIANTS: Registry[Variant] = Registry("comparison variant", "variants")


def register_variant(name: str, layers, *, description: str) -> Variant:
    """Adds a comparison variant; ``--variants NAME`` then trains it in ``train.compare``.

    Args:
      name: the variant's name.
      layers: one preset name (every layer) or ``layers(L) -> L preset names``.
      description: a few words for the table.

    Raises:
      ValueError: the name is taken by another variant (naming both), or
        ``layers`` is neither a preset name nor a callable.
    """
    if isinstance(layers, str):
        # Defined where register_variant was called: a clash names that module.
        defined_by = f"{sys._getframe(1).f_globals.get('__name__', '?')}.<variant {name}>"
        preset, layers = layers, lambda L: (preset,) * L
    elif callable(layers):
        defined_by = layers
    else:
        fail("layers", "a preset name or a callable L -> preset names", repr(layers))
    return VARIANTS.add(name, Variant(description, layers), defined_by=defined_by)


for _name, _description, _layers in (
    ("mha", "softmax, multi-head, RoPE", "mha"),
    ("alibi", "softmax, ALiBi biases instead of RoPE", "alibi"),
    ("fox", "softmax with a forget gate (FoX), no RoPE", "fox"),
    ("gqa", "softmax, grouped-query", "gqa"),
    ("mqa", "softmax, multi-query", "mqa"),
    ("mla", "multi-head latent", "mla"),
    ("window", "sliding window", "window"),
    ("streaming", "sliding window + initial tokens", "streaming"),
    ("local_global", "windows + one global layer", lambda L: ("window",) * (L - 1) + ("mha",)),
    ("linear", "linear, elu+1", "linear"),
    ("linear_decay", "linear, RetNet decay", "linear_decay"),
    ("linear_gated", "linear, data-dependent gates", "linear_gated"),
    # Softmax first: its short conv hands each value token its key, so that one
    # layer does the lookup on the token embeddings (docs/results/README.md has
    # the trial that compared the other order).
    (
        "hybrid",
        "softmax in the first layer, then linear; short convs",
        lambda L: ("mha_conv",) + ("linear_conv",) * (L - 1),
    ),
    (
        "based",
        "Taylor linear, window in the last layer, short convs",
        lambda L: ("based",) * (L - 1) + ("based_window",),
    ),
    ("deltanet", "the delta rule (DeltaNet), q/k/v short convs", "deltanet"),
    ("gated_deltanet", "the delta rule with a decay per head", "gated_deltanet"),
    ("kda", "the delta rule with a decay per key channel (KDA)", "kda"),
    ("mamba2", "Mamba-2 (SSD, its own conv over x, B, C)", "mamba2"),
    # The hybrid in the sense of Mamba-2's paper and its successors: Mamba layers
    # with a few attention layers among them (here the last).
    (
        "mamba2_hybrid",
        "Mamba-2 layers, softmax in the last",
        lambda L: ("mamba2",) * (L - 1) + ("mha",),
    ),
    (
        "gated_deltaproduct",
        "two delta-rule steps per token, beta in (0, 2)",
        "gated_deltaproduct",
    ),
    ("moba", "block-sparse softmax, top-k key blocks per query (MoBA)", "moba"),
    ("nsa", "compressed, selected and window branches (NSA)", "nsa"),
    ("rwkv7", "RWKV-7: the DPLR delta rule, token shift, LoRA decay", "rwkv7"),
    ("comba", "Comba: the delta rule with closed-loop control (a feedback key)", "comba"),
    ("path", "softmax positioned by Householder-like transforms (PaTH), no RoPE", "path"),
    ("path_fox", "PaTH with a forget gate (PaTH-FoX)", "path_fox"),
    (
        "log_linear_mamba2",
        "Mamba-2 with a Fenwick tree of states (log-linear)",
        "log_linear_mamba2",
    ),
    (
        "log_linear_gated_deltanet",
        "Gated DeltaNet with a Fenwick tree of states (log-linear)",
        "log_linear_gated_deltanet",
    ),
    ("ttt_linear", "TTT-Linear: a linear model trained on the sequence", "ttt_linear"),
    ("ttt_mlp", "TTT-MLP: a two-layer MLP trained on the sequence", "ttt_mlp"),
    ("titans", "Titans: an MLP memory trained with momentum and weight decay", "titans"),
    ("mesanet", "MesaNet: the in-context least-squares read (30 CG steps)", "mesanet"),
):
    register_variant(_name, _layers, description=_description)

# Gated attention, the production hybrids (models.layouts) and lightning attention, their
# one new part.
register_variant("gated_mha", "gated_mha", description="softmax MHA, its output gated per channel")
register_variant("lightning", "lightning", description="MiniMax-01's lightning attention")
for _name, _layout in LAYOUTS.items():
    register_variant(_name, _layout.layers, description=_layout.description)


@dataclass(frozen=True)
class CompareConfig:
    """A comparison: one base run, the variants, the learning-rate sweep, the seeds.

    Attributes:
      train: the shared task, model width, budget and bookkeeping. Its
        ``model.layers`` is replaced per variant; its ``optim.lr`` by the sweep.
      variants: names from ``VARIANTS``: mha, alibi, fox, gqa, mqa, mla, window,
        streaming, local_global, linear, linear_decay, linear_gated, hybrid, based,
        deltanet, gated_deltanet, kda, mamba2, mamba2_hybrid, gated_deltaproduct, moba,
        nsa, rwkv7, comba, path, path_fox, the log-linear two, the memories (ttt_linear,
        ttt_mlp, titans, mesanet), gated_mha, lightning, the production hybrids of
        ``models.LAYOUTS`` (qwen3_next, kimi_linear, nemotron_h, minimax01), and any
        added with ``register_variant``.
      lrs: the learning-rate sweep; the best per variant is reported.
      edge_lrs: up to this many more rates per variant, beyond the sweep's edge: while
        a variant's best rate (on ``seeds``) is its highest or lowest, the next one
        out (``edge_ratio`` times it, or divided by it; 2 significant digits)
        trains on ``seeds``. Needs 2 or more ``lrs``.
      edge_ratio: the step beyond the edge; None: the sweep's geometric ratio
        (``lrs``' largest over smallest, to the ``1 / (len(lrs) - 1)``).
      seeds: every (variant, lr) trains once per seed; accuracies are averaged.
      best_lr_seeds: seeds trained after the sweep, at each variant's best learning
        rate only (picked on ``seeds``); the variant's numbers are then over
        ``seeds + best_lr_seeds`` at that rate. E.g. ``seeds=(0,)``,
        ``best_lr_seeds=(1,)``: the sweep on seed 0, a second seed at its best rate.
      num_layers: L, layers of every variant.
      num_heads: N query heads; head dim is ``width / N``.
      gqa_kv_heads: K for ``gqa``.
      window: sliding-window length (itself included) for window variants.
      num_initial_tokens: the always-visible first positions of ``streaming``.
      kv_rank: MLA latent rank R.
      q_rank: MLA query latent rank (None: direct query projection).
      rope_head_dim: MLA decoupled RoPE key width.
      chunk_size: C of the chunkwise linear attention.
      test_lengths: multiples of the training length at which each run's final model
        is also tested (``train.lengths``; e.g. ``(1, 2, 4, 8)``: train short, test
        long); () for none.
      match_params: a variant name, or None. Each variant's SwiGLU width is then the
        one that brings its parameters nearest the named variant's at
        ``train.model.mlp_width`` (within 2%, or the config raises): the MLP absorbs
        what the attention layers add or save, so that variants compare at equal size
        with the same depth and width. None: every variant at ``train.model.mlp_width``.
      name: results go to ``results_dir/name`` and runs to ``runs_dir/name``.
        The test metric, the step cap and the early stop are the train config's:
        ``train.steps`` caps every run and ``train.target_accuracy`` (checked at
        each evaluation) stops it once reached.
      results_dir: where tables and plots go.
      runs_dir: where the runs' checkpoints and metrics go.
      fresh: delete this comparison's runs first instead of resuming them.
      progress: show progress (a bar per run, or with ``jobs > 1`` one over the runs).
      jobs: runs trained at once, each in its own process pinned to one core
        (1: one after another in this process, XLA using every core).
    """

    train: TrainConfig = field(default_factory=TrainConfig)
    variants: tuple[str, ...] = ("mha", "linear")
    lrs: tuple[float, ...] = (1e-3,)
    edge_lrs: int = 0
    edge_ratio: float | None = None
    seeds: tuple[int, ...] = (0,)
    best_lr_seeds: tuple[int, ...] = ()
    num_layers: int = 2
    num_heads: int = 4
    gqa_kv_heads: int = 2
    window: int = 16
    num_initial_tokens: int = 4
    kv_rank: int = 16
    q_rank: int | None = None
    rope_head_dim: int = 4
    chunk_size: int = 32
    test_lengths: tuple[int, ...] = ()
    match_params: str | None = None
    name: str = "compare"
    results_dir: str = "results"
    runs_dir: str = "runs"
    fresh: bool = False
    progress: bool = True
    jobs: int = 2

    def __post_init__(self):
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or not self.variants:
            raise ValueError(
                f"variants: expected names from {sorted(VARIANTS)} (a plugin's with "
                f"--plugin MODULE), got {unknown}"
            )
        if len(set(self.variants)) != len(self.variants):
            raise ValueError(f"variants: expected distinct names, got {self.variants}")
        if not self.lrs or any(not lr > 0 for lr in self.lrs):
            raise ValueError(f"lrs: expected positive learning rates, got {self.lrs}")
        if self.edge_lrs < 0 or (self.edge_lrs and len(set(self.lrs)) < 2):
            raise ValueError(
                f"edge_lrs: expected 0, or an int >= 1 with 2 or more distinct lrs "
                f"(got lrs={self.lrs}), got {self.edge_lrs}"
            )
        if self.edge_ratio is not None and not self.edge_ratio > 1:
            raise ValueError(f"edge_ratio: expected None or a float > 1, got {self.edge_ratio}")
        if not self.seeds:
            raise ValueError(f"seeds: expected at least one seed, got {self.seeds}")
        every = self.seeds + self.best_lr_seeds
        if len(set(every)) != len(every):
            raise ValueError(
                f"best_lr_seeds: expected seeds not in seeds={self.seeds} nor repeated, "
                f"got {self.best_lr_seeds}"
            )
        if self.jobs < 1:
            raise ValueError(f"jobs: expected an int >= 1, got {self.jobs}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers: expected an int >= 1, got {self.num_layers}")
        width = self.train.model.width
        if self.num_heads < 1 or width % self.num_heads:
            raise ValueError(
                f"num_heads: expected a divisor of model.width={width}, got {self.num_heads}"
            )
        if self.gqa_kv_heads < 1 or self.num_heads % self.gqa_kv_heads:
            raise ValueError(
                f"gqa_kv_heads: expected a divisor of num_heads={self.num_heads}, "
                f"got {self.gqa_kv_heads}"
            )
        if not self.name or "/" in self.name:
            raise ValueError(f"name: expected a folder name, got {self.name!r}")
        if any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in self.test_lengths):
            raise ValueError(
                f"test_lengths: expected ints >= 1 (multiples of task.seq_len), "
                f"got {self.test_lengths}"
            )
        if self.match_params is not None and self.match_params not in VARIANTS:
            raise ValueError(
                f"match_params: expected None or a name from {sorted(VARIANTS)}, "
                f"got {self.match_params!r}"
            )
        for variant in self.variants:  # a variant that cannot be matched fails here, not later
            matched_mlp_width(self, variant)


def preset_sizes(config: CompareConfig) -> dict:
    """The ``models.PresetSizes`` fields every variant's presets are built with."""
    return dict(
        num_heads=config.num_heads,
        head_dim=config.train.model.width // config.num_heads,
        gqa_kv_heads=config.gqa_kv_heads,
        window=config.window,
        num_initial_tokens=config.num_initial_tokens,
        kv_rank=config.kv_rank,
        q_rank=config.q_rank,
        rope_head_dim=config.rope_head_dim,
        chunk_size=config.chunk_size,
    )


def variant_pattern(config: CompareConfig, variant: str) -> tuple[str, ...]:
    """The preset names of one variant's layers."""
    names = tuple(VARIANTS.lookup(variant).layers(config.num_layers))
    if len(names) != config.num_layers:
        fail(
            f"variants[{variant!r}]",
            f"a pattern of num_layers={config.num_layers} preset names",
            repr(names),
        )
    return names


def variant_layers(config: CompareConfig, variant: str):
    """The ``ModelConfig.layers`` of one variant under the comparison's shared sizes."""
    return pattern(variant_pattern(config, variant), presets(**preset_sizes(config)))


def matched_mlp_width(config: CompareConfig, variant: str) -> int:
    """The variant's SwiGLU width: ``train.model.mlp_width`` (its default 4 D), or under
    ``match_params`` the width whose parameter count is nearest the reference's.

    Parameters are affine in the MLP width (``3 D`` per unit and layer: up, gate and
    down, bias-free), so one count gives the width (rounded to the nearest
    integer) and the count at it.

    Raises:
      ValueError: naming ``match_params``, when no positive width comes within 2%.
    """
    base = config.train.model
    if config.match_params is None:
        return base.hidden_width
    vocab = config.train.task.vocab

    def count(name: str, mlp: int) -> int:
        model = dataclasses.replace(
            base, layers=variant_layers(config, name), mlp_width=mlp, vocab_size=vocab
        )
        return param_count(model)

    target = count(config.match_params, base.hidden_width)
    at_base = count(variant, base.hidden_width)
    per_unit = 3 * base.width * config.num_layers
    width = max(1, base.hidden_width + round((target - at_base) / per_unit))
    got = at_base + per_unit * (width - base.hidden_width)
    if abs(got - target) > MATCH_TOLERANCE * target:
        fail(
            "match_params",
            f"a variant whose parameters {variant!r} can match within "
            f"{MATCH_TOLERANCE:.0%} by its MLP width",
            f"{config.match_params!r} with {target:,}; {variant!r} has {got:,} "
            f"at MLP width {width}",
        )
    return width


def run_config(config: CompareConfig, variant: str, lr: float, seed: int) -> TrainConfig:
    """The ``TrainConfig`` of one run of the comparison."""
    base = config.train
    model = dataclasses.replace(base.model, layers=variant_layers(config, variant))
    if config.match_params is not None:
        model = dataclasses.replace(model, mlp_width=matched_mlp_width(config, variant))
    return dataclasses.replace(
        base,
        model=model,
        optim=dataclasses.replace(base.optim, lr=lr),
        seed=seed,
    )


@functools.lru_cache(maxsize=512)
def _abstract_model(model_config: ModelConfig) -> Decoder:
    """The model with shapes instead of arrays: sizes without initializing anything.

    Cached by config (frozen, hashable): tracing the model's construction is what a
    size costs, and a grid asks ``param_count`` and ``cache_sizes`` of each config."""
    return nnx.eval_shape(lambda: Decoder(model_config, rngs=nnx.Rngs(0)))


def param_count(model_config: ModelConfig) -> int:
    """Trainable parameters of a ``Decoder`` with this config."""
    state = nnx.state(_abstract_model(model_config), nnx.Param)
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))


def cache_sizes(model_config: ModelConfig) -> tuple[float, int]:
    """Decode-cache bytes of one sequence: ``(per token, fixed)``.

    Measured on the model's own ``init_cache`` (shapes only, nothing allocated)
    at two lengths past any window: full caches grow by ``per token`` bytes,
    ring buffers, linear states and short-convolution states stay at ``fixed`` bytes.
    """
    model = _abstract_model(model_config)
    short, long = 1 << 16, 1 << 17  # longer than any window in a comparison
    size = {
        n: cache_bytes(jax.eval_shape(lambda n=n: model.init_cache(1, n))) for n in (short, long)
    }
    per_token = (size[long] - size[short]) / (long - short)
    return per_token, int(size[short] - per_token * short)


def state_bytes(model_config: ModelConfig, seq_len: int) -> int:
    """Decode-state bytes of one sequence of ``seq_len`` tokens (full caches at that length)."""
    per_token, fixed = cache_sizes(model_config)
    return round(per_token * seq_len) + fixed


def softmax_layers(config: CompareConfig, variant: str) -> list[int]:
    """1-based indices of the variant's layers of the softmax family (MLA and windows too)."""
    layers = variant_layers(config, variant)
    return [i + 1 for i, c in enumerate(layers) if KINDS[c.kind].family == "softmax"]


def chance_accuracy(task) -> float | None:
    """Test accuracy of a model that knows the task's format but recalls nothing, or None.

    On MQAR every answer is one of the ``num_pairs`` values in its sequence, so
    picking one of them at random scores ``1 / num_pairs``: a fixed-state model
    that reaches only that has learned the format, not the associations.
    """
    return 1.0 / task.num_pairs if task.name == "mqar" else None


def metric(task) -> str:
    """The table's headline metric: bits per byte on ``bytes``, accuracy elsewhere."""
    return "bits_per_byte" if task.name == "bytes" else "accuracy"
