"""Faults injected into real runs: nothing saved is lost, nothing broken is loaded silently.

Each fault is applied to a workdir of the tiny config trained by ``python -m
train`` in a subprocess (checkpoints every 5 steps, the last 2 kept), and the
run that survives it is compared array by array with an uninterrupted run of
the same command (a broken checkpoint's fallback also by a load in this
process): SIGKILL at random moments (inside checkpoint writes too), flipped
bytes, truncated data files or a deleted part of the newest checkpoint, an
array that reads but differs from what was saved, a broken ``config.json``.
A second process on a busy workdir, unwritable folders and a full disk are
refused in one line.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import train
from train import workdir as workdirs
from train.__main__ import main as train_main
from train.checkpoint import Checkpointer, CheckpointWriteError, CorruptCheckpoint

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TINY = str(Path(__file__).with_name("tiny_config.py"))
STEPS = 30
# A read that orbax abandoned can call into its closed event loop later than the fallback
# waits for (at a garbage collection), which Python reports as unraisable and pytest as a
# warning of whichever test runs then. (A command line's stderr is checked for tracebacks.)
LATE_ORBAX_REPORT = pytest.mark.filterwarnings(
    "ignore:Exception ignored in:pytest.PytestUnraisableExceptionWarning"
)
FLAGS = ["--ckpt-every", "5", "--keep-checkpoints", "2", "--eval-every", "10", "--log-every", "3"]


def command(workdir, stop_at=None):
    stop = [] if stop_at is None else ["--stop-at", str(stop_at)]
    return [sys.executable, "-m", "train", "--config", TINY, "--workdir", str(workdir),
            "--no-progress", "--steps", str(STEPS), *FLAGS, *stop]  # fmt: skip


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("xla")
    return {**os.environ, "PYTHONPATH": str(REPO), "JAX_COMPILATION_CACHE_DIR": str(cache)}


def run(workdir, env, stop_at=None, timeout=120):
    """``python -m train`` of the tiny run; ``stop_at`` stops it early, as an interruption."""
    return subprocess.run(
        command(workdir, stop_at), cwd=REPO, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory, env):
    """The uninterrupted run: its arrays and its metrics records."""
    workdir = tmp_path_factory.mktemp("reference")
    done = run(workdir, env)
    assert done.returncode == 0, done.stderr[-3000:]
    return arrays(workdir), train.metrics.read_metrics(workdir)


@pytest.fixture(scope="module")
def stopped_at_20_run(tmp_path_factory, env):
    """The run stopped at step 20 (checkpoints 15 and 20), trained once for every test."""
    workdir = tmp_path_factory.mktemp("at20") / "run"
    done = run(workdir, env, stop_at=20)
    assert done.returncode == 0, done.stderr[-3000:]
    return workdir


@pytest.fixture
def stopped_at_20(stopped_at_20_run):
    """A fresh copy of ``stopped_at_20_run`` at the given path, for one fault."""
    return lambda target: Path(shutil.copytree(stopped_at_20_run, target))


def arrays(workdir, step=None) -> list[np.ndarray]:
    model, _ = train.load_run(workdir, step)
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def assert_same_run(workdir, reference):
    want_arrays, want_records = reference
    got = arrays(workdir)
    assert len(got) == len(want_arrays)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(got, want_arrays, strict=True))
    records = train.metrics.read_metrics(workdir)
    strip = lambda rs: [{k: v for k, v in r.items() if "_s" not in k} for r in rs]  # noqa: E731
    assert strip(records) == strip(want_records)  # none lost, none twice


def data_files(workdir, step) -> list[Path]:
    """The array data files of checkpoint ``step`` (OCDBT's ``d/`` folders).

    All of them, not one: how the arrays split into files varies from run to run,
    and a file can hold bytes that the finished checkpoint no longer references
    (damaging only those leaves a checkpoint that still reads and verifies).
    """
    state = Path(workdir) / "checkpoints" / str(step) / "state"
    files = sorted(p for p in state.rglob("*") if p.is_file() and p.parent.name == "d")
    assert files, f"no data files under {state}"
    return files


def test_sigkill_at_random_moments_resumes_bit_identically(tmp_path, env, reference):
    """Killed 3 times, once inside a checkpoint write and twice at random moments (seeded),
    then run to the end: the reference run, array for array and record for record."""
    workdir = tmp_path / "killed"
    ckpts = workdir / "checkpoints"
    rng = random.Random(0)
    for attempt in range(3):
        proc = subprocess.Popen(
            command(workdir), cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        start, writing = time.monotonic(), False
        while time.monotonic() - start < 60 and proc.poll() is None:
            if attempt == 0:  # the moment a checkpoint is half written
                writing = ckpts.exists() and any("tmp" in p.name for p in ckpts.iterdir())
                if writing:
                    break
            elif (workdir / "metrics.jsonl").exists():  # the loop runs
                time.sleep(rng.uniform(0.0, 1.5))
                break
            time.sleep(0.002)
        assert proc.poll() is None, "the run ended before it was killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert attempt > 0 or writing
    done = run(workdir, env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_run(workdir, reference)


@LATE_ORBAX_REPORT
def test_flipped_bytes_are_caught_and_the_run_resumes_from_the_intact_step(
    tmp_path, env, reference, stopped_at_20
):
    workdir = stopped_at_20(tmp_path / "flipped")
    for path in data_files(workdir, 20):
        data = bytearray(path.read_bytes())
        # One byte in each tenth of the file: a single byte can land in slack that no
        # array reads (then nothing is wrong to catch); ten spread out always hit data.
        for i in range(1, 11):
            data[i * len(data) // 11] ^= 0xFF
        path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match=r"^checkpoint 20 \("):
        train.load_run(workdir, step=20)  # exactly that step: refused, never loaded
    done = run(workdir, env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "checkpoint 20 (" in done.stderr and "moved aside" in done.stderr
    assert len([ln for ln in done.stderr.splitlines() if "checkpoint 20" in ln]) == 1
    assert "Traceback" not in done.stderr
    assert "resuming from checkpoint 15, the newest that reads and verifies" in done.stderr
    assert "resuming from step 15 of 30" in done.stderr
    assert_same_run(workdir, reference)
    assert (workdir / "corrupt").is_dir()


def test_an_array_that_reads_but_differs_from_what_was_saved_is_refused(tmp_path, stopped_at_20):
    """The fingerprints recorded at save time are compared with the arrays read back."""
    workdir = stopped_at_20(tmp_path / "differs")
    record = workdir / "checkpoints" / "20" / "meta" / "metadata"
    meta = json.loads(record.read_text())
    name = sorted(meta["fingerprints"])[1]
    meta["fingerprints"][name][1] ^= 1
    record.write_text(json.dumps(meta))
    want = (
        rf"^checkpoint 20 \(.*\): array {re.escape(name)} differs from what was saved \(1 in all\)$"
    )
    with pytest.raises(CorruptCheckpoint, match=want):
        train.load_run(workdir, step=20)


@LATE_ORBAX_REPORT
@pytest.mark.parametrize("fault", ["truncate", "delete_metadata", "delete_state", "bad_meta_json"])
def test_a_broken_newest_checkpoint_is_one_line_and_the_intact_one_loads(
    tmp_path, capfd, fault, stopped_at_20, stopped_at_20_run
):
    """Loaded in this process (the run resuming after such a fallback is the flipped-bytes
    test's): one line for checkpoint 20, none of orbax's tracebacks, checkpoint 15 loaded."""
    workdir = stopped_at_20(tmp_path / fault)
    step_dir = workdir / "checkpoints" / "20"
    if fault == "truncate":
        for path in data_files(workdir, 20):
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    elif fault == "delete_state":
        shutil.rmtree(step_dir / "state")
    elif fault == "delete_metadata":
        (step_dir / "_CHECKPOINT_METADATA").unlink()
        for p in step_dir.rglob("_METADATA"):
            p.unlink()
    else:
        (step_dir / "meta" / "metadata").write_text('{"totals": ')
    capfd.readouterr()
    got = arrays(workdir)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "checkpoint 20" in line]
    assert len(lines) == 1 and "moved aside" in lines[0] and "Traceback" not in err, err
    assert "resuming from checkpoint 15, the newest that reads and verifies" in err
    assert not step_dir.exists() and (workdir / "corrupt").is_dir()
    want = arrays(stopped_at_20_run, step=15)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(got, want, strict=True))


def test_broken_or_incomplete_config_json_is_one_line_naming_it(
    tmp_path, env, capsys, monkeypatch, compilation_cache_dir
):
    """The refused commands run in this process (they stop before JAX computes anything)."""
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", compilation_cache_dir)  # as it has
    workdir = tmp_path / "config"
    done = run(workdir, env, stop_at=5)
    assert done.returncode == 0, done.stderr[-3000:]
    record = workdir / "config.json"
    data = json.loads(record.read_text())
    for text, expected in (
        ("", "invalid JSON"),
        (json.dumps({**data, "batch_size": -1}), "batch_size: expected an int >= 1"),
        (json.dumps({k: v for k, v in data.items() if k != "seed"}), "missing seed"),
        (json.dumps({**data, "model": None}), "TrainConfig.model: expected a value, got null"),
    ):
        record.write_text(text)
        assert train_main(command(workdir)[3:]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and str(record) in lines[0] and expected in lines[0], lines
        with pytest.raises(ValueError, match=str(record)):
            train.load_run(workdir)
    record.write_text(json.dumps(data))
    assert run(workdir, env, stop_at=5).returncode == 0


def test_a_busy_workdir_is_refused_naming_the_holder(tmp_path, env):
    workdir = tmp_path / "busy"
    workdir.mkdir()
    with workdirs.lock(workdir):
        done = run(workdir, env, stop_at=5)
        assert done.returncode == 2
        assert f"in use by pid {os.getpid()}" in done.stderr and len(done.stderr.splitlines()) == 1
    with workdirs.lock(workdir):  # released at the end of the block (and at any exit)
        pass


def test_unwritable_folders_are_refused_before_training(tmp_path, env):
    """A checkpoints 'folder' that is a file cannot be written even by root: the run exits
    at once (within 30 s, never hanging in a writer's threads), in one line."""
    workdir = tmp_path / "unwritable"
    workdir.mkdir()
    (workdir / "checkpoints").write_text("not a folder")
    t0 = time.monotonic()
    done = run(workdir, env, stop_at=5, timeout=30)
    assert time.monotonic() - t0 < 30
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "workdir: expected a folder this process can write" in done.stderr
    # A comparison whose results folder cannot be written stops before it trains anything.
    argv = [
        sys.executable,
        "-m",
        "train.compare",
        "--quick",
        "--no-progress",
        "--results-dir",
        str(workdir / "checkpoints"),
        "--runs-dir",
        str(tmp_path / "runs"),
    ]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    lines = [line for line in done.stderr.splitlines() if "cpu_aot_loader" not in line]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: results_dir: expected a folder this process can write")
    assert not (tmp_path / "runs").exists()


def test_a_full_disk_is_one_line_naming_the_folder_and_step(tmp_path, monkeypatch, capfd):
    """Refused before writing when the free space cannot hold the checkpoint; where space is
    tight the write is finished at once with stderr held back, so a disk that fills during
    it (orbax's writer threads print their tracebacks, then raise tensorstore's ValueError)
    is one line too; and a failed background write surfaces at the next save or close."""
    ckpt = Checkpointer(tmp_path, keep=2, async_save=False)
    tree = {"step": np.asarray(7, np.int64), "w": np.zeros(1000, np.float32)}
    ckpt.save(7, tree, {})

    def check(e, step):
        message = str(e.value)
        assert f"could not save step {step}" in message and "(the disk is full)" in message
        assert "the newest saved step is 7" in message
        assert str(tmp_path / "checkpoints") in message and "\n" not in message

    free = shutil.disk_usage(tmp_path)
    need = int(1.1 * sum(p.stat().st_size for p in (tmp_path / "checkpoints" / "7").rglob("*")))
    monkeypatch.setattr(shutil, "disk_usage", lambda _: free._replace(free=need))
    with pytest.raises(CheckpointWriteError) as e:
        ckpt.save(8, tree, {})
    check(e, 8)
    assert "bytes free, a checkpoint needs about" in str(e.value)

    def full(*args, **kwargs):
        os.write(2, b"Traceback (most recent call last):\nRuntimeError: Event loop is closed\n")
        raise ValueError("RESOURCE_EXHAUSTED: Failed writing: [os_error_code='28']")

    monkeypatch.setattr(shutil, "disk_usage", lambda _: free._replace(free=3 * need + (2 << 20)))
    monkeypatch.setattr(ckpt._manager, "save", full)
    capfd.readouterr()
    with pytest.raises(CheckpointWriteError) as e:
        ckpt.save(9, tree, {})
    check(e, 9)
    assert "Traceback" not in capfd.readouterr().err  # held back: the one line says it all

    def failed_in_background(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt._manager, "wait_until_finished", failed_in_background)
    with pytest.raises(CheckpointWriteError) as e:
        ckpt.wait()
    assert "(the disk is full)" in str(e.value) and "newest saved step is 7" in str(e.value)
    assert isinstance(ckpt.close(), CheckpointWriteError)  # returned, never raised
    with pytest.raises(ValueError, match=r"could not be written \(the disk is full\)"):
        monkeypatch.setattr(Path, "write_text", failed_in_background)
        workdirs.write_atomic(tmp_path / "summary.json", "{}")


def test_checkpoints_without_config_json_are_refused_unless_adopted(
    tmp_path, env, reference, stopped_at_20
):
    """A deleted record: another lr and seed are refused (they used to resume silently and
    rewrite the record); other shapes, even adopted, are refused without moving the intact
    checkpoints aside; the same config adopted resumes the run bit for bit."""
    workdir = stopped_at_20(tmp_path / "unrecorded")
    (workdir / "config.json").unlink()
    other = ["--optim.lr", "0.05", "--seed", "3"]
    done = subprocess.run(command(workdir) + other, cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "holds checkpoints (steps [15, 20]) but no config.json" in done.stderr
    assert "--adopt-checkpoints" in done.stderr and not (workdir / "config.json").exists()
    wider = ["--model.width", "32", "--adopt-checkpoints"]
    done = subprocess.run(command(workdir) + wider, cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "checkpoint 20 in" in done.stderr and "holds other arrays" in done.stderr
    assert not (workdir / "corrupt").exists()
    assert workdirs.saved_steps(workdir) == [15, 20]
    assert not (workdir / "config.json").exists()  # the refused run recorded nothing
    done = subprocess.run([*command(workdir), "--adopt-checkpoints"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from step 20 of 30" in done.stderr
    assert_same_run(workdir, reference)


def test_damaged_metrics_are_reported_and_rebuilt_from_the_checkpoint(
    tmp_path, env, reference, stopped_at_20
):
    """metrics.jsonl with a line cut in the middle, lines deleted and JSON lines that are not
    records: one line names the damage, the records up to the checkpoint come back from it,
    and the run ends as the reference did. A finished run whose metrics.jsonl is deleted
    gets them back too (its summary was nulls)."""
    workdir = stopped_at_20(tmp_path / "metrics")
    path = workdir / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[2] = lines[2][: len(lines[2]) // 2]  # cut mid-line
    del lines[4:6]
    lines[6:6] = ['{"hello": 1}', "[1, 2]", '{"step": 3, "kind": "eval"}']
    path.write_text("\n".join(lines) + "\n")
    done = run(workdir, env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = [line for line in done.stderr.splitlines() if line.startswith(str(path))]
    assert len(report) == 1 and "4 lines that are not records dropped" in report[0], done.stderr
    assert "3 records missing up to step 20 rebuilt from its checkpoint" in report[0]
    assert_same_run(workdir, reference)
    summary = json.loads((workdir / "summary.json").read_text())
    path.unlink()
    done = run(workdir, env)
    assert done.returncode == 0, done.stderr[-3000:]
    again = json.loads((workdir / "summary.json").read_text())
    assert again["train_loss"] == summary["train_loss"] is not None
    assert again["test_accuracy"] == summary["test_accuracy"] is not None
    assert_same_run(workdir, reference)
