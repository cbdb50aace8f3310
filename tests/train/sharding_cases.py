"""Every fake-device case, run in one subprocess on 8 CPU devices: sharded training here,
sequence-parallel models in ``tests/models/test_ring_models.py``.

``python tests/train/sharding_cases.py WORKDIR`` (with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before JAX starts)
prints one JSON line per case, ``{"case", "ok", ...}``, and exits 0 when all pass.
The tests call ``results()``, which runs that once per test session: JAX
starts once and each program compiles once for all the checks.
"""

import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from models import ModelConfig, pattern, presets  # noqa: E402
from tests import fake_devices  # noqa: E402
from tests.train.tiny_config import get_config  # noqa: E402
from tests.util import rel_err  # noqa: E402
from train import sharding  # noqa: E402
from train.checkpoint import Checkpointer, snapshot  # noqa: E402
from train.loop import train  # noqa: E402
from train.steps import init_state, place  # noqa: E402
from train.tasks import make_task  # noqa: E402

RTOL = 1e-5
STEPS = 6  # one run length for every case, so that their programs compile once


def results(tmp_path_factory) -> dict[str, dict]:
    """The results by case name of this file run in a subprocess with 8 fake CPU devices,
    once per test session (``tests.fake_devices.results``)."""
    root = tmp_path_factory.mktemp("sharding_cases")
    return fake_devices.results(tmp_path_factory, "sharding_cases", [__file__, str(root)], 900)


def config(**kw):
    """The tiny config, wide enough (D = 64) that fsdp shards its projections and MLP."""
    base = get_config()
    model = ModelConfig(
        width=64, mlp_width=128, layers=pattern(("mha",), presets(num_heads=4, head_dim=16))
    )
    fields = dict(
        model=model, eval_every=1000, eval_batches=1, ckpt_every=3, log_every=1, batch_size=8
    )
    return dataclasses.replace(base, **{**fields, **kw}).with_task_vocab()


def params(workdir, cfg):
    """The last checkpoint's arrays (parameters, optimizer state, step), keyed by path."""
    model, optimizer = init_state(cfg, make_task(cfg.task).vocab_size)
    ckpt = Checkpointer(workdir, async_save=False)
    tree, _ = ckpt.restore(ckpt.latest_step(), snapshot(model, optimizer, 0))
    ckpt.close()
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree.leaves_with_path(tree)}


def rel_error(a, b) -> float:
    """The largest norm-wise relative error ``||a - b|| / ||b||`` over the arrays."""
    assert a.keys() == b.keys()
    return max(rel_err(a[k], b[k]) for k in a)


def case_layout(root):
    """The rules shard the large parameters and their Adam moments on fsdp, replicate the rest."""
    cfg = config()
    mesh = sharding.make_mesh("data=2,fsdp=4")
    model, optimizer = init_state(cfg, make_task(cfg.task).vocab_size)
    place(mesh, model, optimizer)
    specs = {
        jax.tree_util.keystr(k): v.sharding.spec
        for k, v in jax.tree.leaves_with_path(nnx.to_pure_dict(nnx.state((model, optimizer))))
    }
    sharded = sorted(k for k, s in specs.items() if "fsdp" in tuple(s))
    up = [k for k in sharded if "mlp" in k and "up" in k]
    ok = len(up) == 3 and all("fsdp" not in tuple(s) for k, s in specs.items() if "embed" in k)
    ok &= all(tuple(specs[k]) == () for k in specs if "count" in k or "scale" in k)
    return {"ok": ok, "sharded": len(sharded), "of": len(specs), "mlp_up": up}


def case_one_step(root):
    """One sharded step equals the single-device step with sequence parallelism (ring
    attention over seq) on data=2,fsdp=2,seq=2, on a mesh of Auto axes and of Explicit ones
    (where the step gathers the fsdp shards itself); data=8 and fsdp=4,data=2 alone:
    ``case_resume_on_another_mesh``."""
    cfg = config(steps=STEPS)
    train(cfg, root / "single", stop_at=1, progress=False)
    ref = params(root / "single", cfg)
    errors = {}
    meshes = [("auto", "data=2,fsdp=2,seq=2"), ("explicit", "data=2,fsdp=2,seq=2")]
    for i, (types, mesh) in enumerate(meshes):
        run = dataclasses.replace(cfg, mesh=mesh, mesh_axis_types=types)
        train(run, root / f"step{i}", stop_at=1, progress=False)
        errors[f"{types} {mesh}"] = rel_error(params(root / f"step{i}", cfg), ref)
    return {"ok": all(e <= RTOL for e in errors.values()), "rel": errors}


def losses(workdir) -> list[float]:
    """The training loss of every logged step of a run."""
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


def case_hybrids_train_as_one_device(root):
    """``python -m train --mesh data=2,seq=4 --mesh-axis-types explicit`` on a recurrent
    hybrid (a Gated DeltaNet and a Mamba-2 layer, then softmax on the ring): 10 steps'
    losses equal one device's to 5 digits, and so do the final parameters as one vector
    (Adam's moments of near-zero gradients, leaf by leaf, amplify float rounding).
    Explicit axes: every array states its sharding, so each sharded layer reshards its
    inputs and hands its output back in the residual stream's layout (Auto axes, and the
    sharded short convolutions: ``tests/models/test_sequence_models.py``)."""
    layers = pattern(("gated_deltanet", "mamba2", "mha"), presets(num_heads=2, head_dim=8))
    model = dataclasses.replace(get_config().model, layers=layers)
    cfg = dataclasses.replace(
        get_config(), model=model, steps=10, log_every=1, eval_every=1000, ckpt_every=10
    )
    train(cfg, root / "hybrid_single", progress=False)
    seq = dataclasses.replace(cfg, mesh="data=2,seq=4", mesh_axis_types="explicit")
    train(seq, root / "hybrid_seq", progress=False)
    single, seq = losses(root / "hybrid_single"), losses(root / "hybrid_seq")
    rel = max(abs(a - b) / abs(b) for a, b in zip(seq, single, strict=True))
    got, want = params(root / "hybrid_seq", cfg), params(root / "hybrid_single", cfg)
    names = [k for k in want if k.startswith("['params']")]
    params_rel = rel_err(
        np.concatenate([np.ravel(got[k]) for k in names]),
        np.concatenate([np.ravel(want[k]) for k in names]),
    )
    ok = len(single) == 10 and rel <= 1e-5 and params_rel <= 1e-5
    return {"ok": ok, "loss_rel": rel, "params_rel": params_rel, "steps": len(single)}


def case_resume_on_another_mesh(root):
    """Checkpoint on data=8, resume as fsdp=4,data=2: equals the single-device run (that of
    ``case_one_step``, continued; on one device a resume is bit-exact)."""
    cfg = config(steps=STEPS)
    train(cfg, root / "single", progress=False)
    train(dataclasses.replace(cfg, mesh="data=8"), root / "moved", stop_at=3, progress=False)
    summary = train(dataclasses.replace(cfg, mesh="fsdp=4,data=2"), root / "moved", progress=False)
    recorded = json.loads((root / "moved" / "config.json").read_text())["mesh"]
    rel = rel_error(params(root / "moved", cfg), params(root / "single", cfg))
    ok = rel <= RTOL and summary["step"] == STEPS and recorded == "fsdp=4,data=2"
    return {"ok": ok, "rel": rel, "recorded_mesh": recorded}


def case_bad_meshes(root):
    """Bad mesh strings, a batch or sequence the mesh does not divide, and layers that cannot
    run sequence-parallel raise ValueError naming the field (before anything compiles)."""
    raised = {}
    for spec in ("data=3", "data=4", "model=8", "data=2,data=4", "data=0,fsdp=8", "data8"):
        try:
            sharding.make_mesh(spec)
            raised[spec] = None
        except ValueError as e:
            raised[spec] = str(e)
    ok = all(m is not None and m.startswith("mesh:") for m in raised.values())
    ok &= sharding.make_mesh("seq=8").shape["seq"] == 8
    seq = dict(mesh="data=2,fsdp=2,seq=2")
    layers = presets(num_heads=4, head_dim=16)
    mha, mla = layers["mha"], layers["mla"]
    dense = dataclasses.replace(mha, impl="dense")
    runs = {
        "batch_size:": config(mesh="fsdp=8", batch_size=4),
        "task.seq_len:": config(
            mesh="seq=8", task=dataclasses.replace(get_config().task, seq_len=12)
        ),
        "model.layers[1].kind:": config(
            model=dataclasses.replace(config().model, layers=(mha, mla)), **seq
        ),
        "model.layers[0].impl:": config(
            model=dataclasses.replace(config().model, layers=(dense,)), **seq
        ),
        "model.layers[0].score:": config(
            model=dataclasses.replace(config().model, layers=(layers["fox"],)), **seq
        ),
    }
    errors = {}
    for i, (field, cfg) in enumerate(runs.items()):
        try:
            train(cfg, root / f"bad{i}", progress=False)
            errors[field] = None
        except ValueError as e:
            errors[field] = str(e)
        ok &= errors[field] is not None and errors[field].startswith(field)
    return {"ok": ok, "messages": raised, "errors": errors}


def main(root):
    root = Path(root)
    assert jax.device_count() == 8, jax.devices()
    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
    from tests.models import test_ring_models, test_sequence_models

    cases = [(n, f) for n, f in globals().items() if n.startswith("case_")]
    for module in (test_ring_models, test_sequence_models):
        cases += [(n, f) for n, f in vars(module).items() if n.startswith("case_")]
    only = sys.argv[2:]  # case names: run only those (by hand)
    cases = [(n, f) for n, f in cases if not only or n[5:] in only]
    failed = 0
    t_all = time.perf_counter()
    for name, fn in cases:
        t0, c0 = time.perf_counter(), time.process_time()
        result = {**fn(root), "s": round(time.perf_counter() - t0, 1)}
        result["cpu_s"] = round(time.process_time() - c0, 1)  # meaningful on a loaded machine
        failed += not result["ok"]
        print(json.dumps({"case": name[5:], **result}), flush=True)
    print(
        json.dumps({"case": "done", "failed": failed, "s": round(time.perf_counter() - t_all, 1)})
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
