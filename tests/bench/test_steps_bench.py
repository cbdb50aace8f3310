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


@pytest.mark.integration
def test_one_variant_one_round(bench, tmp_path):
    # --config: any comparison's file (here the main job's, under another name); its
    # variants are the default and its name names the report.
    config = tmp_path / "my_compare.py"
    config.write_text(
        "from configs.compare_mqar import get_config as main_job\n\n\n"
        "def get_config():\n    return main_job()\n"
    )
    cfg = bench.Config(variants=("mha",), steps=2, rounds=1, out_dir=tmp_path, matmul_repeats=4,
                       xla_flags="--xla_backend_optimization_level=0", config=config)  # fmt: skip
    bench.main(cfg)
    saved = json.loads((tmp_path / "steps-my_compare-cpu.json").read_text())
    (run,) = saved["runs"]["mha"]["after"]
    assert run["tokens_per_s"] > 0 and run["flops_per_step"] > 0
    assert saved["meta"]["steps"] == 2 and saved["meta"]["baseline_commit"] is None
    meta = saved["meta"]
    assert meta["sizes"] == "width 64, 2 layers, batch 64, 24 tokens"
    assert meta["projection"] == "[1536,64] @ [64,192]" and meta["config"] == str(config)
    table = (tmp_path / "steps-my_compare-cpu.md").read_text()
    assert "mha" in table and "width 64, 2 layers" in table
