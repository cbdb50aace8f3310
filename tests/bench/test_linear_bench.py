"""bench/linear.py end to end at tiny sizes, both families: every form timed, the report written.

Timings are never asserted; the runs check that every measurement the report
promises is made and written.
"""

import json

import pytest

from tests.bench.script import load

TINY = dict(lengths=(64,), max_len=64, train_len=64, heads=2, head_dim=8, chunk_size=16,
            decode_steps=2, quick=True)  # fmt: skip


@pytest.fixture(scope="module")
def bench():
    yield from load("linear")


@pytest.mark.integration
def test_a_tiny_linear_run_writes_the_report(bench, tmp_path):
    result = bench.main(bench.Config(**TINY, out_dir=str(tmp_path)))
    seconds = result["forms"]["seconds"]
    assert set(seconds) == {"parallel", "recurrent", "chunkwise", "softmax"}
    assert all(list(by_len) == [64] and all(t > 0 for t in by_len.values())
               for by_len in seconds.values())  # fmt: skip
    assert all(t > 0 for t in result["train"]["seconds"].values())
    assert list(result["decode"]["linear_step"]) == list(result["decode"]["softmax_step"])
    saved = json.loads((tmp_path / "linear-cpu-quick.json").read_text())
    assert saved["forms"]["softmax_impl"] == result["forms"]["softmax_impl"]
    assert (tmp_path / "linear-cpu-quick.md").read_text().startswith("#")
    assert (tmp_path / "linear-cpu-quick.png").stat().st_size > 0


@pytest.mark.integration
def test_a_tiny_delta_run_writes_the_report(bench, tmp_path):
    """The delta rule's family (bench/_delta.py), two of its methods (compiles dominate; the
    float64 oracle is tests/attn/linear/test_delta.py's, not rerun here)."""
    methods = ("gated_deltanet chunkwise", "gla chunkwise")
    cfg = bench.Config(**TINY, family="delta", delta_methods=methods, oracle=False,
                       out_dir=str(tmp_path))  # fmt: skip
    delta = bench.main(cfg)["delta"]
    assert set(delta["lengths"]["forward_backward"]) == set(methods)
    assert all(s[64] > 0 for s in delta["lengths"]["forward_backward"].values())
    assert delta["targets"]["oracle_gradient_error"]["met"] is None  # not measured
    assert (tmp_path / "delta-cpu-quick.md").read_text().startswith("#")


@pytest.mark.integration
def test_a_tiny_mamba2_run_writes_the_report(bench, tmp_path):
    """Mamba-2's family (bench/_mamba.py): its three forms and gated linear attention, timed
    (the float64 oracle is tests/attn/linear/test_mamba.py's, not rerun here)."""
    cfg = bench.Config(**TINY, family="mamba2", oracle=False, out_dir=str(tmp_path))
    mamba = bench.main(cfg)["mamba2"]
    fb = mamba["lengths"]["forward_backward"]
    assert set(fb) == {"ssd chunkwise", "ssd recurrent", "ssd quadratic", "gla chunkwise"}
    assert all(s[64] > 0 for s in fb.values())
    assert mamba["oracle"] == {} and mamba["targets"]["oracle_gradient_error"]["met"] is None
    assert mamba["targets"]["ssd_over_gla_fwd_bwd_at_4k"]["value"] is None  # not measured
    assert mamba["decode_tokens_per_s"] > 0
    assert (tmp_path / "mamba2-cpu-quick.md").read_text().startswith("# Mamba-2")
