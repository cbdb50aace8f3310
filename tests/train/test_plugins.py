"""``--plugin``: loading, one-line errors, what a run records, and the per-CPU compilation cache."""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import pytest

import models
from train import cli, plugins
from train.config import TrainConfig
from train.run import run_batch
from train.tasks import make_task


def test_split_flags():
    assert plugins.split_flags(["--plugin", "a", "--steps", "3", "--plugin=b.py"]) == (
        ["a", "b.py"],
        ["--steps", "3"],
    )
    with pytest.raises(ValueError, match=r"^--plugin: expected a module name .*got nothing"):
        plugins.split_flags(["--plugin", "--steps", "3"])


def test_a_missing_plugin_is_one_line_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"^--plugin: .*got 'no_such_plugin_x'") as e:
        plugins.load(["no_such_plugin_x"])
    # A run recorded with a module-name plugin, read from another folder, is told how to find it.
    assert "\n" not in str(e.value) and "run from its folder or set PYTHONPATH" in str(e.value)
    with pytest.raises(ValueError, match=r"got '.*nothing_here\.py'"):
        plugins.load([str(tmp_path / "nothing_here.py")])


def test_a_plugin_that_does_not_import_is_one_line(tmp_path):
    """A syntax error, an exception at import, an import of something missing: one line
    (the command lines print it and exit 2), naming the plugin and where it failed."""
    bodies = {
        "plugin_syntax_x.py": ("def broken(:\n", "SyntaxError"),
        "plugin_raises_x.py": (
            "x = 1\nraise RuntimeError('no GPU\\nmore')\n",
            "RuntimeError: no GPU",
        ),
        "plugin_missing_x.py": ("import not_a_module_anywhere\n", "ModuleNotFoundError"),
    }
    for name, (body, error) in bodies.items():
        (tmp_path / name).write_text(body)
        with pytest.raises(ValueError) as e:
            plugins.load([str(tmp_path / name)])
        message = str(e.value)
        assert "\n" not in message and message.startswith(f"--plugin '{tmp_path / name}'")
        assert f"expected a plugin that imports, got {error}" in message
        assert f"{name}:" in message and name[:-3] not in sys.modules


def test_a_plugin_file_registers_and_is_recorded(tmp_path):
    path = tmp_path / "plugin_for_test_x.py"
    path.write_text(
        "import models\n"
        "models.register_preset('test_plugin_window', lambda s: s.base(window=3), "
        "description='from a file')\n"
    )
    try:
        assert plugins.load([str(path)]) == (str(path.resolve()),)
        assert plugins.load([str(path)]) == (str(path.resolve()),)  # once only
        assert str(path.resolve()) in plugins.loaded()
        assert models.presets()["test_plugin_window"].window == 3
        # Every run of this process records it, whatever its layers.
        assert str(path.resolve()) in plugins.needed(models.ModelConfig())
        clash = tmp_path / "clash_for_test_x.py"
        clash.write_text(
            "import models\n"
            "models.register_preset('test_plugin_window', lambda s: s.base(), description='x')\n"
        )
        with pytest.raises(ValueError, match=r"^--plugin '.*clash_for_test_x.py': names: "):
            plugins.load([str(clash)])
    finally:
        models.PRESET_REGISTRY.remove("test_plugin_window")
        plugins._LOADED.remove(str(path.resolve()))
        sys.modules.pop("plugin_for_test_x", None)


def test_needed_names_the_module_of_a_kind():
    class Local(models.SelfAttention):
        pass

    models.register_kind("test_needed", Local, config=models.SoftmaxConfig)
    try:
        config = models.ModelConfig(layers=(models.SoftmaxConfig(kind="test_needed"),))
        assert __name__ in plugins.needed(config)
        assert plugins.needed(models.ModelConfig()) == plugins.loaded()  # built-ins need none
    finally:
        models.KINDS.remove("test_needed")


def test_compilation_cache_is_one_folder_per_cpu(tmp_path, monkeypatch):
    zen = "model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f\n"
    other = "model name\t: AMD EPYC\nflags\t\t: fpu avx2\n"
    assert cli.machine_tag(zen) == cli.machine_tag(zen) != cli.machine_tag(other)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path))
    folder = cli.compilation_cache_dir()
    assert folder.parent == tmp_path and folder.name == f"cpu-{cli.machine_tag()}"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(folder))  # a child process: as is
    assert cli.compilation_cache_dir() == folder


def test_no_compilation_cache_turns_it_off_here_and_for_the_processes_started(monkeypatch):
    monkeypatch.setenv(cli.NO_CACHE_VAR, "0")  # restored after the test: "0" is on
    before = jax.config.jax_compilation_cache_dir
    assert cli.without_cache_flag(["--steps", "3"]) == ["--steps", "3"]
    assert os.environ[cli.NO_CACHE_VAR] == "0"
    config, _ = cli.parse("p", "d", ["--config", "configs/mqar.py", cli.NO_CACHE_FLAG,
                                     "--steps", "3"], default_config=None)  # fmt: skip
    assert config.steps == 3 and os.environ[cli.NO_CACHE_VAR] == "1"  # children inherit it
    assert cli.enable_compilation_cache() is False
    assert jax.config.jax_compilation_cache_dir == before


def test_run_batch_is_the_runs_batch():
    config = TrainConfig(batch_size=3)
    got = run_batch(config, "test", step=1)
    want = make_task(config.task).batch(config.seed, "test", 1, 3)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])
    assert run_batch(config, "train", batch_size=2)["tokens"].shape[0] == 2
