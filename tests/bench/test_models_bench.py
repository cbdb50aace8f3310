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


def test_a_quick_run_writes_the_report(bench, tmp_path):
    bench.main(bench.Config(quick=True, repeats=1, new_tokens=2, out_dir=tmp_path))
    saved = json.loads((tmp_path / "models-cpu-quick.json").read_text())
    assert [row["kind"] for row in saved["rows"]] == list(bench.QUICK_KINDS)
    for row in saved["rows"]:
        assert row["params"] > 0 and row["tokens_per_s_b1"] > 0
        # The hybrid's linear and window layers add fixed bytes; GQA's grow per token only.
        assert row["cache_bytes_per_token"] > 0
    fixed = {row["kind"]: row["cache_fixed_bytes"] for row in saved["rows"]}
    assert fixed["hybrid"] > fixed["gqa (K=2)"]
    table = (tmp_path / "models-cpu-quick.md").read_text()
    assert "2 new tokens" in table and "| hybrid |" in table
