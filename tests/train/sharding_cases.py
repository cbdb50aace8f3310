"""Sharded-training cases, run by ``test_sharding.py`` in one subprocess on 8 CPU devices.

``python tests/train/sharding_cases.py WORKDIR`` (with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before JAX starts)
prints one JSON line per case, ``{"case", "ok", ...}``, and exits 0 when all pass.
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
from tests.train.tiny_config import get_config  # noqa: E402
from tests.util import rel_err  # noqa: E402
from train import sharding  # noqa: E402
from train.checkpoint import Checkpointer, snapshot  # noqa: E402
from train.loop import _place, init_state, train  # noqa: E402
from train.tasks import make_task  # noqa: E402

RTOL = 1e-5


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
    _place(mesh, model, optimizer)
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
    """One sharded step equals the single-device step (data=8, fsdp=8)."""
    cfg = config(steps=1)
    train(cfg, root / "single", progress=False)
    ref = params(root / "single", cfg)
    errors = {}
    for i, mesh in enumerate(("data=8", "fsdp=8")):
        train(dataclasses.replace(cfg, mesh=mesh), root / f"step{i}", progress=False)
        errors[mesh] = rel_error(params(root / f"step{i}", cfg), ref)
    return {"ok": all(e <= RTOL for e in errors.values()), "rel": errors}


def case_resume_on_another_mesh(root):
    """Checkpoint on data=8, resume as fsdp=4,data=2: equals an uninterrupted single-device run."""
    cfg = config(steps=6)
    train(cfg, root / "straight", progress=False)
    train(dataclasses.replace(cfg, mesh="data=8"), root / "moved", stop_at=3, progress=False)
    summary = train(dataclasses.replace(cfg, mesh="fsdp=4,data=2"), root / "moved", progress=False)
    recorded = json.loads((root / "moved" / "config.json").read_text())["mesh"]
    rel = rel_error(params(root / "moved", cfg), params(root / "straight", cfg))
    ok = rel <= RTOL and summary["step"] == 6 and recorded == "fsdp=4,data=2"
    return {"ok": ok, "rel": rel, "recorded_mesh": recorded}


def case_bad_meshes(root):
    """Bad mesh strings, and a batch the mesh does not divide, raise ValueError naming the field."""
    raised = {}
    for spec in ("data=3", "data=4", "model=8", "data=2,data=4", "data=0,fsdp=8", "data8", "seq=8"):
        try:
            sharding.make_mesh(spec)
            raised[spec] = None
        except ValueError as e:
            raised[spec] = str(e)
    ok = all(m is not None and m.startswith("mesh:") for m in raised.values())
    ok &= "ring" in raised["seq=8"]
    try:
        train(config(mesh="fsdp=8", batch_size=4), root / "bad_batch", progress=False)
        batch = None
    except ValueError as e:
        batch = str(e)
    ok &= batch is not None and batch.startswith("batch_size:")
    return {"ok": ok, "messages": raised, "batch": batch}


def main(root):
    root = Path(root)
    assert jax.device_count() == 8, jax.devices()
    failed = 0
    for name, fn in list(globals().items()):
        if name.startswith("case_"):
            t0 = time.perf_counter()
            result = {**fn(root), "s": round(time.perf_counter() - t0, 1)}
            failed += not result["ok"]
            print(json.dumps({"case": name[5:], **result}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
