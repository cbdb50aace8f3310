"""The comparison's plots: the metric against decode-state size, the curves, and the test
lengths (``train.compare_report.write_results`` writes them beside the table).

Each ``*_figure`` returns the matplotlib figure (for tests and notebooks); each
``plot_*`` saves it to a PNG.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = [
    "curves_figure",
    "lengths_figure",
    "place_labels",
    "plot_curves",
    "plot_lengths",
    "plot_recall_vs_state",
    "recall_vs_state_figure",
    "scatter_name",
]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _best_runs(results: dict[str, Any], name: str) -> list[dict[str, Any]]:
    lr = results["variants"][name]["lr"]
    return [r for r in results["runs"] if r["variant"] == name and r["lr"] == lr]


# Where a point's label may go, in points from it: right, left, above, below, diagonals.
_LABEL_SPOTS = (
    (8, 0, "left", "center"),
    (-8, 0, "right", "center"),
    (0, 8, "center", "bottom"),
    (0, -8, "center", "top"),
    (8, 9, "left", "bottom"),
    (-8, 9, "right", "bottom"),
    (8, -9, "left", "top"),
    (-8, -9, "right", "top"),
    (0, 20, "center", "bottom"),
    (0, -20, "center", "top"),
)


def place_labels(ax, points, marker_points: float = 6.0) -> list:
    """Annotates each ``(x, y, text, color)`` where its label overlaps no other label
    and no point's marker and stays inside the axes, trying ``_LABEL_SPOTS`` in turn.

    Args:
      ax: the axes, with everything but the labels drawn.
      points: the labelled points, in data coordinates.
      marker_points: half the width of a marker, in points.

    Returns:
      The label ``Text`` artists.
    """
    from matplotlib.transforms import Bbox

    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    half = marker_points * fig.dpi / 72
    markers = [
        Bbox.from_extents(px - half, py - half, px + half, py + half)
        for px, py in (ax.transData.transform((x, y)) for x, y, _, _ in points)
    ]
    placed, labels = list(markers), []

    def annotate(x, y, text, color, spot):
        dx, dy, ha, va = spot
        label = ax.annotate(
            text, (x, y), textcoords="offset points", xytext=(dx, dy), ha=ha, va=va,
            fontsize=8, color=color,
        )  # fmt: skip
        return label, label.get_window_extent(renderer)

    for x, y, text, color in points:
        for spot in _LABEL_SPOTS:
            label, box = annotate(x, y, text, color, spot)
            inside = frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1)
            if inside and not any(box.overlaps(other) for other in placed):
                break
            label.remove()
        else:  # every spot taken: the first, which at least stays next to its point
            label, box = annotate(x, y, text, color, _LABEL_SPOTS[0])
        placed.append(box)
        labels.append(label)
    return labels


def _state_ticks(ax, xs) -> None:
    """Byte ticks: at powers of two (8, 16, 32 KiB, ...) when the points span a factor
    of 4 or more, else at the points' own sizes (at least 15% apart). A log axis over
    a narrow range would otherwise crowd its minor labels together."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullLocator

    def label(x, _):
        for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1)):
            if x >= scale:
                return f"{x / scale:.3g} {unit}"
        return f"{x:g} B"

    if max(xs) >= 4 * min(xs):
        ax.xaxis.set_major_locator(LogLocator(base=2, subs=(1.0,)))
    else:
        ticks = []
        for x in sorted(set(xs)):
            if not ticks or x > 1.15 * ticks[-1]:
                ticks.append(x)
        ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FuncFormatter(label))
    ax.xaxis.set_minor_locator(NullLocator())


def scatter_name(results: dict[str, Any]) -> str:
    """The scatter's file name, named for the task: ``bits_vs_state.png`` on a byte
    corpus, ``recall_vs_state.png`` on the recall tasks."""
    return "bits_vs_state.png" if results["metric"] == "bits_per_byte" else "recall_vs_state.png"


def variant_colors(n: int) -> list:
    """``n`` distinct colors, one per variant: tab10's up to 10, tab20's beyond (its
    20 hues, dark and light), so that no two variants of a comparison share one."""
    plt = _pyplot()
    if n <= 10:
        return [plt.get_cmap("tab10")(i) for i in range(n)]
    if n <= 20:
        return [plt.get_cmap("tab20")(i) for i in range(n)]
    return [plt.get_cmap("turbo")(i / (n - 1)) for i in range(n)]


def recall_vs_state_figure(results: dict[str, Any]):
    """The figure of ``plot_recall_vs_state`` and its point labels: ``(fig, ax, labels)``."""
    plt = _pyplot()
    bpb = results["metric"] == "bits_per_byte"
    key = "bits_per_byte" if bpb else "accuracy"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = variant_colors(len(results["variants"]))
    points, top = [], 0.0
    for i, (name, v) in enumerate(results["variants"].items()):
        color = colors[i]
        x = max(v["state_bytes"], 1)
        seeds = [y for y in v[key]["seeds"] if y is not None]
        top = max([top, *seeds])
        ax.scatter([x] * len(seeds), seeds, color=color, s=12, alpha=0.6, zorder=3)
        agg = v[key]
        if agg["mean"] is not None:
            # The bar spans the seeds' range: what another seed could have given.
            spread = [[agg["mean"] - agg["min"]], [agg["max"] - agg["mean"]]]
            ax.errorbar([x], [agg["mean"]], yerr=spread, color=color, capsize=3, lw=1, zorder=4)
            ax.scatter([x], [agg["mean"]], color=color, s=60, marker="D", label=name, zorder=5)
            points.append((x, agg["mean"], name, color))
    chance = results.get("chance_accuracy")
    if chance is not None:
        ax.axhline(chance, color="gray", ls="--", lw=1, label=f"chance ({chance:.2f})")
    ax.scatter([], [], color="black", s=12, alpha=0.6, label="each seed (bar: their range)")
    ax.set_xscale("log")
    ax.margins(x=0.12)  # room beside the outermost points for their labels
    _state_ticks(ax, [p[0] for p in points] or [1])
    ax.set_xlabel("decode-state bytes per sequence (log scale)")
    if bpb:  # from 0: differences read against the whole loss, not a zoomed band
        ax.set_ylabel("final test bits per byte (lower is better)")
        ax.set_ylim(0, 1.08 * top or 1)
    else:
        ax.set_ylabel("final test accuracy (higher is better)")
        ax.set_ylim(0, 1.1)
    what = "bits per byte" if bpb else "recall accuracy"
    ax.set_title(f"{results['config']['name']}: {what} against decode-state size")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig, ax, place_labels(ax, sorted(points, key=lambda p: (p[1], p[0])))


def plot_recall_vs_state(results: dict[str, Any], path: Path) -> Path:
    """Final test metric against decode-state bytes per sequence (log x), every seed shown.

    One marker per variant at its seeds' mean and a small dot per seed, as in
    Zoology's and Based's recall-against-state plots; labels are placed where
    they overlap no other label and stay inside the axes (``place_labels``).
    """
    return _save(recall_vs_state_figure(results)[0], path)


def curves_figure(results: dict[str, Any]):
    """The figure of ``plot_curves``."""
    plt = _pyplot()
    bpb = results["metric"] == "bits_per_byte"
    fig, (ax_loss, ax_test) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = variant_colors(len(results["variants"]))
    for i, name in enumerate(results["variants"]):
        for j, run in enumerate(_best_runs(results, name)):
            c, style = run["curves"], dict(color=colors[i], ls="-" if j == 0 else "--")
            label = name if j == 0 else None
            train = [x / math.log(2) for x in c["train_loss"]] if bpb else c["train_loss"]
            ax_loss.plot(c["train_step"], train, label=label, lw=1, **style)
            test = [x / math.log(2) for x in c["test_loss"]] if bpb else c["test_accuracy"]
            ax_test.plot(c["eval_step"], test, marker=".", label=label, **style)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("train bits per byte (log scale)" if bpb else "train loss, nats (log scale)")
    ax_loss.set_yscale("log")
    ax_test.set_xlabel("step")
    ax_test.set_ylabel("test bits per byte (lower is better)" if bpb else "test accuracy")
    chance = results.get("chance_accuracy")
    if chance is not None:
        ax_test.axhline(chance, color="gray", ls="--", lw=1, label="chance")
    if not bpb:
        ax_test.set_ylim(0, 1.05)
    ax_test.legend(fontsize=7)
    seeds = len(results["config"]["seeds"]) + len(results["config"].get("best_lr_seeds", ()))
    fig.suptitle(
        f"{results['config']['name']}: best learning rate per variant"
        + (
            "; seed 0 solid, other seeds dashed"
            if seeds > 1
            else f" (seed {results['config']['seeds'][0]})"
        )
    )
    fig.tight_layout()
    return fig


def plot_curves(results: dict[str, Any], path: Path) -> Path:
    """Train loss and the test metric against step: every seed of each best learning rate."""
    return _save(curves_figure(results), path)


def lengths_figure(results: dict[str, Any]):
    """The figure of ``plot_lengths``: each variant's metric against the test length."""
    plt = _pyplot()
    bpb = results["metric"] == "bits_per_byte"
    multiples = results["config"]["test_lengths"]
    T = results["config"]["train"]["task"]["seq_len"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = variant_colors(len(results["variants"]))
    for i, (name, v) in enumerate(results["variants"].items()):
        aggs = [v["at_length"][f"{k}"] for k in multiples]
        xs = [k for k, a in zip(multiples, aggs, strict=True) if a["mean"] is not None]
        kept = [a for a in aggs if a["mean"] is not None]
        spread = [[a["mean"] - a["min"] for a in kept], [a["max"] - a["mean"] for a in kept]]
        ax.errorbar(xs, [a["mean"] for a in kept], yerr=spread, color=colors[i],
                    marker="o", ms=4, capsize=3, lw=1, label=name)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(multiples, [f"{k}x\n{k * T}" for k in multiples])
    ax.set_xlabel("test length: multiple of the training length, and tokens")
    if bpb:
        ax.set_ylabel("test bits per byte (lower is better)")
        ax.set_ylim(bottom=0)
    else:
        ax.set_ylabel("test accuracy (higher is better)")
        ax.set_ylim(0, 1.05)
    ax.set_title(f"{results['config']['name']}: trained at T={T}, tested longer")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig


def plot_lengths(results: dict[str, Any], path: Path) -> Path:
    """Each variant's test metric at every test length (bars: the seeds' range)."""
    return _save(lengths_figure(results), path)


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path
