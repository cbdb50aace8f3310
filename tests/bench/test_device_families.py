"""bench/_device_families.py and bench/_fla_peer.py: the items' order, the FLOP counts,
the report; a dry run of one item per kind on the CPU (integration).

Timings are never asserted: these check what the phase measures and reports, so that
it runs unchanged on a GPU with torch and fla beside it.
"""

import importlib.util
import json
import time

import pytest

from bench import _device_families as fam
from bench import _device_families_plan as plan
from bench import _fla_peer
from bench._device_common import Context


def test_every_familys_8k_forward_backward_comes_first_ours_then_the_peer():
    items = fam.items(False)
    names = [i["name"] for i in items]
    assert len(set(names)) == len(names)
    points = {}  # each point's sides, in order: ours, then its peer (where fla has one)
    for i in items:
        points.setdefault(fam.point_key(i), []).append(i["side"])
    assert all(sides == (["ours"] if key[0] in fam.PEERLESS else ["ours", "peer"])
               for key, sides in points.items())  # fmt: skip
    assert [fam.point_key(i) for i in items] == [k for k, s in points.items() for _ in s]
    n = 2 * len(fam.FAMILIES)
    head = items[:n]
    assert [i["family"] for i in head[::2]] == list(fam.FAMILIES)
    assert head[0]["family"] == "gated_deltanet"
    assert all(i["T"] == 8192 and i["mode"] == "fwd+bwd" for i in head)
    assert [i["S"] for i in items[n : n + 4 : 2]] == [8192, 32768]  # then decoding
    memories = [i for i in items if i["family"] in fam.MEMORIES]  # last
    newer = [i for i in items if i["family"] in fam.NEWER]  # before them
    assert items[-len(memories) :] == memories
    assert items[-len(newer) - len(memories) : -len(memories)] == newer
    assert [i["family"] for i in newer[:6:2]] == list(fam.NEWER)
    assert [(i["T"], i["mode"]) for i in newer[:6]] == [(8192, "fwd+bwd")] * 6
    assert {i["T"] for i in newer if i["family"] == "path"} == {2048, 8192}
    first = [fam.point_key(i) for i in memories[:6]]  # each memory's 8K first, then 2K
    assert list(dict.fromkeys(first)) == [(f, 8192, "fwd+bwd") for f in fam.MEMORIES]
    assert {i["T"] for i in memories if i["family"] != "ttt_linear"} == {2048, 8192}
    assert {i["T"] for i in memories if i["family"] == "ttt_linear"} == set(plan.LENGTHS)
    older = items[: -len(newer) - len(memories)]
    assert [i["mode"] for i in older[-n:]] == ["fwd"] * n  # then forward only
    assert {i["B"] * i["T"] for i in items if "T" in i} == {fam.TOKENS}
    dry = fam.items(True)
    assert {i["family"] for i in dry} == {*fam.FAMILIES, "decode", *fam.NEWER, *fam.MEMORIES}
    assert {i["mode"] for i in dry if i["family"] == "kda"} == {"fwd+bwd"}


def test_flop_counts():
    softmax = dict(family="softmax", mode="fwd+bwd", B=4, T=8192, N=16, H=128)
    assert fam.flops(softmax) == 4 * 4 * 16 * 128 * (8192 * 8193 // 2) * 3.5
    C, H, E = 64, 128, 64
    linear = dict(family="linear", mode="fwd", B=1, T=2, N=1, H=H, E=E, chunk=C)
    assert fam.flops(linear) == 2 * (2 * C * (H + E) + 4 * H * E)
    delta = dict(linear, family="deltanet")
    assert fam.flops(delta) == 2 * (6 * C * H + 4 * C * E + 6 * H * E + C * C / 3)
    assert fam.flops(dict(delta, mode="fwd+bwd")) == 3 * fam.flops(delta)
    assert fam.flops(dict(delta, family="deltaproduct", n=1)) == fam.flops(delta)
    assert fam.flops(dict(delta, family="deltaproduct", n=2)) > 1.5 * fam.flops(delta)
    assert fam.flops(dict(family="decode", mode="step", B=1, S=8, K=1, H=8)) is None
    dplr = dict(delta, family="dplr")
    assert fam.flops(dplr) == 2 * (10 * C * H + 8 * C * E + 6 * H * E + 2 * H * H
                                   + 2 * H * H * E / C + C * C / 3)  # fmt: skip
    log_linear = dict(linear, family="log_linear", T=8192)
    assert fam.log_levels(8192, 64) == 7 and fam.log_levels(64, 64) == 0
    assert fam.flops(log_linear) == 8192 * (2 * C * (H + E) + 4 * H * E * 7)
    path = dict(softmax, family="path")
    assert fam.flops(path) == 2 * fam.flops(softmax)
    H, b, F = 64, plan.MINI_BATCH, 256
    ttt = dict(linear, family="ttt_linear", H=H, E=H)
    assert fam.flops(ttt) == 2 * (6 * H * H + 4 * b * H)
    assert fam.flops(dict(ttt, family="ttt_mlp")) == 2 * (14 * H * F + 4 * b * (H + F))
    assert fam.flops(dict(ttt, family="titans")) == 2 * (22 * H * F + 4 * b * (H + F))
    s = plan.CG_STEPS
    per_token = 4 * H * H + s * (2 * H * H + 4 * C * H) + 2 * H * H + 4 * C * H
    assert fam.flops(dict(ttt, family="mesa_net")) == 2 * per_token
    # A selection that covers every visible key reads what dense causal attention reads.
    sparse = dict(
        family="sparse",
        mode="fwd",
        B=1,
        T=256,
        N=2,
        H=16,
        moba_block=16,
        moba_top_k=16,
        dsa_top_k=256,
        index_heads=2,
        index_dim=8,
        compress_block=16,
        compress_stride=8,
        select_block=16,
        num_selected=16,
        window=256,
    )
    dense = fam.sparse_reads(sparse, "dense")[0]
    assert dense == 256 * 257 // 2
    assert fam.sparse_reads(sparse, "moba")[0] == fam.sparse_reads(sparse, "dsa")[0] == dense
    compressed = sum(max(0, (s - 16) // 8 + 1) for s in range(1, 257))
    assert fam.sparse_reads(sparse, "nsa")[0] == 2 * dense + compressed
    assert fam.flops(sparse, "dense") == 4 * 2 * 16 * dense
    assert fam.flops(sparse, "dsa") == 4 * 2 * 16 * dense + 2 * 2 * 8 * dense  # + the indexer


def _row(family, side, key, rows, T=8192, mode="fwd+bwd"):
    point = dict(family=family, T=T, B=4, mode=mode, N=16, H=128, E=128)
    return dict(point, name=f"{family} {side}", side=side, status="ok", **{key: rows})


def test_the_report_pairs_each_point_and_checks_the_target():
    ok = dict(status="ok", tflops=100.0, peak_share=0.1)
    rows = [
        _row("gated_deltanet", "ours", "ours", {"chunkwise": dict(ok, ms=10.0)}),
        _row(
            "gated_deltanet",
            "peer",
            "peers",
            {
                "fla": dict(
                    ok,
                    ms=4.0,
                    op="fla gdn",
                    match={"chunkwise": {"out": 1e-3, "grad": "g", "grad_rel": 2e-2}},
                )
            },
        ),
        _row("kda", "ours", "ours", {"chunkwise": dict(ok, ms=3.0)}),
        _row("kda", "peer", "peers", {"fla": dict(ok, ms=2.0)}),
        _row("deltanet", "ours", "ours", {"chunkwise": dict(ok, ms=3.0)}),
        dict(_row("deltanet", "peer", "peers", None), status="not measured: time budget"),
    ]
    md = fam.markdown(rows, {"dry_run": False, "matmul_tflops": 600.0})
    assert (
        "| 8192 | 4 | fwd+bwd | chunkwise | 10 ms / 100 TF / 10% | 4 ms / 100 TF / 10% | "
        "2.50x | out 1.0e-03, dg 2.0e-02 |" in md
    )
    assert "| 3 ms / 100 TF / 10% | not measured: time budget | - |" in md
    assert "gated_deltanet 2.50x (NOT met); kda 1.50x (met); deltanet not measured" in md
    assert md.rstrip().endswith("1 of 6 met.")
    assert "peer: fla gdn" in md and "measured matmul: 600 TFLOP/s" in md


def test_the_peer_says_why_it_is_not_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(_fla_peer, "_loaded", {})
    with pytest.raises(_fla_peer.Unavailable) as e:
        _fla_peer.load(None)
    if importlib.util.find_spec("torch") is None:
        assert str(e.value) == "torch is not installed"
    with pytest.raises(_fla_peer.Unavailable, match=str(e.value)):
        _fla_peer.load(None)  # remembered: not tried again
    (tmp_path / "fla").mkdir()
    (tmp_path / "fla" / "__init__.py").write_text('__version__ = "0.5.2"\n')
    (tmp_path / "COMMIT").write_text("bc3b101\n")
    assert _fla_peer.fla_version(tmp_path / "fla" / "__init__.py") == "0.5.2"
    assert _fla_peer.fla_commit(tmp_path) == "bc3b101"
    assert _fla_peer.fla_commit(tmp_path / "missing") == "unknown"
    assert _fla_peer.op_name("kda") == "fla.ops.kda.chunk_kda"


@pytest.mark.integration
def test_a_dry_run_of_one_point_per_kind_on_the_cpu(monkeypatch):
    monkeypatch.setattr(_fla_peer, "_loaded", {})
    ctx = Context(
        dry_run=True,
        platform="cpu",
        device_kind="cpu",
        matmul_tflops=0.05,
        peak_tflops=None,
        deadline=time.time() + 600,
        fla_path=None,
        repeats=2,
    )
    chosen = [("gated_deltanet", "fwd+bwd"), ("softmax", "fwd"), ("sparse", "fwd+bwd"),
              ("decode", "step"), ("mesa_net", "fwd+bwd"), ("titans", "fwd+bwd")]  # fmt: skip
    rows = [
        dict(item, **fam.run_item(item, ctx))
        for item in fam.items(True)
        if (item["family"], item["mode"]) in chosen
    ]
    json.dumps(rows)  # what bench/device.py prints
    by = {(r["family"], r["side"]): r for r in rows}
    gdn = by["gated_deltanet", "ours"]["ours"]["chunkwise"]
    assert gdn["status"] == "ok" and gdn["ms"] > 0 and gdn["tflops"] > 0
    assert gdn["flops"] == fam.flops(by["gated_deltanet", "ours"])
    peer = by["gated_deltanet", "peer"]
    assert peer["status"] == peer["peers"]["fla"]["status"]
    assert peer["status"].startswith("not measured: ")
    if importlib.util.find_spec("torch") is None:
        assert peer["status"] == "not measured: torch is not installed"
    softmax = by["softmax", "ours"]["ours"]
    assert softmax["pallas"]["status"] == softmax["blockwise"]["status"] == "ok"
    cudnn = by["softmax", "peer"]["peers"]["cudnn"]
    assert cudnn["status"] == "not measured: cuDNN needs a GPU"
    sparse = by["sparse", "ours"]["ours"]
    assert [f for f in sparse if sparse[f]["status"] == "ok"] == ["moba", "nsa", "dsa"]
    assert all(sparse[f]["flops"] == fam.flops(by["sparse", "ours"], f) for f in sparse)
    dense = by["sparse", "peer"]["peers"]
    assert dense["cudnn dense"]["status"] == "not measured: cuDNN needs a GPU"
    assert dense["fla nsa"]["status"].startswith("not measured: ")
    decode = by["decode", "ours"]["ours"]
    assert all(decode[f]["status"] == "ok" and decode[f]["gb_per_s"] > 0 for f in decode)
    # jax.nn computes the same step: bf16 rounding apart, the outputs agree.
    match = by["decode", "peer"]["peers"]["jax.nn"]["match"]
    assert set(match) == set(decode) and all(m["out"] < 0.02 for m in match.values())
    mesa = by["mesa_net", "ours"]["ours"]["chunkwise"]
    assert mesa["status"] == "ok" and mesa["flops"] == fam.flops(by["mesa_net", "ours"])
    assert by["mesa_net", "peer"]["status"].startswith("not measured: ")
    titans = by["titans", "ours"]["ours"]["dual"]
    assert titans["status"] == "ok" and ("titans", "peer") not in by  # fla has no kernel
    md = fam.markdown(rows, {"dry_run": True})
    assert "**titans** (N=2, H=16, E=16); peer: none (fla has no Titans kernel)" in md
    assert "**gated_deltanet**" in md and "**decode**" in md and "Dry run" in md
    assert "gated_deltanet not measured" in md
