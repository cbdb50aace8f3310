"""Synthetic recall tasks and byte-level language modelling, as NumPy batches.

Every batch is a deterministic function of ``(seed, split, step)``: the
generator is seeded with ``SeedSequence((seed, split_tag, step))``, so a run
resumed at step ``s`` sees exactly the batches an uninterrupted run would, and
train and test draw from different streams (the split tag differs) however the
seeds are chosen.

A batch is ``dict(tokens [B,T] int32, labels [B,T] int32, weights [B,T] float32)``.
``labels[b, t]`` is what the logits at position ``t`` should predict; positions
that are not scored carry ``IGNORE`` (-100) and weight 0, so loss and accuracy
count only labelled positions.

Tasks:

- ``mqar``: multi-query associative recall (Zoology, Arora et al. 2023).
- ``induction``: ``[BOS] r r``, predict the second copy of random tokens ``r``.
- ``selective_copy``: a few data tokens scattered among blanks, reproduced in
  order after a separator (Gu and Dao 2023).
- ``bytes``: next-byte prediction over a text corpus (default: the Python
  standard library's own source files; nothing is downloaded), optionally
  with a beginning-of-sequence token first.

State tracking (the word problem of a finite group, ``state_batch``): the
inputs are random group elements and the label at every position is the
running product so far, which a model can only give by tracking a state.

- ``parity``: bits, labels the running parity (the group Z2);
- ``modular``: numbers mod ``modulus``, labels the running sum mod it;
- ``s3``, ``s5``: permutations of 3 and 5 items (6 and 120 elements), labels
  the running composition. S3 is solvable, S5 is not: Merrill, Petty and
  Sabharwal (ICML 2024) prove that no fixed-depth transformer or diagonal
  SSM of the usual precision tracks S5's products at every length.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from train.corpus import Corpus, load_corpus, stdlib_corpus_path

__all__ = [
    "IGNORE",
    "SPLITS",
    "Corpus",
    "TaskConfig",
    "data_fingerprint",
    "induction_batch",
    "load_corpus",
    "make_task",
    "mqar_batch",
    "needle_batch",
    "selective_copy_batch",
    "state_batch",
    "stdlib_corpus_path",
]

IGNORE = -100  # label of a position that is not scored (PyTorch's ignore_index convention)
SPLITS = {"train": 0, "test": 1}  # folded into the seed: train and test never share a stream

STATE_TASKS = ("parity", "modular", "s3", "s5")
TASK_NAMES = ("mqar", "needle", "induction", "selective_copy", "bytes", *STATE_TASKS)
BYTE_VOCAB = 256
# The bytes task's beginning-of-sequence token: NUL, which load_corpus keeps out
# of every corpus (it skips files that hold one).
BOS = 0


@dataclass(frozen=True)
class TaskConfig:
    """Which task to train on and its sizes.

    Attributes:
      name: one of ``mqar``, ``needle``, ``induction``, ``selective_copy``, ``bytes``, or
        the state-tracking tasks ``parity``, ``modular``, ``s3``, ``s5``.
      seq_len: T, tokens per example.
      vocab_size: V for the recall tasks (``bytes`` always uses 256, the
        state-tracking tasks their group's order).
      modulus: m of ``modular`` (addition mod m).
      num_pairs: MQAR key-value pairs per example (Zoology requires
        ``4 * num_pairs <= seq_len``: the context takes ``2n`` tokens and the
        queries need room for ``n`` gaps of two); the needles of ``needle``
        (``3 * num_pairs <= seq_len``).
      min_pairs: MQAR: training examples hold between ``min_pairs`` and
        ``num_pairs`` pairs (uniformly), a curriculum that lets the recall
        circuit form on easy examples; test examples always hold ``num_pairs``.
        None: every example holds ``num_pairs``.
      power_a: MQAR query-gap power law, ``p(gap = i) ~ i^(a - 1)``; Zoology uses 0.01.
      random_fill: MQAR: fill the blanks between queries with random tokens
        (Zoology's default) instead of zeros.
      num_copy: selective copying: data tokens to reproduce.
      data: ``bytes``: a text file or a folder of text files; None for the
        standard library's source files.
      val_percent: ``bytes``: percent of the corpus pieces held out for test.
      bos: ``bytes``: every window starts with ``BOS`` (byte 0, which no corpus
        file holds) followed by T - 1 bytes, all T of which are predicted; a
        fixed first token, as in corpora packed with a BOS per document. False:
        T bytes predict the next T.
      fingerprint: the identity of the data the batches come from
        (``data_fingerprint``), set by ``train`` when a run starts and kept in
        its record: a run resumes, and ``train.load_run`` and
        ``train.run_batch`` rebuild batches, only on data with this
        fingerprint (``make_task`` refuses any other). None: not pinned.
    """

    name: Literal[
        "mqar", "needle", "induction", "selective_copy", "bytes", "parity", "modular", "s3", "s5"
    ] = "mqar"
    seq_len: int = 64
    vocab_size: int = 256
    modulus: int = 5
    num_pairs: int = 8
    min_pairs: int | None = None
    power_a: float = 0.01
    random_fill: bool = True
    num_copy: int = 8
    data: str | None = None
    val_percent: int = 10
    bos: bool = False
    fingerprint: str | None = None

    def __post_init__(self):
        if self.name not in TASK_NAMES:
            raise ValueError(f"task.name: expected one of {TASK_NAMES}, got {self.name!r}")
        if self.seq_len < 2:
            raise ValueError(f"task.seq_len: expected an int >= 2, got {self.seq_len}")
        if self.name not in ("bytes", *STATE_TASKS) and self.vocab_size < 4:
            raise ValueError(f"task.vocab_size: expected an int >= 4, got {self.vocab_size}")
        if self.name == "mqar":
            if self.num_pairs < 1 or 4 * self.num_pairs > self.seq_len:
                raise ValueError(
                    f"task.num_pairs: expected 1 <= num_pairs <= seq_len / 4 = "
                    f"{self.seq_len // 4}, got {self.num_pairs}"
                )
            if self.vocab_size // 2 - 1 < self.num_pairs:
                raise ValueError(
                    f"task.vocab_size: expected at least {2 * self.num_pairs + 2} so that "
                    f"{self.num_pairs} distinct keys fit in [1, V/2), got {self.vocab_size}"
                )
            if self.min_pairs is not None and not 1 <= self.min_pairs <= self.num_pairs:
                raise ValueError(
                    f"task.min_pairs: expected None or 1..num_pairs={self.num_pairs}, "
                    f"got {self.min_pairs}"
                )
            if not 0.0 < self.power_a <= 1.0:
                raise ValueError(f"task.power_a: expected a float in (0, 1], got {self.power_a}")
        if self.name == "needle" and not (
            self.num_pairs >= 1
            and 3 * self.num_pairs <= self.seq_len
            and 4 * self.num_pairs + 4 <= self.vocab_size
        ):
            raise ValueError(
                f"task.num_pairs: expected 1 <= num_pairs <= min(seq_len / 3, vocab_size / 4 - 1) "
                f"= {min(self.seq_len // 3, self.vocab_size // 4 - 1)}, got {self.num_pairs}"
            )
        if self.name == "induction" and self.seq_len % 2:
            raise ValueError(f"task.seq_len: induction expects an even length, got {self.seq_len}")
        if self.name == "selective_copy" and not 1 <= self.num_copy <= (self.seq_len - 1) // 2:
            raise ValueError(
                f"task.num_copy: expected 1 <= num_copy <= (seq_len - 1) / 2 = "
                f"{(self.seq_len - 1) // 2}, got {self.num_copy}"
            )
        if not isinstance(self.bos, bool) or (self.bos and self.name != "bytes"):
            raise ValueError(f"task.bos: expected False unless name is 'bytes', got {self.bos!r}")
        if self.name == "bytes" and not 0 < self.val_percent < 100:
            raise ValueError(f"task.val_percent: expected 1..99, got {self.val_percent}")
        m = self.modulus
        if self.name == "modular" and (isinstance(m, bool) or not isinstance(m, int) or m < 2):
            raise ValueError(f"task.modulus: expected an int >= 2, got {m!r}")
        if self.fingerprint is not None and not isinstance(self.fingerprint, str):
            raise ValueError(f"task.fingerprint: expected None or a str, got {self.fingerprint!r}")

    @property
    def vocab(self) -> int:
        """The vocabulary size the model needs."""
        if self.name in STATE_TASKS:
            return len(group_table(self.group))
        return BYTE_VOCAB if self.name == "bytes" else self.vocab_size

    @property
    def group(self) -> str:
        """The group of a state-tracking task: ``"Z2"``, ``"Z<m>"``, ``"S3"`` or ``"S5"``."""
        if self.name not in STATE_TASKS:
            raise ValueError(f"task.name: expected one of {STATE_TASKS}, got {self.name!r}")
        return {"parity": "Z2", "modular": f"Z{self.modulus}"}.get(self.name, self.name.upper())


def _rng(seed: int, split: str, step: int) -> np.random.Generator:
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {tuple(SPLITS)}, got {split!r}")
    if step < 0:
        raise ValueError(f"step: expected an int >= 0, got {step}")
    return np.random.default_rng(np.random.SeedSequence((int(seed), SPLITS[split], int(step))))


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
    # n pairs of two tokens among T - n haystack tokens: choose n of the T - 2n slots
    # that remain when each pair counts as one, then spread them out again.
    slots = np.sort(_sample_without_replacement(rng, batch, T - 2 * n, n), axis=1)
    starts = slots + np.arange(n)  # the i-th pair starts after i earlier pairs' 2 tokens
    rows = np.arange(batch)[:, None]
    tokens[rows, starts], tokens[rows, starts + 1] = keys, values
    order = np.argsort(rng.random((batch, n)), axis=1)
    tokens[:, T - n :] = np.take_along_axis(keys, order, axis=1)
    labels = np.full((batch, T), IGNORE, np.int64)
    labels[:, T - n :] = np.take_along_axis(values, order, axis=1)
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
    rng: np.random.Generator, batch: int, *, stream: np.ndarray, seq_len: int, bos: bool = False
):
    """Random windows of ``T + 1`` bytes: inputs are the first T, labels the next T.

    With ``bos`` the inputs are ``BOS`` and the window's first T - 1 bytes, and
    the labels its first T bytes (the same windows, shifted by one).

    Returns:
      ``dict(tokens [B,T], labels [B,T], weights [B,T])``, every position scored.
    """
    if len(stream) < seq_len + 1:
        raise ValueError(
            f"data: expected a corpus split of at least seq_len + 1 = {seq_len + 1} bytes, "
            f"got {len(stream)}"
        )
    starts = rng.integers(0, len(stream) - seq_len, size=(batch, 1))
    windows = stream[starts + np.arange(seq_len + 1)].astype(np.int64)
    if bos:
        return _batch(with_bos(windows[:, : seq_len - 1]), windows[:, :seq_len])
    return _batch(windows[:, :-1], windows[:, 1:])


def with_bos(tokens: np.ndarray) -> np.ndarray:
    """``[..., S]`` bytes as ``[..., S + 1]`` with ``BOS`` in front."""
    return np.concatenate([np.full_like(tokens[..., :1], BOS), tokens], axis=-1)


# ----------------------------------------------------------------------------
# The task object the loop uses


@dataclass(frozen=True)
class Task:
    """A task bound to its config: ``task.batch(seed, split, step, batch_size)``."""

    config: TaskConfig
    corpus: Corpus | None = dataclasses.field(default=None, repr=False)

    @property
    def vocab_size(self) -> int:
        """V the model needs."""
        return self.config.vocab

    @property
    def fingerprint(self) -> str:
        """The data's identity (``data_fingerprint``)."""
        return _fingerprint(self.config, self.corpus)

    def batch(self, seed: int, split: str, step: int, batch_size: int) -> dict[str, np.ndarray]:
        """The batch number ``step`` of ``split`` for ``seed``; always the same arrays.

        Args:
          seed: the run's data seed.
          split: "train" or "test".
          step: the batch index (the optimizer step for training batches).
          batch_size: B.

        Returns:
          ``dict(tokens [B,T] int32, labels [B,T] int32, weights [B,T] float32)``.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size: expected an int >= 1, got {batch_size}")
        c, rng = self.config, _rng(seed, split, step)
        if c.name == "mqar":
            return mqar_batch(
                rng,
                batch_size,
                seq_len=c.seq_len,
                vocab_size=c.vocab_size,
                num_pairs=c.num_pairs,
                min_pairs=c.min_pairs if split == "train" else None,
                power_a=c.power_a,
                random_fill=c.random_fill,
            )
        if c.name == "needle":
            return needle_batch(
                rng, batch_size, seq_len=c.seq_len, vocab_size=c.vocab_size, num_pairs=c.num_pairs
            )
        if c.name == "induction":
            return induction_batch(rng, batch_size, seq_len=c.seq_len, vocab_size=c.vocab_size)
        if c.name in STATE_TASKS:
            return state_batch(rng, batch_size, seq_len=c.seq_len, group=c.group)
        if c.name == "selective_copy":
            return selective_copy_batch(
                rng, batch_size, seq_len=c.seq_len, vocab_size=c.vocab_size, num_copy=c.num_copy
            )
        stream = self.corpus.train if split == "train" else self.corpus.test
        return bytes_batch(rng, batch_size, stream=stream, seq_len=c.seq_len, bos=c.bos)


def make_task(config: TaskConfig) -> Task:
    """Binds a task config; reads the corpus for ``bytes`` (cached while its files stay).

    Raises:
      ValueError: ``config.fingerprint`` is set and the data has another (one
        line: the corpus changed since the run was recorded).
    """
    corpus = load_corpus(config.data, config.val_percent) if config.name == "bytes" else None
    task = Task(config, corpus)
    now = task.fingerprint
    if config.fingerprint is not None and config.fingerprint != now:
        where = "the task config" if corpus is None else f"the files under {corpus.source!r}"
        raise ValueError(
            f"task.fingerprint: expected the data the run was recorded with "
            f"({config.fingerprint[:16]}), got other data: {where} now hash to {now[:16]}; "
            "restore the recorded data, or start a new run (a new workdir) on this data"
        )
    return task


def data_fingerprint(config: TaskConfig) -> str:
    """The identity of a task's data: SHA-256 (hex) of the corpus's files and split rule
    for ``bytes``, of the task config (its generator's settings) for the synthetic tasks."""
    return make_task(dataclasses.replace(config, fingerprint=None)).fingerprint


def _fingerprint(config: TaskConfig, corpus: Corpus | None) -> str:
    if corpus is not None:
        return corpus.fingerprint
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k != "fingerprint"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
