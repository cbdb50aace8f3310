"""The main job: ``python -m train.compare --quick`` end to end on a tiny override, and the
seed statistics, table and plot on hand-made numbers (``--task bytes``: test_compare_lm.py)."""

import dataclasses
import json
import multiprocessing
import os
import signal
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn import linear_state_bytes
from models import Decoder
from train import compare
from train import pool as pool_lib
from train.compare_plots import plot_recall_vs_state
from train.compare_report import aggregate, first_reached, summarize_variant
from train.config import TrainConfig
from train.variants import VARIANTS, CompareConfig, cache_sizes, register_variant, variant_layers

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_compare_quick_end_to_end(tmp_path, compilation_cache_dir):
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "JAX_COMPILATION_CACHE_DIR": compilation_cache_dir,
    }
    cmd = [
        sys.executable,
        "-m",
        "train.compare",
        "--quick",
        "--variants", "mha", "hybrid",
        "--lrs", "3e-3",
        "--seeds", "0", "1",
        "--train.steps", "12",
        "--train.eval-every", "4",
        "--train.batch-size", "8",
        "--train.task.seq-len", "16",
        "--train.task.num-pairs", "2",
        "--train.model.width", "16",
        "--num-heads", "2",
        "--gqa-kv-heads", "1",
        "--window", "4",
        "--name", "tiny",
        "--results-dir", str(tmp_path / "results"),
        "--runs-dir", str(tmp_path / "runs"),
        "--no-progress",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    folder = tmp_path / "results" / "tiny"
    table = (folder / "table.md").read_text()
    assert table in out.stdout  # printed at the end
    header = (
        "| variant | layers | softmax layers | params | state bytes/seq | final test accuracy "
        "| step to 0.5 | step to 0.9 | steps run | best lr |"
    )
    assert header in table
    rows = [line for line in table.splitlines() if line.startswith(("| mha", "| hybrid"))]
    assert len(rows) == 2
    assert rows[1].startswith(
        "| hybrid (softmax in the first layer, then linear; short convs) "
        "| mha_conv+linear_conv | layer 1 of 2 |"
    )
    assert "| mha (softmax, multi-head, RoPE) | mha+mha | layers 1, 2 of 2 |" in rows[0]

    results = json.loads((folder / "results.json").read_text())
    assert set(results["variants"]) == {"mha", "hybrid"} and results["metric"] == "accuracy"
    # The layers each variant trained, not the base config's placeholders.
    assert results["config"]["train"]["model"]["layers"].startswith("per variant")
    hybrid_layers = results["variants"]["hybrid"]["model"]["layers"]
    assert [(x["kind"], x["head_dim"], x["short_conv"]) for x in hybrid_layers] == [
        ("softmax", 8, 4),
        ("linear", 8, 4),
    ]
    assert hybrid_layers[1]["chunk_size"] == 24  # the comparison's, not the default 64
    assert "bits_per_byte" not in results["variants"]["mha"]  # MQAR reports accuracy
    assert len(results["runs"]) == 4  # 2 variants x 1 learning rate x 2 seeds
    for name, v in results["variants"].items():
        runs = sorted((r for r in results["runs"] if r["variant"] == name), key=lambda r: r["seed"])
        accs = [r["summary"]["test_accuracy"] for r in runs]
        assert v["accuracy"] == {
            "mean": pytest.approx(np.mean(accs)),
            "min": min(accs),
            "max": max(accs),
            "seeds": accs,
            "count": 2,
        }
        assert v["steps_run"]["seeds"] == [r["summary"]["step"] for r in runs]
        assert v["params"] > 0 and v["tokens_per_s"] > 0 and v["wall_s"] > 0
    # Full softmax caches grow per token; the hybrid's linear layer adds a fixed state.
    # K and V x 2 layers x 2 kv heads x head dim 8 x 4 bytes, per token of the 16.
    mha = results["variants"]["mha"]
    assert mha["cache_bytes_per_token"] == 2 * 2 * 2 * 8 * 4 and mha["cache_bytes_fixed"] == 0
    assert mha["state_bytes"] == 16 * mha["cache_bytes_per_token"]
    assert results["variants"]["hybrid"]["cache_bytes_fixed"] > 0
    num_pairs = results["config"]["train"]["task"]["num_pairs"]
    assert results["chance_accuracy"] == 1 / num_pairs  # MQAR: a random value of the sequence
    assert f"Chance is {1 / num_pairs:.3f}" in table
    for png in ("recall_vs_state.png", "curves.png"):
        assert (folder / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_seed_aggregation_on_hand_made_numbers():
    assert aggregate([0.5, 1.0, 0.75]) == {
        "mean": 0.75, "min": 0.5, "max": 1.0, "seeds": [0.5, 1.0, 0.75], "count": 3
    }  # fmt: skip
    # A milestone two seeds of three reached: the statistics are over those two.
    assert aggregate([300, None, 100]) == {
        "mean": 200.0, "min": 100.0, "max": 300.0, "seeds": [300.0, None, 100.0], "count": 2
    }  # fmt: skip
    assert aggregate([None, None])["mean"] is None
    assert first_reached([25, 50, 75, 100], [0.2, 0.6, 0.95, 0.9], 0.9) == 75
    assert first_reached([25, 50], [0.2, 0.6], 0.9) is None


def _hand_made_run(variant, lr, seed, accs, *, step, reached=False, diverged_at=None):
    steps = [10 * (i + 1) for i in range(len(accs))]
    return {
        "variant": variant,
        "lr": lr,
        "seed": seed,
        "diverged_at": diverged_at,
        "summary": {
            "step": step,
            "test_accuracy": accs[-1],
            "test_loss": 1.0 - accs[-1],
            "target_reached": reached,
            "tokens_per_s": 100.0,
            "wall_s": 2.0,
        },
        "curves": {
            "train_step": steps,
            "train_loss": [2.0 - a for a in accs],
            "eval_step": steps,
            "test_accuracy": accs,
            "test_loss": [1.0 - a for a in accs],
        },
    }


def test_summarize_variant_takes_the_best_lr_over_seeds():
    config = CompareConfig(variants=("mha",), lrs=(1e-3, 1e-2), seeds=(0, 1), num_heads=4)
    per_lr = {
        1e-3: [
            _hand_made_run("mha", 1e-3, 0, [0.2, 0.4], step=20),
            _hand_made_run("mha", 1e-3, 1, [0.3, 0.5], step=20),
        ],
        1e-2: [
            _hand_made_run("mha", 1e-2, 0, [0.6, 0.95, 1.0], step=30, reached=True),
            _hand_made_run("mha", 1e-2, 1, [0.3, 0.8], step=20),
        ],
    }
    v = summarize_variant(config, "mha", per_lr)
    assert v["lr"] == 1e-2 and v["metric_per_lr"] == {"0.001": 0.45, "0.01": 0.9}
    assert v["accuracy"] == {"mean": 0.9, "min": 0.8, "max": 1.0, "seeds": [1.0, 0.8], "count": 2}
    assert v["step_to_0.5"]["seeds"] == [10, 20] and v["step_to_0.5"]["mean"] == 15
    assert v["step_to_0.9"]["seeds"] == [20, None] and v["step_to_0.9"]["count"] == 1
    assert v["steps_run"]["seeds"] == [30, 20] and v["target_reached"] == 1
    assert v["softmax_layers"] == [1, 2] and v["diverged"] == 0
    # A diverged seed scores 0 for its learning rate and has no steps to any milestone.
    per_lr[1e-2][1] = _hand_made_run("mha", 1e-2, 1, [0.3], step=10, diverged_at=12)
    v = summarize_variant(config, "mha", per_lr)
    assert v["lr"] == 1e-2 and v["accuracy"]["seeds"] == [1.0, 0.0] and v["diverged"] == 1
    assert v["steps_run"]["seeds"] == [30, 12]


def test_the_sweep_widens_where_a_best_rate_is_at_its_edge(tmp_path, monkeypatch):
    """``edge_lrs``: each variant whose best rate is the highest (or lowest) tried trains the
    next one out on the sweep's seeds, up to ``edge_lrs`` times; then ``best_lr_seeds``."""
    peak = {"mha": 1e-1, "linear": 2e-3}  # accuracy peaks at this rate (hand-made)

    def fake_train_one(config, variant, lr, seed, desc, bar):
        acc = 1.0 / (1.0 + abs(np.log(lr / peak[variant])))
        return _hand_made_run(variant, lr, seed, [acc], step=10)

    monkeypatch.setattr(compare, "_train_one", fake_train_one)
    config = CompareConfig(
        variants=("mha", "linear"), lrs=(3e-3, 1e-2), edge_lrs=2, edge_ratio=3.0,
        seeds=(0,), best_lr_seeds=(1,), num_heads=4, jobs=1, progress=False,
        results_dir=str(tmp_path / "results"), runs_dir=str(tmp_path / "runs"),
    )  # fmt: skip
    runs = compare.run_comparison(config)["runs"]
    tried = [(r["variant"], r["lr"], r["seed"]) for r in runs]
    assert tried == [
        ("mha", 3e-3, 0), ("linear", 3e-3, 0), ("mha", 1e-2, 0), ("linear", 1e-2, 0),
        ("mha", 3e-2, 0), ("linear", 1e-3, 0),  # both at an edge: one step out each
        ("mha", 9e-2, 0),  # mha still at its edge; linear's best (3e-3) now inside
        ("mha", 9e-2, 1), ("linear", 3e-3, 1),  # the second seed at each best rate
    ]  # fmt: skip
    # Without a ratio the step is the sweep's own (geometric), to 2 significant digits.
    config = dataclasses.replace(config, edge_lrs=1, edge_ratio=None, lrs=(1e-3, 1e-2, 1e-1))
    two = [_hand_made_run("mha", lr, 0, [acc], step=1) for lr, acc in ((1e-1, 0.9), (1e-2, 0.5))]
    assert compare._beyond_edge(config, "mha", two) == 1.0
    with pytest.raises(ValueError, match=r"^edge_lrs: expected 0, or an int >= 1 with 2 or more"):
        dataclasses.replace(config, lrs=(1e-3,))
    with pytest.raises(ValueError, match=r"^edge_ratio: expected None or a float > 1"):
        dataclasses.replace(config, edge_ratio=0.5)


def test_recall_vs_state_plot_writes_a_png(tmp_path):
    results = {
        "config": {"name": "hand_made"},
        "metric": "accuracy",
        "chance_accuracy": 0.25,
        "variants": {
            "mha": {"state_bytes": 24576, "accuracy": aggregate([1.0, 0.98])},
            "linear": {"state_bytes": 8704, "accuracy": aggregate([0.3, 0.26])},
            "window": {"state_bytes": 0, "accuracy": aggregate([0.25, None])},
        },
    }
    path = plot_recall_vs_state(results, tmp_path / "recall.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_variants_and_cache_sizes():
    config = CompareConfig(train=TrainConfig(), variants=tuple(VARIANTS), num_heads=4, window=16)
    for name in VARIANTS:
        assert len(variant_layers(config, name)) == config.num_layers
    kinds = {n: (c.kind, c.score, c.rope) for n in ("mha", "alibi", "fox", "moba", "nsa")
             for c in variant_layers(config, n)[:1]}  # fmt: skip
    assert kinds == {"mha": ("softmax", None, True), "alibi": ("softmax", "alibi", False),
                     "fox": ("softmax", "forgetting", False), "moba": ("moba", None, True),
                     "nsa": ("nsa", None, True)}  # fmt: skip
    hybrid = variant_layers(config, "hybrid")
    assert [(a.kind, a.short_conv) for a in hybrid] == [("softmax", 4), ("linear", 4)]
    based, window = variant_layers(config, "based")
    assert (based.kind, based.feature_map, based.short_conv) == ("linear", "taylor", 4)
    assert (window.kind, window.window, window.short_conv) == ("softmax", 16, 4)
    width, heads = config.train.model.width, 4
    # K and V x 2 layers x kv heads x head dim x 4 bytes, per token.
    assert cache_sizes(_model(config, "mha")) == (2 * 2 * heads * (width // heads) * 4, 0)
    per_token, fixed = cache_sizes(_model(config, "streaming"))
    assert per_token == 0 and fixed == 2 * 2 * heads * (width // heads) * 4 * (16 + 4)
    per_token, fixed = cache_sizes(_model(config, "linear"))
    assert per_token == 0 and fixed > 0
    # Based: a Taylor state (F = 1 + H + H^2), a ring of 16, and each conv's last 3 inputs.
    H = based.head_dim
    state = linear_state_bytes(
        num_layers=1, num_heads=heads, feature_dim=1 + H + H * H, value_dim=H
    )
    ring = 2 * heads * (width // heads) * 4 * 16
    assert cache_sizes(_model(config, "based")) == (0, state + ring + 2 * 3 * width * 4)


def test_based_variant_builds_and_takes_a_gradient_step():
    """Based trains: finite loss and gradients reaching every parameter, short convs included.

    In process at -O0: as a third variant of the end-to-end run above it cost ~15 s.
    """
    config = CompareConfig(train=TrainConfig(), variants=("based",), num_heads=2, window=4)
    model = Decoder(_model(config, "based"), rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    seq = jnp.asarray(np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 12)))

    def loss(params):
        logits = nnx.merge(graphdef, params, rest)(seq[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, seq[:, 1:, None], -1))

    fast = {"xla_backend_optimization_level": 0}  # compiling dominates; -O0 keeps IEEE math
    value, grads = jax.jit(jax.value_and_grad(loss), compiler_options=fast)(params)
    assert np.isfinite(float(value))
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert np.isfinite(g).all() and np.abs(g).sum() > 0, path
    assert [b.conv.weight.shape for b in model.blocks] == [(4, model.config.width)] * 2


def _model(config, variant):
    return dataclasses.replace(config.train.model, layers=variant_layers(config, variant))


def test_parameters_are_matched_by_the_mlp_width():
    """``match_params``: each variant's SwiGLU width brings it within 2% of the reference."""
    from models import ModelConfig
    from train.variants import matched_mlp_width, param_count, run_config

    names = ("mha", "gqa", "mla", "linear", "gated_deltanet", "mamba2")
    train = TrainConfig(model=ModelConfig(width=32, mlp_width=64))
    config = CompareConfig(train=train, variants=names, num_heads=2, gqa_kv_heads=1,
                           kv_rank=8, match_params="mha")  # fmt: skip

    def params(variant):
        model = run_config(config, variant, 1e-3, 0).model
        return param_count(dataclasses.replace(model, vocab_size=train.task.vocab))

    target = params("mha")
    assert matched_mlp_width(config, "mha") == 64
    for name in names:
        assert abs(params(name) - target) <= 0.02 * target, name
    # The delta rule's projections and convolutions cost more than MHA's: a narrower MLP.
    assert matched_mlp_width(config, "gated_deltanet") < 64 < matched_mlp_width(config, "gqa")
    unmatched = dataclasses.replace(config, match_params=None)
    assert run_config(unmatched, "gated_deltanet", 1e-3, 0).model.mlp_width == 64


def test_bad_compare_configs_name_the_field():
    with pytest.raises(ValueError, match="variants"):
        CompareConfig(variants=("mha", "nope"))
    with pytest.raises(ValueError, match="num_heads"):
        CompareConfig(num_heads=5)
    with pytest.raises(ValueError, match="gqa_kv_heads"):
        CompareConfig(num_heads=4, gqa_kv_heads=3)
    with pytest.raises(ValueError, match=r"^best_lr_seeds: expected seeds not in"):
        CompareConfig(seeds=(0, 1), best_lr_seeds=(1,))
    with pytest.raises(ValueError, match=r"^test_lengths: expected ints >= 1"):
        CompareConfig(test_lengths=(1, 0))
    from train.lengths import at_length

    with pytest.raises(ValueError, match=r"^multiple: expected an int >= 1, got 1.5"):
        at_length(TrainConfig(), 1.5)
    with pytest.raises(ValueError, match=r"^match_params: expected None or a name"):
        CompareConfig(match_params="nope")
    # An MLP of width 1 cannot give back what the delta rule's projections add.
    from models import ModelConfig

    narrow = TrainConfig(model=ModelConfig(width=32, mlp_width=1))
    with pytest.raises(ValueError, match=r"^match_params: .*'gated_deltanet' has"):
        CompareConfig(train=narrow, variants=("mha", "gated_deltanet"), match_params="mha")


def test_report_names_layers_and_keeps_labels_apart():
    from train.compare_plots import curves_figure, recall_vs_state_figure
    from train.compare_report import which_layers

    assert which_layers([2], 2) == "layer 2 of 2"
    assert which_layers([1, 2], 2) == "layers 1, 2 of 2"
    assert which_layers([], 3) == "none of 3"
    # The committed comparison: linear and linear_decay sit on one spot, based at the right.
    results = json.loads((REPO / "docs/results/compare_mqar/results.json").read_text())
    fig, ax, labels = recall_vs_state_figure(results)
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    boxes = [label.get_window_extent(renderer) for label in labels]
    assert sorted(t.get_text() for t in labels) == sorted(results["variants"])
    for i, box in enumerate(boxes):
        assert frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1), labels[i]
        assert not any(box.overlaps(other) for other in boxes[i + 1 :]), labels[i]
    ticks = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
    assert len(ticks) >= 2
    assert not any(a.overlaps(b) for i, a in enumerate(ticks) for b in ticks[i + 1 :])
    one_seed = {**results, "config": {**results["config"], "seeds": [0]}}
    assert "dashed" not in curves_figure(one_seed)._suptitle.get_text()
    assert "dashed" in curves_figure(results)._suptitle.get_text()


def test_registered_variant_is_compared_and_reported(scratch_variant):
    config = CompareConfig(variants=("test_window_global",), num_heads=4, window=16)
    assert variant_layers(config, "test_window_global")[1].window is None
    from train.variants import softmax_layers

    assert softmax_layers(config, "test_window_global") == [1, 2]
    # Attention functions other than softmax are never counted as softmax layers.
    register_variant("test_sigmoid", lambda L: ("sigmoid", "mha", "softpick")[:L], description="x")
    try:
        assert softmax_layers(dataclasses.replace(config, num_layers=3), "test_sigmoid") == [2]
    finally:
        VARIANTS.remove("test_sigmoid")
    with pytest.raises(ValueError, match=r"already a comparison variant"):
        register_variant("test_window_global", "mha", description="again")
    bad = CompareConfig(variants=("test_short",), num_heads=4)
    with pytest.raises(ValueError, match=r"^variants\['test_short'\]: expected a pattern of"):
        variant_layers(bad, "test_short")


@pytest.fixture
def scratch_variant():
    register_variant(
        "test_window_global", lambda L: ("window",) * (L - 1) + ("mha",), description="x"
    )
    register_variant("test_short", "mha", description="one layer")
    VARIANTS.remove("test_short")  # a string pattern is every layer: re-add as a short one
    register_variant("test_short", lambda L: ("mha",), description="one layer only")
    yield
    VARIANTS.remove("test_window_global")
    VARIANTS.remove("test_short")


def _death_signal() -> int:
    """In a worker: the signal Linux sends it when its parent dies (prctl PR_GET_PDEATHSIG)."""
    import ctypes

    value = ctypes.c_int(0)
    ctypes.CDLL(None).prctl(pool_lib.PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0)
    return value.value


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_workers_die_with_their_parent():
    # A comparison killed by SIGTERM or SIGKILL must not leave its workers training on.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        1, mp_context=context, initializer=pool_lib.worker_init, initargs=(context.Value("i", 0),)
    ) as pool:
        assert pool.submit(_death_signal).result() == signal.SIGKILL
