"""What one step of a run computes: the model and optimizer state, the loss, the jitted steps.

* ``build_model`` / ``init_state``: the run's model (and optimizer) at step 0;
* ``weighted_metrics``: the loss (cross-entropy over labelled positions) and accuracy;
* ``make_train_step(mesh, model, optimizer)``: the jitted update and evaluation
  over the state's arrays that ``train.loop.train`` runs, on one device or on
  a mesh laid out by ``train.sharding`` (``place``); ``Steps`` holds the state
  between them;
* ``evaluate``: the fixed test batches' loss and accuracy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from train import sharding
from train.config import TrainConfig
from train.optimizer import make_optimizer
from train.tasks import Task

__all__ = [
    "ModelFn",
    "Steps",
    "TrainStep",
    "build_model",
    "count_params",
    "evaluate",
    "init_state",
    "make_train_step",
    "place",
    "weighted_metrics",
]

ModelFn = Callable[[Any, int, nnx.Rngs], nnx.Module]


def weighted_metrics(logits, batch) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Cross-entropy and accuracy over labelled positions only.

    Args:
      logits: ``[B,T,V]``.
      batch: ``labels [B,T]`` (any value where unweighted) and ``weights [B,T]``.

    Returns:
      ``(mean loss, correct predictions, labelled positions)``, float32 scalars;
      the loss is the weighted mean, 0 when nothing is labelled.
    """
    weights = batch["weights"].astype(jnp.float32)
    labels = jnp.where(weights > 0, batch["labels"], 0)  # IGNORE (-100) is not a class
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    count = weights.sum()
    loss = (ce * weights).sum() / jnp.maximum(count, 1.0)
    correct = ((logits.argmax(-1) == labels) * weights).sum()
    return loss, correct, count


def logits_of(model, batch):
    """The model on a batch; a sequence-parallel batch carries its tokens' ``positions``."""
    if "positions" in batch:
        return model(batch["tokens"], positions=batch["positions"])
    return model(batch["tokens"])


def _gathered(model, gather):
    """``model``, or (with ``gather``) a copy of it computing with ``gather(state)``.

    A copy, so that the caller's state keeps its layout (and gradients flow
    through ``gather`` to it).
    """
    if gather is None:
        return model
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, gather(state))


def _train_step(model, optimizer, batch, gather=None):
    def loss_fn(model):
        logits = logits_of(_gathered(model, gather), batch)
        loss, correct, count = weighted_metrics(logits, batch)
        return loss, (correct, count)

    (loss, (correct, count)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return {
        "loss": loss,
        "accuracy": correct / jnp.maximum(count, 1.0),
        "grad_norm": optax.tree.norm(grads),
    }


def _eval_step(model, batch, gather=None):
    loss, correct, count = weighted_metrics(logits_of(_gathered(model, gather), batch), batch)
    return jnp.stack([loss * count, correct, count])


_jit_eval_step = nnx.jit(_eval_step)


class TrainStep(NamedTuple):
    """A run's jitted steps over the arrays (``leaves``) of ``nnx.split((model, optimizer))``.

    ``update(leaves, batch) -> (leaves, metrics)`` is one optimizer update
    (metrics: loss, accuracy, grad_norm); ``evaluate(leaves, batch)`` is
    ``[loss sum, correct, count]`` of a batch. Call them under
    ``jax.set_mesh(mesh)`` with batches from ``train.sharding.shard_batch``
    when the run has a mesh.
    """

    update: Callable
    evaluate: Callable


def make_train_step(mesh, model: nnx.Module, optimizer: nnx.Optimizer) -> tuple[TrainStep, list]:
    """The steps ``train.loop.train`` runs for this model and optimizer, and their state's arrays.

    Args:
      mesh: the run's mesh (``train.sharding.make_mesh``), with the state
        already placed on it (``place``), or None for one device.
      model, optimizer: the run's state (``init_state``).

    Returns:
      ``(TrainStep, leaves)``: the jitted steps and the state's arrays they take.
    """
    graphdef, state = nnx.split((model, optimizer))
    leaves, treedef = jax.tree.flatten(state)
    return _pure_steps(mesh, graphdef, treedef), leaves


@functools.lru_cache(maxsize=16)
def _pure_steps(mesh, graphdef, treedef):
    """``TrainStep``: ``_train_step`` and ``_eval_step`` jitted over the state's leaves.

    ``update(leaves, batch) -> (leaves, metrics)`` and ``evaluate(leaves, batch) ->
    [loss sum, correct, count]``, where ``leaves`` are the arrays of
    ``nnx.split((model, optimizer))``'s state (``treedef`` its structure) and
    ``graphdef`` the rest. A call costs the host one flatten of a list of
    arrays: ``nnx.cached_partial`` also writes every variable back into the
    modules after each call, and a static graphdef is hashed on each call;
    either costs a small model's step on one core several milliseconds.

    On a mesh (``train.sharding``'s layout): under Auto axes the collectives
    come from the input shardings. Under Explicit ones each step gathers the
    parameters it computes with (``sharding.gather``: FSDP's all-gather, whose
    transpose scatters the gradients back to the shards). The updated state is
    constrained back to the rules, so the layout never drifts.
    """
    gather = None
    if mesh is not None and sharding.is_explicit(mesh):
        gather = functools.partial(sharding.gather, mesh)

    def objects(leaves):
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

    @jax.jit
    def update(leaves, batch):
        model, optimizer = objects(leaves)
        out = _train_step(model, optimizer, batch, gather)
        state = nnx.split((model, optimizer))[1]
        if mesh is not None:
            state = sharding.constrain(mesh, state)
        return jax.tree.leaves(state), out

    @jax.jit
    def evaluate(leaves, batch):
        model, _ = objects(leaves)
        return _eval_step(model, batch, gather)

    return TrainStep(update, evaluate)


class Steps:
    """A run's jitted train and eval steps on host batches, over its model's state.

    The state lives here between steps, as a list of arrays; ``sync()`` writes
    it into the model and optimizer (before anything reads them: checkpoints,
    the summary) and ``reload()`` takes it from them (after a restore wrote
    into them).
    """

    def __init__(self, mesh, model: nnx.Module, optimizer: nnx.Optimizer, ordered: bool = False):
        """``ordered``: a layer runs in array order (``train.sharding.in_order``), so a
        sequence-parallel batch is laid out in contiguous spans."""
        self.mesh, self.objects, self.ordered = mesh, (model, optimizer), ordered
        self.reload()

    def reload(self) -> None:
        graphdef, state = nnx.split(self.objects)
        self.leaves, self.treedef = jax.tree.flatten(state)
        self.step = _pure_steps(self.mesh, graphdef, self.treedef)
        self.synced = True

    def sync(self) -> None:
        if not self.synced:
            nnx.update(self.objects, jax.tree.unflatten(self.treedef, self.leaves))
            self.synced = True

    def _batch(self, batch):
        if self.mesh is None:
            return batch
        return sharding.shard_batch(self.mesh, batch, self.ordered)

    def _context(self):
        # Models read the mesh when they trace (ring attention over "seq", models.softmax).
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def update(self, batch) -> dict:
        """One update; returns its metrics (loss, accuracy, grad_norm) as device scalars."""
        with self._context():
            self.leaves, out = self.step.update(self.leaves, self._batch(batch))
        self.synced = False
        return out

    def eval(self, batch):
        """``[loss sum, correct, count]`` of the current state on ``batch``."""
        with self._context():
            return self.step.evaluate(self.leaves, self._batch(batch))


def place(mesh, model: nnx.Module, optimizer: nnx.Optimizer) -> None:
    """Moves the model and optimizer state onto ``mesh`` with ``train.sharding``'s rules."""
    for obj in (model, optimizer):
        nnx.update(obj, sharding.place(mesh, nnx.state(obj)))


def evaluate(
    model: nnx.Module, task: Task, config: TrainConfig, *, step_fn=None, batches: int | None = None
) -> dict:
    """Loss and accuracy on the test split's first ``eval_batches`` batches (a fixed set).

    Args:
      model: the model.
      task: its task.
      config: the run config (seed, batch size, eval_batches).
      step_fn: ``batch -> [loss sum, correct, count]``; default a jitted step on ``model``.
      batches: how many test batches instead of ``config.eval_batches`` (the first ones).

    Returns:
      ``dict(test_loss, test_accuracy, test_loss_se)``, weighted by labelled positions.
      ``test_loss_se`` is the standard error of ``test_loss`` as an estimate of the
      test distribution's loss, each batch one sample (the ratio estimator's
      linearization: ``sqrt(n / (n - 1) * sum_b (L_b - loss * c_b)^2) / sum_b c_b`` for
      batch loss sums ``L_b`` over ``c_b`` positions); None with one batch.
    """
    step_fn = step_fn or nnx.cached_partial(_jit_eval_step, model)
    n = batches or config.eval_batches
    sums = np.stack(
        [
            np.asarray(step_fn(task.batch(config.seed, "test", i, config.batch_size)))
            for i in range(n)
        ]
    )
    loss_sum, correct, count = sums.sum(axis=0)
    loss = loss_sum / max(count, 1.0)
    se = None
    if n > 1 and count > 0:
        deviations = sums[:, 0] - loss * sums[:, 2]
        se = float(np.sqrt(n / (n - 1) * np.sum(deviations**2)) / count)
    return {
        "test_loss": float(loss),
        "test_accuracy": float(correct / max(count, 1.0)),
        "test_loss_se": se,
    }


def _decoder(model_config, vocab_size: int, rngs: nnx.Rngs) -> nnx.Module:
    from models import Decoder  # the model package is only needed when it is used

    return Decoder(dataclasses.replace(model_config, vocab_size=vocab_size), rngs=rngs)


def build_model(config: TrainConfig, vocab_size: int, model_fn: ModelFn | None = None):
    """The run's model, initialized from ``config.seed`` (eagerly).

    Args:
      config: the run config.
      vocab_size: V, from the task.
      model_fn: ``(model_config, vocab_size, rngs) -> nnx.Module``; default ``models.Decoder``.
    """
    return (model_fn or _decoder)(config.model, vocab_size, nnx.Rngs(config.seed))


def init_state(config: TrainConfig, vocab_size: int, model_fn: ModelFn | None = None):
    """The run's model and optimizer at step 0, built by one jitted program.

    One compilation instead of one per initializer and shape (each eager op
    compiles on first use, which on CPU costs more than the whole program).

    Returns:
      ``(model, optimizer)``.
    """

    def init():
        model = build_model(config, vocab_size, model_fn)
        tx = make_optimizer(config.optim, config.steps)
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    return nnx.jit(init)()


def count_params(model: nnx.Module) -> int:
    """Number of trainable parameters."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
