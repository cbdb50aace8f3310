"""Ctrl-C (SIGINT) at several moments of the command lines: exit 130, one line, no crash.

Moments are found by watching the run's files rather than by fixed delays
(the machine's speed varies): while JAX imports, while the first step
compiles with an empty compilation cache, inside the training loop, twice in a
row, in a comparison with two worker processes, and in an experiment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import train
from train.workdir import saved_steps

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TINY = str(Path(__file__).with_name("tiny_config.py"))


def start(argv, tmp_path, cache=None):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache or tmp_path / "xla")  # empty: a cold compile
    return subprocess.Popen(
        [sys.executable, "-m", *argv], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def wait_for(proc, condition, timeout=90.0):
    t0 = time.monotonic()
    while not condition():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() - t0 < timeout, "the moment never came"
        time.sleep(0.005)


def interrupt(proc, times=1, gap=0.05):
    """Sends SIGINT ``times`` times; returns ``(status, stderr lines without XLA's logs)``
    and checks that the process ended within a few seconds."""
    for i in range(times):
        if i:
            time.sleep(gap)
        proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 30
    lines = [line for line in err.splitlines() if line.strip() and "cpu_aot_loader" not in line]
    return proc.returncode, lines


def train_argv(workdir):
    return ["train", "--config", TINY, "--workdir", str(workdir), "--no-progress",
            "--steps", "100000", "--ckpt-every", "50"]  # fmt: skip


def test_ctrl_c_while_jax_imports(tmp_path):
    proc = start(train_argv(tmp_path / "w"), tmp_path)
    time.sleep(0.3)  # importing JAX takes longer than this
    status, lines = interrupt(proc)
    assert status == 130 and len(lines) == 1, lines
    assert lines[0].startswith("python -m train: interrupted")
    assert not (tmp_path / "w" / "checkpoints").exists()


def test_ctrl_c_during_a_cold_compile_never_crashes(tmp_path):
    """The record is written before the model is built and the first step compiles."""
    workdir = tmp_path / "w"
    proc = start(train_argv(workdir), tmp_path)
    wait_for(proc, lambda: (workdir / "config.json").exists())
    status, lines = interrupt(proc)
    assert status == 130 and len(lines) == 1, lines  # never -11 (a segfault) nor a traceback
    assert "interrupted" in lines[0] and "Fatal" not in lines[0]


@pytest.mark.parametrize("times", [1, 2])
def test_ctrl_c_in_the_loop_saves_or_stops_at_once(tmp_path, times):
    workdir = tmp_path / "w"
    proc = start(train_argv(workdir), tmp_path)
    # A record in metrics.jsonl: the loop is stepping (the file itself opens before it).
    metrics = workdir / "metrics.jsonl"
    wait_for(proc, lambda: metrics.exists() and metrics.stat().st_size > 0)
    status, lines = interrupt(proc, times)
    assert status == 130 and len(lines) == 1, lines
    if times == 1:  # the step in flight finishes and is saved
        assert lines[0].startswith("interrupted after ")
        assert "Resume with: python -m train" in lines[0]
    # Whatever was saved verifies and loads.
    if (workdir / "checkpoints").exists() and any((workdir / "checkpoints").iterdir()):
        train.load_run(workdir)


def test_ctrl_c_in_a_comparison_with_workers(tmp_path, compilation_cache_dir):
    """Stopped before any run reached its ``ckpt_every``: each run keeps the checkpoint of its
    last ``ckpt_seconds``, the same command resumes from it, and the results are an
    uninterrupted comparison's."""
    argv = ["train.compare", "--quick", "--variants", "mha", "linear", "--jobs", "2",
            "--train.steps", "60", "--train.ckpt-every", "1000", "--train.ckpt-seconds", "1",
            "--no-progress", "--results-dir", "results", "--runs-dir", "runs"]  # fmt: skip
    proc = start([*argv, "--name", "c"], tmp_path, compilation_cache_dir)
    runs = tmp_path / "runs" / "c"
    dirs = [runs / v / "lr0.003_seed0" for v in ("mha", "linear")]
    wait_for(proc, lambda: all(saved_steps(d) for d in dirs))
    status, lines = interrupt(proc)
    assert status == 130 and len(lines) == 1, lines
    assert lines[0].startswith("python -m train.compare: interrupted")
    assert "run the same command to resume" in lines[0]
    time.sleep(0.5)
    ps = subprocess.run(["ps", "-eo", "ppid="], capture_output=True, text=True).stdout.split()
    assert str(proc.pid) not in ps  # no worker left behind
    kept = [saved_steps(d) for d in dirs]
    assert all(s and s[-1] < 60 for s in kept), kept  # saved by time, not by steps

    results = {}
    for name in ("c", "straight"):  # resumed, then the same comparison uninterrupted
        again = start([*argv, "--name", name], tmp_path, compilation_cache_dir)
        _, err = again.communicate(timeout=300)
        assert again.returncode == 0, err[-2000:]
        assert err.count("resuming from step") == (2 if name == "c" else 0), err[-2000:]
        data = json.loads((tmp_path / "results" / name / "results.json").read_text())
        results[name] = [
            (r["variant"], r["curves"], {k: r["summary"][k] for k in ("step", "test_loss")})
            for r in data["runs"]
        ]
    assert results["c"] == results["straight"]  # bit for bit


def test_ctrl_c_in_an_experiment(tmp_path):
    argv = ["analysis.experiments.induction_heads", "--quick", "--out", str(tmp_path / "out")]
    proc = start(argv, tmp_path)
    wait_for(proc, lambda: any((tmp_path / "out").rglob("metrics.jsonl")))
    status, lines = interrupt(proc)
    assert status == 130 and len(lines) == 1, lines
    assert "interrupted" in lines[0]


def test_ctrl_c_while_stderr_is_held_back_still_says_so(tmp_path):
    """A checkpoint restore holds back file descriptor 2 (orbax's tracebacks of abandoned
    reads); a Ctrl-C there used to exit 130 with its message lost in the held text."""
    code = (
        "import os, signal\n"
        "from train.interrupt import exit_on_sigint\n"
        "exit_on_sigint('python -m train')\n"
        "from train.checkpoint import _stderr_kept_unless_failed\n"
        "with _stderr_kept_unless_failed():\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    import time; time.sleep(5)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 130 and len(lines) == 1, done.stderr
    assert lines[0].startswith("python -m train: interrupted; no checkpoint was being written")
