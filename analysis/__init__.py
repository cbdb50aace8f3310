"""What attention heads do: metrics on captured weights, head importance, plots.

Pure functions over arrays (NumPy float64 on the host; JAX arrays are accepted).
Weights come from ``models.capture_weights`` as L arrays ``[B,N,T,S]``; every
metric takes them stacked, ``[L,B,N,T,S]``, or as that list, and returns one
number per head, ``[L,N]``. Axis letters as in ``attn``: L layers, B batch,
N heads, T queries, S keys; F fractions in ``pruning_masks``.

    from analysis import metrics, plots

    logits, weights = models.capture_weights(model, tokens)   # L x [B,N,T,T]
    ind = metrics.induction_score(weights, period=P, start=P + 1, tokens=tokens)
    plots.score_heatmap(ind, "results/induction.png", "induction score")

Files: ``metrics.py`` (entropy, previous-token, duplicate-token, induction,
first-token mass and sink rate), ``importance.py`` (normalizing head importance,
pruning orders and masks), ``plots.py`` (attention grids, heatmaps, curves) and
``_checks.py`` (input validation).

``python -m analysis.claims`` measures every claim the project reproduces and
prints a table (also ``results/claims/table.md`` and ``results.json``): one
row per claim with the measured value, the criterion and whether it holds.
Claims 1-9 are fast checks computed with ``attn`` and ``models``
(``claim_checks.py``; under a minute on 2 cores); claim 10 reads the main
comparison's results and claims 11-14 the experiments' (committed under
``docs/results/``), or runs them first with ``--run``. ``--only 1,5`` picks
rows. The committed table is ``docs/results/claims/table.md``.
"""

__all__ = [
    "SINK_THRESHOLD",
    "SinkRate",
    "duplicate_pattern",
    "duplicate_token_score",
    "entropy",
    "first_token_mass",
    "importance",
    "induction_pattern",
    "induction_score",
    "induction_score_from_tokens",
    "metrics",
    "normalize_importance",
    "pattern_score",
    "periodic_induction_pattern",
    "plots",
    "previous_token_pattern",
    "previous_token_score",
    "pruning_masks",
    "pruning_order",
    "sink_rate",
    "uniform_entropy",
]

# Where each public name lives: imported on first use (PEP 562), so that the
# experiments' command lines can set up Ctrl-C handling before JAX is imported.
_HOMES = {
    **{name: "analysis.metrics" for name in __all__},
    "normalize_importance": "analysis.importance",
    "pruning_masks": "analysis.importance",
    "pruning_order": "analysis.importance",
}
_MODULES = ("importance", "metrics", "plots")


def __getattr__(name: str):
    import importlib

    if name in _MODULES:
        return importlib.import_module(f"analysis.{name}")
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'analysis' has no attribute {name!r}")
