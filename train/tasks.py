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
- ``needle``: key-value pairs anywhere in filler, every key queried at the end.
- ``multikey_needle``: the same haystack, one of its keys queried at the end, the
  other needles distractors (RULER's multi-key needle, Hsieh et al. 2024).
- ``variable_tracking``: chains of assignments ``x1 v``, ``x2 x1``, ... in filler,
  the last variable of one chain queried at the end (RULER's variable tracking).
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
import hashlib
import json
from dataclasses import dataclass
from typing import Literal

import numpy as np

from train.corpus import Corpus, load_corpus, stdlib_corpus_path
from train.generators import (  # noqa: F401  (the generators are this module's too)
    BOS,
    IGNORE,
    bytes_batch,
    group_table,
    induction_batch,
    mqar_batch,
    multikey_needle_batch,
    needle_batch,
    selective_copy_batch,
    state_batch,
    variable_tracking_batch,
    with_bos,
)

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
    "multikey_needle_batch",
    "needle_batch",
    "selective_copy_batch",
    "state_batch",
    "stdlib_corpus_path",
    "variable_tracking_batch",
]

SPLITS = {"train": 0, "test": 1}  # folded into the seed: train and test never share a stream

STATE_TASKS = ("parity", "modular", "s3", "s5")
RULER_TASKS = ("multikey_needle", "variable_tracking")  # one query at the end
TASK_NAMES = ("mqar", "needle", *RULER_TASKS, "induction", "selective_copy", "bytes", *STATE_TASKS)
BYTE_VOCAB = 256


@dataclass(frozen=True)
class TaskConfig:
    """Which task to train on and its sizes.

    Attributes:
      name: one of ``mqar``, ``needle``, ``multikey_needle``, ``variable_tracking``,
        ``induction``, ``selective_copy``, ``bytes``, or the state-tracking tasks
        ``parity``, ``modular``, ``s3``, ``s5``.
      seq_len: T, tokens per example.
      vocab_size: V for the recall tasks (``bytes`` always uses 256, the
        state-tracking tasks their group's order).
      modulus: m of ``modular`` (addition mod m).
      num_pairs: MQAR key-value pairs per example (Zoology requires
        ``4 * num_pairs <= seq_len``: the context takes ``2n`` tokens and the
        queries need room for ``n`` gaps of two); the needles of ``needle``
        (``3 * num_pairs <= seq_len``) and of ``multikey_needle``
        (``2 * num_pairs + 1 <= seq_len``); the chains of ``variable_tracking``
        (``3 * num_pairs * hops + 1 <= seq_len`` past one hop: a filler token after
        each assignment keeps the parse unique; and ``num_pairs * hops``
        distinct variables in ``[1, V/4)``).
      hops: ``variable_tracking``: assignments per chain (1: the multi-key needle).
      min_pairs: MQAR: training examples hold between ``min_pairs`` and
        ``num_pairs`` pairs (uniformly), a curriculum that lets the recall
        circuit form on easy examples; test examples always hold ``num_pairs``.
        None: every example holds ``num_pairs``.
      power_a: MQAR query-gap power law, ``p(gap = i) ~ i^(a - 1)``; Zoology uses 0.01.
      random_fill: MQAR: fill the blanks between queries with random tokens
        (Zoology's default) instead of zeros.
      num_copy: selective copying: data tokens to reproduce.
      data: ``bytes``: a text file, a folder of text files, or a named corpus
        (``train.corpus.CORPORA``: ``python``, ``shakespeare``); None for ``python``,
        the standard library's source files.
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
        "mqar",
        "needle",
        "multikey_needle",
        "variable_tracking",
        "induction",
        "selective_copy",
        "bytes",
        "parity",
        "modular",
        "s3",
        "s5",
    ] = "mqar"
    seq_len: int = 64
    vocab_size: int = 256
    modulus: int = 5
    num_pairs: int = 8
    hops: int = 2
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
        # Sizes are counts: a float or a bool would fail later, inside a batch's indexing.
        for name in ("seq_len", "vocab_size", "num_pairs", "hops", "num_copy", "val_percent"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int):
                raise ValueError(f"task.{name}: expected an int, got {x!r}")
        if self.min_pairs is not None and (
            isinstance(self.min_pairs, bool) or not isinstance(self.min_pairs, int)
        ):
            raise ValueError(f"task.min_pairs: expected None or an int, got {self.min_pairs!r}")
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
        if self.name in RULER_TASKS:
            self._check_ruler()
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

    def _check_ruler(self):
        """``multikey_needle`` and ``variable_tracking``: hops, and room for the pairs."""
        h, n, what = 1, self.num_pairs, "needles"
        if self.name == "variable_tracking":
            h, what = self.hops, "chains"
            if isinstance(h, bool) or not isinstance(h, int) or h < 1:
                raise ValueError(f"task.hops: expected an int >= 1, got {h!r}")
        width = 2 * h if h == 1 else 3 * h  # past one hop, a filler after each assignment
        most = (self.seq_len - 1) // width
        if not 1 <= n <= most:
            raise ValueError(
                f"task.num_pairs: expected 1 <= num_pairs <= (seq_len - 1) / {width} = {most} "
                f"({what} of {width} tokens before the query), got {n}"
            )
        if self.vocab_size // 4 - 1 < n * h:
            raise ValueError(
                f"task.vocab_size: expected at least {4 * (n * h + 1)} so that {n * h} distinct "
                f"{'variables' if h > 1 else 'keys'} fit in [1, V/4), got {self.vocab_size}"
            )

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
          seed: the run's data seed (not for a corpus's test windows: those are one
            sample for every seed, so that seeds differ by their training alone).
          split: "train" or "test".
          step: the batch index (the optimizer step for training batches).
          batch_size: B.

        Returns:
          ``dict(tokens [B,T] int32, labels [B,T] int32, weights [B,T] float32)``.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size: expected an int >= 1, got {batch_size}")
        c = self.config
        rng = _rng(0 if (split == "test" and c.name == "bytes") else seed, split, step)
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
        if c.name == "multikey_needle":
            return multikey_needle_batch(
                rng, batch_size, seq_len=c.seq_len, vocab_size=c.vocab_size, num_pairs=c.num_pairs
            )
        if c.name == "variable_tracking":
            return variable_tracking_batch(
                rng,
                batch_size,
                seq_len=c.seq_len,
                vocab_size=c.vocab_size,
                num_pairs=c.num_pairs,
                hops=c.hops,
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
        return bytes_batch(
            rng, batch_size, stream=stream, seq_len=c.seq_len, bos=c.bos, split=split
        )


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


# Fields added after fingerprints were recorded: left out of the hash at these
# defaults, so every config recorded before them keeps its fingerprint.
_ADDED_DEFAULTS = {"hops": 2}


def _fingerprint(config: TaskConfig, corpus: Corpus | None) -> str:
    if corpus is not None:
        return corpus.fingerprint
    fields = {
        k: v
        for k, v in dataclasses.asdict(config).items()
        if k != "fingerprint" and not (k in _ADDED_DEFAULTS and v == _ADDED_DEFAULTS[k])
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
