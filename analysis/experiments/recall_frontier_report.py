"""The recall frontier's report: its points, Pareto frontier, claim, table and figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from analysis.experiments import _common
from analysis.experiments.recall_frontier_grid import FAMILIES, Run, Scale, setting_key, sizes

REACHED = 0.9  # the accuracy the table's "reaches" column looks for


# ----------------------------------------------------------------------------
# Summaries: points, the frontier, the claim


def points(scale: Scale, summaries: dict[Run, dict]) -> list[dict[str, Any]]:
    """Every point of the grid at its best learning rate (by mean final accuracy over seeds),
    and whether more updates could raise it (``learning_at_cap``: its best rate short of
    the target, and one of its runs ended at its last cap still learning)."""
    rows = []
    for setting in scale.settings:
        for family, knobs in scale.knobs:
            for knob in knobs:
                by_lr = {
                    lr: [summaries[Run(setting, family, knob, lr, s)] for s in scale.seeds]
                    for lr in scale.lrs
                }
                mean = {
                    lr: float(np.mean([r["test_accuracy"] for r in v])) for lr, v in by_lr.items()
                }
                best = max(scale.lrs, key=lambda lr: mean[lr])
                reached = all(r.get("target_reached") for r in by_lr[best])
                learning = any(r.get("learning_at_cap") for v in by_lr.values() for r in v)
                rows.append({
                    "setting": list(setting),
                    "family": family,
                    "knob": knob,
                    **sizes(scale, (setting, family, knob)),
                    "best_lr": best,
                    "accuracy": mean[best],
                    "seed_accuracies": [r["test_accuracy"] for r in by_lr[best]],
                    "steps": [r["step"] for r in by_lr[best]],
                    "accuracy_by_lr": {f"{lr:.1e}": mean[lr] for lr in scale.lrs},
                    # more updates could raise its number: its best rate did not reach the
                    # target, and one of its runs (any rate or seed) ended still learning
                    "learning_at_cap": not reached and learning,
                })  # fmt: skip
    return rows


def pareto(rows: list[dict]) -> list[dict]:
    """The points no other point beats with no more state and at least the accuracy,
    by state (ties in state keep the more accurate)."""
    front, best = [], -1.0
    for r in sorted(rows, key=lambda r: (r["state_elements"], -r["accuracy"])):
        if r["accuracy"] > best:
            front.append(r)
            best = r["accuracy"]
    return front


def reach(rows: list[dict], family: str, level: float = REACHED) -> str:
    """Where ``family`` first reaches ``level``: the smallest state, or that it does not."""
    mine = sorted((r for r in rows if r["family"] == family), key=lambda r: r["state_elements"])
    hit = next((r for r in mine if r["accuracy"] >= level), None)
    if hit is not None:
        return f"{hit['state_elements']:.3g} ({FAMILIES[family].knob} {hit['knob']})"
    return f"not reached at {mine[-1]['state_elements']:.3g}"


def _largest_below(rows, family, level=0.5):
    """The largest state at which ``family`` stays below ``level`` (None: none does)."""
    low = [r["state_elements"] for r in rows if r["family"] == family and r["accuracy"] < level]
    return max(low) if low else None


def claim(scale: Scale, rows: list[dict]) -> dict[str, Any]:
    """The claim row: the frontier in one line, judged on the delta rule against linear attention.

    Criterion (fixed before the run): at every setting, Gated DeltaNet reaches
    0.9 with no more state than the largest at which linear attention (elu+1)
    stays below 0.5.
    """
    parts, holds = [], True
    for setting in scale.settings:
        mine = [r for r in rows if tuple(r["setting"]) == tuple(setting)]
        families = [f for f, _ in scale.knobs]
        reached = ", ".join(f"{f} {reach(mine, f)}" for f in families)
        parts.append(f"{setting_key(setting)}: 0.9 at state {reached}")
        if "gated_deltanet" in families and "linear" in families:
            low = _largest_below(mine, "linear")
            hits = [
                r["state_elements"]
                for r in mine
                if r["family"] == "gated_deltanet" and r["accuracy"] >= REACHED
            ]
            holds = holds and low is not None and bool(hits) and min(hits) <= low
        else:
            holds = False
    bound = [
        f"{r['family']} {r['knob']} at {setting_key(r['setting'])}"
        for r in rows
        if r.get("learning_at_cap")
    ]
    parts.append(f"still learning at the cap: {', '.join(bound) or 'none'}")
    return _common.claim(
        "; ".join(parts),
        "at every setting Gated DeltaNet reaches 0.9 with no more state than the largest "
        "at which linear attention (elu+1) stays below 0.5",
        holds,
    )


# ----------------------------------------------------------------------------
# Reports


def _reach_rows(scale: Scale, mine: list[dict]) -> list[list]:
    """Per family: where it reaches 0.9, its best accuracy and that point's state."""
    out = []
    for family, _ in scale.knobs:
        best = max((r for r in mine if r["family"] == family), key=lambda r: r["accuracy"])
        label = FAMILIES[family].label
        out.append([label, reach(mine, family), best["accuracy"], f"{best['state_elements']:.3g}"])
    return out


def _point_row(r: dict, front: list[dict]) -> list:
    family = FAMILIES[r["family"]]
    return [
        family.label,
        f"{family.knob} {r['knob']}",
        f"{r['state_elements']:,}",
        f"{r['state_bytes']:,}",
        f"{r['params']:,}",
        f"{r['best_lr']:.1e}",
        r["accuracy"],
        " ".join(f"{a:.3f}" for a in r["seed_accuracies"]),
        " ".join(str(s) for s in r["steps"]),
        "yes" if r in front else "",
        "yes" if r.get("learning_at_cap") else "",
    ]


POINT_COLUMNS = (
    "family", "knob", "state (elements)", "state (bytes, f32)", "params", "best lr",
    "accuracy", "per seed", "steps", "on the frontier", "still learning at the cap",
)  # fmt: skip


def table(scale: Scale, rows: list[dict]) -> str:
    """``table.md``'s body: per setting, where each family reaches 0.9, then every point."""
    lines = []
    for setting in scale.settings:
        mine = [r for r in rows if tuple(r["setting"]) == tuple(setting)]
        front = pareto(mine)
        reach_head = ["family", f"reaches {REACHED} at state (elements)", "best accuracy", "at"]
        ordered = sorted(mine, key=lambda r: (r["family"], r["state_elements"]))
        lines += [
            f"## {setting_key(setting)} (chance {1 / setting[1]:.3f})",
            "",
            _common.markdown_table(reach_head, _reach_rows(scale, mine)),
            _common.markdown_table(POINT_COLUMNS, [_point_row(r, front) for r in ordered]),
        ]
    return "\n".join(lines)


def plot(scale: Scale, rows: list[dict], path: Path) -> Path:
    """``frontier.png``: accuracy against state, a panel per setting."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    n = len(scale.settings)
    fig = Figure(figsize=(5.5 * n, 4.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, n, squeeze=False)[0]
    colors = {f: f"C{i}" for i, (f, _) in enumerate(scale.knobs)}
    for ax, setting in zip(axes, scale.settings, strict=True):
        mine = [r for r in rows if tuple(r["setting"]) == tuple(setting)]
        for family, _ in scale.knobs:
            pts = sorted(
                (r for r in mine if r["family"] == family), key=lambda r: r["state_elements"]
            )
            xs = [r["state_elements"] for r in pts]
            ax.plot(xs, [r["accuracy"] for r in pts], "-", color=colors[family], lw=1.4,
                    label=FAMILIES[family].label)  # fmt: skip
            for r in pts:
                ax.plot([r["state_elements"]] * len(r["seed_accuracies"]), r["seed_accuracies"],
                        "o", color=colors[family], ms=4, alpha=0.8)  # fmt: skip
        front = pareto(mine)
        ax.step([r["state_elements"] for r in front], [r["accuracy"] for r in front], "k--",
                where="post", lw=1, label="Pareto frontier")  # fmt: skip
        ax.axhline(1 / setting[1], color="gray", ls=":", lw=1, label="chance")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
        ax.xaxis.set_minor_formatter(NullFormatter())  # labels at every 2x, 3x, ... overlap
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("decode state (elements per sequence, log)")
        ax.set_ylabel("final test accuracy")
        ax.set_title(f"MQAR {setting_key(setting)}, V={scale.vocab_size}")
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path
