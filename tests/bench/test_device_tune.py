"""bench/_device_tune.py, the tune phase of bench/device.py: its cases, its search, its cache.

The search runs here on fake timings (no kernel compiles); the integration
test runs two dry-run items end to end in interpret mode and reads the cache
they write back through ``attn.pallas.tuning``.
"""

import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from attn.pallas import flash, tuning
from attn.pallas.blocks import BLOCKS, Blocks
from attn.softmax.call import check_call
from bench import _device_tune as tune
from bench._device_common import Context


def context(seconds=60.0, dry_run=True):
    return Context(dry_run=dry_run, platform="cpu", device_kind="cpu", matmul_tflops=1.0,
                   peak_tflops=None, deadline=time.time() + seconds, fla_path=None,
                   repeats=2)  # fmt: skip


def test_the_cases_their_order_and_their_keys():
    todo = tune.items(dry_run=False)
    names = [item["name"] for item in todo]
    assert names[:2] == ["causal-h128-16k", "causal-h128-4k"]  # the target first
    assert len(set(names)) == len(names) == 12
    assert {(i["mask_class"], i["H"], i["T"]) for i in todo} == {
        (m, H, T) for m in ("causal", "full", "sparse") for H in (64, 128) for T in (4096, 16384)
    }
    # Each mask class's H = 128 case comes before its H = 64 one, at each length.
    for m in ("causal", "full", "sparse"):
        for T in (4096, 16384):
            order = [i["H"] for i in todo if i["mask_class"] == m and i["T"] == T]
            assert order == [128, 64]
    for item in todo + tune.items(dry_run=True):
        mask = tune.build_mask(item)
        key = tuning.case(item["H"], item["H"], jnp.bfloat16, mask, item["T"], item["T"]).key
        assert tuning.parse_key(key).mask == item["mask_class"], item["name"]
        assert item["fwd_tiles"] and item["bwd_tiles"]
    for item in todo:  # bench/gpu.py's shapes
        assert item["N"] * item["H"] == 2048 and item["B"] == tune.batch_for(item["T"])
    assert {i["mask_class"] for i in tune.items(dry_run=True)} == {"causal", "full", "sparse"}
    assert Blocks._fields == tune.FIELDS


def test_visible_pairs_and_useful_flops():
    for mask in ("causal", "full", "window_sinks"):
        item = dict(mask=mask, T=200, window=16, B=2, N=4, H=64)
        pos = np.arange(200)
        assert tune.visible_pairs(item) == tune.build_mask(item).allowed(pos, pos).sum()
        assert tune.useful_flops(item, "fwd+bwd") == 3.5 * tune.useful_flops(item, "fwd")
    assert tune.useful_flops(dict(mask="full", T=10, window=1, B=1, N=2, H=8), "fwd") == 6400


def test_defaults_are_the_kernels_own(monkeypatch):
    """The sweep's baseline is what a GPU without an entry compiles."""
    monkeypatch.setenv(tuning.ENV, "")  # no cache: on a GPU host the committed one may apply
    q = jnp.zeros((1, 4096, 16, 128), jnp.bfloat16)
    call = check_call(q, q, q)
    c = flash._config(call, jnp.bfloat16, None, None, False, "gpu", None, None)
    want = tune.default_tiles(128)
    assert (c.block_q, c.block_k, c.bwd_block_q, c.bwd_block_k) == tuple(want[:4])
    assert c.launch() == (want.num_warps, want.num_stages)
    assert c.launch(backward=True) == (want.bwd_num_warps, want.bwd_num_stages)
    assert tune.default_tiles(64).num_warps == 4 and want[:4] == BLOCKS["gpu"][:4]
    assert tune.describe(want) == "fwd 128x64 w8 s2, bwd 64x64 w8 s2"


def fake_timings(monkeypatch, ms):
    """``Sweep._measure`` as ``ms(mode, Blocks)`` (None: a compile failure), compiling nothing."""

    def measure(self, mode, tiles):
        got = ms(mode, Blocks(*tiles))
        if got is None:
            raise RuntimeError("out of resource: shared memory\nmore")
        return dict(ms=got, compile_seconds=0.0, rel_error=0.0)

    monkeypatch.setattr(tune.Sweep, "_measure", measure)


def small_item(**lists):
    item = dict(tune.items(dry_run=True)[1], name="t", fwd_tiles=[[64, 128], [32, 32]],
                fwd_warps=[4, 8], fwd_stages=[3], bwd_tiles=[[32, 64]], bwd_warps=[8],
                bwd_stages=[1])  # fmt: skip
    return dict(item, **lists)


def test_the_search_takes_each_pass_best_and_skips_failures(monkeypatch):
    def ms(mode, t):
        if t.block_q == 32:
            return None  # fails to compile
        fwd = 1.0 - 0.5 * (t.block_k == 128) - 0.1 * (t.num_warps == 8) + 0.2 * (t.num_stages == 3)
        if mode == "fwd":
            return fwd
        return fwd + 4.0 - 1.0 * (t.bwd_block_q == 32) - 0.3 * (t.bwd_num_stages == 1)

    fake_timings(monkeypatch, ms)
    r = tune.run_item(small_item(), context())
    tuned = Blocks(*r["tuned"])
    assert (tuned.block_q, tuned.block_k, tuned.num_warps, tuned.num_stages) == (64, 128, 8, 2)
    assert (tuned.bwd_block_q, tuned.bwd_block_k, tuned.bwd_num_stages) == (32, 64, 1)
    assert r["fwd_ms"] == pytest.approx(0.4) and r["fwd_bwd_ms"] == pytest.approx(3.1)
    assert r["default_fwd_ms"] == pytest.approx(1.0) and r["forward_kept"]
    assert r["failed"] == 1 and r["cut"] == 0
    failed = [row for row in r["tried"] if "error" in row]
    assert failed[0]["error"] == "RuntimeError: out of resource: shared memory"
    assert r["key"] == "h16-16bit-sparse-64" and r["cudnn_note"].startswith("not applicable")
    table = tune.markdown([dict(small_item(), **r)], dict(peak_tflops=989.0))
    assert "| t | `h16-16bit-sparse-64` | 1 | 1 | 0.4 | 2.50x | — |" in table
    assert "fwd 64x128 w8 s2, bwd 32x64 w4 s1" in table and "Candidates skipped:" in table


def test_the_guard_keeps_the_default_forward_where_it_is_faster_with_the_backward(monkeypatch):
    def ms(mode, t):
        wide = t.block_k == 128  # a faster forward whose tiles slow the dq kernel down
        if mode == "fwd":
            return 0.5 if wide else 1.0
        return (9.0 if wide else 5.0) - 1.0 * (t.bwd_block_q == 32)

    fake_timings(monkeypatch, ms)
    r = tune.run_item(small_item(fwd_tiles=[[64, 128]], fwd_warps=[], fwd_stages=[]), context())
    tuned = Blocks(*r["tuned"])
    assert (tuned.block_k, tuned.bwd_block_q) == (64, 32) and not r["forward_kept"]
    assert r["fwd_ms"] == 1.0 and r["fwd_bwd_ms"] == 4.0
    table = tune.markdown([dict(small_item(), **r)], dict(peak_tflops=None))
    assert "(the default forward: its winner was not faster with the backward)" in table
    assert Blocks(*r["fwd_winner"]).block_k == 128


def test_a_near_deadline_cuts_candidates_but_never_the_defaults(monkeypatch):
    fake_timings(monkeypatch, lambda mode, t: 1.0 if t.block_k == 128 else 2.0)
    r = tune.run_item(small_item(), context(seconds=-1.0))
    assert r["status"] == "ok" and r["tuned"] == r["default"] == list(tune.default_tiles(16))
    assert r["cut"] > 0 and len(r["tried"]) == 2  # the default forward and fwd+bwd


@pytest.mark.integration
def test_dry_run_items_write_a_cache_the_kernel_reads(tmp_path, monkeypatch):
    committed = tuning.CACHE.read_bytes()
    todo = [dict(item, fwd_tiles=[*item["fwd_tiles"], [0, 32]])
            for item in tune.items(dry_run=True)[1:]]  # fmt: skip
    rows = [dict(item, **tune.run_item(item, context())) for item in todo]
    assert [r["status"] for r in rows] == ["ok", "ok"]
    for r in rows:  # the bad tile is refused by flash_attention's check, recorded, skipped
        assert r["failed"] == 1 and "tiles: expected block_q a positive int" in str(r["tried"])
        assert r["default_fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["cudnn_fwd_ms"] is None
    info = dict(dry_run=True, kind="cpu", platform="cpu", jax="x", peak_tflops=None)
    table = tune.markdown(rows, info)
    assert all(f"| {r['name']} | `{r['key']}` |" in table for r in rows)
    (path,) = tune.finish(rows, info, tmp_path)
    assert path == tmp_path / "tuned-dry-run.json"
    assert tuning.CACHE.read_bytes() == committed  # a dry run never writes the committed cache
    entries = tuning.load(path)["cpu"]
    for r in rows:
        assert entries[tuning.parse_key(r["key"])] == Blocks(*r["tuned"])
    # The kernel reads it for the named device: the window row's tiles.
    monkeypatch.setenv(tuning.ENV, str(path))
    r = rows[0]
    q = jnp.zeros((r["B"], r["T"], r["N"], r["H"]), jnp.bfloat16)
    call = check_call(q, q, q, mask=tune.build_mask(r))
    c = flash._config(call, jnp.bfloat16, None, None, True, "cpu", None, "cpu")
    want = Blocks(*r["tuned"])
    fit = [min(b, r["T"]) for b in want[:4]]
    assert [c.block_q, c.block_k, c.bwd_block_q, c.bwd_block_k] == fit
    assert Path(path).read_text().startswith('{\n  "format": 1,')
