"""The task generators: NumPy batches of the synthetic tasks and of byte windows.

Each takes a seeded ``np.random.Generator`` and returns ``dict(tokens [B,T]
int32, labels [B,T] int32, weights [B,T] float32)``; positions that are not
scored carry ``IGNORE`` and weight 0. ``train.tasks`` binds them to a config
(``Task``) and says what each task is.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np

IGNORE = -100  # label of a position that is not scored (PyTorch's ignore_index convention)
# The bytes task's beginning-of-sequence token: NUL, which load_corpus keeps out
# of every corpus (it skips files that hold one).
BOS = 0


def _sample_without_replacement(rng, batch: int, population: int, k: int, log_p=None):
    """``[batch, k]`` distinct indices in ``[0, population)``, in random order.

    Uses the Gumbel top-k trick: the k largest ``log p + Gumbel`` are a sample
    without replacement with probabilities ``p`` (uniform when ``log_p`` is None),
    vectorized over the batch where ``Generator.choice`` would need a loop.
    """
    scores = rng.gumbel(size=(batch, population))
    if log_p is not None:
        scores = scores + log_p
    # A partial partition finds the top k in O(population); sorting just those k
    # by score puts them in the random order of the sample.
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1)
    return np.take_along_axis(top, order, axis=1)


def _batch(tokens, labels) -> dict[str, np.ndarray]:
    labels = labels.astype(np.int32)
    return {
        "tokens": tokens.astype(np.int32),
        "labels": labels,
        "weights": (labels != IGNORE).astype(np.float32),
    }


def _pair_starts(rng, batch: int, length: int, n: int, gap: int = 0) -> np.ndarray:
    """``[batch, n]`` sorted starts of ``n`` non-overlapping 2-token pairs in ``[0, length)``,
    each followed by at least ``gap`` other tokens inside ``[0, length)``.

    Uniform over placements: choose n of the ``length - (1 + gap) n`` slots that remain
    when each pair and its gap count as one token, then spread them out again.
    """
    width = 2 + gap
    slots = np.sort(_sample_without_replacement(rng, batch, length - (width - 1) * n, n), axis=1)
    return slots + (width - 1) * np.arange(n)  # after i earlier pairs and their gaps


def mqar_batch(
    rng: np.random.Generator,
    batch: int,
    *,
    seq_len: int,
    vocab_size: int,
    num_pairs: int,
    min_pairs: int | None = None,
    power_a: float = 0.01,
    random_fill: bool = True,
) -> dict[str, np.ndarray]:
    """Multi-query associative recall, following Zoology's ``multiquery_ar``.

    An example is the context ``k1 v1 k2 v2 ... kn vn`` (keys drawn without
    replacement from ``[1, V/2)``, values from ``[V/2, V)``), then a query region
    of ``T - 2n`` tokens where each key appears once more at an even offset
    ``2 g``; the gaps ``g`` are drawn without replacement with
    ``p(g) ~ (g + 1)^(a - 1)``, so most queries come soon after the context.
    The label at a query's position is the value paired with its key; every
    other position is ``IGNORE``. Blanks are 0 or, with ``random_fill``,
    random tokens from ``[0, V)`` other than the example's keys (never scored).

    With ``min_pairs``, example b keeps only its first ``n_b`` pairs
    (``n_b`` uniform in ``[min_pairs, num_pairs]``): the others' context and
    query slots become blanks, so shapes stay fixed.

    Returns:
      ``dict(tokens [B,T] int32, labels [B,T] int32, weights [B,T] float32)``
      with ``num_pairs`` (or ``n_b``) labelled positions per example.
    """
    half = vocab_size // 2
    n, T = num_pairs, seq_len
    keys = 1 + _sample_without_replacement(rng, batch, half - 1, n)
    values = half + _sample_without_replacement(rng, batch, vocab_size - half, n)
    context = np.empty((batch, 2 * n), np.int64)
    context[:, 0::2], context[:, 1::2] = keys, values

    space = (T - 2 * n) // 2  # query slots at even offsets of the query region
    log_p = (power_a - 1.0) * np.log(np.arange(1, space + 1, dtype=np.float64))
    gaps = _sample_without_replacement(rng, batch, space, n, log_p)
    query_pos = 2 * n + 2 * gaps  # [B, n] absolute positions of the query keys

    keep = np.ones((batch, n), bool)
    if min_pairs is not None:
        keep = np.arange(n) < rng.integers(min_pairs, n + 1, size=(batch, 1))
    context = np.where(np.repeat(keep, 2, axis=1), context, 0)

    tokens = np.zeros((batch, T), np.int64)
    tokens[:, : 2 * n] = context
    rows = np.arange(batch)[:, None]
    tokens[rows, query_pos] = np.where(keep, keys, 0)
    labels = np.full((batch, T), IGNORE, np.int64)
    labels[rows, query_pos] = np.where(keep, values, IGNORE)
    if random_fill:
        blank = tokens == 0
        fill = rng.integers(0, vocab_size, size=(batch, T))
        # A filler equal to one of the example's keys would be an unlabelled extra
        # query with a bogus "value" after it; Zoology's large vocabularies make that
        # rare, small ones do not, so such fillers become 0.
        fill[(fill[:, :, None] == keys[:, None, :]).any(-1)] = 0
        tokens = np.where(blank, fill, tokens)
    return _batch(tokens, labels)


def needle_batch(
    rng: np.random.Generator, batch: int, *, seq_len: int, vocab_size: int, num_pairs: int
) -> dict[str, np.ndarray]:
    """Needles in a haystack: ``n`` key-value pairs anywhere in filler, queried at the end.

    The first ``T - n`` tokens are filler from ``[V/2, V)`` holding the pairs
    ``k v`` (keys from ``[1, V/4)``, values from ``[V/4, V/2)``, keys distinct) at
    uniformly random non-overlapping places; the last ``n`` tokens are the keys
    again in random order, each labelled with its value. Where MQAR's queries
    mostly follow their pairs closely, a needle lies anywhere before its query,
    so the distance to look back is spread over the whole sequence.

    Returns:
      ``dict(tokens [B,T] int32, labels [B,T] int32, weights [B,T] float32)``.
    """
    n, T = num_pairs, seq_len
    quarter, half = vocab_size // 4, vocab_size // 2
    keys = 1 + _sample_without_replacement(rng, batch, quarter - 1, n)
    values = quarter + rng.integers(0, half - quarter, size=(batch, n))
    tokens = rng.integers(half, vocab_size, size=(batch, T))
    starts = _pair_starts(rng, batch, T - n, n)
    rows = np.arange(batch)[:, None]
    tokens[rows, starts], tokens[rows, starts + 1] = keys, values
    order = np.argsort(rng.random((batch, n)), axis=1)
    tokens[:, T - n :] = np.take_along_axis(keys, order, axis=1)
    labels = np.full((batch, T), IGNORE, np.int64)
    labels[:, T - n :] = np.take_along_axis(values, order, axis=1)
    return _batch(tokens, labels)


def multikey_needle_batch(
    rng: np.random.Generator, batch: int, *, seq_len: int, vocab_size: int, num_pairs: int
) -> dict[str, np.ndarray]:
    """RULER's multi-key needle in a haystack: ``n`` needles, one of them queried at the end.

    The haystack (the first ``T - 1`` tokens) is built as ``needle_batch``'s: filler
    from ``[V/2, V)`` holding the pairs ``k v`` (keys distinct from ``[1, V/4)``,
    values from ``[V/4, V/2)``) at uniformly random non-overlapping places. The
    last token is one of the keys, chosen uniformly, labelled with its value; the
    other needles are distractors. It is ``variable_tracking_batch`` with one hop.

    Returns:
      ``dict(tokens [B,T] int32, labels [B,T] int32, weights [B,T] float32)`` with
      one labelled position per example, the last.
    """
    return variable_tracking_batch(
        rng, batch, seq_len=seq_len, vocab_size=vocab_size, num_pairs=num_pairs, hops=1
    )


def variable_tracking_batch(
    rng: np.random.Generator,
    batch: int,
    *,
    seq_len: int,
    vocab_size: int,
    num_pairs: int,
    hops: int,
) -> dict[str, np.ndarray]:
    """RULER's variable tracking: ``n`` chains of ``h`` assignments, one chain's end queried.

    Chain c assigns ``x1 v`` (the variable x1 takes the value v), then ``x2 x1``,
    ..., ``x_h x_(h-1)`` (each copies the one before). Variables are distinct
    across all chains, from ``[1, V/4)``; values from ``[V/4, V/2)``. The ``n h``
    two-token assignments lie at uniformly random non-overlapping places in the
    haystack (the first ``T - 1`` tokens, filler from ``[V/2, V)``), the chains
    interleaved at random, each chain's in order. The last token is ``x_h`` of
    a chain chosen uniformly, labelled with that chain's value ``v``: answering
    takes ``h`` lookups back through the haystack.

    With ``h > 1`` a filler token follows every assignment: ``x2 x1`` right before
    ``x7 x6`` would also read ``x1 x7``, a second assignment of ``x1`` that no
    reader of the tokens could tell from the real one (the values, never names,
    end the first hop's assignments, so one hop needs no gap: RULER's multi-key
    needle keeps its placements).

    Returns:
      ``dict(tokens [B,T] int32, labels [B,T] int32, weights [B,T] float32)`` with
      one labelled position per example, the last.
    """
    n, h, T = num_pairs, hops, seq_len
    quarter, half = vocab_size // 4, vocab_size // 2
    rows = np.arange(batch)[:, None]
    names = 1 + _sample_without_replacement(rng, batch, quarter - 1, n * h).reshape(batch, n, h)
    values = quarter + rng.integers(0, half - quarter, size=(batch, n))
    copied = np.concatenate([values[:, :, None], names[:, :, :-1]], axis=2)  # [B, n, h]
    tokens = rng.integers(half, vocab_size, size=(batch, T))
    starts = _pair_starts(rng, batch, T - 1, n * h, gap=int(h > 1))  # [B, n h], in order
    # Each assignment takes a random slot; sorting a chain's slots keeps its order.
    slot = np.sort(np.argsort(rng.random((batch, n * h)), axis=1).reshape(batch, n, h), axis=2)
    where = np.take_along_axis(starts, slot.reshape(batch, n * h), axis=1)  # [B, n h]
    tokens[rows, where] = names.reshape(batch, n * h)
    tokens[rows, where + 1] = copied.reshape(batch, n * h)
    chain = rng.integers(0, n, size=batch)
    tokens[:, T - 1] = names[np.arange(batch), chain, h - 1]
    labels = np.full((batch, T), IGNORE, np.int64)
    labels[:, T - 1] = values[np.arange(batch), chain]
    return _batch(tokens, labels)


def induction_batch(rng: np.random.Generator, batch: int, *, seq_len: int, vocab_size: int):
    """Repeated random tokens: the sequence ``[BOS] r r`` with ``BOS = 0``.

    ``r`` has ``T / 2`` tokens from ``[1, V)``. The inputs are the sequence
    without its last token and the labels the next tokens, scored only where
    the target lies in the second copy (which an induction head can predict).

    Returns:
      ``dict(tokens [B,T], labels [B,T], weights [B,T])`` with ``T / 2``
      labelled positions per example, ``T / 2 .. T - 1``.
    """
    half = seq_len // 2
    r = rng.integers(1, vocab_size, size=(batch, half))
    seq = np.concatenate([np.zeros((batch, 1), np.int64), r, r], axis=1)  # [B, T + 1]
    labels = seq[:, 1:].copy()
    labels[:, :half] = IGNORE  # targets in BOS r: random, nothing to recall
    return _batch(seq[:, :-1], labels)


def selective_copy_batch(
    rng: np.random.Generator, batch: int, *, seq_len: int, vocab_size: int, num_copy: int
):
    """Selective copying: reproduce the data tokens of a noisy region, in order.

    The sequence is ``region SEP d1 ... dn``: the region holds the ``n`` data
    tokens (from ``[2, V)``) at random sorted positions among blanks (0), and
    ``SEP = 1``. Unlike plain copying the spacing varies, so the model must
    select by content. Inputs are the sequence without its last token; the
    labels are ``d1 .. dn``, scored at SEP and at ``d1 .. d(n-1)``.

    Returns:
      ``dict(tokens [B,T], labels [B,T], weights [B,T])`` with ``num_copy``
      labelled positions per example, the last ones.
    """
    n = num_copy
    region = seq_len - n  # the inputs are region + SEP + d1..d(n-1): T tokens
    data = rng.integers(2, vocab_size, size=(batch, n))
    where = np.sort(_sample_without_replacement(rng, batch, region, n), axis=1)
    seq = np.zeros((batch, seq_len + 1), np.int64)
    rows = np.arange(batch)[:, None]
    seq[rows, where] = data
    seq[:, region] = 1
    seq[:, region + 1 :] = data
    labels = np.full((batch, seq_len), IGNORE, np.int64)
    labels[:, region:] = data
    return _batch(seq[:, :-1], labels)


# ----------------------------------------------------------------------------
# State tracking: word problems of finite groups


@functools.cache
def group_table(group: str) -> np.ndarray:
    """The multiplication table ``[n, n]`` of ``"Z<m>"`` or ``"S<k>"``: ``table[a, b] = a b``.

    Elements are indices; 0 is the identity. ``Z<m>`` is addition mod m. The
    elements of ``S<k>`` are the permutations of ``range(k)`` in lexicographic
    order and ``a b`` is "a, then b": ``(a b)(i) = b(a(i))``.
    """
    kind, size = group[0], int(group[1:])
    if kind == "Z":
        return np.add.outer(np.arange(size), np.arange(size)) % size
    perms = list(itertools.permutations(range(size)))
    index = {p: i for i, p in enumerate(perms)}
    table = np.zeros((math.factorial(size),) * 2, np.int64)
    for i, a in enumerate(perms):
        for j, b in enumerate(perms):
            table[i, j] = index[tuple(b[a[x]] for x in range(size))]
    return table


def state_batch(rng: np.random.Generator, batch: int, *, seq_len: int, group: str):
    """The word problem of ``group``: random elements, labelled by their running products.

    ``labels[:, t]`` is ``x_0 x_1 ... x_t`` (``group_table``): the state after
    reading position t, scored at every position.

    Returns:
      ``dict(tokens [B,T], labels [B,T], weights [B,T])``.
    """
    table = group_table(group)
    tokens = rng.integers(0, len(table), size=(batch, seq_len))
    labels = np.empty_like(tokens)
    state = np.zeros(batch, np.int64)  # the identity
    for t in range(seq_len):
        state = table[state, tokens[:, t]]
        labels[:, t] = state
    return _batch(tokens, labels)


# ----------------------------------------------------------------------------
# Byte-level language modelling (the corpus is read by train.corpus)


def bytes_batch(
    rng: np.random.Generator,
    batch: int,
    *,
    stream: np.ndarray,
    seq_len: int,
    bos: bool = False,
    split: str = "train",
):
    """Random windows of ``T + 1`` bytes: inputs are the first T, labels the next T.

    With ``bos`` the inputs are ``BOS`` and the window's first T - 1 bytes, and
    the labels its first T bytes (the same windows, shifted by one).

    ``split`` names the corpus split ``stream`` is, for the message.

    Returns:
      ``dict(tokens [B,T], labels [B,T], weights [B,T])``, every position scored.
    """
    if len(stream) < seq_len + 1:
        raise ValueError(
            f"data: expected a {split} split of at least seq_len + 1 = {seq_len + 1} bytes, "
            f"got {len(stream)} (a corpus this small needs a shorter seq_len)"
        )
    starts = rng.integers(0, len(stream) - seq_len, size=(batch, 1))
    windows = stream[starts + np.arange(seq_len + 1)].astype(np.int64)
    if bos:
        return _batch(with_bos(windows[:, : seq_len - 1]), windows[:, :seq_len])
    return _batch(windows[:, :-1], windows[:, 1:])


def with_bos(tokens: np.ndarray) -> np.ndarray:
    """``[..., S]`` bytes as ``[..., S + 1]`` with ``BOS`` in front."""
    return np.concatenate([np.full_like(tokens[..., :1], BOS), tokens], axis=-1)
