"""bench/sparse.py end to end at tiny sizes: every method timed, the report written.

Timings are never asserted; the run checks what it measured and wrote.
"""

import json

import pytest

from tests.bench.script import load


@pytest.fixture(scope="module")
def bench():
    yield from load("sparse")


@pytest.mark.integration
def test_a_tiny_run_writes_the_report(bench, tmp_path):
    cfg = bench.Config(quick=True, lengths=(256,), out_dir=str(tmp_path), chunk=64, heads=4)
    result = bench.main(cfg)
    L = result["vs_length"]
    for kind in ("forward", "forward_backward"):
        for m in bench.METHODS:
            assert L[kind][m][256] > 0, (kind, m)
    assert all(L["temp_bytes"][m][256] > 0 for m in bench.METHODS)
    assert set(result["decode"]["seconds"]) == set(bench.METHODS)
    assert set(result["crossover"]["forward"]) == {"moba", "nsa", "dsa"}
    saved = json.loads((tmp_path / "sparse-cpu-quick.json").read_text())
    assert saved["lengths"] == [256]
    report = (tmp_path / "sparse-cpu-quick.md").read_text()
    assert "| 256 |" in report and "Crosses 1x" in report and "decode step" in report
    assert "GFLOP/s" in report
    assert (tmp_path / "sparse-cpu-quick.png").stat().st_size > 0


def test_crossover_interpolates_in_log_length(bench):
    lengths = (1024, 2048, 4096)
    base = {1024: 1.0, 2048: 4.0, 4096: 16.0}
    assert bench.crossover(lengths, base, {1024: 2.0, 2048: 2.0, 4096: 2.0}) == pytest.approx(
        2 ** (10 + 0.5)
    )
    assert bench.crossover(lengths, base, {1024: 20.0, 2048: 20.0, 4096: 20.0}) is None
    assert bench.crossover(lengths, base, {1024: 0.5, 2048: 1.0, 4096: 1.0}) == 1024


def test_bad_sizes_are_refused(bench):
    with pytest.raises(ValueError, match="--reads"):
        bench.Config(reads=100, block=64)
