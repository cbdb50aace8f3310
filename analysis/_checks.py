"""Input validation shared by the public functions of ``analysis``.

Every public function checks what the user passed here and raises ``ValueError``
naming the argument, what was expected and what was received. Weights are
converted to NumPy float64 on the host: analysis runs once per capture, so
exact sums matter more than memory (8 bytes per weight; pass a slice of the
layers, ``w[l:l + 1]``, when a capture is too large).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from attn.checks import fail  # the project's one ValueError("<arg>: expected ..., got ...")

# A row of attention probabilities sums to 1; float32 captures (and linear
# attention's ``+ eps`` in the normalizer) leave it off by far less than this.
ROW_SUM_TOL = 1e-2
# Softmax and positive feature maps never give negative weights; float32
# rounding around 0 stays far above this.
NEGATIVE_TOL = 1e-6


def _shape(x) -> str:
    return f"shape {np.shape(x)}" if hasattr(x, "shape") else type(x).__name__


def weights(w, name: str = "w") -> tuple[np.ndarray, np.ndarray]:
    """Checks attention weights and returns them as float64 with the rows that see a key.

    Args:
      w: ``[L,B,N,T,S]`` probabilities (NumPy or JAX), or a sequence of L
        ``[B,N,T,S]`` arrays (what ``models.capture_weights`` returns).

    Returns:
      ``(w [L,B,N,T,S] float64, live [L,B,N,T] bool)``: ``live`` marks the query
      rows with any mass. Rows that see no key are all zeros (padding, or a
      mask that hides every key) and are left out of every mean.
    """
    if isinstance(w, Sequence) and not isinstance(w, str | bytes):
        shapes = {np.shape(x) for x in w}
        if len(shapes) != 1 or len(next(iter(shapes))) != 4:
            fail(name, "a sequence of L [B,N,T,S] arrays of one shape", f"shapes {sorted(shapes)}")
        w = np.stack([np.asarray(x) for x in w])
    if getattr(w, "ndim", None) != 5:
        fail(name, "a rank-5 array [L,B,N,T,S] or a sequence of L [B,N,T,S] arrays", _shape(w))
    if 0 in w.shape:
        fail(name, "no empty axis in [L,B,N,T,S]", f"shape {w.shape}")
    w = np.asarray(w, dtype=np.float64)
    if not np.isfinite(w).all():
        fail(name, "finite attention probabilities", "NaN or inf entries")
    if w.min() < -NEGATIVE_TOL:
        fail(name, "non-negative attention probabilities (not logits)", f"min {w.min():.3g}")
    mass = w.sum(-1)  # [L,B,N,T]
    live = mass > 0
    off = np.abs(mass - 1.0)[live]
    if off.size and off.max() > ROW_SUM_TOL:
        worst = mass[live][int(np.argmax(off))]
        fail(name, "rows summing to 1 (or 0 where a query sees no key)", f"a row sum {worst:.4g}")
    return w, live


def square(w: np.ndarray, metric: str) -> None:
    """Queries and keys are the same positions (self-attention), as ``metric`` assumes."""
    T, S = w.shape[-2:]
    if T != S:
        fail("w", f"self-attention maps with T == S for {metric}", f"T={T}, S={S}")


def tokens(x, B: int, T: int, name: str = "tokens") -> np.ndarray:
    """Checks integer tokens ``[B,T]`` matching the weights' batch and query length."""
    x = np.asarray(x)
    if x.shape != (B, T):
        fail(name, f"shape ({B}, {T}) = [B,T] of the weights", f"shape {x.shape}")
    if not np.issubdtype(x.dtype, np.integer):
        fail(name, "integer token ids", f"dtype {x.dtype}")
    return x


def integer(x, name: str, lo: int, hi: int | None = None, why: str = "") -> int:
    """``x`` as an int in ``[lo, hi)`` (``hi=None``: no upper bound); else ``ValueError``."""
    ok = not isinstance(x, bool) and isinstance(x, int | np.integer)
    if not ok or x < lo or (hi is not None and x >= hi):
        span = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
        fail(name, f"an int {span}{why}", repr(x))
    return int(x)


def fraction(x, name: str, lo_open: bool = False, hi_open: bool = False) -> float:
    """``x`` as a float in the unit interval (ends open as asked); else ``ValueError``."""
    ok = not isinstance(x, bool) and isinstance(x, int | float | np.integer | np.floating)
    lo_ok = ok and (x > 0 if lo_open else x >= 0)
    hi_ok = ok and (x < 1 if hi_open else x <= 1)
    if not (lo_ok and hi_ok):
        span = ("(" if lo_open else "[") + "0, 1" + (")" if hi_open else "]")
        fail(name, f"a number in {span}", repr(x))
    return float(x)


def scores(x, name: str) -> np.ndarray:
    """Checks per-head scores ``[L,N]`` (or a sequence of L ``[N]``) and returns float64."""
    try:
        x = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        fail(name, "[L,N] numbers (or a sequence of L [N] arrays of one length)", _shape(x))
    if x.ndim != 2 or 0 in x.shape:
        fail(name, "a non-empty [L,N] array (or a sequence of L [N] arrays)", f"shape {x.shape}")
    if not np.isfinite(x).all():
        fail(name, "finite scores", "NaN or inf entries")
    return x
