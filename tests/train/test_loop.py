"""The training loop: learning, exact resume in process, divergence (SIGKILL: test_faults.py)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.train.tiny_config import get_config
from train import load_run, run_batch
from train import loop as train_loop
from train.checkpoint import Checkpointer, snapshot
from train.config import OptimConfig, read_record
from train.loop import NonFiniteLossError, train
from train.metrics import read_metrics
from train.optimizer import make_optimizer
from train.run import find_run
from train.steps import build_model, evaluate, init_state, make_train_step
from train.tasks import TaskConfig, data_fingerprint, make_task


def _final_state(config, workdir):
    """The arrays of the newest checkpoint in ``workdir`` (params, rngs, opt, step)."""
    model = build_model(config, make_task(config.task).vocab_size)
    optimizer = nnx.Optimizer(model, make_optimizer(config.optim, config.steps), wrt=nnx.Param)
    ckpt = Checkpointer(workdir)
    try:
        tree, _ = ckpt.restore(ckpt.latest_step(), snapshot(model, optimizer, 0))
    finally:
        ckpt.close()
    return tree


def _assert_bitwise_equal(a, b):
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def _train_records(workdir):
    """Train records without timings (those differ between runs)."""
    keys = ("step", "loss", "accuracy", "grad_norm", "lr")
    return [{k: r[k] for k in keys} for r in read_metrics(workdir) if r["kind"] == "train"]


def test_a_few_steps_lower_the_loss(tmp_path, monkeypatch):
    read = []  # how many test batches each evaluation scored

    def evaluate_counting(*args, batches=None, **kwargs):
        read.append(batches)
        return evaluate(*args, batches=batches, **kwargs)

    monkeypatch.setattr(train_loop, "evaluate", evaluate_counting)
    config = dataclasses.replace(
        get_config(), steps=40, log_every=10, eval_every=20, final_eval_batches=5
    )
    summary = train(config, tmp_path, progress=False)
    losses = [r["loss"] for r in read_metrics(tmp_path) if r["kind"] == "train"]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.3
    assert summary["step"] == 40 and 0 <= summary["test_accuracy"] <= 1
    assert summary["params"] > 0 and summary["tokens_per_s"] > 0
    assert json.loads((tmp_path / "summary.json").read_text())["step"] == 40
    # The curve's evaluations read eval_batches; the last one, where the result is read, 5.
    assert read == [None, 5]
    with pytest.raises(ValueError, match="final_eval_batches: expected None or an int >= "):
        dataclasses.replace(config, final_eval_batches=1)


def test_bf16_compute_trains_as_float32_does():
    """Mixed precision: bfloat16 activations with float32 parameters, optimizer state and
    loss. Over 40 updates the losses stay within two bfloat16 ulps (2^-7, relative) of
    float32's, while not being float32's bits (the compute did change)."""
    losses, states = {}, {}
    for dtype in ("float32", "bfloat16"):
        config = get_config().with_task_vocab()
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype=dtype))
        task = make_task(config.task)
        model, optimizer = init_state(config, task.vocab_size)
        step, leaves = make_train_step(None, model, optimizer)
        losses[dtype] = []
        for i in range(config.steps):
            leaves, metrics = step.update(
                leaves, task.batch(config.seed, "train", i, config.batch_size)
            )
            losses[dtype].append(float(metrics["loss"]))
        states[dtype] = leaves
    f32, bf16 = np.array(losses["float32"]), np.array(losses["bfloat16"])
    assert f32[-1] < f32[0] - 0.3  # it learned
    assert np.max(np.abs(bf16 - f32) / f32) < 2.0**-7
    assert not np.array_equal(bf16, f32)
    floats = [x.dtype for x in states["bfloat16"] if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and set(floats) == {jnp.dtype("float32")}  # parameters and Adam's moments


def test_a_checkpoint_every_ckpt_seconds_off_the_step_grid(tmp_path):
    """A run killed before its first ``ckpt_every`` loses at most ``ckpt_seconds`` of work."""
    config = dataclasses.replace(get_config(), ckpt_every=1000, ckpt_seconds=1e-9)
    train(config, tmp_path / "timed", stop_at=5, progress=False)
    ckpt = Checkpointer(tmp_path / "timed")
    assert ckpt.all_steps() == [4, 5]  # every step is past its 1e-9 s: the 2 kept
    ckpt.close()
    with pytest.raises(ValueError, match=r"^ckpt_seconds: expected None or a positive number"):
        dataclasses.replace(config, ckpt_seconds=0)


@pytest.mark.integration  # the fast tier's 4 minutes are full
def test_resume_is_exact_in_process(tmp_path):
    config = get_config()  # 40 steps, checkpoints every 10, eval every 20
    train(config, tmp_path / "straight", progress=False)

    part = tmp_path / "interrupted"
    first = train(config, part, stop_at=13, progress=False)  # off the checkpoint grid
    assert first["step"] == 13
    ckpt = Checkpointer(part)
    assert ckpt.latest_step() == 13
    ckpt.close()
    with (part / "metrics.jsonl").open("a") as f:
        f.write('{"step": 15, "kind": "train", "lo')  # a write torn by a crash
    train(config, part, progress=False)

    _assert_bitwise_equal(_final_state(config, part), _final_state(config, tmp_path / "straight"))
    records = _train_records(part)
    assert records == _train_records(tmp_path / "straight")
    steps = [(r["step"], r["kind"]) for r in read_metrics(part)]
    assert len(steps) == len(set(steps))  # nothing logged twice
    # Running a finished run again changes nothing.
    again = train(config, part, progress=False)
    assert again["step"] == 40 and _train_records(part) == records


def test_resume_refuses_a_different_config(tmp_path):
    config = get_config()
    train(config, tmp_path, stop_at=2, progress=False)
    changed = dataclasses.replace(config, optim=OptimConfig(lr=1e-2))
    with pytest.raises(ValueError, match=r"optim\.lr \(recorded 0\.003, got 0\.01\)"):
        train(changed, tmp_path, progress=False)
    # Bookkeeping fields may change.
    train(dataclasses.replace(config, log_every=2), tmp_path, stop_at=4, progress=False)


def test_a_run_resumes_and_reloads_only_on_its_own_data(tmp_path):
    """A corpus file replaced by one of the same size: the resume, load_run and run_batch
    refuse it in one line; restored, all three work again (and a synthetic task's identity
    is its config, which the record holds)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"{i}.txt").write_text(f"text {i} " * 200)
    config = get_config()
    config = dataclasses.replace(
        config, task=TaskConfig(name="bytes", seq_len=16, data=str(corpus)), steps=4
    )
    train(config, tmp_path / "run", stop_at=2, progress=False)
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["task"]["fingerprint"]
    assert recorded == data_fingerprint(config.task)
    original = (corpus / "1.txt").read_bytes()
    (corpus / "1.txt").write_bytes(original.upper())  # the same size
    with pytest.raises(ValueError, match=r"holds a run of other data .* changed\); restore"):
        train(config, tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match=r"^task\.fingerprint: expected the data the run"):
        load_run(tmp_path / "run")
    loaded, _ = read_record(tmp_path / "run")  # the record alone reads
    with pytest.raises(ValueError, match=r"^task\.fingerprint: expected the data the run"):
        run_batch(loaded, "test")
    (corpus / "1.txt").write_bytes(original)
    _, loaded = load_run(tmp_path / "run")
    assert run_batch(loaded, "test")["tokens"].shape == (config.batch_size, 16)
    assert train(config, tmp_path / "run", progress=False)["step"] == 4


@pytest.mark.integration  # the fast tier's 4 minutes are full
def test_more_steps_extend_a_finished_run_with_its_schedule(tmp_path):
    short = dataclasses.replace(get_config(), steps=20)
    train(short, tmp_path / "extended", progress=False)
    longer = dataclasses.replace(short, steps=30)
    summary = train(longer, tmp_path / "extended", progress=False)
    assert summary["step"] == 30 and not summary["partial"]
    recorded = json.loads((tmp_path / "extended" / "config.json").read_text())
    assert recorded["steps"] == 30 and recorded["optim"]["decay_steps"] == 20
    # The same as an uninterrupted run whose schedule ends at step 20.
    pinned = dataclasses.replace(longer, optim=dataclasses.replace(longer.optim, decay_steps=20))
    train(pinned, tmp_path / "straight", progress=False)
    _assert_bitwise_equal(
        _final_state(pinned, tmp_path / "extended"), _final_state(pinned, tmp_path / "straight")
    )
    lrs = [r["lr"] for r in _train_records(tmp_path / "extended") if r["step"] > 20]
    assert lrs == pytest.approx([short.optim.lr * short.optim.final_lr_fraction] * len(lrs))
    # Fewer steps, or a new horizon for the steps taken, would change the result.
    with pytest.raises(ValueError, match=r"steps \(recorded 30, got 20\)"):
        train(short, tmp_path / "extended", progress=False)
    other = dataclasses.replace(pinned, optim=dataclasses.replace(pinned.optim, decay_steps=30))
    with pytest.raises(ValueError, match=r"optim\.decay_steps \(recorded 20, got 30\)"):
        train(other, tmp_path / "extended", progress=False)


def test_the_recorded_config_holds_the_vocabulary_the_model_uses(tmp_path):
    config = get_config()
    config = dataclasses.replace(config, task=dataclasses.replace(config.task, vocab_size=40))
    assert config.model.vocab_size != config.task.vocab  # the model's field left as it was
    train(config, tmp_path, stop_at=1, progress=False)
    recorded = json.loads((tmp_path / "config.json").read_text())
    assert recorded["model"]["vocab_size"] == config.task.vocab
    model, loaded = load_run(tmp_path)
    assert model.embed.embedding[...].shape[0] == loaded.model.vocab_size == config.task.vocab


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(tmp_path):
    # An absurd learning rate blows the parameters up within a few steps.
    config = dataclasses.replace(
        get_config(), optim=OptimConfig(lr=1e30, warmup_fraction=0.0), ckpt_every=1, log_every=1
    )
    with pytest.raises(NonFiniteLossError, match=r"at step \d+") as info:
        train(config, tmp_path, progress=False)
    bad = info.value.step
    assert f"step {bad}" in str(info.value)
    assert info.value.last_checkpoint == bad - 1
    ckpt = Checkpointer(tmp_path)
    assert ckpt.all_steps()[-1] == bad - 1  # nothing saved from the bad step
    ckpt.close()
    tree = _final_state(config, tmp_path)  # still loadable
    assert int(tree["step"]) == bad - 1
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tree["params"]))
    assert all(r["step"] < bad for r in read_metrics(tmp_path))


def test_non_finite_loss_is_found_at_its_step_between_reads(tmp_path):
    # The loop reads the metrics every log_every steps; the error still names the
    # first bad step, and the checkpoint kept is the last one before it. (At this
    # learning rate the tiny model's loss overflows at step 8.)
    def run(every, workdir):
        config = dataclasses.replace(
            get_config(),
            optim=OptimConfig(lr=300.0, warmup_fraction=0.0),
            ckpt_every=every,
            log_every=every,
            eval_every=every,
        )
        with pytest.raises(NonFiniteLossError) as info:
            train(config, workdir, progress=False)
        return info.value

    each, sparse = run(1, tmp_path / "each"), run(3, tmp_path / "sparse")
    assert each.step > 3  # the bad step lies past a checkpoint of the sparse run
    assert sparse.step == each.step
    kept = (each.step - 1) // 3 * 3
    assert sparse.last_checkpoint == kept
    assert all(r["step"] <= kept for r in read_metrics(tmp_path / "sparse"))


def test_the_test_loss_comes_with_its_standard_error():
    """Batches of equal position counts: the standard error of the mean of their losses
    (sample standard deviation / sqrt(n)); unequal counts weigh each batch by its count."""
    config = dataclasses.replace(get_config(), eval_batches=4)
    task = make_task(config.task)
    sums = iter([[6.0, 1, 4], [2.0, 1, 4], [4.0, 1, 4], [8.0, 1, 4]])  # [loss sum, correct, count]
    got = evaluate(None, task, config, step_fn=lambda batch: np.asarray(next(sums)))
    means = np.array([6.0, 2.0, 4.0, 8.0]) / 4
    assert got["test_loss"] == pytest.approx(means.mean())
    assert got["test_loss_se"] == pytest.approx(means.std(ddof=1) / 2)
    # Counts 1 and 3 with per-position losses 1 and 3: the ratio estimator's linearization.
    sums = iter([[1.0, 0, 1], [9.0, 0, 3]] * 2)
    got = evaluate(None, task, config, step_fn=lambda batch: np.asarray(next(sums)))
    loss = 20.0 / 8
    deviations = np.array([1 - loss, 9 - 3 * loss] * 2)
    assert got["test_loss"] == loss
    assert got["test_loss_se"] == pytest.approx(np.sqrt(4 / 3 * np.sum(deviations**2)) / 8)
    one = evaluate(None, task, dataclasses.replace(config, eval_batches=1),
                   step_fn=lambda batch: np.asarray([1.0, 0, 1]))  # fmt: skip
    assert one["test_loss_se"] is None


def test_load_run_rebuilds_the_trained_model_from_its_record(tmp_path):
    config = dataclasses.replace(
        get_config(), steps=20, ckpt_every=10, eval_every=20, keep_checkpoints=3
    )
    summary = train(config, tmp_path, progress=False)
    model, loaded = load_run(tmp_path)
    pinned = dataclasses.replace(config.task, fingerprint=data_fingerprint(config.task))
    assert loaded == dataclasses.replace(config, task=pinned)  # the config and its data's identity
    # The newest checkpoint is the trained model: it reproduces the run's last evaluation.
    again = evaluate(model, make_task(config.task), config)
    assert again["test_loss"] == pytest.approx(summary["test_loss"], rel=1e-6)
    assert again["test_accuracy"] == summary["test_accuracy"]
    assert again["test_loss_se"] == pytest.approx(summary["test_loss_se"], rel=1e-5)
    earlier, _ = load_run(tmp_path, step=10)
    assert evaluate(earlier, make_task(config.task), config)["test_loss"] > again["test_loss"]
    with pytest.raises(ValueError, match=r"step: expected one of the saved steps \[10, 20\]"):
        load_run(tmp_path, step=15)
    with pytest.raises(ValueError, match="workdir: expected a run folder"):
        load_run(tmp_path / "nothing")


def test_target_accuracy_stops_at_the_first_evaluation_reaching_it(tmp_path):
    config = dataclasses.replace(get_config(), steps=40, eval_every=5)
    train(config, tmp_path / "full", progress=False)
    records = read_metrics(tmp_path / "full")
    evals = [(r["step"], r["test_accuracy"]) for r in records if r["kind"] == "eval"]
    # A target this run reaches before its end: its best accuracy before the last evaluation.
    target = max(a for s, a in evals if s < config.steps)
    stop = next(s for s, a in evals if a >= target)
    assert target > 0 and stop < config.steps

    early = dataclasses.replace(config, target_accuracy=target)
    summary = train(early, tmp_path / "early", progress=False)
    assert summary["step"] == stop and summary["target_reached"] and not summary["partial"]
    assert summary["test_accuracy"] == dict(evals)[stop]
    assert json.loads((tmp_path / "early" / "summary.json").read_text())["step"] == stop
    ckpt = Checkpointer(tmp_path / "early")
    assert ckpt.latest_step() == stop  # saved where it stopped, off the checkpoint grid or not
    ckpt.close()
    records = _train_records(tmp_path / "early")
    assert records == [r for r in _train_records(tmp_path / "full") if r["step"] <= stop]
    # Resuming a run that reached its target trains no further...
    again = train(early, tmp_path / "early", progress=False)
    assert again["step"] == stop and again["target_reached"]
    assert _train_records(tmp_path / "early") == records
    # ...and without the target it continues to the same end as a run that never stopped.
    rest = train(config, tmp_path / "early", progress=False)
    assert rest["step"] == 40 and not rest["target_reached"]
    _assert_bitwise_equal(
        _final_state(config, tmp_path / "early"), _final_state(config, tmp_path / "full")
    )
    for bad in (0.0, 1.5, True):
        with pytest.raises(ValueError, match="target_accuracy"):
            dataclasses.replace(config, target_accuracy=bad)


def test_make_train_step_is_the_step_train_runs(tmp_path):
    """The public step (what bench/parallel.py compiles) gives the loop's losses, bit for bit."""
    config = dataclasses.replace(get_config(), steps=2, log_every=1, eval_every=2, ckpt_every=2)
    train(config, tmp_path, progress=False)
    config = config.with_task_vocab()
    task = make_task(config.task)
    model, optimizer = init_state(config, task.vocab_size)
    step, leaves = make_train_step(None, model, optimizer)
    losses = []
    for i in range(2):
        leaves, metrics = step.update(
            leaves, task.batch(config.seed, "train", i, config.batch_size)
        )
        losses.append(float(metrics["loss"]))
    assert losses == [r["loss"] for r in _train_records(tmp_path)]
    test = task.batch(config.seed, "test", 0, config.batch_size)
    loss_sum, _, count = np.asarray(step.evaluate(leaves, test))
    assert np.isfinite(loss_sum) and count > 0


def test_a_folder_of_runs_names_them_and_variant_lr_seed_pick_one(tmp_path):
    """A comparison's ``runs/<name>``: ``<variant>/lr<lr>_seed<seed>`` folders."""
    for variant in ("mha", "gqa"):
        for lr, seed in (("0.001", 0), ("0.003", 0), ("0.003", 1)):
            run = tmp_path / "cmp" / variant / f"lr{lr}_seed{seed}"
            run.mkdir(parents=True)
            (run / "config.json").write_text("{}")
    cmp = tmp_path / "cmp"
    assert find_run(cmp, variant="gqa", lr=1e-3) == cmp / "gqa" / "lr0.001_seed0"
    assert find_run(cmp / "mha", lr=3e-3, seed=1) == cmp / "mha" / "lr0.003_seed1"
    with pytest.raises(ValueError, match=r"6 runs \(gqa/lr0\.001_seed0, .*\) and 2 runs match"):
        load_run(cmp, variant="mha", lr=0.003)
    with pytest.raises(ValueError, match=r"holds 3 runs .* none matches seed=5: pick one with"):
        load_run(cmp / "mha", seed=5)
    with pytest.raises(ValueError, match=r"^workdir: expected a run folder with config\.json"):
        load_run(tmp_path / "nothing")
