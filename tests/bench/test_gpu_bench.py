"""bench/gpu.py: its bookkeeping, and its --dry-run end to end on the CPU (interpret mode).

Timings are never asserted; these check that the script measures what it says
and reports it faithfully, so that it runs unchanged on a GPU machine.
"""

import json

import numpy as np
import pytest

from attn import masks
from tests.bench.script import load


@pytest.fixture(scope="module")
def bench():
    yield from load("gpu")


def test_useful_flops_count_the_visible_pairs(bench):
    T, w = 200, 16
    streaming = masks.causal() & (masks.sliding_window(w) | masks.initial_tokens(4))
    allowed = streaming.allowed(np.arange(T), np.arange(T))
    assert bench.visible_pairs("window_sinks", T, w) == allowed.sum()
    assert bench.visible_pairs("causal", T, w) == T * (T + 1) // 2  # about half of full
    p = dict(B=2, N=16, H=128, T=T, mask="full", mode="fwd+bwd")
    assert bench.useful_flops(p, w) == 4 * 2 * 16 * 128 * T * T * 3.5
    assert bench.peak_tflops("NVIDIA H200") == 989.0 and bench.peak_tflops("Tesla T4") is None


def test_the_gpu_sweep_and_its_skips(bench):
    todo = bench.points(bench.Config())
    assert {p["T"] for p in todo} == set(bench.LENGTHS)
    assert {(p["N"], p["H"]) for p in todo} == {(16, 128), (32, 64)}
    assert {p["B"] for p in todo} == {1, 2, 4}
    # jax.nn lacks initial tokens; cuDNN needs a GPU; materialized logits must fit.
    p = dict(impl="xla", mask="window_sinks", mode="fwd", B=1, N=16, H=128, T=32768)
    assert bench.skip_reason(p, "gpu", None, 0.7).startswith("not applicable")
    p.update(mask="causal", mode="fwd+bwd")
    assert bench.skip_reason(p, "gpu", 140 * 2**30, 0.7) == (
        "not measured: [B,N,T,S] arrays ~384 GiB"
    )
    assert bench.skip_reason(dict(p, T=4096), "gpu", 140 * 2**30, 0.7) is None
    assert bench.skip_reason(dict(p, impl="cudnn"), "cpu", None, 0.7).startswith("not measured")
    for impl in ("mosaic", "mosaic_1wg"):  # Hopper's kernels, the second only with --impls
        assert bench.skip_reason(dict(p, impl=impl), "cpu", None, 0.7).startswith("not measured")
    assert "mosaic_1wg" in bench.KNOWN_IMPLS and "mosaic_1wg" not in bench.IMPLS
    with pytest.raises(ValueError, match=r"^impls: expected some of .*got \['triton'\]"):
        bench.Config(impls=("pallas", "triton"))


@pytest.mark.integration
def test_dry_run_on_cpu_writes_the_report(bench, tmp_path):
    cfg = bench.Config(dry_run=True, masks=("causal", "window_sinks"), modes=("fwd", "fwd+bwd"),
                       out_dir=str(tmp_path))  # fmt: skip
    result = bench.main(cfg)
    rows = {(r["impl"], r["mask"]): r for r in result["rows"] if r["mode"] == "fwd+bwd"}
    forward = {(r["impl"], r["mask"]): r for r in result["rows"] if r["mode"] == "fwd"}
    for impl in ("pallas", "xla", "blockwise"):
        row = rows[impl, "causal"]
        assert row["status"] == "ok" and row["ms"] > 0 and row["tflops"] > 0
        assert row["program_bytes"] > 0
    assert rows["pallas", "window_sinks"]["status"] == "ok"
    # bf16 inputs against the float32 reference: bf16's rounding, not a wrong mask.
    assert 0 < forward["pallas", "window_sinks"]["max_abs_error"] < 0.02
    assert result["device"]["matmul_tflops"] > 0
    assert rows["cudnn", "causal"]["status"] == "not measured: cuDNN needs a GPU"
    assert rows["xla", "window_sinks"]["status"].startswith("not applicable")
    saved = json.loads((tmp_path / "gpu-dry-run.json").read_text())
    assert saved["rows"] == result["rows"]
    table = (tmp_path / "gpu-dry-run.md").read_text()
    assert "| causal | fwd+bwd | 1 | 2 | 16 | 64 |" in table
    assert (tmp_path / "gpu-dry-run.png").stat().st_size > 0
