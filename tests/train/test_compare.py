"""The main job end to end: ``python -m train.compare --quick`` with a tiny override."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import Decoder, linear_state_bytes
from train.compare import VARIANTS, CompareConfig, cache_sizes, variant_layers
from train.config import TrainConfig

REPO = Path(__file__).resolve().parents[2]


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
        "--lrs", "3e-3", "1e-2",
        "--train.steps", "12",
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
    header = "| variant | layers | params | cache B/token | fixed cache/state | test accuracy |"
    assert header in table
    rows = [line for line in table.splitlines() if line.startswith(("| mha", "| hybrid"))]
    assert len(rows) == 2
    assert "| hybrid (linear + one softmax layer, short convs) | linear_conv+mha_conv |" in table

    results = json.loads((folder / "results.json").read_text())
    assert set(results["best"]) == {"mha", "hybrid"}
    assert len(results["runs"]) == 4  # 2 variants x 2 learning rates x 1 seed
    for name, best in results["best"].items():
        assert best["lr"] in (3e-3, 1e-2)
        assert 0 <= best["test_accuracy"] <= 1 and best["params"] > 0
        assert best["tokens_per_s"] > 0 and best["wall_s"] > 0
        runs = [r for r in results["runs"] if r["variant"] == name]
        assert best["test_accuracy"] == max(r["summary"]["test_accuracy"] for r in runs)
    # Full softmax caches grow per token; the hybrid's linear layer adds a fixed state.
    # K and V x 2 layers x 2 kv heads x head dim 8 x 4 bytes.
    assert results["best"]["mha"]["cache_bytes_per_token"] == 2 * 2 * 2 * 8 * 4
    assert results["best"]["mha"]["cache_bytes_fixed"] == 0
    assert results["best"]["hybrid"]["cache_bytes_fixed"] > 0
    num_pairs = results["config"]["train"]["task"]["num_pairs"]
    assert results["chance_accuracy"] == 1 / num_pairs  # MQAR: a random value of the sequence
    assert f"Chance is {1 / num_pairs:.3f}" in table
    for png in ("accuracy.png", "loss.png"):
        assert (folder / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_variants_and_cache_sizes():
    config = CompareConfig(train=TrainConfig(), variants=tuple(VARIANTS), num_heads=4, window=16)
    for name in VARIANTS:
        assert len(variant_layers(config, name)) == config.num_layers
    hybrid = variant_layers(config, "hybrid")
    assert [(a.kind, a.short_conv) for a in hybrid] == [("linear", 4), ("softmax", 4)]
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


def test_bad_compare_configs_name_the_field():
    with pytest.raises(ValueError, match="variants"):
        CompareConfig(variants=("mha", "nope"))
    with pytest.raises(ValueError, match="num_heads"):
        CompareConfig(num_heads=5)
    with pytest.raises(ValueError, match="gqa_kv_heads"):
        CompareConfig(num_heads=4, gqa_kv_heads=3)
