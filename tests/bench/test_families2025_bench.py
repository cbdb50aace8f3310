"""bench/families2025.py end to end at tiny sizes: a family and its relative timed, the
ratio and its target computed, the report written.

Timings are never asserted; the run checks that every measurement the report
promises is made and written. Two of the pairs (compiles dominate the run).
"""

import json

import pytest

from tests.bench.script import load

METHODS = ("log_linear_mamba2 chunkwise", "ssd chunkwise", "path blockwise", "softmax blockwise")
TINY = dict(lengths=(32,), max_len=32, heads=2, head_dim=8, chunk_size=8, path_blocks=(8, 16),
            path_block_at=32, quick=True, methods=METHODS)  # fmt: skip


@pytest.fixture(scope="module")
def bench():
    yield from load("families2025")


@pytest.mark.integration
def test_a_tiny_run_writes_the_report(bench, tmp_path):
    result = bench.main(bench.Config(**TINY, out_dir=str(tmp_path)))
    L = result["lengths"]
    for kind in ("forward", "forward_backward"):
        assert set(L[kind]) == set(METHODS)
        timed = {n: by_t for n, by_t in L[kind].items() if by_t[32] is not None}
        assert all(list(by_t) == [32] and by_t[32] > 0 for by_t in timed.values())
    # PaTH's forward + backward is timed (its block inverse is matmuls, not LAPACK's solve).
    assert L["forward_backward"]["path blockwise"][32] > 0
    assert result["path_block"]["block_size"] in (8, 16)
    assert set(result["path_block"]["seconds"]["forward_backward"]) == {8, 16}
    ratios = result["ratios"]
    assert set(ratios) == {"log_linear_mamba2 / ssd", "path / softmax"}  # both measured
    path = ratios["path / softmax"]
    assert path["bound"] == 3.0 and path["forward"]["ratio"][32] > 0
    assert path["forward"]["met"] == (path["forward"]["worst"] <= 3.0)
    assert path["forward_backward"]["met"] == (path["forward_backward"]["worst"] <= 3.0)
    assert ratios["log_linear_mamba2 / ssd"]["forward"]["met"] is None  # shown, no target
    saved = json.loads((tmp_path / "families2025-cpu-quick.json").read_text())
    assert saved["path_block"]["block_size"] == result["path_block"]["block_size"]
    table = (tmp_path / "families2025-cpu-quick.md").read_text()
    assert table.startswith("# The 2025 families") and "| path / softmax |" in table
    assert (tmp_path / "families2025-cpu-quick.png").stat().st_size > 0


@pytest.mark.integration
def test_the_trained_memories_are_timed_beside_gated_deltanet(bench, tmp_path):
    """Issue 71's rows: TTT-Linear and MesaNet at 8 CG steps against their 3x target, TTT-MLP
    and Titans shown (``bench.MEMORIES``: what ``bench/results/memories-cpu.md`` runs)."""
    tiny = dict(TINY, methods=bench.MEMORIES, path_blocks=(8,))
    result = bench.main(bench.Config(**tiny, out_dir=str(tmp_path), name="memories"))
    for kind in ("forward", "forward_backward"):
        assert all(result["lengths"][kind][n][32] > 0 for n in bench.MEMORIES)
    ratios = result["ratios"]
    assert {p: ratios[p]["bound"] for p in ratios} == {
        "ttt_linear / gated_deltanet": 3.0, "mesanet_cg8 / gated_deltanet": 3.0,
        "ttt_mlp / gated_deltanet": None, "titans_mlp / gated_deltanet": None,
    }  # fmt: skip
    assert "| mesanet_cg8 / gated_deltanet |" in (tmp_path / "memories-quick.md").read_text()
