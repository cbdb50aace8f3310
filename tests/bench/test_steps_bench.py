"""bench/steps.py end to end at a tiny size: one variant, two child runs, the report written.

Timings are never asserted; the run checks that a child trains, counts its
FLOPs and measures the matmul rate, and that the table reports them.
"""

import json

import pytest

from tests.bench.script import load


@pytest.fixture(scope="module")
def bench():
    yield from load("steps")


def test_one_variant_one_round(bench, tmp_path):
    cfg = bench.Config(variants=("mha",), steps=2, rounds=1, out_dir=tmp_path, matmul_repeats=4,
                       xla_flags="--xla_backend_optimization_level=0")  # fmt: skip
    bench.main(cfg)
    saved = json.loads((tmp_path / "steps-cpu.json").read_text())
    (run,) = saved["runs"]["mha"]["after"]
    assert run["tokens_per_s"] > 0 and run["flops_per_step"] > 0
    assert saved["meta"]["steps"] == 2 and saved["meta"]["baseline_commit"] is None
    assert "mha" in (tmp_path / "steps-cpu.md").read_text()
