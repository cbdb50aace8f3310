"""Plots write non-empty PNG files and check their arguments."""

import numpy as np
import pytest

from analysis import plots
from tests.analysis.test_metrics import random_causal

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def is_png(path):
    data = path.read_bytes()
    return len(data) > 1000 and data.startswith(PNG_MAGIC)


def test_attention_grid(tmp_path):
    w = random_causal(0, (2, 2, 3, 6, 6))
    tokens = np.arange(12).reshape(2, 6)
    out = plots.attention_grid(w, [0, 1], [0, 2], tmp_path / "grid.png", tokens=tokens, batch=1)
    assert out == tmp_path / "grid.png" and is_png(out)
    # One index each, no tokens, a nested folder that does not exist yet.
    assert is_png(plots.attention_grid(w, 1, 2, str(tmp_path / "a" / "one.png")))


def test_score_heatmap(tmp_path):
    scores = np.random.default_rng(0).random((3, 4))
    assert is_png(plots.score_heatmap(scores, tmp_path / "heat.png", "induction score"))


def test_curves(tmp_path):
    xs = [0.0, 0.25, 0.5]
    ys = {"importance": [1.0, 0.9, 0.6], "random": [1.0, 0.7, 0.3]}
    assert is_png(plots.curves(xs, ys, tmp_path / "c.png", "heads masked", "accuracy", hline=0.5))


def test_validation_errors(tmp_path):
    w = random_causal(0, (2, 1, 3, 4, 4))
    cases = [
        (lambda: plots.attention_grid(w, [2], [0], tmp_path / "g.png"), "layers: expected an int"),
        (lambda: plots.attention_grid(w, [0], [], tmp_path / "g.png"), "heads: expected"),
        (lambda: plots.attention_grid(w, 0, 0, tmp_path / "g.pdf"), "path: expected a file name"),
        (lambda: plots.attention_grid(w, 0, 0, tmp_path / "g.png", tokens=[1, 2]), "tokens:"),
        (lambda: plots.score_heatmap(np.ones(3), tmp_path / "h.png", "t"), "scores: expected"),
        (lambda: plots.curves([1, 2], {"a": [1]}, tmp_path / "c.png", "x", "y"), "ys_by_label"),
        (lambda: plots.curves([1, 2], {}, tmp_path / "c.png", "x", "y"), "ys_by_label: expected"),
        (lambda: plots.curves([1], {"a": [1]}, tmp_path / "c.png", "x", "y", hline="0"), "hline"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    assert not list(tmp_path.iterdir())  # nothing written on a bad call
