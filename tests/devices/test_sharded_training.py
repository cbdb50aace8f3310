"""Sharded training on 8 fake CPU devices (``train.sharding``): a sharded step, a resume
on another mesh and a sequence-parallel hybrid equal one device's run; bad meshes raise.

The mesh strings, the sharding rules and the layouts need no devices:
``tests/train/test_sharding.py``.
"""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from models import ModelConfig, pattern, presets
from tests.train.saved import saved_arrays
from tests.train.tiny_config import get_config
from tests.util import rel_err
from train import sharding
from train.loop import train
from train.steps import init_state, place
from train.tasks import make_task

pytestmark = pytest.mark.devices

RTOL = 1e-5
STEPS = 6  # one run length for every case, so that their programs compile once


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


def rel_error(a, b) -> float:
    """The largest norm-wise relative error ``||a - b|| / ||b||`` over the arrays."""
    assert a.keys() == b.keys()
    return max(rel_err(a[k], b[k]) for k in a)


def test_layout():
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
    assert ok, {"sharded": len(sharded), "of": len(specs), "mlp_up": up}


def test_one_step(tmp_path):
    """One sharded step equals the single-device step with sequence parallelism (ring
    attention over seq) on data=2,fsdp=2,seq=2, on a mesh of Auto axes and of Explicit ones
    (where the step gathers the fsdp shards itself); data=8 and fsdp=4,data=2 alone:
    ``test_resume_on_another_mesh``."""
    cfg = config(steps=STEPS)
    train(cfg, tmp_path / "single", stop_at=1, progress=False)
    ref = saved_arrays(tmp_path / "single", cfg)
    errors = {}
    meshes = [("auto", "data=2,fsdp=2,seq=2"), ("explicit", "data=2,fsdp=2,seq=2")]
    for i, (types, mesh) in enumerate(meshes):
        run = dataclasses.replace(cfg, mesh=mesh, mesh_axis_types=types)
        train(run, tmp_path / f"step{i}", stop_at=1, progress=False)
        errors[f"{types} {mesh}"] = rel_error(saved_arrays(tmp_path / f"step{i}", cfg), ref)
    assert all(e <= RTOL for e in errors.values()), errors


def losses(workdir) -> list[float]:
    """The training loss of every logged step of a run."""
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


def test_hybrids_train_as_one_device(tmp_path):
    """``python -m train --mesh data=2,seq=4 --mesh-axis-types explicit`` on a recurrent
    hybrid (a Gated DeltaNet and a Mamba-2 layer, then softmax on the ring): 10 steps'
    losses equal one device's to 5 digits, and so do the final parameters as one vector
    (Adam's moments of near-zero gradients, leaf by leaf, amplify float rounding).
    Explicit axes: every array states its sharding, so each sharded layer reshards its
    inputs and hands its output back in the residual stream's layout (Auto axes, and the
    sharded short convolutions: ``test_sequence_parallel_models.py``)."""
    layers = pattern(("gated_deltanet", "mamba2", "mha"), presets(num_heads=2, head_dim=8))
    model = dataclasses.replace(get_config().model, layers=layers)
    cfg = dataclasses.replace(
        get_config(), model=model, steps=10, log_every=1, eval_every=1000, ckpt_every=10
    )
    train(cfg, tmp_path / "hybrid_single", progress=False)
    seq = dataclasses.replace(cfg, mesh="data=2,seq=4", mesh_axis_types="explicit")
    train(seq, tmp_path / "hybrid_seq", progress=False)
    single, seq = losses(tmp_path / "hybrid_single"), losses(tmp_path / "hybrid_seq")
    rel = max(abs(a - b) / abs(b) for a, b in zip(seq, single, strict=True))
    got = saved_arrays(tmp_path / "hybrid_seq", cfg)
    want = saved_arrays(tmp_path / "hybrid_single", cfg)
    names = [k for k in want if k.startswith("['params']")]
    params_rel = rel_err(
        np.concatenate([np.ravel(got[k]) for k in names]),
        np.concatenate([np.ravel(want[k]) for k in names]),
    )
    ok = len(single) == 10 and rel <= 1e-5 and params_rel <= 1e-5
    assert ok, {"loss_rel": rel, "params_rel": params_rel, "steps": len(single)}


def test_resume_on_another_mesh(tmp_path):
    """Checkpoint on data=8, resume as fsdp=4,data=2: equals an uninterrupted
    single-device run (on one device a resume is bit-exact)."""
    cfg = config(steps=STEPS)
    train(cfg, tmp_path / "single", progress=False)
    train(dataclasses.replace(cfg, mesh="data=8"), tmp_path / "moved", stop_at=3, progress=False)
    moved = dataclasses.replace(cfg, mesh="fsdp=4,data=2")
    summary = train(moved, tmp_path / "moved", progress=False)
    recorded = json.loads((tmp_path / "moved" / "config.json").read_text())["mesh"]
    rel = rel_error(saved_arrays(tmp_path / "moved", cfg), saved_arrays(tmp_path / "single", cfg))
    ok = rel <= RTOL and summary["step"] == STEPS and recorded == "fsdp=4,data=2"
    assert ok, {"rel": rel, "recorded_mesh": recorded}


def test_bad_meshes(tmp_path):
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
            train(cfg, tmp_path / f"bad{i}", progress=False)
            errors[field] = None
        except ValueError as e:
            errors[field] = str(e)
        ok &= errors[field] is not None and errors[field].startswith(field)
    assert ok, {"messages": raised, "errors": errors}
