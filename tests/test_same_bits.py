"""tools/same_bits.py runs: its attention cases (every implementation, the interpreted
kernels asked for by name) compute, and ``--check`` names what differs (integration)."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "same_bits.py"


def load():
    spec = importlib.util.spec_from_file_location("same_bits", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.integration
def test_the_attention_cases_compute_and_a_check_names_what_differs(tmp_path, monkeypatch, capsys):
    tool = load()
    arrays = tool.attention_arrays()
    assert {"pallas/causal", "splash/causal", "decode/pallas", "xla/causal"} <= set(arrays)
    # Everything finite but the log-sum-exps of rows that see no key (padding): -inf.
    for name, case in arrays.items():
        for key, x in case.items():
            x = np.asarray(x)
            ok = np.isfinite(x) | ((x == -np.inf) if key == "lse" else False)
            assert ok.all(), (name, key)
    flat = {"a:out": np.ones(3, np.float32), "b:out": np.zeros(2, np.float32)}
    monkeypatch.setattr(tool, "compute", lambda: dict(flat))
    assert tool.main(["--save", str(tmp_path)]) == 0
    assert tool.main(["--check", str(tmp_path)]) == 0
    flat["a:out"] = np.asarray([1, 1, 1.5], np.float32)
    flat["c:out"] = np.zeros(1, np.float32)
    assert tool.main(["--check", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "a:out: differs, max |diff| 0.5" in out and "c:out: only in this run" in out
