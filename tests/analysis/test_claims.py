"""``python -m analysis.claims``: the fast checks' values, result files read into rows, the CLI.

The nine fast checks run once for the module (``fast_rows``; compiling their
tiny programs is the cost, about 20 s of CPU). Results of claims 10 to 14 are
fake files in ``tmp_path``, in the formats their writers use.
"""

import json

import numpy as np
import pytest

from analysis import claim_checks, claim_rows, claims


@pytest.fixture(scope="module")
def fast_rows():
    rows = claims.collect(range(1, 10))
    return {r.number: r for r in rows}


def write_json(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def experiment_result(measured="induction score jumps at step 300", holds=True):
    return {
        "claim": {"measured": measured, "criterion": "jumps within 100 steps", "holds": holds},
        "runtime_s": 123.0,
    }


def compare_result(accuracy: dict[str, float]):
    """A ``train.compare`` results.json with only what claim 10 reads."""
    variants = {
        name: {"accuracy": {"mean": a, "min": a, "max": a, "seeds": [a], "count": 1}}
        for name, a in accuracy.items()
    }
    return {
        "config": {"name": "compare_mqar", "train": {"model": {"width": 64}}},
        "variants": variants,
        "chance_accuracy": 0.125,
        "wall_s": 500.0,
    }


# ----------------------------------------------------------------------------
# Claims 1-9


def test_every_fast_check_holds(fast_rows):
    assert sorted(fast_rows) == list(range(1, 10))
    for number, row in fast_rows.items():
        assert row.holds is True, (number, row.measured, row.criterion)
        assert row.status == "holds"
        assert row.measured and row.criterion
        assert row.claim == claims.CLAIMS[number]


def test_worked_example_values(fast_rows):
    v = fast_rows[1].values
    np.testing.assert_array_equal(
        np.round(v["weights"], 2), [[0.40, 0.20, 0.40], [0.20, 0.40, 0.40], [0.25, 0.25, 0.50]]
    )
    np.testing.assert_array_equal(np.round(v["outputs"], 2), [[0.6, 0.4], [0.4, 0.6], [0.5, 0.5]])
    # Rows of weights sum to 1 (a softmax), outputs are weights @ V.
    w = np.array(v["weights"])
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(v["outputs"], w @ [[1, 0], [0, 1], [0.5, 0.5]], atol=1e-6)


def test_score_scale_values(fast_rows):
    v = fast_rows[2].values
    assert abs(v["std"] - 8.0) < 0.1
    assert abs(v["scaled_std"] - 1.0) < 0.0125
    np.testing.assert_allclose(v["scaled_std"], v["std"] / 8.0, rtol=1e-6)


def test_softmax_saturation_values(fast_rows):
    v = fast_rows[3].values
    np.testing.assert_array_equal(np.round(v["softmax_small"], 2), [0.09, 0.24, 0.67])
    np.testing.assert_array_equal(np.round(v["softmax_large"], 4), [0.0, 0.0003, 0.9997])
    # diag(p) - p p^T: its largest entry is p_i (1 - p_i) for the largest such product.
    p = np.array(v["softmax_large"])
    np.testing.assert_allclose(v["max_jacobian_large"], np.max(p * (1 - p)), rtol=1e-3)
    assert v["max_jacobian_large"] < 1e-3 < 0.2 < v["max_jacobian_small"]


def test_equivariance_causality_rope_values(fast_rows):
    assert fast_rows[4].values["max_diff"] < 1e-5 < 0.1 < fast_rows[4].values["max_diff_rope"]
    assert fast_rows[5].values["max_diff"] < 1e-5
    v = fast_rows[6].values
    assert v["spread_over_shifts"] < 1e-4 < 0.01 < v["spread_over_offsets"]


def test_cache_sizes_values(fast_rows):
    v = fast_rows[7].values
    assert v["bytes_per_token"] == 128 * 1024
    assert v["bytes_8k"] == 2**30
    assert v["bytes_8k_x16"] == 16 * 2**30
    by_k = v["bytes_per_token_by_kv_heads"]
    assert by_k["32"] == 4 * by_k["8"] == 32 * by_k["1"]
    assert v["mla_bytes_per_token"] == 60 * (512 + 64) * 2
    assert v["mha_128_heads_bytes_per_token"] == 2 * 60 * 128 * 128 * 2


def test_blockwise_values(fast_rows):
    v = fast_rows[8].values
    assert v["max_diff"] < 1e-5
    T1, T2 = v["lengths"]
    assert v["growth"]["blockwise"] <= 1.25 * T2 / T1
    # The contrast that makes the criterion mean something: dense grows quadratically.
    assert v["growth"]["dense"] > 0.75 * (T2 / T1) ** 2


def test_linear_values(fast_rows):
    v = fast_rows[9].values
    assert v["max_diff_forms"] < 1e-5
    assert v["max_diff_resumed"] < 1e-5
    short, long = v["state_bytes"]
    assert short == long == v["linear_state_bytes"]
    assert v["state_lengths"][1] == 8 * v["state_lengths"][0]


def test_a_failing_check_is_a_row_that_does_not_hold(monkeypatch):
    failing = claim_checks.Check("1 != 2", "equal", False, {"x": 1})
    monkeypatch.setitem(claim_checks.CHECKS, 7, lambda: failing)
    (row,) = claims.collect([7])
    assert (row.holds, row.status, row.measured, row.values) == (
        False,
        "does not hold",
        "1 != 2",
        {"x": 1},
    )


def test_a_raising_check_is_an_error_row(monkeypatch):
    def broken():
        raise RuntimeError("boom")

    monkeypatch.setitem(claim_checks.CHECKS, 7, broken)
    (row,) = claims.collect([7])
    assert row.status == "error" and row.holds is None
    assert "RuntimeError: boom" in row.measured


# ----------------------------------------------------------------------------
# Claims 10-14 from result files


def test_missing_results_are_not_run(tmp_path):
    rows = claims.collect(range(10, 19), results=tmp_path)
    assert [r.number for r in rows] == list(range(10, 19))
    for r in rows:
        assert r.holds is None
        assert r.status == "not run"
        assert r.measured == "not run (use --run)"


@pytest.mark.parametrize("holds", [True, False])
def test_experiment_result_is_read_into_its_row(tmp_path, holds):
    files = {}
    for number, name in claims.EXPERIMENTS.items():  # state_tracking holds two rows
        entry = experiment_result(f"measured {number}", holds)["claim"]
        key = claim_rows.CLAIM_KEYS.get(number, "claim")
        files.setdefault(name, experiment_result())[key] = entry
    for name, data in files.items():
        write_json(tmp_path / name / "results.json", data)
    rows = claims.collect(sorted(claims.EXPERIMENTS), results=tmp_path)
    assert [r.number for r in rows] == [11, 12, 13, 14, 15, 16, 17, 18, 19]
    for r in rows:
        assert r.measured == f"measured {r.number}"
        assert r.criterion == "jumps within 100 steps"
        assert r.holds is holds
        assert r.status == ("holds" if holds else "does not hold")
        assert r.runtime_s == 123.0
        assert r.source.endswith(f"{claims.EXPERIMENTS[r.number]}/results.json")


@pytest.mark.parametrize(
    "bad",
    [
        {"runtime_s": 1.0},  # no claim
        {"claim": {"measured": "x", "criterion": "y", "holds": "yes"}},  # holds not a bool
        {"claim": {"measured": 3, "criterion": "y", "holds": True}},
    ],
)
def test_malformed_experiment_result_is_an_error(tmp_path, bad):
    path = write_json(tmp_path / "induction_heads" / "results.json", bad)
    row = claims.experiment_row(11, path)
    assert row.status == "error" and row.holds is None


def test_compare_accuracies_reads_the_committed_comparison():
    committed = json.loads((claims.REPO / "docs/results/compare_mqar/results.json").read_text())
    acc = claims.compare_accuracies(committed)
    assert {"mha", "linear", "hybrid"} <= set(acc)
    assert acc["mha"] == committed["variants"]["mha"]["accuracy"]["mean"]
    with pytest.raises(ValueError, match=r"results\.json"):
        claims.compare_accuracies({"config": {}})
    with pytest.raises(ValueError, match=r"results\.json"):
        claims.compare_accuracies({"variants": {"mha": {"accuracy": {"mean": "high"}}}})


@pytest.mark.parametrize(("linear", "holds"), [(0.14, True), (0.95, False)])
def test_compare_row(tmp_path, linear, holds):
    accuracy = {"mha": 0.98, "linear": linear, "hybrid": 0.5}
    path = write_json(tmp_path / "compare_mqar" / "results.json", compare_result(accuracy))
    (row,) = claims.collect([10], results=tmp_path)
    assert row.holds is holds
    assert row.values["accuracy"] == {"mha": 0.98, "linear": linear, "hybrid": 0.5}
    assert row.values["gap"] == pytest.approx(0.98 - linear)
    assert row.values["width"] == 64
    assert "mha 0.98" in row.measured and "hybrid 0.50" in row.measured
    assert row.runtime_s == 500.0
    assert row.source.endswith("compare_mqar/results.json")
    path.write_text(json.dumps(compare_result({"mha": 0.9})))
    assert claims.compare_row(path).status == "error"  # no linear variant


def test_compare_row_places_the_delta_rule(tmp_path):
    accuracy = {"mha": 0.99, "linear": 0.25, "gated_deltanet": 0.62}
    write_json(tmp_path / "compare_mqar" / "results.json", compare_result(accuracy))
    (row,) = claims.collect([10], results=tmp_path)
    assert "gated_deltanet 0.62" in row.measured
    assert "the delta rule closes 50% of it (gated_deltanet)" in row.measured
    assert row.values["delta_rule_closes"] == {"gated_deltanet": pytest.approx(0.5)}


def test_run_reads_what_the_runs_wrote(tmp_path, monkeypatch):
    """--run: the comparison and the experiments write into out; the rows read them there."""
    out = tmp_path / "out"
    calls = []

    def fake_compare(out_dir):
        calls.append("compare")
        accuracy = {"mha": 0.99, "linear": 0.26}
        return write_json(out_dir / claims.COMPARE_QUICK / "results.json", compare_result(accuracy))

    def fake_experiment(name, out_dir):
        calls.append(name)
        return write_json(out_dir / name / "results.json", experiment_result(f"ran {name}"))

    monkeypatch.setattr(claims, "run_compare", fake_compare)
    monkeypatch.setattr(claims, "run_experiment", fake_experiment)
    rows = claims.collect([10, 11, 14], run=True, results=tmp_path / "committed", out=out)
    assert calls == ["compare", "induction_heads", "windows_global"]
    assert [r.status for r in rows] == ["holds", "holds", "holds"]
    assert rows[2].measured == "ran windows_global"


def test_a_failed_run_is_an_error_row(tmp_path, monkeypatch):
    def broken(name, out_dir):
        raise RuntimeError(f"{name} crashed")

    monkeypatch.setattr(claims, "run_experiment", broken)
    (row,) = claims.collect([13], run=True, out=tmp_path)
    assert row.status == "error" and "head_pruning crashed" in row.measured


# ----------------------------------------------------------------------------
# The command line


def test_cli_writes_table_and_json(tmp_path, capsys):
    results = tmp_path / "results"
    write_json(results / "induction_heads" / "results.json", experiment_result("a |jump|"))
    out = tmp_path / "claims"
    rc = claims.main(["--only", "7,11,12", "--out", str(out), "--results", str(results)])
    assert rc == 0
    table = (out / "table.md").read_text()
    assert table == capsys.readouterr().out.split("wrote ")[0].rstrip("\n") + "\n"
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(lines) == 1 + 3  # the header, then one row per claim
    assert lines[1].startswith("| 7 |") and lines[1].endswith("| holds |")
    assert "a \\|jump\\|" in lines[2]  # pipes escaped inside cells
    assert lines[3].startswith("| 12 |") and lines[3].endswith("| not run |")
    data = json.loads((out / "results.json").read_text())
    assert [r["number"] for r in data["rows"]] == [7, 11, 12]
    assert [r["holds"] for r in data["rows"]] == [True, True, None]
    assert data["rows"][0]["values"]["bytes_per_token"] == 131072
    assert data["run"] is False and data["fast_checks_s"] >= 0


def test_cli_exit_code_is_one_on_errors(tmp_path):
    results = tmp_path / "results"
    write_json(results / "head_pruning" / "results.json", {"claim": "broken"})
    rc = claims.main(["--only", "13", "--out", str(tmp_path / "o"), "--results", str(results)])
    assert rc == 1
    data = json.loads((tmp_path / "o" / "results.json").read_text())
    assert data["rows"][0]["status"] == "error"


@pytest.mark.parametrize("only", ["20", "0", "1,x", ","])
def test_cli_rejects_bad_claim_numbers(tmp_path, only):
    with pytest.raises(ValueError, match="--only"):
        claims.main(["--only", only, "--out", str(tmp_path)])


def test_run_runs_an_experiment_once_for_all_its_rows(tmp_path, monkeypatch):
    calls = []

    def fake(name, out):
        calls.append(name)
        data = {**experiment_result("parity"), "claim_s5": experiment_result("s5")["claim"]}
        return write_json(out / name / "results.json", data)

    monkeypatch.setattr(claims, "run_experiment", fake)
    rows = claims.collect([16, 17], run=True, out=tmp_path)
    assert calls == ["state_tracking", "state_tracking_groups"]  # claim 17 has its own grid
    assert [r.measured for r in rows] == ["parity", "s5"]
    calls.clear()
    monkeypatch.setitem(claims.EXPERIMENTS, 17, "state_tracking")  # two rows, one experiment
    rows = claims.collect([16, 17], run=True, out=tmp_path)
    assert calls == ["state_tracking"]
    assert [r.measured for r in rows] == ["parity", "s5"]


@pytest.mark.parametrize("name", sorted(set(claims.EXPERIMENTS.values())))
def test_run_experiment_runs_the_full_config(tmp_path, monkeypatch, name):
    """run_experiment calls the experiment's run with configs/<name>.py's full config."""
    import importlib

    import train.cli

    module_name = claim_rows.EXPERIMENT_MODULES.get(name, name)
    module = importlib.import_module(f"analysis.experiments.{module_name}")
    seen = {}

    def fake_run(config, out_dir):
        seen["config"], seen["out_dir"] = config, out_dir
        return write_json(out_dir / "results.json", experiment_result())

    monkeypatch.setattr(module, "run", fake_run)
    monkeypatch.setattr(train.cli, "enable_compilation_cache", lambda: None)
    path = claims.run_experiment(name, tmp_path)
    assert path == tmp_path / name / "results.json" and path.is_file()
    assert seen["out_dir"] == tmp_path / name
    full = train.cli.load_config(claims.REPO / "configs" / f"{name}.py", quick=False)
    quick = train.cli.load_config(claims.REPO / "configs" / f"{name}.py", quick=True)
    assert seen["config"] == full
    assert full != quick  # so the check above tells the full config from the quick one
