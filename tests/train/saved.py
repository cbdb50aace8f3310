"""A finished run's saved arrays, for tests that compare runs."""

import jax
import numpy as np

from train.checkpoint import Checkpointer, snapshot
from train.steps import init_state
from train.tasks import make_task


def saved_arrays(workdir, cfg) -> dict[str, np.ndarray]:
    """The last checkpoint's arrays (parameters, optimizer state, step), keyed by path."""
    model, optimizer = init_state(cfg, make_task(cfg.task).vocab_size)
    ckpt = Checkpointer(workdir, async_save=False)
    tree, _ = ckpt.restore(ckpt.latest_step(), snapshot(model, optimizer, 0))
    ckpt.close()
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree.leaves_with_path(tree)}
