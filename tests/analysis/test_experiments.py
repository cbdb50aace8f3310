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
    recall_frontier_grid,
    recall_frontier_report,
    recall_frontier_train,
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
    sinks = sinks_streaming._variant(model, "streaming_llm", w, n)
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


@pytest.mark.integration
def test_recall_frontier_quick(tmp_path, capsys, monkeypatch):
    # Two runs end to end through the command line (one job), extended from 6 updates to
    # 12 while "still learning" (made so here), then again: read back.
    quick = dataclasses.replace(recall_frontier_grid.SCALES["quick"], max_steps=(12,))
    monkeypatch.setitem(recall_frontier_grid.SCALES, "quick", quick)
    monkeypatch.setattr(recall_frontier_train, "still_learning", lambda evals, steps: True)
    out = tmp_path / "frontier"
    argv = ["--quick", "--jobs", "1", "--out", str(out), "--no-progress"]
    assert recall_frontier.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    check_common(results, out, "recall_frontier")
    for r in results["runs"]:
        assert r["summary"]["step"] == 12 and r["summary"]["learning_at_cap"]
        record = json.loads((out / "runs" / r["name"] / "config.json").read_text())
        assert record["optim"]["decay_steps"] == 12  # one schedule throughout
    assert all(p["learning_at_cap"] and p["steps"] == [12] for p in results["points"])
    assert "still learning at the cap: mha 16 at T=16, 2 pairs" in results["claim"]["measured"]
    assert {(p["family"], p["knob"]) for p in results["points"]} == {("mha", 16), ("linear", 16)}
    for p in results["points"]:
        assert 0 <= p["accuracy"] <= 1 and p["state_elements"] * 4 == p["state_bytes"]
    mha, linear = sorted(results["points"], key=lambda p: p["family"] != "mha")
    # 2 layers: K/V of width 16 over T = 16, or 4 heads' 16 x 16 state and normalizer;
    # and each layer's short conv keeps its last 3 inputs.
    assert mha["state_elements"] == 2 * (2 * 16 * 16 + 3 * 16)
    assert linear["state_elements"] == 2 * (4 * 16 * 16 + 4 * 16 + 3 * 64)
    summaries = {r["name"]: r["summary"] for r in results["runs"]}
    capsys.readouterr()
    assert recall_frontier.main(argv) == 0  # finished runs are read back, not retrained
    again = json.loads((out / "results.json").read_text())
    assert {r["name"]: r["summary"] for r in again["runs"]} == summaries


def _frontier_results(scale, families, runtime):
    """A results file's fields for hand-made runs of ``families`` (name -> knob)."""
    grid = [
        {**dataclasses.asdict(run), "name": run.name,
         "summary": {"test_accuracy": 0.5 + run.knob / 100, "step": 6, "target_reached": False,
                     "learning_at_cap": run.family == "linear"}}
        for run in recall_frontier_grid.runs(scale) if families.get(run.family) == run.knob
    ]  # fmt: skip
    return {"scale": dataclasses.asdict(scale), "runs": grid, "runtime_s": runtime}


def test_recall_frontier_add_to_merges_a_family_into_a_run(tmp_path):
    """``--add-to``: a run of some families joins a committed run, its points drawn again
    from every run; refuses another grid."""
    quick = recall_frontier_grid.SCALES["quick"]
    old = _frontier_results(quick, {"mha": 16, "linear": 16}, 10.0)
    rows = recall_frontier_report.points(quick, {recall_frontier._run_of(r): r["summary"]
                                                  for r in old["runs"]})  # fmt: skip
    recall_frontier._write(quick, rows, old["runs"], 10.0, tmp_path)
    knobs = (("mamba2", (8,)), ("linear", (32,)))
    new_scale = dataclasses.replace(quick, name="more", knobs=knobs)
    new = _frontier_results(new_scale, {"mamba2": 8, "linear": 32}, 5.0)
    merged = recall_frontier.add_to(tmp_path, new)
    assert [k for k, _ in merged["scale"]["knobs"]] == ["mha", "mamba2", "linear"]
    assert merged["scale"]["name"] == "more"  # the added run's
    points = {(p["family"], p["knob"]): p for p in merged["points"]}
    assert set(points) == {("mha", 16), ("mamba2", 8), ("linear", 32)}  # linear 32 replaced 16
    assert points[("linear", 32)]["accuracy"] == 0.5 + 32 / 100
    assert points[("linear", 32)]["learning_at_cap"]
    assert not points[("mha", 16)]["learning_at_cap"]
    assert [r["family"] for r in merged["runs"]] == ["mha", "mamba2", "linear"]
    assert merged["runtime_s"] == 15.0 and (tmp_path / "frontier.png").is_file()
    assert json.loads((tmp_path / "results.json").read_text()) == merged
    other = {**new, "scale": dataclasses.asdict(dataclasses.replace(new_scale, lrs=(1e-2,)))}
    with pytest.raises(ValueError, match=r"^add_to: expected a run with the same lrs"):
        recall_frontier.add_to(tmp_path, other)
    with pytest.raises(ValueError, match=r"^add_to: expected a folder"):
        recall_frontier.add_to(tmp_path / "none", new)


@pytest.mark.integration  # the fast tier's 4 minutes are full
def test_recall_frontier_dry_run_builds_zoologys_grid(capsys):
    result = recall_frontier_grid.dry_run(recall_frontier_grid.SCALES["zoology"])
    scale = recall_frontier_grid.SCALES["zoology"]
    assert result["runs"] == 14 * 4 * 4 * 4 == len(recall_frontier_grid.runs(scale))
    assert len(result["points"]) == 14 * 4 * 4
    by = {(tuple(p["setting"]), p["family"], p["knob"]): p for p in result["points"]}
    # Zoology's count for a softmax layer: 2 x d x T per layer (plus the short convs' W-1
    # inputs of width d, which Zoology's count leaves out).
    mha = by[((64, 4), "mha", 64)]
    assert mha["state_elements"] == 2 * (2 * 64 * 64 + 3 * 64)
    # Fixed states do not grow with T; caches do.
    fixed = ("linear", 16), ("gated_deltanet", 32), ("window", 32), ("mamba2", 32), ("rwkv7", 32)
    for family, knob in fixed:
        assert (
            by[((64, 4), family, knob)]["state_elements"]
            == by[((512, 64), family, knob)]["state_elements"]
        )
    assert by[((512, 64), "mha", 64)]["state_elements"] > mha["state_elements"]
    for family, knobs in scale.knobs:  # every knob sweep grows the state
        states = [by[((128, 8), family, k)]["state_elements"] for k in knobs]
        assert states == sorted(states) and len(set(states)) == len(states), family
    assert recall_frontier.main(["--dry-run", "--scale", "zoology", "--only", "mha,linear"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "128 runs, 32 points (zoology scale)"


def test_recall_frontier_pareto_and_reach():
    rows = [
        {"family": "a", "knob": 1, "state_elements": 10, "accuracy": 0.5},
        {"family": "a", "knob": 2, "state_elements": 100, "accuracy": 0.95},
        {"family": "b", "knob": 1, "state_elements": 50, "accuracy": 0.4},
        {"family": "b", "knob": 2, "state_elements": 100, "accuracy": 0.97},
    ]
    front = recall_frontier_report.pareto(rows)
    assert [(r["family"], r["knob"]) for r in front] == [("a", 1), ("b", 2)]
    families = dict(recall_frontier_grid.FAMILIES, a=recall_frontier_grid.FAMILIES["mha"])
    families["b"] = recall_frontier_grid.FAMILIES["linear"]
    import unittest.mock

    with unittest.mock.patch.object(recall_frontier_report, "FAMILIES", families):
        assert recall_frontier_report.reach(rows, "a").startswith("100 (width 2)")
        assert recall_frontier_report.reach(rows, "b", level=0.99) == "not reached at 100"


def test_recall_frontier_still_learning_reads_the_second_half(tmp_path):
    def evals(*points):
        return [{"step": s, "test_loss": x, "test_accuracy": a} for s, x, a in points]

    still = recall_frontier_train.still_learning
    flat = evals((50, 3.0, 0.25), (100, 2.95, 0.26), (150, 2.9, 0.26), (200, 2.89, 0.27))
    assert not still(flat, 200)  # 2% lower, 0.01 higher than at step 100
    assert still(evals((100, 3.0, 0.25), (200, 2.8, 0.25)), 200)  # the loss, 7% down
    assert still(evals((100, 3.0, 0.25), (200, 3.0, 0.30)), 200)  # the accuracy, 0.05 up
    assert not still(evals((100, 3.0, 0.25), (200, 1.0, 0.99)), 400)  # the same at the half
    assert not still([], 200)
    scale = dataclasses.replace(recall_frontier_grid.SCALES["quick"], max_steps=(20,))
    run = recall_frontier_grid.runs(scale)[0]
    workdir = tmp_path / "runs" / run.name
    workdir.mkdir(parents=True)
    rising = [{"kind": "eval", **e} for e in evals((3, 3.0, 0.2), (6, 2.0, 0.5), (9, 1.0, 0.9))]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rising))
    cap = recall_frontier_train.next_cap
    assert cap(scale, tmp_path, run, {"step": 6}) == 12  # doubled; the record past 6 unread
    assert cap(scale, tmp_path, run, {"step": 12}) == 20  # at most max_steps
    assert cap(scale, tmp_path, run, {"step": 20}) is None
    assert cap(scale, tmp_path, run, {"step": 6, "target_reached": True}) is None
    assert cap(recall_frontier_grid.SCALES["quick"], tmp_path, run, {"step": 6}) is None
    with pytest.raises(ValueError, match=r"max_steps: expected one per setting, each >= its"):
        dataclasses.replace(scale, max_steps=(5,))


def test_recall_frontier_bad_input_names_the_argument(tmp_path, capsys):
    assert recall_frontier.main(["--only", "mha,nope", "--dry-run"]) == 2
    assert "only: expected family names" in capsys.readouterr().err
    with pytest.raises(ValueError, match="jobs: expected an int >= 1"):
        recall_frontier.run(recall_frontier_grid.SCALES["quick"], tmp_path, jobs=0)
    with pytest.raises(ValueError, match="steps: expected one cap per setting"):
        dataclasses.replace(recall_frontier_grid.SCALES["quick"], steps=(1, 2))
