"""bench/_device_numerics.py: its items, its verdicts, and its dry run on the CPU.

The dry run proves the harness and the tolerances: every form of every family
passes on the CPU against the float64 references, and a form that is off by
more than its tolerance is reported as a FAIL.
"""

import dataclasses
import time

import numpy as np
import pytest

import attn
from bench import _device_numerics as numerics
from bench._device_common import Context


def context(dry_run=True):
    return Context(dry_run=dry_run, platform="cpu", device_kind="cpu", matmul_tflops=0.0,
                   peak_tflops=None, deadline=time.time() + 600, fla_path=None)  # fmt: skip


def test_items_cover_every_family_and_form_most_important_first():
    device, dry = numerics.items(False), numerics.items(True)
    for todo in (device, dry):
        assert len({item["name"] for item in todo}) == len(todo)
        assert {item["case"] for item in todo} == set(numerics.CASES)
    # The fixed-state cases are the records' (every family with a reference, every variant),
    # and their training forms run right after softmax's kernels: one pass over all of them
    # before any runs a second item; float32 with TF32 comes last.
    records = {n for n, f in attn.linear.FAMILIES.items() if f.reference is not None}
    assert {n for n, _ in numerics.FIXED} == records >= {"comba", "log_linear_delta_rule"}
    first = device[5 : 5 + len(numerics.FIXED)]
    assert [item["case"] for item in first] == [f"{n}/{v}" for n, v in numerics.FIXED]
    assert [item["form"] for item in first] == [
        "chunkwise" if "chunkwise" in attn.linear.FAMILIES[n].forms else "dual"  # TTT's
        for n, _ in numerics.FIXED
    ]
    tf32 = [i for i, item in enumerate(device) if item["precision"] == "default"
            and item["dtype"] == "float32"]  # fmt: skip
    assert min(tf32) == len(device) - len(tf32)
    for name in records:  # every form of every family, on its first variant
        forms = {item["form"] for item in device if item["case"].startswith(name + "/")}
        assert forms == set(attn.linear.FAMILIES[name].forms), name
    # A CPU has no cuDNN and no TF32 (float32 at the default precision is float32 there).
    assert {item["form"] for item in device} > {item["form"] for item in dry} >= {"pallas", "xla"}
    assert not [
        item for item in dry if item["precision"] == "default" and item["dtype"] == "float32"
    ]
    assert len(dry) < len(device) <= 96  # a budget cut drops the tail
    assert {"parallel", "recurrent", "chunkwise", "quadratic", "gather", "paged"} <= {
        item["form"] for item in dry
    }


def test_the_comparison_flags_what_is_off_by_more_than_its_tolerance():
    rng = np.random.default_rng(0)
    out, state, grad = (rng.standard_normal(s) for s in ((2, 5, 3), (2, 3), (2, 5, 4)))
    want = {"out": [out, state], "grads": {"q": grad}}
    f32 = numerics.tolerance("float32", "highest")
    low = numerics.tolerance("bfloat16", "default")
    assert f32 == {"out": 1e-5, "grad": 1e-4} and low == numerics.tolerance("float32", "default")

    def got(out_scale=1.0, state_scale=1.0, grad_scale=1.0):
        return {"out": [out * out_scale, state * state_scale], "grads": {"q": grad * grad_scale}}

    exact = numerics.compare(got(), want, f32)
    assert exact["passed"] and exact["out_error"] == 0.0 and exact["worst_grad"] == "q"
    assert numerics.verdict(exact) == "ok"
    off = numerics.compare(got(out_scale=1 + 3e-5), want, f32)
    assert not off["passed"] and off["out_error"] == pytest.approx(3e-5, rel=1e-3)
    assert numerics.verdict(off) == "FAIL: output 3.0e-05 > 1e-05"
    assert numerics.compare(got(out_scale=1 + 3e-5), want, low)["passed"]
    assert not numerics.compare(got(out_scale=1 + 3e-2), want, low)["passed"]
    assert not numerics.compare(got(state_scale=1 + 3e-5), want, f32)["passed"]  # a final state
    off = numerics.compare(got(grad_scale=1 + 3e-4), want, f32)
    assert numerics.verdict(off) == "FAIL: dq 3.0e-04 > 1e-04"
    assert numerics.compare(got(grad_scale=1 + 3e-5), want, f32)["passed"]
    nan = got()
    nan["grads"]["q"][0, 0, 0] = np.nan
    assert numerics.verdict(numerics.compare(nan, want, low)) == "FAIL: dq inf > 1e-02"


def test_one_item_on_the_cpu_and_a_wrong_form_fails(monkeypatch):
    item = next(i for i in numerics.items(True) if i["name"] == "decode/causal/dense/float32")
    row = {**item, **numerics.run_item(item, context())}
    assert row["status"] == "ok" and row["passed"] and row["out_error"] < 1e-6
    assert row["reference"] == "float64" and row["grad_error"] is None  # forward only
    text = numerics.markdown([row], {"dry_run": True})
    assert "| decode | dense (" in text and "| pass |" in text and "**1 of 1 pass**" in text

    case = numerics.build_case(item["case"], True)
    wrong = dataclasses.replace(case, run=lambda form, a: case.run(form, a) * 1.0001)
    monkeypatch.setattr(numerics, "build_case", lambda name, dry_run: wrong)
    bad = {**item, **numerics.run_item(item, context())}
    assert bad["status"].startswith("FAIL: output ") and "> 1e-05" in bad["status"]
    assert not bad["passed"] and bad["out_error"] > 1e-5
    text = numerics.markdown([row, bad], {"dry_run": True})
    assert "**FAIL**" in text and "**1 of 2 pass**" in text


def first_of_each_case(items):
    """The first item of each family and case (``softmax/causal-gqa``, ``delta/kda``, ...):
    the items' order puts each family's fast form first; its other forms and dtypes run the
    same code on other arguments (and are each checked against float64 in tests/attn)."""
    seen = {}
    for item in items:
        seen.setdefault(tuple(item["name"].split("/")[:2]), item)
    return list(seen.values())


@pytest.mark.integration
def test_dry_run_of_every_case_passes_on_the_cpu(monkeypatch):
    ctx = context()
    items = first_of_each_case(numerics.items(True))
    assert len(items) == 9 + len(numerics.FIXED) and {i["name"].split("/")[0] for i in items} == {
        *("softmax", "moba", "nsa", "dsa", "decode", "path"),
        *(n for n, _ in numerics.FIXED),
    }
    rows = [{**item, **numerics.run_item(item, ctx)} for item in items]
    failed = [(r["name"], r["status"], r.get("grad_errors")) for r in rows if r["status"] != "ok"]
    assert not failed
    for row in rows:  # float32 at "highest" is far inside its tolerance on the CPU
        if row["tolerance"]["out"] == numerics.F32_TOL:
            assert row["out_error"] < 1e-6 and (row["grad_error"] or 0.0) < 1e-6, row["name"]
    text = numerics.markdown(rows, {"dry_run": True})
    assert f"**{len(rows)} of {len(rows)} pass**" in text and "FAIL" not in text
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len(table) == len(rows) + 2 and all(line.count("|") == 8 for line in table)

    # A form off by a little more than its tolerance, in its output and so its gradients.
    build = numerics.build_case
    for name, scale in (("linear_attention/gated/chunkwise/float32", 1 + 3e-5),
                        ("ssd/mamba2/chunkwise/bfloat16", 1 + 3e-2)):  # fmt: skip
        item = next(i for i in numerics.items(True) if i["name"] == name)
        case = build(item["case"], True)

        def run(form, a, case=case, scale=scale):
            out, state = case.run(form, a)
            return out * scale, state

        wrong = dataclasses.replace(case, run=run)
        monkeypatch.setattr(numerics, "build_case", lambda name, dry_run, wrong=wrong: wrong)
        bad = numerics.run_item(item, ctx)
        assert bad["status"].startswith("FAIL: output") and not bad["passed"], name
        assert bad["out_error"] > bad["tolerance"]["out"], name
