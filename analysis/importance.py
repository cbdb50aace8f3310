"""Head importance and pruning schedules: pure helpers over per-head scores ``[L,N]``.

The scores come from elsewhere: ``models.head_importance`` gives the gradient
of a loss with respect to the head gates; Michel et al. (2019), "Are Sixteen
Heads Really Better than One?", take its magnitude averaged over data,
``mean |d loss / d gate|``, normalize it per layer (``normalize_importance``) and
mask heads from the least important up (``pruning_order``, ``pruning_masks``),
the masks going to ``models.set_head_gates``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from analysis import _checks
from attn.checks import fail

ORDERS = ("importance", "random")


def normalize_importance(scores) -> np.ndarray:
    """Divides each layer's scores by their L2 norm (Michel et al.).

    Gradient magnitudes differ in scale from layer to layer; normalizing makes
    one global ranking of heads meaningful.

    Args:
      scores: ``[L,N]`` (or a sequence of L ``[N]``), normally non-negative
        importances ``mean |d loss / d gate|``.

    Returns:
      ``[L,N]`` float64 with unit L2 norm per layer; a layer of zeros stays zeros.
    """
    scores = _checks.scores(scores, "scores")
    norm = np.linalg.norm(scores, axis=1, keepdims=True)
    return scores / np.where(norm > 0, norm, 1.0)


def pruning_order(importance, by: str = "importance", seed: int = 0) -> np.ndarray:
    """The order in which heads are masked: ``(layer, head)`` pairs, first masked first.

    Args:
      importance: ``[L,N]`` scores (see ``normalize_importance``).
      by: ``"importance"``, least important first (ties keep row-major order,
        so the order is deterministic), or ``"random"``, a permutation drawn
        from ``seed`` (the baseline Michel et al. compare against).
      seed: for ``by="random"``.

    Returns:
      int64 ``[L*N, 2]``: every head exactly once, as (layer, head).
    """
    importance = _checks.scores(importance, "importance")
    if by not in ORDERS:
        fail("by", f"one of {ORDERS}", repr(by))
    seed = _checks.integer(seed, "seed", 0)
    L, N = importance.shape
    if by == "importance":
        flat = np.argsort(importance.ravel(), kind="stable")
    else:
        flat = np.random.default_rng(seed).permutation(L * N)
    return np.stack(np.unravel_index(flat, (L, N)), axis=1).astype(np.int64)


def _order(order) -> tuple[np.ndarray, int, int]:
    """Checks a ``pruning_order`` result and returns it with the grid ``(L, N)`` it covers."""
    order = np.asarray(order)
    if order.ndim != 2 or order.shape[1] != 2 or not np.issubdtype(order.dtype, np.integer):
        fail("order", "integer (layer, head) pairs [L*N, 2]", f"{order.dtype} shape {order.shape}")
    if order.size == 0 or order.min() < 0:
        fail("order", "non-empty, non-negative (layer, head) pairs", f"shape {order.shape}")
    L, N = (int(x) + 1 for x in order.max(axis=0))
    seen = np.zeros((L, N), int)
    np.add.at(seen, (order[:, 0], order[:, 1]), 1)
    if (seen != 1).any():
        fail("order", f"each head of the {L} x {N} grid exactly once", f"{len(order)} pairs")
    return order, L, N


def pruning_masks(order, fractions: Sequence[float]) -> np.ndarray:
    """0/1 head gates that mask the first heads of ``order``, one set per fraction.

    Args:
      order: ``[L*N, 2]`` (layer, head) pairs, as ``pruning_order`` returns.
      fractions: F shares of heads to mask, each in ``[0, 1]``; the number
        masked is the nearest integer to ``fraction * L * N`` (halves up).

    Returns:
      float32 ``[F,L,N]``: 1 keeps a head, 0 masks it (``models.set_head_gates``).
    """
    order, L, N = _order(order)
    if isinstance(fractions, str) or not isinstance(fractions, Sequence | np.ndarray):
        fail("fractions", "a sequence of numbers in [0, 1]", type(fractions).__name__)
    if len(fractions) == 0:
        fail("fractions", "at least one fraction", "none")
    masks = np.ones((len(fractions), L, N), np.float32)
    for i, f in enumerate(fractions):
        f = _checks.fraction(f, f"fractions[{i}]")
        k = int(np.floor(f * L * N + 0.5))
        masks[i, order[:k, 0], order[:k, 1]] = 0.0
    return masks
