"""What attention heads do, measured on captured weights: pure functions, NumPy float64.

Every metric takes weights ``w [L,B,N,T,S]`` (probabilities: each query row
sums to 1, or is all zeros where the query sees no key; causal rows hold zeros
right of the diagonal), NumPy or JAX, or the list of L ``[B,N,T,S]`` arrays that
``models.capture_weights`` returns, and returns ``[L,N]``: one number per head,
the mean over the batch and the queries the metric is about. Queries are pooled
over the batch (every relevant (b, t) counts once), so examples with more
relevant queries weigh more.

Most scores are one rule, ``pattern_score``: a boolean target pattern says, for
each query, which keys a head of that kind would attend to; the score is the
attention mass a query puts on its targets, averaged over the queries that have
at least one target. A perfect head of the kind scores 1 whatever the share of
queries with a target.

Normalization compared with TransformerLens' ``detect_head`` (error measure
``"mul"``, its default): it multiplies one sequence's attention pattern by the
detection pattern and divides the sum by the sum of the whole attention pattern,
which is the number of query rows, since each row sums to 1. Every query is in
its denominator, including those that cannot match (position 0 for previous-token
heads, the whole first copy of a repeated sequence for induction heads), so its
score is ours times the share of queries that have a target: a perfect induction
head on ``[BOS] r r`` scores about 1/2 there and 1 here, and its score moves with
the sequence's composition rather than the head's behaviour. Sequences are
averaged one by one there and pooled here. Its induction pattern also keeps the
diagonal (query t on itself when token t-1 equals token t), which ours leaves out
(``induction_pattern``); ``exclude_bos`` / ``exclude_current_token`` there zero
columns of the attention in both sums, which renormalizes over the whole pattern
rather than per query.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from analysis import _checks
from attn.checks import fail
from attn.masks import Mask

# Gu et al. (2024), "When attention sink emerges in language models", count a
# head as a sink when its mean attention on the first token exceeds 0.3.
SINK_THRESHOLD = 0.3


def _mean_rows(values: np.ndarray, rows: np.ndarray, what: str) -> np.ndarray:
    """``[L,B,N,T]`` values averaged over the selected (b, t) rows of each head: ``[L,N]``."""
    count = rows.sum(axis=(1, 3))
    if (count == 0).any():
        fail("w", f"at least one query row per head that {what}", "none")
    return np.where(rows, values, 0.0).sum(axis=(1, 3)) / count


def pattern_score(w, pattern) -> np.ndarray:
    """Mean attention mass on target keys, over the queries that have a target.

    Args:
      w: weights ``[L,B,N,T,S]`` (see the module docstring).
      pattern: bool ``[T,S]`` or ``[B,T,S]``: ``pattern[b, t, s]`` is True when key
        s is a target of query t.

    Returns:
      ``[L,N]`` float64: for each head, ``sum_s w[t, s] * pattern[t, s]`` averaged
      over the (b, t) whose pattern row has a target and that see some key.
    """
    w, live = _checks.weights(w)
    return _pattern_score(w, live, pattern)


def _pattern_score(w: np.ndarray, live: np.ndarray, pattern) -> np.ndarray:
    _, B, _, T, S = w.shape
    pattern = np.asarray(pattern)
    if pattern.dtype != bool or pattern.shape not in ((T, S), (B, T, S)):
        got = f"{pattern.dtype} shape {pattern.shape}"
        fail("pattern", f"a bool [T,S] = ({T}, {S}) or [B,T,S] array", got)
    pattern = np.broadcast_to(pattern, (B, T, S))
    mass = np.einsum("lbnts,bts->lbnt", w, pattern.astype(np.float64))
    rows = live & pattern.any(-1)[None, :, None, :]
    return _mean_rows(mass, rows, "has a target key")


def _token_pattern_score(w, tokens, pattern_of, score: str, needed: str) -> np.ndarray:
    """``_pattern_score`` of self-attention weights on ``pattern_of(tokens)`` ``[B,T,T]``."""
    w, live = _checks.weights(w)
    _checks.square(w, score)
    pattern = pattern_of(_checks.tokens(tokens, w.shape[1], w.shape[3]))
    if not pattern.any():
        fail("tokens", f"at least {needed}", "tokens with none")
    return _pattern_score(w, live, pattern)


def entropy(w) -> np.ndarray:
    """Mean entropy of the attention rows, in nats.

    Only rows that see a key count. Compare with ``uniform_entropy``: the
    entropy of a head that spreads each query evenly over the keys it may see
    (for causal rows, query t sees t + 1 keys, so the baseline is the mean over
    t of ``log(t + 1)``, not ``log T``). A head far below the baseline is
    focused; one near it is averaging.

    Args:
      w: weights ``[L,B,N,T,S]``.

    Returns:
      ``[L,N]`` float64, in ``[0, log S]``.
    """
    w, live = _checks.weights(w)
    # 0 log 0 = 0: zeros (masked keys) contribute nothing.
    plogp = w * np.log(np.where(w > 0, w, 1.0))
    return _mean_rows(-plogp.sum(-1), live, "sees a key")


def uniform_entropy(T: int, *, causal: bool = True) -> float:
    """The entropy ``entropy`` gives for uniform attention over the visible keys.

    Args:
      T: query length (= key length for self-attention).
      causal: True when query t sees keys ``0..t`` (the baseline is then
        ``mean_t log(t + 1)``); False when every query sees all T keys (``log T``).

    Returns:
      The baseline in nats, a Python float. It assumes every query row is live;
      with padded rows, compute the mean of ``log(visible keys)`` over the real rows.
    """
    T = _checks.integer(T, "T", 1)
    if not isinstance(causal, bool):
        fail("causal", "a bool", repr(causal))
    if not causal:
        return float(np.log(T))
    return float(np.log(np.arange(1, T + 1, dtype=np.float64)).mean())


def previous_token_pattern(T: int) -> np.ndarray:
    """Bool ``[T,T]``: query t targets key t - 1 (queries t >= 1)."""
    T = _checks.integer(T, "T", 2, why=" (query t targets key t - 1)")
    return np.eye(T, k=-1, dtype=bool)


def previous_token_score(w) -> np.ndarray:
    """Mean attention from query t to key t - 1, over the queries t >= 1.

    A pure previous-token head scores 1; uniform causal attention scores the
    mean of ``1 / (t + 1)`` over t >= 1.

    Args:
      w: self-attention weights ``[L,B,N,T,T]``, T >= 2.

    Returns:
      ``[L,N]`` float64 in ``[0, 1]``.
    """
    w, live = _checks.weights(w)
    _checks.square(w, "the previous-token score")
    T = w.shape[-1]
    if T < 2:
        fail("w", "T >= 2 positions (query t scores its key t - 1)", f"T={T}")
    return _pattern_score(w, live, previous_token_pattern(T))


def duplicate_pattern(tokens) -> np.ndarray:
    """Bool ``[B,T,T]``: query t targets the earlier positions j < t holding its token."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        fail("tokens", "integer token ids [B,T]", f"{tokens.dtype} shape {tokens.shape}")
    T = tokens.shape[1]
    same = tokens[:, :, None] == tokens[:, None, :]
    return same & np.tri(T, k=-1, dtype=bool)


def duplicate_token_score(w, tokens) -> np.ndarray:
    """Mean attention mass from query t onto earlier positions holding the same token.

    Averaged over the queries whose token occurred before (the others have
    nothing to find). A head that splits each such query's attention over the
    earlier copies scores 1.

    Args:
      w: self-attention weights ``[L,B,N,T,T]``.
      tokens: integer ``[B,T]``, the inputs the weights were captured on.

    Returns:
      ``[L,N]`` float64 in ``[0, 1]``.
    """
    return _token_pattern_score(
        w, tokens, duplicate_pattern, "the duplicate-token score", "a token that occurs twice"
    )


def induction_pattern(tokens) -> np.ndarray:
    """Bool ``[B,T,T]``: query t targets keys j < t with ``tokens[j - 1] == tokens[t]``.

    Key j follows an earlier occurrence of the current token: where an induction
    head looks ("prefix matching", Olsson et al. 2022). j = t is left out: when
    token t - 1 equals token t, the key after that occurrence is the query
    itself, which any head that attends to itself would score on.
    """
    prev = duplicate_pattern(tokens)  # [b, t, i]: token i == token t, i < t
    T = prev.shape[1]
    pattern = np.zeros_like(prev)
    pattern[:, :, 1:] = prev[:, :, :-1]  # target j = i + 1
    return pattern & np.tri(T, k=-1, dtype=bool)


def induction_score_from_tokens(w, tokens) -> np.ndarray:
    """Mean attention on the positions after earlier occurrences of the current token.

    For each query t, the mass on keys j < t with ``tokens[j - 1] == tokens[t]``
    (``induction_pattern``), averaged over the queries that have such a key. On
    a repeated sequence of distinct tokens this equals ``induction_score`` with
    that period; it also works on any text.

    Args:
      w: self-attention weights ``[L,B,N,T,T]``.
      tokens: integer ``[B,T]``.

    Returns:
      ``[L,N]`` float64 in ``[0, 1]``. See the module docstring for how this
      normalization differs from TransformerLens' ``detect_head``.
    """
    return _token_pattern_score(
        w, tokens, induction_pattern, "the induction score", "a token that recurs later"
    )


def periodic_induction_pattern(T: int, period: int, start: int | None = None) -> np.ndarray:
    """Bool ``[T,T]``: each query t >= start targets key ``t - period + 1``.

    In a sequence with ``tokens[t] == tokens[t - period]`` from ``start`` on, key
    ``t - period + 1`` holds the token that followed the earlier occurrence of
    token t: the one to copy.
    """
    T = _checks.integer(T, "T", 3, why=" (a period >= 2 must fit twice)")
    period = _checks.integer(period, "period", 2, T, " (with 1 the target is the query itself)")
    start = period if start is None else start
    start = _checks.integer(start, "start", period, T, f" (query t copies from t - {period})")
    t = np.arange(start, T)
    pattern = np.zeros((T, T), bool)
    pattern[t, t - period + 1] = True
    return pattern


def induction_score(w, period: int, *, start: int | None = None, tokens=None) -> np.ndarray:
    """Mean attention from each query of the repeat to the token after its earlier occurrence.

    For repeated random sequences (a random block followed by a copy of it):
    query t in the copy, ``t >= start``, holds the token seen at ``t - period``,
    and an induction head attends to ``t - period + 1``. A perfect induction head
    scores 1; a previous-token head scores 0 (it looks at ``t - 1``).

    Args:
      w: self-attention weights ``[L,B,N,T,T]``.
      period: length of the repeated block P, ``2 <= P < T``.
      start: first query position of the copy, ``P <= start < T``; default P
        (``r r``). With a leading BOS (``[BOS] r r``, as ``train``'s induction
        task feeds it) the copy starts at ``P + 1``.
      tokens: optional integer ``[B,T]``: when given, checked to repeat with
        that period from ``start`` on, which catches an off-by-one ``start``.

    Returns:
      ``[L,N]`` float64 in ``[0, 1]``.
    """
    w, live = _checks.weights(w)
    _checks.square(w, "the induction score")
    B, T = w.shape[1], w.shape[3]
    if T < 3:
        fail("w", "T >= 3 positions (a block of period >= 2 and its copy)", f"T={T}")
    pattern = periodic_induction_pattern(T, period, start)  # validates period and start
    start = period if start is None else start
    if tokens is not None:
        tokens = _checks.tokens(tokens, B, T)
        bad = tokens[:, start:] != tokens[:, start - period : T - period]
        if bad.any():
            b, t = np.argwhere(bad)[0]
            rule = f"tokens[:, t] == tokens[:, t - {period}] for t >= start={start}"
            fail("tokens", rule, f"a mismatch at batch {b}, position {t + start}")
    return _pattern_score(w, live, pattern)


def _visible_first(mask: Mask | None, T: int, S: int) -> np.ndarray:
    """Bool ``[T]``: which queries may see key 0 (all when ``mask`` is None)."""
    if mask is None:
        return np.ones(T, bool)
    if not isinstance(mask, Mask):
        fail("mask", "an attn.masks.Mask or None", type(mask).__name__)
    # The project's default alignment: keys arange(S), queries the last T of them.
    q_pos = np.arange(T) + S - T
    return np.asarray(mask.allowed(q_pos, np.zeros(1, np.int64)))[:, 0]


def first_token_mass(w, *, mask: Mask | None = None) -> np.ndarray:
    """Mean attention on key 0 over the queries that can see it.

    Gu et al.'s per-head sink statistic: the query at position 0 counts (under a
    causal mask its whole row is on key 0), as in their average over queries
    ``i >= 1`` in one-based positions.

    Args:
      w: weights ``[L,B,N,T,S]``.
      mask: the mask the weights were computed with, when some queries cannot
        see key 0 (a sliding window without sinks); None counts every query
        that sees a key. Positions follow the project's alignment: keys
        ``arange(S)``, queries ``arange(T) + S - T``.

    Returns:
      ``[L,N]`` float64 in ``[0, 1]``.
    """
    w, live = _checks.weights(w)
    T, S = w.shape[-2:]
    rows = live & _visible_first(mask, T, S)
    return _mean_rows(w[..., 0], rows, "sees key 0")


class SinkRate(NamedTuple):
    """The share of heads that are attention sinks."""

    overall: float  # over all L x N heads
    per_layer: np.ndarray  # [L]


def sink_rate(w, threshold: float = SINK_THRESHOLD, *, mask: Mask | None = None) -> SinkRate:
    """The share of heads whose ``first_token_mass`` exceeds ``threshold``.

    Gu et al. (2024), "When attention sink emerges in language models", with
    their default threshold 0.3 (a head of a causal model that spread attention
    uniformly over T keys would put about ``log(T) / T`` on key 0).

    Args:
      w: weights ``[L,B,N,T,S]``.
      threshold: in ``[0, 1)``; a head counts when its mass is strictly above it.
      mask: as in ``first_token_mass``.

    Returns:
      ``SinkRate(overall, per_layer [L])``, shares in ``[0, 1]``.
    """
    threshold = _checks.fraction(threshold, "threshold", hi_open=True)
    sinks = first_token_mass(w, mask=mask) > threshold  # [L,N]
    return SinkRate(float(sinks.mean()), sinks.mean(axis=1))


class MassiveActivations(NamedTuple):
    """The largest hidden-state magnitudes per layer (Sun et al. 2024, "Massive activations
    in large language models"): each ``[L+1]``, the embedding's first."""

    top: np.ndarray  # the largest |h| over tokens and channels
    median: np.ndarray  # the median |h|
    ratio: np.ndarray  # top / median


def massive_activations(hidden) -> MassiveActivations:
    """The largest |h| of each layer's residual stream, and its ratio to the median.

    Sun et al. call an activation massive when it is both large and about 1000x the
    median magnitude of its layer; the gated-attention paper reports the largest one
    per layer.

    Args:
      hidden: ``[L+1,B,T,D]`` (``models.Decoder.hidden_states``), finite.

    Returns:
      ``MassiveActivations``, float64.
    """
    h = np.abs(np.asarray(hidden, np.float64))
    if h.ndim != 4 or not np.isfinite(h).all():
        fail("hidden", "finite hidden states [L+1,B,T,D]", f"shape {h.shape}")
    flat = h.reshape(h.shape[0], -1)
    top, median = flat.max(axis=1), np.median(flat, axis=1)
    return MassiveActivations(top, median, top / np.maximum(median, np.finfo(np.float64).tiny))
