"""The attention benchmark's bookkeeping: skips, targets, the table, and one child run.

Timing is never asserted (that is the benchmark's job, not a test's); these
check that the script measures what it says and reports it faithfully.
"""

import pytest

from tests.bench.script import load


@pytest.fixture(scope="module")
def bench():
    yield from load("attention")


def row(impl, mask, mode, T, seconds, rss=300 * 2**20):
    return dict(
        impl=impl, mask=mask, mode=mode, T=T, status="ok", seconds=seconds, peak_rss_bytes=rss
    )


def test_skips_materialized_arrays_that_do_not_fit_and_long_projections(bench):
    cfg = bench.Config(max_seconds=10.0)
    gib = 2**30
    # xla forward at T=8192 holds 2.5 [8, 8192, 8192] float32 arrays: 5 GiB.
    assert bench.skip_reason(cfg, "xla", "causal", "fwd", 8192, {}, memory=20 * gib) is None
    reason = bench.skip_reason(cfg, "xla", "causal", "fwd", 8192, {}, memory=4 * gib)
    assert reason.startswith("[N,T,S] float32 arrays: ~5 GiB")
    # Quadratic projection from the previous length: 3 s at 4K -> 12 s at 8K > 10 s.
    done = {(("blockwise", "full", "fwd"), 4096): {"status": "ok", "seconds": 3.0}}
    reason = bench.skip_reason(cfg, "blockwise", "full", "fwd", 8192, done, memory=gib)
    assert reason == "projected 12 s > 10 s"
    # ... except for the configurations the targets are about.
    done = {(("blockwise", "causal", "fwd+bwd"), 32768): {"status": "ok", "seconds": 30.0}}
    assert bench.skip_reason(cfg, "blockwise", "causal", "fwd+bwd", 65536, done, 1) is None
    done = {(("torch", "causal", "fwd"), 4096): {"status": "skipped: x"}}
    reason = bench.skip_reason(cfg, "torch", "causal", "fwd", 8192, done, memory=gib)
    assert reason == "a shorter length was not measured"


def test_targets_and_table_from_a_result(bench):
    rows = [
        row("blockwise", "causal", "fwd", 8192, 0.5),
        row("tiles", "causal", "fwd", 8192, 0.3),
        row("torch", "causal", "fwd", 8192, 0.4),
        row("xla", "causal", "fwd", 8192, 5.0),
        row("blockwise", "causal", "fwd+bwd", 8192, 1.5),
        row("blockwise", "causal", "fwd+bwd", 65536, 100.0, rss=2 * 10**9),
        dict(impl="xla", mask="causal", mode="fwd+bwd", T=65536, status="skipped: too big"),
    ]
    cfg = bench.Config(impls=("xla", "blockwise", "tiles", "torch"), masks=("causal",))
    result = dict(
        platform="cpu",
        config=dict(vars(cfg)),
        env=dict(cpu_count=2, load_average_at_start=(0.5,), load_average_at_end=(0.6,), nice=0),
        matmul_gflops=100.0,
        rows=rows,
    )
    for r in rows:
        if r["status"] == "ok":
            flops = bench.useful_flops(cfg, r["T"], r["mask"], r["mode"])
            r["matmul_fraction"] = flops / r["seconds"] / 100e9
    targets = {t["target"]: t for t in bench.targets(result)}
    assert targets["T=8192 fwd: blockwise / torch SDPA time"]["value"] == pytest.approx(1.25)
    assert targets["T=8192 fwd: blockwise / torch SDPA time"]["met"] is False
    assert targets["T=8192 fwd: jax.nn (xla) / blockwise time"]["value"] == pytest.approx(10)
    # 2 T^2 N H useful FLOPs at T=8192: 68.7 GFLOP in 0.5 s against 100 GFLOP/s.
    fraction = targets["T=8192 fwd: blockwise useful FLOP/s / matmul rate"]["value"]
    assert fraction == pytest.approx(2 * 8192**2 * 8 * 64 / 0.5 / 100e9)
    assert targets["T=65536 fwd+bwd: blockwise peak RSS (GB)"]["value"] == pytest.approx(2.0)
    assert targets["T=8192: blockwise fwd+bwd / fwd time"]["value"] == pytest.approx(3.0)
    assert targets["T=8192: blockwise fwd+bwd / fwd time"]["met"] is True

    result["targets"] = list(targets.values())
    table = bench.markdown(result)
    assert "| causal | fwd | 8192 | 5.000 s / 300 MB / 14% | 0.500 s / 300 MB / 137% |" in table
    assert "| 1.25 | 10.00 |" in table  # blockwise / torch, xla / blockwise
    assert "- xla causal fwd+bwd T=65536: skipped: too big" in table
    assert "tile matmuls alone take 0.300 s: 0.75x torch SDPA's" in table


def test_names_are_checked_before_any_measurement(bench):
    """A bad --impls (or --masks, --modes) is refused when the config is built, before a sweep."""
    with pytest.raises(ValueError, match=r"^--impls: expected names from .*got \['jax_nn'"):
        bench.Config(impls=("jax_nn", "blockwise", "torch"))
    with pytest.raises(ValueError, match=r"^--masks: "):
        bench.Config(masks=("causal", "sliding"))
    with pytest.raises(ValueError, match=r"^--modes: "):
        bench.Config(modes=())
    assert bench.Config(impls=("blockwise", "torch")).impls == ("blockwise", "torch")


@pytest.mark.integration
def test_a_tiny_sweep_writes_the_report(bench, tmp_path):
    """End to end: a child process per measurement (the matmul rate, each run)."""
    cfg = bench.Config(lengths=(64,), heads=2, head_dim=8, impls=("blockwise", "tiles"),
                       masks=("causal",), modes=("fwd",), rounds=1, repeats=1,
                       platform="cpu", matmul_size=256, out_dir=str(tmp_path))  # fmt: skip
    result = bench.main(cfg)
    assert {(r["impl"], r["T"], r["status"]) for r in result["rows"]} == {
        ("blockwise", 64, "ok"),
        ("tiles", 64, "ok"),
    }
    assert all(r["seconds"] > 0 and r["peak_rss_bytes"] > 0 for r in result["rows"])
    assert not any("peak_device_bytes" in r for r in result["rows"])  # on a CPU: the host's RSS
    assert result["matmul_gflops"] > 0
    assert (tmp_path / "attention-cpu.md").read_text().startswith("#")


@pytest.mark.integration
@pytest.mark.parametrize("score", ["mask", "bias"])
def test_scores_times_jax_nn_arrays_with_their_gradients(score):
    """``--scores``' child measurement of a boolean mask array and a bias (a tiny T): the
    step differentiates the float arguments only (the mask has no gradient)."""
    from bench import _scores

    spec = dict(impl="blockwise", score=score, mode="fwd+bwd", T=64, batch=1, heads=2,
                head_dim=8, repeats=1)  # fmt: skip
    result = _scores.time_scores(spec)
    assert result["seconds"] > 0
    assert score in _scores.SCORES
