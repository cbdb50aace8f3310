"""The command line: config files, tyro overrides, ``--data`` and errors."""

import json
from pathlib import Path

import pytest

from train.__main__ import main
from train.cli import load_config
from train.loop import read_metrics

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
