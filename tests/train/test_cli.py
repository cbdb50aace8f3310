"""The command line: config files, tyro overrides, ``--data`` and errors."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train.__main__ import main
from train.cli import load_config, parse, with_pattern
from train.metrics import read_metrics

pytestmark = pytest.mark.integration

TINY_CONFIG = str(Path(__file__).with_name("tiny_config.py"))
REPO = Path(__file__).resolve().parents[2]


def test_bytes_run_on_a_folder_with_overrides(tmp_path, capsys, monkeypatch, compilation_cache_dir):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", compilation_cache_dir)
    data = tmp_path / "text"
    data.mkdir()
    for i in range(12):
        (data / f"{i}.txt").write_text(f"line {i}: the quick brown fox\n" * 20)
    argv = [
        "--config", TINY_CONFIG,
        "--workdir", str(tmp_path / "run"),
        "--data", str(data),
        "--task.name", "bytes",
        "--steps", "4",
        "--log-every", "2",
        "--model.width", "32",
        "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] == 4 and 0 <= summary["test_accuracy"] <= 1
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["task"]["name"] == "bytes" and saved["task"]["data"] == str(data)
    assert saved["model"]["width"] == 32
    assert [r["step"] for r in read_metrics(tmp_path / "run") if r["kind"] == "train"] == [2, 4]


def test_every_config_file_loads():
    for path in sorted((REPO / "configs").glob("*.py")):
        if path.name != "__init__.py":
            assert load_config(path) is not None
    quick = load_config(REPO / "configs" / "compare_mqar.py", quick=True)
    assert quick.name.endswith("quick")


def test_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="--config"):
        load_config(tmp_path / "missing.py")
    assert main(["--config", TINY_CONFIG]) == 2  # no --workdir
    assert "--workdir" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--config", TINY_CONFIG, "--workdir", str(tmp_path), "--no-such-field", "1"])


def test_help_lists_the_fields_with_or_without_a_config():
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    bare = subprocess.run(
        [sys.executable, "-m", "train", "--help"], cwd=REPO, env=env, capture_output=True,
        text=True, check=False,
    )  # fmt: skip
    assert bare.returncode == 0, bare.stderr
    for flag in ("--steps", "--task.name", "--model.width", "--optim.lr", "--model.pattern"):
        assert flag in bare.stdout
    assert "TrainConfig()" in bare.stdout
    # With a config file and a pattern: its values, the new layers' panels, no subcommand.
    # One column (COLUMNS < 130): side by side, tyro may wrap a default across panels.
    argv = ["--config", TINY_CONFIG, "--model.pattern", "gqa,linear", "--help"]
    shown = subprocess.run(
        [sys.executable, "-m", "train", *argv], cwd=REPO, env={**env, "COLUMNS": "120"},
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "--model.layers.1.kind" in shown.stdout and "--model.layers.2" not in shown.stdout
    assert "(default: linear)" in shown.stdout
    assert "cross-attention" not in shown.stdout.splitlines()[0]  # no positional choice
    # Each preset with its sizes under this config (tiny: 2 heads of 8), no encoder ones.
    text = " ".join(shown.stdout.split())
    listed = text.split("Presets of --model.pattern here:")[1].split("Each name_conv")[0]
    assert "window (softmax, 2 heads x 8, window 4)" in listed
    assert "mla (mla, 2 heads x 8, kv_rank 8, q_rank 16)" in listed
    assert "band" not in listed


def test_pattern_refusals_and_plugin_flags_through_the_command_lines(tmp_path, capsys, monkeypatch):
    """One line, exit 2, naming what is wrong: an encoder preset in a decoder, a missing
    plugin in each command line; a plugin file loads in analysis.claims (in a process of
    its own: importing it here would register it in every later test)."""
    import analysis.claims
    import analysis.experiments.induction_heads
    import train.compare

    monkeypatch.chdir(tmp_path)
    assert main(["--config", TINY_CONFIG, "--workdir", "w", "--model.pattern", "band,band"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "'band', a bidirectional (encoder) layer" in err and "valid here" in err
    assert not (tmp_path / "w").exists()  # refused before anything is written
    for command in (train.compare, analysis.experiments.induction_heads, analysis.claims):
        assert command.main(["--plugin", "no_such_plugin"]) == 2, command.__name__
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, (command.__name__, lines)
        assert lines[0].startswith("error: --plugin: ") and "'no_such_plugin'" in lines[0]
    plugin = tmp_path / "marker_plugin.py"
    plugin.write_text("import sys\nprint('marker plugin imported', file=sys.stderr)\n")
    done = subprocess.run(
        [sys.executable, "-m", "analysis.claims", "--plugin", str(plugin), "--only", "1",
         "--out", "claims"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "marker plugin imported" in done.stderr


BAD_KIND_PLUGIN = """
import jax.numpy as jnp
import models

def int_attention(q, k, v, **call):
    return jnp.ones((*q.shape[:3], v.shape[-1]), jnp.int32)

models.attention_kind("int_out", int_attention, family="int")
models.register_preset("int_out", lambda s: s.function("int_out"), description="an int output")
"""


def test_a_plugin_kind_returning_ints_ends_the_run_in_one_line(tmp_path):
    """It trained silently on truncated outputs (status 0); now one line, status 2."""
    (tmp_path / "int_plugin.py").write_text(BAD_KIND_PLUGIN)
    done = subprocess.run(
        [sys.executable, "-m", "train", "--plugin", "int_plugin.py", "--config", TINY_CONFIG,
         "--workdir", "w", "--model.pattern", "int_out", "--no-progress"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
    )  # fmt: skip
    # XLA's false alarm on loading a cached program (README) is not the command's line.
    lines = [x for x in done.stderr.strip().splitlines() if "cpu_aot_loader" not in x]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("error: kind 'int_out': expected int_plugin.int_attention to ")
    assert lines[0].endswith("got int32 (8, 16, 2, 8)") and done.stdout == ""


def test_layer_pattern_and_depth_from_the_command_line():
    base = load_config(TINY_CONFIG)
    model = with_pattern(base.model, "gqa,streaming", 5)
    assert [a.num_kv_heads for a in model.layers] == [1, None, 1, None, 1]  # 2 heads: GQA of 1
    assert [a.window for a in model.layers] == [None, 4, None, 4, None]
    assert {a.head_dim for a in model.layers} == {base.model.layers[0].head_dim}
    assert len(with_pattern(base.model, None, 3).layers) == 3
    config, _ = parse("p", "", ["--config", TINY_CONFIG, "--model.pattern", "mha,linear",
                                "--model.layers.1.chunk-size", "8"],
                      default_config=None, layer_flags=True)  # fmt: skip
    assert [a.kind for a in config.model.layers] == ["softmax", "linear"]
    assert config.model.layers[1].chunk_size == 8
    with pytest.raises(ValueError, match=r"--model\.pattern: expected .*got 'mha,nope'"):
        with_pattern(base.model, "mha,nope", None)
    with pytest.raises(ValueError, match=r"--model\.depth"):
        with_pattern(base.model, None, 0)


def test_a_model_vocabulary_other_than_the_tasks_is_refused(tmp_path, capsys):
    argv = ["--config", TINY_CONFIG, "--workdir", str(tmp_path), "--model.vocab-size", "999"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--model.vocab-size: expected the task's vocabulary 32" in err
    assert not (tmp_path / "config.json").exists()
    # The task's vocabulary is what the model gets, also after --task.vocab-size.
    config, _ = parse("p", "", ["--config", TINY_CONFIG, "--task.vocab-size", "40"],
                      default_config=None)  # fmt: skip
    assert config.model.vocab_size == config.task.vocab == 40
    config, _ = parse("p", "", ["--config", TINY_CONFIG, "--model.vocab-size", "32"],
                      default_config=None)  # fmt: skip
    assert config.model.vocab_size == 32


def _run_cli(workdir, *extra):
    return [sys.executable, "-m", "train", "--config", TINY_CONFIG, "--workdir", str(workdir),
            "--no-progress", *extra]  # fmt: skip


def test_ctrl_c_prints_the_last_checkpoint_and_how_to_resume(tmp_path, compilation_cache_dir):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env["JAX_COMPILATION_CACHE_DIR"] = compilation_cache_dir
    run = tmp_path / "run"
    args = ("--steps", "100000", "--ckpt-every", "10", "--eval-every", "100000")
    proc = subprocess.Popen(
        _run_cli(run, *args), cwd=REPO, env=env, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        ckpts = run / "checkpoints"
        if ckpts.exists() and any(p.name.isdigit() for p in ckpts.iterdir()):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    pattern = r"after (\d+) updates; the last checkpoint is step (\d+) of 100000\. "
    pattern += r"Resume with: (.+)$"
    match = re.search(pattern, err, re.M)
    assert match, err
    done, last = int(match.group(1)), int(match.group(2))
    assert last == done >= 10, "the step in flight finishes and is saved: nothing is lost"
    assert f"--workdir {run}" in match.group(3)
    # The printed command resumes, and says so; --stop-at marks the summary partial.
    resumed = subprocess.run(
        [sys.executable, *shlex.split(match.group(3))[1:], "--stop-at", str(last + 5)],
        cwd=REPO, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout)
    assert summary["step"] == last + 5 and summary["partial"] is True


def test_resume_says_so_and_a_config_mismatch_is_one_line(tmp_path, capsys, monkeypatch,
                                                          compilation_cache_dir):  # fmt: skip
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", compilation_cache_dir)
    run = str(tmp_path / "run")
    assert main(["--config", TINY_CONFIG, "--workdir", run, "--steps", "10", "--stop-at", "5"]) == 0
    first = capsys.readouterr()
    assert json.loads(first.out)["partial"] is True and "resuming" not in first.err
    assert main(["--config", TINY_CONFIG, "--workdir", run, "--steps", "10"]) == 0
    second = capsys.readouterr()
    assert "resuming from step 5 of 10" in second.err
    assert json.loads(second.out)["partial"] is False
    assert main(["--config", TINY_CONFIG, "--workdir", run, "--model.width", "32"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "error: workdir:" in err
    assert "model.width (recorded 16, got 32)" in err and "new workdir" in err
    # More steps extend the finished run.
    assert main(["--config", TINY_CONFIG, "--workdir", run, "--steps", "12"]) == 0
    third = capsys.readouterr()
    assert "resuming from step 10 of 12 (extended from 10 steps" in third.err
    assert json.loads(third.out)["step"] == 12
