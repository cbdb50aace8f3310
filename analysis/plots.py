"""PNG plots of attention maps, per-head scores and curves; each returns the path it wrote.

Figures are built on ``matplotlib.figure.Figure`` and rendered by the Agg
canvas, not through ``pyplot``: importing this module never switches the
user's backend, and no figure is left open in global state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from analysis import _checks
from attn.checks import fail

# Token labels on the axes stay readable up to about this many positions.
MAX_TICK_LABELS = 32
# Per-cell value annotations on a heatmap stay readable up to this many cells.
MAX_ANNOTATED_CELLS = 144
DPI = 120


def _png(path) -> Path:
    if not isinstance(path, str | Path):
        fail("path", "a str or pathlib.Path ending in .png", type(path).__name__)
    path = Path(path)
    if path.suffix.lower() != ".png":
        fail("path", "a file name ending in .png", repr(str(path)))
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, format="png", dpi=DPI)
    return path


def _indices(x, name: str, size: int, axis: str) -> list[int]:
    if isinstance(x, int | np.integer) and not isinstance(x, bool):
        x = [x]
    if not isinstance(x, Sequence | np.ndarray) or len(x) == 0:
        fail(name, f"a non-empty sequence of {axis} indices", repr(x))
    return [_checks.integer(i, name, 0, size, f" ({size} {axis}s)") for i in x]


def _labels(tokens, batch: int, T: int, S: int):
    """Tick labels ``(queries, keys)`` from tokens, or None when absent or too long to read."""
    if tokens is None or max(T, S) > MAX_TICK_LABELS:
        return None
    tokens = np.asarray(tokens)
    if tokens.ndim == 2 and tokens.shape[0] <= batch:
        fail("tokens", f"[B,S] ids with more than batch={batch} rows", f"shape {tokens.shape}")
    row = tokens[batch] if tokens.ndim == 2 else tokens
    if row.ndim != 1 or len(row) != S:
        fail("tokens", f"[B,S] ids or S = {S} labels", f"shape {tokens.shape}")
    labels = [str(x) for x in row]
    return labels[S - T :], labels  # queries are the last T key positions


def attention_grid(w, layers, heads, path, tokens=None, *, batch: int = 0) -> Path:
    """Attention maps for the chosen layers (rows) and heads (columns) of one example.

    Args:
      w: weights ``[L,B,N,T,S]`` (or a sequence of L ``[B,N,T,S]``).
      layers, heads: indices (or one index each) to show.
      path: the PNG to write (parent folders are created).
      tokens: optional ``[B,S]`` token ids or ``[S]`` labels for the axes (shown
        when S <= MAX_TICK_LABELS).
      batch: which example.

    Returns:
      ``path`` as a ``pathlib.Path``.
    """
    w, _ = _checks.weights(w)
    L, B, N, T, S = w.shape
    layers = _indices(layers, "layers", L, "layer")
    heads = _indices(heads, "heads", N, "head")
    batch = _checks.integer(batch, "batch", 0, B, f" ({B} examples)")
    path = _png(path)
    labels = _labels(tokens, batch, T, S)
    rows, cols = len(layers), len(heads)
    # One color scale for every map shown, so heads compare at a glance; the
    # shown maximum rather than 1, so long rows of small weights stay visible.
    vmax = max(float(w[np.ix_(layers, [batch], heads)].max()), np.finfo(np.float32).tiny)
    fig = Figure(figsize=(2.4 * cols + 0.8, 2.4 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for r, layer in enumerate(layers):
        for c, head in enumerate(heads):
            ax = axes[r, c]
            image = ax.imshow(w[layer, batch, head], vmin=0.0, vmax=vmax, cmap="viridis")
            ax.set_title(f"L{layer} H{head}", fontsize=9)
            if labels is None:
                ax.tick_params(labelsize=6)
            else:
                ax.set_xticks(range(S), labels[1], rotation=90, fontsize=5)
                ax.set_yticks(range(T), labels[0], fontsize=5)
    axes[-1, 0].set_xlabel("key")
    axes[-1, 0].set_ylabel("query")
    fig.colorbar(image, ax=axes, shrink=0.8)
    return _save(fig, path)


def score_heatmap(scores, path, title: str) -> Path:
    """One score per head as a layer x head heatmap, values written in the cells.

    Args:
      scores: ``[L,N]`` (e.g. ``metrics.induction_score``).
      path: the PNG to write.
      title: the figure's title.

    Returns:
      ``path`` as a ``pathlib.Path``.
    """
    scores = _checks.scores(scores, "scores")
    if not isinstance(title, str):
        fail("title", "a str", type(title).__name__)
    path = _png(path)
    L, N = scores.shape
    fig = Figure(figsize=(max(3.0, 0.5 * N + 1.5), max(2.5, 0.4 * L + 1.2)), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(scores, cmap="magma", aspect="auto")
    ax.set_xticks(range(N))
    ax.set_yticks(range(L))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title)
    if L * N <= MAX_ANNOTATED_CELLS:
        mid = (scores.min() + scores.max()) / 2
        for (l, n), value in np.ndenumerate(scores):
            color = "black" if value > mid else "white"  # legible on magma's light and dark ends
            ax.text(n, l, f"{value:.2f}", ha="center", va="center", fontsize=7, color=color)
    fig.colorbar(image, ax=ax)
    return _save(fig, path)


def curves(
    xs, ys_by_label: Mapping[str, Sequence[float]], path, xlabel: str, ylabel: str, hline=None
) -> Path:
    """Line plot of several series over shared x values (e.g. accuracy vs heads masked).

    Args:
      xs: X numbers.
      ys_by_label: ``{label: X numbers}``, one line each, in the mapping's order.
      path: the PNG to write.
      xlabel, ylabel: axis labels.
      hline: optional y value drawn as a dashed reference line (a baseline).

    Returns:
      ``path`` as a ``pathlib.Path``.
    """
    xs = np.asarray(xs, dtype=np.float64)
    if xs.ndim != 1 or xs.size == 0:
        fail("xs", "a non-empty 1-D sequence of numbers", f"shape {xs.shape}")
    if not isinstance(ys_by_label, Mapping) or not ys_by_label:
        fail("ys_by_label", "a non-empty mapping {label: ys}", repr(ys_by_label))
    series = {}
    for label, ys in ys_by_label.items():
        ys = np.asarray(ys, dtype=np.float64)
        if ys.shape != xs.shape:
            fail(f"ys_by_label[{label!r}]", f"shape {xs.shape} like xs", f"shape {ys.shape}")
        series[str(label)] = ys
    if hline is not None and not isinstance(hline, int | float | np.integer | np.floating):
        fail("hline", "a number or None", repr(hline))
    path = _png(path)
    fig = Figure(figsize=(5.0, 3.5), layout="constrained")
    ax = fig.subplots()
    for label, ys in series.items():
        ax.plot(xs, ys, marker="o", markersize=3, label=label)
    if hline is not None:
        ax.axhline(float(hline), color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel(str(xlabel))
    ax.set_ylabel(str(ylabel))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
