"""The experiments: their helpers on hand-made inputs, and each quick run end to end.

The quick runs use the configs' ``quick=True`` settings (a few training steps of
tiny models): they check the files, the claim entry and that the numbers are
in range, not the claims themselves.

Most of their cost is compilation, and ``train.load_run`` compiles the same
initialization once per checkpoint it loads: a persistent compilation cache
(a temporary folder, unless one is configured already, as ``tests/train`` does)
makes every load after the first a cache hit.
"""

import dataclasses
import json
import runpy
import sys

import numpy as np
import pytest

from analysis import streaming
from analysis.experiments import (
    NAMES,
    _common,
    head_pruning,
    induction_heads,
    recall_frontier,
    sinks_gated,
    sinks_streaming,
    sparse,
    state_tracking,
    windows_global,
)
from train.cli import load_config

MODULES = {
    "induction_heads": induction_heads,
    "sinks_streaming": sinks_streaming,
    "head_pruning": head_pruning,
    "windows_global": windows_global,
    "recall_frontier": recall_frontier,
    "state_tracking": state_tracking,
    "sparse": sparse,
    "sinks_gated": sinks_gated,
}


def quick_config(name):
    return load_config(_common.REPO_ROOT / "configs" / f"{name}.py", quick=True)


def check_common(results, out, name):
    """Files written, the claim entry well-formed, the JSON equal to what run returned."""
    assert (out / "results.json").is_file() and (out / "table.md").is_file()
    assert json.loads((out / "results.json").read_text()) == results
    assert results["name"] == name
    entry = results["claim"]
    assert set(entry) == {"measured", "criterion", "holds"}
    assert isinstance(entry["holds"], bool)
    assert entry["measured"] and entry["criterion"]
    assert results["runtime_s"] > 0
    table = (out / "table.md").read_text()
    assert entry["measured"] in table and table.count("\n|") >= 2
    pngs = list(out.glob("*.png"))
    assert pngs and all(p.stat().st_size > 1000 for p in pngs)


def test_every_module_has_the_interface():
    assert tuple(MODULES) == NAMES
    for name, module in MODULES.items():
        assert name == module.NAME
        assert callable(module.run) and callable(module.main)


def test_claim_and_write_results(tmp_path):
    entry = _common.claim("x = 1", "x > 0", np.bool_(True))
    assert entry == {"measured": "x = 1", "criterion": "x > 0", "holds": True}
    with pytest.raises(ValueError, match="measured"):
        _common.claim("", "x > 0", True)
    results = {"name": "t", "claim": entry, "runtime_s": 1.5, "a": np.arange(3), "b": np.nan}
    written = _common.write_results(tmp_path, results, _common.markdown_table(["k"], [[0.5]]))
    assert written["a"] == [0, 1, 2] and written["b"] is None
    assert "| 0.500 |" in (tmp_path / "table.md").read_text()
    with pytest.raises(ValueError, match="claim"):
        _common.write_results(tmp_path, {"name": "t", "runtime_s": 1.0}, "")


def test_transition_step():
    steps = [0, 10, 20, 30, 40]
    assert induction_heads.transition_step(steps, [0.0, 0.1, 0.2, 0.9, 1.0]) == 30
    # A falling curve: half of the drop from 4 to 0 is first reached at step 20.
    assert induction_heads.transition_step(steps, [4.0, 3.5, 1.9, 0.5, 0.0]) == 20
    assert induction_heads.transition_step(steps, [1.0] * 5) == 40
    assert induction_heads.transition_step(steps, [0, 0.05, 0.1, 0.5, 1], 0.1) == 20


def test_query_gaps():
    # Context k1 v1 k2 v2 = 3 9 5 8, then queries of 5 at position 6 and 3 at position 9.
    tokens = np.array([[3, 9, 5, 8, 0, 0, 5, 0, 0, 3]])
    weights = np.zeros((1, 10), np.float32)
    weights[0, [6, 9]] = 1
    gaps = windows_global.query_gaps(tokens, weights, num_pairs=2)
    expected = np.full((1, 10), -1)
    expected[0, 6], expected[0, 9] = 6 - 2, 9 - 0
    np.testing.assert_array_equal(gaps, expected)


def test_prunable_fraction():
    f = [0.0, 0.25, 0.5, 0.75, 1.0]
    assert head_pruning.prunable_fraction(f, [0.9, 0.88, 0.86, 0.5, 0.0], 0.05) == 0.5
    # A later recovery does not count: the first drop ends the prunable range.
    assert head_pruning.prunable_fraction(f, [0.9, 0.7, 0.9, 0.9, 0.9], 0.05) == 0.0


def test_configs_validate():
    cfg = quick_config("induction_heads")
    with pytest.raises(ValueError, match="keep_checkpoints"):
        dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, keep_checkpoints=1))
    with pytest.raises(ValueError, match="fractions"):
        head_pruning.Config(train=quick_config("head_pruning").train, fractions=(0.5, 1.0))
    w = quick_config("windows_global")
    with pytest.raises(ValueError, match="global"):
        windows_global.Config(window_only=w.window_only, hybrid=w.window_only, window=w.window)


@pytest.mark.integration
def test_induction_heads_quick(tmp_path):
    results = induction_heads.run(quick_config("induction_heads"), tmp_path)
    check_common(results, tmp_path, "induction_heads")
    rows = results["checkpoints"]
    assert [r["step"] for r in rows] == [0, 10, 20]
    for r in rows:
        assert 0 <= r["induction_best"] <= 1 and 0 <= r["previous_token_best"] <= 1
        assert np.isfinite(r["first_copy_loss"]) and r["second_copy_loss"] > 0
        assert np.shape(r["induction"]) == (2, 4)
    assert results["induction_jump_step"] in (10, 20)
    # The workdir holds the run: a second call resumes it instead of training again.
    assert (tmp_path / "runs" / "induction" / "summary.json").is_file()


@pytest.mark.integration
def test_sinks_gated_quick(tmp_path):
    config = quick_config("sinks_gated")
    results = sinks_gated.run(config, tmp_path)
    check_common(results, tmp_path, "sinks_gated")
    # Both quick sizes train unless the first has a sink; the gated model at the last one.
    onset = results["onset"]
    assert [r["width"] for r in onset] == [16, 16][: len(onset)]
    assert (onset[-1]["history"][-1]["sink_rate"] > 0) or len(onset) == 2
    assert [h["step"] for h in onset[0]["history"]] == [5, 10]
    size = config.base.sizes[len(onset) - 1]
    for model in sinks_gated.MODELS:
        m = results["models"][model]
        assert np.shape(m["first_token_mass"]) == (size.layers, size.heads)
        assert len(m["massive_top"]) == size.layers + 1
        assert all(r >= 1 for r in m["massive_ratio"])
        for v in sinks_gated.STREAMS:
            assert len(m["perplexity_per_window"][v]) == config.base.stream_factor
    gated_run = tmp_path / "runs" / f"gated_w16_l{size.layers}_h2" / "config.json"
    assert '"output_gate": "elementwise"' in gated_run.read_text()
    assert results["claim"]["criterion"] == sinks_gated.CRITERION


def test_sinks_gated_refuses_a_gated_base_and_an_unknown_gate():
    base = quick_config("sinks_gated").base
    with pytest.raises(ValueError, match="gate"):
        sinks_gated.Config(base, gate="sigmoid")
    gated = sinks_gated.gated(base.train, "headwise")
    with pytest.raises(ValueError, match=r"base\.train\.model\.layers"):
        sinks_gated.Config(dataclasses.replace(base, train=gated))
    with pytest.raises(ValueError, match=r"base\.sizes"):
        sinks_gated.Config(dataclasses.replace(base, sizes=()))


@pytest.mark.integration
@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # the second copy
def test_sinks_streaming_quick(tmp_path, monkeypatch):
    # As its command line runs it: the module is __main__, a second copy, while the
    # config's Size comes from analysis.experiments.sinks_streaming; the sweep must
    # still recognize the main run's size (else it trains that model twice).
    config = quick_config("sinks_streaming")
    argv = ["sinks_streaming", "--quick", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as done:
        runpy.run_module("analysis.experiments.sinks_streaming", run_name="__main__")
    assert done.value.code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    check_common(results, tmp_path, "sinks_streaming")
    assert 0 <= results["sink_rate"] <= 1
    mass = np.asarray(results["first_token_mass"])
    assert mass.shape == (1, 2) and ((mass >= 0) & (mass <= 1)).all()
    for v in sinks_streaming.VARIANTS:
        ppl = results["perplexity_per_window"][v]
        assert len(ppl) == config.stream_factor and all(p >= 1 for p in ppl)
    # Before positions leave the window every variant computes the same function.
    first = [results["perplexity_per_window"][v][0] for v in sinks_streaming.VARIANTS]
    np.testing.assert_allclose(first, first[0], rtol=1e-4)
    assert results["decode_vs_forward_max_abs_nll"] < 1e-3
    # The sweep: the main run's own row (no BOS) and one more run with a BOS first.
    rows = results["sizes"]
    assert [r["bos"] for r in rows] == [False, True] and rows[0]["params"] == rows[1]["params"]
    assert rows[0]["sink_rate"] == results["sink_rate"]
    for r in rows:
        assert 0 <= r["mean_first_token_mass"] <= r["max_first_token_mass"] <= 1
    assert (tmp_path / "runs" / "size_w16_l1_h2_bos" / "summary.json").is_file()
    assert not (tmp_path / "runs" / "size_w16_l1_h2").exists()
    assert "sink onset" in results["claim"]["measured"]


@pytest.mark.integration
def test_head_pruning_quick(tmp_path):
    config = quick_config("head_pruning")
    results = head_pruning.run(config, tmp_path)
    check_common(results, tmp_path, "head_pruning")
    imp = np.asarray(results["importance"])
    assert imp.shape == (2, 4) and (imp >= 0).all()
    np.testing.assert_allclose(np.linalg.norm(imp, axis=1), 1.0, rtol=1e-6)
    for curve in (results["accuracy_by_importance"], results["accuracy_random_mean"]):
        assert len(curve) == len(config.fractions) and all(0 <= a <= 1 for a in curve)
    # No head masked: both orders measure the same model.
    assert results["accuracy_by_importance"][0] == results["accuracy_random_mean"][0]


@pytest.mark.integration
def test_windows_global_quick(tmp_path):
    results = windows_global.run(quick_config("windows_global"), tmp_path)
    check_common(results, tmp_path, "windows_global")
    counts = results["queries_per_bucket"]
    assert sum(counts) == 8 * 2  # one batch of 8 test examples with 2 queries each
    for name in windows_global.MODELS:
        assert 0 <= results["accuracy_long_gaps"][name] <= 1
        acc = [a for a in results["accuracy_by_gap"][name] if a is not None]
        assert acc and all(0 <= a <= 1 for a in acc)


@pytest.mark.integration
def test_state_tracking_quick(tmp_path):
    config = quick_config("state_tracking")
    results = state_tracking.run(config, tmp_path)
    check_common(results, tmp_path, "state_tracking")
    assert set(results["claim_s5"]) == {"measured", "criterion", "holds"}
    assert len(results["runs"]) == len(config.variants)  # one task, one rate
    for variant, best in results["best"]["parity"].items():
        assert variant in config.variants and best["lr"] == config.lrs[0]
        for f in config.factors:
            assert 0 <= best["accuracy"][str(f)] <= 1
            assert len(best["per_position"][str(f)]) == config.train_len * f
    assert "parity at 2x the training length" in results["claim"]["measured"]


def test_state_tracking_claims_read_the_table():
    """The claims' rules on hand-made accuracies: parity needs both pairs, S5 only products."""
    config = state_tracking.Config(factors=(1, 2))

    def table(task, accs):
        return {task: {v: {"accuracy": {"1": a, "2": a}} for v, a in accs.items()}}

    pairs = {"mamba2": 0.5, "mamba2_negative": 1.0, "gated_deltanet": 0.6}
    parity = state_tracking.parity_claim
    assert parity(config, table("parity", {**pairs, "gated_deltanet_negative": 0.95}))["holds"]
    assert not parity(config, table("parity", {**pairs, "gated_deltanet_negative": 0.7}))["holds"]
    s5 = state_tracking.s5_claim
    assert s5(config, table("s5", {"deltaproduct3": 0.95, "mha": 0.1}))["holds"]
    assert not s5(config, table("s5", {"deltaproduct3": 0.95, "mamba2": 0.92}))["holds"]
    none = s5(config, table("s5", {"deltaproduct3": 0.2, "mha": 0.1}))
    assert not none["holds"] and "deltaproduct3 0.20, mha 0.10" in none["measured"]
    assert none["measured"].startswith("S5 tracked by none within 1200 updates (at 1x")
    s3 = {"s3": {"deltaproduct2": {"accuracy": {"1": 0.99, "2": 0.88}},
                 "mamba2": {"accuracy": {"1": 0.5, "2": 0.4}}}}  # fmt: skip
    both = s5(config, {**table("s5", {"deltaproduct2": 0.1}), **s3})
    assert "; S3 tracked by deltaproduct2 0.99 (0.88 at 2x) (chance 0.17)" in both["measured"]
    with pytest.raises(ValueError, match=r"^variants: expected"):
        state_tracking.Config(variants=("mamba3",))


@pytest.mark.integration
def test_sparse_quick(tmp_path):
    config = quick_config("sparse")
    results = sparse.run(config, tmp_path)
    check_common(results, tmp_path, "sparse")
    assert len(results["runs"]) == len(config.variants) * len(config.tasks)
    for run in results["runs"].values():
        assert all(0 <= run["accuracy"][str(f)] <= 1 for f in config.factors)
    assert results["keys_read"]["window"]["32"] == config.reads
    assert "keys read per query" in results["claim"]["measured"]


def test_sparse_keys_read_and_claim():
    """Keys read by the last query of each variant, and the claim's rule on hand-made
    accuracies."""
    config = sparse.Config()
    assert sparse.keys_read(config, "mha", 1024) == 1024
    assert sparse.keys_read(config, "window", 1024) == sparse.keys_read(config, "dsa", 1024) == 64
    assert sparse.keys_read(config, "moba", 1024) == 64  # 4 blocks of 16, its own one full
    assert sparse.keys_read(config, "moba", 1000) == 56  # its own block holds 8 positions
    assert sparse.keys_read(config, "nsa", 1024) == 16 + 32 + (1024 - 16) // 8 + 1
    assert sparse.keys_read(config, "gated_deltanet", 1024) is None

    def results(accs):
        return {sparse.Run("needle", v): {"accuracy": {"1": a}} for v, a in accs.items()}

    assert sparse.claim(config, results({"moba": 0.95, "window": 0.3}))["holds"]
    assert not sparse.claim(config, results({"moba": 0.95, "window": 0.6}))["holds"]
    assert not sparse.claim(config, results({"nsa": 0.99, "window": 0.3}))["holds"]  # reads more
    with pytest.raises(ValueError, match="reads"):
        sparse.Config(reads=40)


def test_sparse_ruler_tasks_chance_and_table_without_training():
    """The RULER grid's tasks: chance, labelled positions per task in the table, the
    chains variable tracking gets, and the claim read on the needles, else the multi-key
    needle."""
    ruler = load_config(_common.REPO_ROOT / "configs" / "sparse_ruler.py")
    assert ruler.tasks == ("multikey_needle", "variable_tracking") and ruler.eval_batches == 8
    config = dataclasses.replace(ruler, tasks=("needle", *ruler.tasks))
    assert sparse.Config().tasks == ("needle", "mqar")  # the committed grid's
    assert [sparse.chance(config, t) for t in ("mqar", *config.tasks)] == [1 / 32] + [1 / 16] * 3
    vt = sparse.train_config(config, sparse.Run("variable_tracking", "window")).task
    assert (vt.num_pairs, vt.hops) == (6, 2)  # 6 chains of 2: 12 pairs, as the needles
    results = {
        sparse.Run(t, v): {"accuracy": {str(f): 0.5 for f in config.factors}, "seconds": 1.0}
        for t in config.tasks
        for v in config.variants
    }
    table = sparse.table_md(config, results)
    assert "(needle 12, multikey_needle 1, variable_tracking 1 per example, 128 examples" in table
    assert "variable_tracking: 6 chains of 2 assignments." in table
    assert sparse.claim(config, results)["measured"].startswith("needle accuracy at T = 256")
    ruler_results = {r: x for r, x in results.items() if r.task != "needle"}
    measured = sparse.claim(ruler, ruler_results)["measured"]
    assert measured.startswith("multikey needle accuracy at T = 256, 64 keys read per query")
    with pytest.raises(ValueError, match=r"^hops: expected 1 <= hops <= num_pairs"):
        sparse.Config(tasks=("variable_tracking",), hops=13)


@pytest.mark.parametrize("name", NAMES)
def test_command_line_parses(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        MODULES[name].main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--quick" in out and "--out" in out


def test_streaming_llm_renumbers_positions_in_the_cache():
    # One layer: its keys and values depend on each token alone (and RoPE), so
    # StreamingLLM's cache at query t holds exactly what a forward pass computes over
    # the initial tokens then the window, numbered from 0.
    from flax import nnx

    from models import Decoder, ModelConfig, pattern, presets

    n, w, S, V = 2, 4, 11, 32
    layers = pattern(("mha",), presets(num_heads=2, head_dim=8))
    model = Decoder(ModelConfig(vocab_size=V, width=16, mlp_width=16, layers=layers),
                    rngs=nnx.Rngs(0))  # fmt: skip
    rng = np.random.default_rng(0)
    tokens, targets = rng.integers(0, V, (2, S)), rng.integers(0, V, (2, S))
    sinks = sinks_streaming.variant_model(model, "streaming_llm", w, n)
    renumbered = streaming.stream_nll(sinks, tokens, targets, renumber=(n, w))
    absolute = streaming.stream_nll(sinks, tokens, targets)
    for t in range(S):
        keep = sorted({*range(min(n, t + 1)), *range(max(0, t - w + 1), t + 1)})
        forward = _common.token_losses(model, tokens[:, keep], targets[:, keep])[:, -1]
        np.testing.assert_allclose(renumbered[:, t], forward, rtol=1e-5, atol=1e-5)
    # Up to n + w - 1 the two numberings agree; past it only the renumbered one is above.
    np.testing.assert_allclose(absolute[:, : n + w], renumbered[:, : n + w], rtol=1e-6)
    assert np.abs(absolute[:, n + w :] - renumbered[:, n + w :]).min() > 1e-6
    assert [int(streaming.renumber_shift(t, n, w)) for t in (0, 5, 6, 10)] == [0, 0, 1, 5]
    # Renumbering a cache the layers do not keep would be a silent wrong answer.
    for wrong_model, wrong in ((model, (n, w)), (sinks, (n, w + 1)), (sinks, (n + 1, w))):
        with pytest.raises(ValueError, match="renumber"):
            streaming.stream_nll(wrong_model, tokens, targets, renumber=wrong)


def test_sink_onset_is_the_smallest_model_with_a_sink():
    def row(params, bos, rate):
        return {"params": params, "bos": bos, "sink_rate": rate}

    rows = [row(10, False, 0.0), row(10, True, 0.0), row(40, False, 0.0), row(40, True, 0.25)]
    assert sinks_streaming.onset(rows, True) == rows[3]
    assert sinks_streaming.onset(rows, False) is None
    with pytest.raises(ValueError, match="sizes"):
        sinks_streaming.Size(width=30, layers=2, heads=4)
