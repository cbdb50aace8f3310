"""Writing a benchmark's result: ``<name>.json``, ``.md`` (its table) and ``.png``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_report(
    result: dict,
    out_dir: str,
    name: str,
    markdown: Callable[[dict], str],
    plot: Callable[[dict, Path], None],
) -> Path:
    """Writes ``result`` to ``out_dir/name.{json,md,png}`` and prints its table.

    A relative ``out_dir`` is relative to the repository root, so the scripts
    write to ``bench/results/`` from any working directory. Returns the folder.
    """
    out = Path(out_dir)
    out = out if out.is_absolute() else ROOT / out
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    (out / f"{name}.md").write_text(table)
    plot(result, out / f"{name}.png")
    print(table)
    print(f"wrote {out / name}.{{json,md,png}} in {result['wall_seconds']:.0f} s")
    return out
