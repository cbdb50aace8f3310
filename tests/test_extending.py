"""docs/extending.md runs as written: its plugin, its commands and its script.

The page's Python blocks are saved into the files they name (``# my_variants.py``
starts the plugin, later blocks continue it, ``# check_gated.py`` is the
script), and every ``python ...`` line of its bash blocks runs in that folder,
with tiny budgets appended (a later flag overrides an earlier one). So the
plugin's layer kind is trained through the CLI, compared with ``--jobs 2``,
reloaded with ``load_run`` and decoded (prefill + decode == forward) in fresh
processes, which keeps its registrations out of this one.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "extending.md"

TINY_RUN = "--steps 4 --eval-every 2 --ckpt-every 2 --log-every 2 --batch-size 4 "
TINY_RUN += "--eval-batches 1 --model.width 32 --model.mlp-width 32 --no-progress"
TINY_COMPARE = (
    "--train.steps 4 --train.eval-every 2 --train.ckpt-every 2 --train.log-every 2 "
    "--train.batch-size 4 --train.eval-batches 1 --train.model.width 32 "
    "--train.model.mlp-width 32 --no-progress --jobs 2 --results-dir results --runs-dir runs"
)


def blocks(language: str) -> list[str]:
    text = PAGE.read_text()
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def write_files(folder: Path) -> dict[str, str]:
    files, current = {}, None
    for block in blocks("python"):
        first = block.splitlines()[0]
        if re.fullmatch(r"# \w+\.py", first):
            current = first[2:]
            files[current] = ""
        assert current is not None, "the first python block must name its file"
        files[current] += block + "\n"
    for name, text in files.items():
        (folder / name).write_text(text)
    return files


def commands() -> list[list[str]]:
    lines = [line for block in blocks("bash") for line in block.splitlines() if line.strip()]
    assert all(line.startswith("python ") for line in lines), lines
    out = []
    for line in lines:
        cmd = shlex.split(line.replace("configs/", f"{REPO}/configs/"))
        if cmd[1:3] == ["-m", "train"]:
            cmd += shlex.split(TINY_RUN)
        elif cmd[1:3] == ["-m", "train.compare"]:
            cmd += shlex.split(TINY_COMPARE)
        out.append([sys.executable, *cmd[1:]])
    return out


def test_page_parts():
    """The page holds the five examples and the commands the test runs."""
    text = PAGE.read_text()
    for call in ("register_feature_map", "register_preset", "register_kind", "register_variant",
                 "attention_kind"):  # fmt: skip
        assert f"{call}(" in text
    # The attention function example is at most ~25 lines, as printed.
    example = next(b for b in blocks("python") if "def relu_attention" in b)
    assert len(example.strip().splitlines()) <= 25
    names = [c[1:3] for c in commands()]
    assert ["-m", "train"] in names and ["-m", "train.compare"] in names


def run_page(folder: Path):
    """Every command of the page, in order, in ``folder`` holding the page's files."""
    files = write_files(folder)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "JAX_COMPILATION_CACHE_DIR": str(folder / "xla"),  # shared by the commands, not $HOME
    }
    outputs = []
    for cmd in commands():
        done = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{shlex.join(cmd)}\n{done.stdout}\n{done.stderr}"
        outputs.append(done.stdout)
    return files, outputs


def test_plugin_trains_compares_reloads_and_decodes(tmp_path):
    """One test (its commands build on each other): train, compare, reload, decode."""
    import train

    folder = tmp_path
    files, outputs = run_page(folder)
    assert set(files) == {"my_variants.py", "check_gated.py"}
    record = json.loads((folder / "runs" / "gated" / "config.json").read_text())
    assert record["plugins"] == ["my_variants"]
    layers = record["model"]["layers"]
    assert [x["kind"] for x in layers] == ["gated", "gated", "relu"]
    assert [x["gate"] for x in layers[:2]] == ["sigmoid", "silu"]
    softplus = json.loads((folder / "runs" / "softplus" / "config.json").read_text())
    assert softplus["model"]["layers"][1]["feature_map"] == "softplus"
    results = json.loads((folder / "results" / "gated_quick" / "results.json").read_text())
    variants = results["variants"]
    assert list(variants) == ["mha", "gated", "softplus_hybrid"]
    assert variants["softplus_hybrid"]["layers"] == "mha_conv+linear_softplus_conv"
    kinds = [x["kind"] for x in variants["gated"]["model"]["layers"]]
    assert kinds == ["gated", "gated"]
    assert all(r["summary"]["step"] == 4 for r in results["runs"])  # the workers trained them
    assert "prefill + decode == forward for gated, relu layers" in outputs[-1]
    # Without the plugin on the path, the run's record names what it needs, in one line.
    assert "my_variants" not in sys.modules
    with pytest.raises(ValueError, match=r"config\.json plugins: .*'my_variants'") as e:
        train.load_run(folder / "runs" / "gated")
    assert "\n" not in str(e.value)


def test_missing_plugin_is_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "train", "--plugin", "no_such_plugin", "--config", "x.py"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no_such_plugin" in lines[0] and lines[0].startswith("error:")
