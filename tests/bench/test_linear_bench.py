"""bench/linear.py end to end at tiny sizes, both families: every form timed, the report written.

Timings are never asserted; the runs check that every measurement the report
promises is made and written.
"""

import json

import pytest

from tests.bench.script import load

TINY = dict(lengths=(32, 64), max_len=64, train_len=64, heads=2, head_dim=8, chunk_size=16,
            decode_steps=2, quick=True)  # fmt: skip


@pytest.fixture(scope="module")
def bench():
    yield from load("linear")


def test_a_tiny_linear_run_writes_the_report(bench, tmp_path):
    result = bench.main(bench.Config(**TINY, out_dir=str(tmp_path)))
    seconds = result["forms"]["seconds"]
    assert set(seconds) == {"parallel", "recurrent", "chunkwise", "softmax"}
    assert all(list(by_len) == [32, 64] and all(t > 0 for t in by_len.values())
               for by_len in seconds.values())  # fmt: skip
    assert all(t > 0 for t in result["train"]["seconds"].values())
    assert list(result["decode"]["linear_step"]) == list(result["decode"]["softmax_step"])
    saved = json.loads((tmp_path / "linear-cpu-quick.json").read_text())
    assert saved["forms"]["softmax_impl"] == result["forms"]["softmax_impl"]
    assert (tmp_path / "linear-cpu-quick.md").read_text().startswith("#")
    assert (tmp_path / "linear-cpu-quick.png").stat().st_size > 0


def test_a_tiny_delta_run_writes_the_report(bench, tmp_path):
    """The delta rule's family (bench/_delta.py) at one length: its compiles dominate."""
    result = bench.main(bench.Config(**{**TINY, "lengths": (64,)}, family="delta",
                                     out_dir=str(tmp_path)))  # fmt: skip
    delta = result["delta"]
    assert all(list(by_len) == [64] for by_len in delta["lengths"]["forward_backward"].values())
    assert delta["oracle_T"] == 65  # one past the longest length, a multiple of no chunk
    assert delta["targets"]["oracle_gradient_error"]["met"]
    assert (tmp_path / "delta-cpu-quick.md").read_text().startswith("#")
