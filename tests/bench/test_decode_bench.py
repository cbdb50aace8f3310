"""bench/decode.py end to end at tiny sizes: what it measures, and its report.

Timings are never asserted; the run checks that every implementation is timed
and that the memory and targets are computed from what it measured.
"""

import json

import pytest

from tests.bench.script import load


@pytest.fixture(scope="module")
def bench():
    yield from load("decode")


@pytest.mark.integration
def test_a_tiny_run_writes_the_report(bench, tmp_path):
    cfg = bench.Config(contexts=(40, 96), batches=(1, 3), max_tokens=100, splits=(2,),
                       ragged_lengths=(5, 17, 40), page_size=8, repeats=1,
                       out_dir=str(tmp_path), pallas=True)  # fmt: skip
    result = bench.main(cfg)
    shapes = [(r["S"], r["B"]) for r in result["rows"]]
    assert shapes == [(40, 1), (96, 1)]  # 40 x 3 and 96 x 3 are over max_tokens
    for row in result["rows"]:
        # The Pallas kernels in interpret mode: ours, and JAX's own as the peer.
        assert set(row["seconds"]) == set(bench.IMPLS + bench.PALLAS_IMPLS)
        assert all(t > 0 for t in row["seconds"].values())
        assert set(row["cores_busy"]) == set(row["seconds"])
        assert max(row["rel_err_vs_unsplit"].values()) < 1e-5
        assert all(c > 0 for c in row["cores_busy"].values())
        assert row["best_splits"] == 2 and row["default_splits"] == 1
    g = result["ragged"]
    per_token = 2 * cfg.kv_heads * cfg.head_dim * 4
    assert g["valid_bytes"] == 62 * per_token and g["contiguous_bytes"] == 3 * 40 * per_token
    assert g["paged_bytes"] == (1 + 3 + 5) * 8 * per_token  # pages of 8 per row
    names = [t["target"] for t in result["targets"]]
    assert names[0].startswith("split-K at S=96, B=1") and len(names) == 2
    top = result["rows"][-1]
    assert (
        result["targets"][0]["ceiling"] == result["env"]["cpu_count"] / top["cores_busy"]["unsplit"]
    )
    saved = json.loads((tmp_path / "decode-cpu.json").read_text())
    assert saved["rows"] == result["rows"]
    report = (tmp_path / "decode-cpu.md").read_text()
    assert "| 96 | 1 |" in report and "Pallas ops gqa (peer)" in report
    assert (tmp_path / "decode-cpu.png").stat().st_size > 0


def test_bad_sizes_are_refused(bench):
    with pytest.raises(ValueError, match="--contexts/--batches/--splits"):
        bench.Config(splits=())
