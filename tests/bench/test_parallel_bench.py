"""bench/parallel.py end to end at a tiny size on 8 fake devices: the step ``train`` runs,
compiled per mesh, with its collectives and memory read from the compiled program, and
a fixed-state family's sharded form with each exchange.

The script sets its own device count, so it runs as the command line does, in a
subprocess. Timings are never asserted.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_meshes_at_a_tiny_size(tmp_path):
    tiny = ["--quick", "--width", "64", "--seq-len", "64", "--batch", "8", "--repeats", "1"]
    cmd = [sys.executable, str(ROOT / "bench" / "parallel.py"), *tiny, "--out-dir", str(tmp_path)]
    # XLA_FLAGS as the suite sets them (-O0); the script adds its 8 devices to them.
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.loads((tmp_path / "parallel-cpu-quick.json").read_text())
    rows = {row["mesh"]: row for row in saved["rows"]}
    assert set(rows) == {"single device", "data=2,fsdp=2,seq=2"}
    assert rows["single device"]["collective_bytes"] == 0
    sharded = rows["data=2,fsdp=2,seq=2"]
    assert sharded["collectives"]["collective-permute"]["bytes"] > 0  # the ring's shifts
    assert sharded["argument_bytes"] < rows["single device"]["argument_bytes"]  # fsdp shards
    # The same step on both: the losses agree up to float rounding.
    assert abs(sharded["loss"] - rows["single device"]["loss"]) < 1e-4
    report = (tmp_path / "parallel-cpu-quick.md").read_text()
    assert report.startswith("# One training step") and "## The fixed-state families" in report
    # Each family's sharded form, with each exchange: the all-gather receives 7 pairs on 8
    # devices, the scan log2 8 = 3 pairs plus a shifted state and the final one.
    families = {(r["family"], r["exchange"]): r for r in saved["families"]}
    assert set(families) == {("gated_deltanet", "gather"), ("gated_deltanet", "scan")}
    gather, scan = families["gated_deltanet", "gather"], families["gated_deltanet", "scan"]
    assert gather["collectives"]["all-gather"]["bytes"] > 0
    assert scan["collectives"]["collective-permute"]["bytes"] > 0
    assert scan["received_bytes"] < gather["received_bytes"]
