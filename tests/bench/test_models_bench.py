"""bench/models.py end to end at a tiny size: every row measured, the report written.

Timings are never asserted; the run checks that each kind's parameters, cache
bytes and generation rate are measured and written.
"""

import json

import pytest

from tests.bench.script import load


@pytest.fixture(scope="module")
def bench():
    yield from load("models")


@pytest.mark.integration
def test_a_quick_run_of_the_hybrid_writes_the_report(bench, tmp_path):
    """The hybrid holds every kind of cache: linear state, ring buffer, latents, K/V."""
    bench.main(bench.Config(quick=True, kinds=("hybrid",), repeats=1, new_tokens=2,
                            out_dir=tmp_path))  # fmt: skip
    saved = json.loads((tmp_path / "models-cpu-quick.json").read_text())
    (row,) = saved["rows"]
    assert row["kind"] == "hybrid" and row["params"] > 0 and row["tokens_per_s_b1"] > 0
    # Its full layers (MLA, GQA) grow per token; the linear state and the window do not.
    assert row["cache_bytes_per_token"] > 0 and row["cache_fixed_bytes"] > 0
    table = (tmp_path / "models-cpu-quick.md").read_text()
    assert "2 new tokens" in table and "| hybrid |" in table
