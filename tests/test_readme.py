"""The README's example runs as printed and shows what it says."""

from pathlib import Path

import numpy as np
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(text: str) -> list[str]:
    blocks, current = [], None
    for line in text.splitlines():
        if current is None and line.strip() == "```python":
            current = []
        elif current is not None and line.strip() == "```":
            blocks.append("\n".join(current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_readme_example_runs_and_a_decode_step_is_the_last_row(capsys):
    blocks = python_blocks(README.read_text())
    (example,) = [b for b in blocks if "from attn import masks" in b]
    for block in blocks:  # the others need a trained run: they must at least compile
        compile(block, str(README), "exec")
    scope: dict = {}
    exec(compile(example, str(README), "exec"), scope)
    out, last = np.asarray(scope["out"]), np.asarray(scope["last"])
    assert out.shape == (2, 128, 8, 64)
    np.testing.assert_allclose(last, out[:, -1:], rtol=1e-5, atol=1e-5)
    assert capsys.readouterr().out.strip() == "131072"


@pytest.mark.integration  # the fast tier's 4 minutes are full
def test_readme_decoding_example_serves_what_generate_gives():
    (example,) = [b for b in python_blocks(README.read_text()) if "models.serve(" in b]
    scope: dict = {}
    exec(compile(example, str(README), "exec"), scope)  # it asserts the two agree
    assert [len(s) for s in scope["served"]] == [8, 8, 8]
