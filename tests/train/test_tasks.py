"""Invariants of the task batches: what is labelled, with what, and determinism."""

import itertools

import numpy as np
import pytest

from train.tasks import BOS, IGNORE, TaskConfig, group_table, load_corpus, make_task

MQAR = TaskConfig(name="mqar", seq_len=64, vocab_size=128, num_pairs=8)


def _rows(batch):
    return [tuple(row) for row in batch["tokens"]]


@pytest.mark.parametrize("random_fill", [False, True])
def test_mqar_labels_are_the_values_of_the_queried_keys(random_fill):
    cfg = TaskConfig(name="mqar", seq_len=64, vocab_size=128, num_pairs=8, random_fill=random_fill)
    b = make_task(cfg).batch(seed=3, split="train", step=5, batch_size=16)
    tokens, labels, weights = b["tokens"], b["labels"], b["weights"]
    assert tokens.shape == labels.shape == weights.shape == (16, 64)
    assert tokens.dtype == labels.dtype == np.int32 and weights.dtype == np.float32
    n, half = 8, 64
    for tok, lab, w in zip(tokens, labels, weights, strict=True):
        keys, values = tok[0 : 2 * n : 2], tok[1 : 2 * n : 2]
        assert len(set(keys)) == n and len(set(values)) == n  # without replacement
        assert ((keys >= 1) & (keys < half)).all() and ((values >= half) & (values < 128)).all()
        pairs = dict(zip(keys, values, strict=True))
        where = np.flatnonzero(lab != IGNORE)
        np.testing.assert_array_equal(w, (lab != IGNORE).astype(np.float32))
        assert len(where) == n and (where >= 2 * n).all()  # queries only, after the context
        assert ((where - 2 * n) % 2 == 0).all()  # at even offsets of the query region
        assert sorted(tok[where]) == sorted(keys)  # each key queried exactly once
        for p in where:
            assert lab[p] == pairs[tok[p]]
        blanks = np.setdiff1d(np.arange(2 * n, 64), where)
        assert not np.isin(tok[blanks], keys).any()  # no filler looks like a query
        if not random_fill:
            assert (tok[blanks] == 0).all()


def test_needles_lie_anywhere_and_are_queried_at_the_end():
    cfg = TaskConfig(name="needle", seq_len=60, vocab_size=64, num_pairs=6)
    b = make_task(cfg).batch(seed=1, split="test", step=0, batch_size=64)
    tokens, labels = b["tokens"], b["labels"]
    n, T, quarter, half = 6, 60, 16, 32
    starts = []
    for tok, lab in zip(tokens, labels, strict=True):
        where = np.flatnonzero(lab != IGNORE)
        assert where.tolist() == list(range(T - n, T))  # the queries: the last n tokens
        hay = tok[: T - n]
        found = np.flatnonzero(hay < quarter)  # keys are the only tokens below V/4
        assert len(found) == n and sorted(hay[found]) == sorted(tok[T - n :])
        assert ((hay[found + 1] >= quarter) & (hay[found + 1] < half)).all()  # then its value
        pairs = dict(zip(hay[found], hay[found + 1], strict=True))
        assert [pairs[k] for k in tok[T - n :]] == lab[T - n :].tolist()
        others = np.setdiff1d(np.arange(T - n), np.concatenate([found, found + 1]))
        assert (hay[others] >= half).all()  # filler only in between
        starts += found.tolist()
    # the needles are spread over the whole haystack, its first and last pairs included
    assert min(starts) == 0 and max(starts) == T - n - 2
    with pytest.raises(ValueError, match="num_pairs"):
        TaskConfig(name="needle", seq_len=12, vocab_size=64, num_pairs=5)


def _answer(hay, key, quarter, half):
    """The value a query of ``key`` asks for, following its chain back through ``hay``:
    a variable's first place is its assignment (a copy comes after it)."""
    hops, at = 0, len(hay)
    while not quarter <= key < half:
        p = int(np.flatnonzero(hay == key)[0])
        assert p < at  # each assignment lies before the one that copies it
        key, at, hops = hay[p + 1], p, hops + 1
    return key, hops


@pytest.mark.parametrize(("name", "hops"), [("multikey_needle", 1), ("variable_tracking", 3)])
def test_ruler_tasks_query_one_needle_or_chain_at_the_end(name, hops):
    n, T, V = 4, 40, 64
    quarter, half = V // 4, V // 2
    cfg = TaskConfig(name=name, seq_len=T, vocab_size=V, num_pairs=n, hops=hops)
    b = make_task(cfg).batch(seed=2, split="train", step=1, batch_size=64)
    assert b["tokens"].dtype == b["labels"].dtype == np.int32
    np.testing.assert_array_equal(b["weights"], (b["labels"] != IGNORE).astype(np.float32))
    queried = []
    for tok, lab in zip(b["tokens"], b["labels"], strict=True):
        assert np.flatnonzero(lab != IGNORE).tolist() == [T - 1]
        hay = tok[: T - 1]
        names = np.flatnonzero(hay < quarter)
        firsts = np.array([p for p in names if p == np.flatnonzero(hay == hay[p])[0]])
        assert len(firsts) == n * hops == len(set(hay[firsts]))  # distinct keys or variables
        covered = np.concatenate([firsts, firsts + 1])
        assert len(set(covered)) == 2 * n * hops  # the pairs do not overlap
        others = np.setdiff1d(np.arange(T - 1), covered)
        assert (hay[others] >= half).all()  # filler only in between
        assert (hay[covered] < half).all()  # keys, variables and values only
        value, steps = _answer(hay, tok[T - 1], quarter, half)
        assert (value, steps) == (lab[T - 1], hops)  # the last variable of a whole chain
        chain_ends = [k for k in hay[firsts] if k not in hay[firsts + 1]]
        assert len(chain_ends) == n and tok[T - 1] in chain_ends
        queried.append(chain_ends.index(tok[T - 1]))  # which needle or chain, by place
    assert set(queried) == set(range(n))  # every needle or chain is queried over a batch
    again = make_task(cfg).batch(seed=2, split="train", step=1, batch_size=64)
    for k in b:
        np.testing.assert_array_equal(b[k], again[k])


def readings(row, vocab: int) -> dict[int, list[int]]:
    """Every assignment a reader of the tokens can see: each name (``[1, V/4)``) in the
    haystack followed by a name or a value (``[1, V/2)``), with what it takes."""
    quarter, half = vocab // 4, vocab // 2
    seen: dict[int, list[int]] = {}
    for a, b in itertools.pairwise(row[:-1]):  # the haystack: the last token is the query
        if 1 <= a < quarter and 1 <= b < half:
            seen.setdefault(int(a), []).append(int(b))
    return seen


@pytest.mark.parametrize(
    ("T", "n", "hops", "V"),
    [(256, 6, 2, 64), (64, 6, 2, 64), (32, 2, 2, 32), (40, 4, 3, 64)],
    ids=["sparse_ruler", "sparse_ruler_at_64", "its_quick", "three_hops"],
)
def test_variable_tracking_reads_one_way_and_a_solver_of_the_tokens_answers(T, n, hops, V):
    """No name has two assignments in the tokens (``x2 x1`` right before ``x7 x6`` also
    reads ``x1 x7``: 23% of examples at T = 256 and 74% at T = 64, 6 chains of 2, before a
    filler followed each assignment), so following the query's name back through the only
    readings reaches the label, in every example."""
    cfg = TaskConfig(name="variable_tracking", seq_len=T, vocab_size=V, num_pairs=n, hops=hops)
    task = make_task(cfg)
    for seed in range(4):
        b = task.batch(seed=seed, split="train", step=0, batch_size=256)
        for tok, lab in zip(b["tokens"], b["labels"], strict=True):
            seen = readings(tok, V)
            assert len(seen) == n * hops and all(len(r) == 1 for r in seen.values()), seen
            x, steps = int(tok[-1]), 0
            while x < V // 4:
                x, steps = seen[x][0], steps + 1
            assert (x, steps) == (lab[-1], hops)


def test_ruler_tasks_refuse_what_does_not_fit():
    with pytest.raises(ValueError, match=r"^task\.hops: expected an int >= 1, got 0"):
        TaskConfig(name="variable_tracking", seq_len=64, vocab_size=64, num_pairs=2, hops=0)
    with pytest.raises(ValueError, match=r"^task\.num_pairs: expected .*= 5 .*got 6"):
        TaskConfig(name="variable_tracking", seq_len=12, vocab_size=64, num_pairs=6, hops=1)
    with pytest.raises(ValueError, match=r"^task\.num_pairs: expected .*/ 6 = 1 .*got 3"):
        TaskConfig(name="variable_tracking", seq_len=12, vocab_size=64, num_pairs=3, hops=2)
    with pytest.raises(ValueError, match=r"^task\.vocab_size: expected at least 40 .*got 36"):
        TaskConfig(name="variable_tracking", seq_len=64, vocab_size=36, num_pairs=3, hops=3)
    with pytest.raises(ValueError, match=r"^task\.num_pairs"):
        TaskConfig(name="multikey_needle", seq_len=8, vocab_size=64, num_pairs=4)
    with pytest.raises(ValueError, match=r"^task\.vocab_size"):
        TaskConfig(name="multikey_needle", seq_len=64, vocab_size=16, num_pairs=4)
    TaskConfig(name="variable_tracking", seq_len=19, vocab_size=40, num_pairs=3, hops=2)  # fits


def test_mqar_min_pairs_varies_training_examples_only():
    cfg = TaskConfig(name="mqar", seq_len=64, vocab_size=128, num_pairs=8, min_pairs=2)
    task = make_task(cfg)
    train = task.batch(0, "train", 0, 256)
    counts = (train["labels"] != IGNORE).sum(1)
    assert counts.min() == 2 and counts.max() == 8
    for tok, lab, n in zip(train["tokens"], train["labels"], counts, strict=True):
        keys, values = tok[0 : 2 * n : 2], tok[1 : 2 * n : 2]
        assert not np.isin(tok[2 * n : 16], keys).any()  # dropped pairs became filler
        where = np.flatnonzero(lab != IGNORE)
        assert sorted(tok[where]) == sorted(keys)
        pairs = dict(zip(keys, values, strict=True))
        assert all(lab[p] == pairs[tok[p]] for p in where)
    test = task.batch(0, "test", 0, 64)
    assert ((test["labels"] != IGNORE).sum(1) == 8).all()


def test_mqar_gaps_follow_a_decreasing_power_law():
    b = make_task(MQAR).batch(seed=0, split="train", step=0, batch_size=2000)
    offsets = (np.argwhere(b["labels"] != IGNORE)[:, 1] - 16) // 2
    counts = np.bincount(offsets, minlength=24)
    assert counts.sum() == 2000 * 8
    # p(gap = i) ~ i^-0.99: the first slots are the most frequent, the last the least.
    assert counts[0] > counts[5] > counts[23]


def test_batches_are_deterministic_and_splits_disjoint():
    task = make_task(MQAR)
    a, b = task.batch(7, "train", 11, 8), task.batch(7, "train", 11, 8)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert _rows(task.batch(7, "train", 12, 8)) != _rows(a)
    assert _rows(task.batch(8, "train", 11, 8)) != _rows(a)
    train = {r for step in range(50) for r in _rows(task.batch(7, "train", step, 32))}
    test = {r for step in range(4) for r in _rows(task.batch(7, "test", step, 32))}
    assert len(train) == 50 * 32 and len(test) == 4 * 32
    assert not train & test


def test_induction_labels_the_second_copy():
    cfg = TaskConfig(name="induction", seq_len=32, vocab_size=16)
    b = make_task(cfg).batch(seed=1, split="test", step=0, batch_size=8)
    tok, lab, w = b["tokens"], b["labels"], b["weights"]
    assert (tok[:, 0] == 0).all() and (tok[:, 1:] >= 1).all()  # BOS, then r from [1, V)
    np.testing.assert_array_equal(tok[:, 1:17], np.concatenate([tok[:, 17:], lab[:, -1:]], 1))
    assert (lab[:, :16] == IGNORE).all() and (w[:, :16] == 0).all()
    np.testing.assert_array_equal(lab[:, 16:], tok[:, 1:17])  # the second copy is r again
    assert (w[:, 16:] == 1).all()


def test_selective_copy_labels_the_data_tokens_in_order():
    cfg = TaskConfig(name="selective_copy", seq_len=40, vocab_size=12, num_copy=6)
    b = make_task(cfg).batch(seed=2, split="train", step=3, batch_size=8)
    tok, lab = b["tokens"], b["labels"]
    region = 40 - 6
    for t, lb in zip(tok, lab, strict=True):
        data = t[:region][t[:region] != 0]
        assert len(data) == 6 and (data >= 2).all()
        assert t[region] == 1  # SEP
        np.testing.assert_array_equal(lb[region:], data)
        np.testing.assert_array_equal(t[region + 1 :], data[:-1])  # teacher forcing
        assert (lb[:region] == IGNORE).all()


def test_corpus_from_a_folder(tmp_path):
    for i in range(30):
        (tmp_path / f"f{i:02d}.txt").write_text(f"file {i}: " + "abc" * 50)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "g.py").write_text("print('x')\n")
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2")  # binary: skipped
    corpus = load_corpus(str(tmp_path), 10)
    assert corpus.files == 31
    total = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file() and p.suffix != ".bin")
    assert len(corpus.train) + len(corpus.test) == total
    assert len(corpus.train) > len(corpus.test) > 0
    assert load_corpus(str(tmp_path), 10).test.tobytes() == corpus.test.tobytes()
    # Files smaller than a piece go whole to one side.
    train, test = corpus.train.tobytes(), corpus.test.tobytes()
    for i in range(30):
        text = (tmp_path / f"f{i:02d}.txt").read_bytes()
        assert (text in train) != (text in test)

    cfg = TaskConfig(name="bytes", seq_len=16, data=str(tmp_path))
    task = make_task(cfg)
    b = task.batch(0, "train", 0, 4)
    assert task.vocab_size == 256 and b["tokens"].shape == (4, 16)
    np.testing.assert_array_equal(b["tokens"][:, 1:], b["labels"][:, :-1])  # next bytes
    assert (b["weights"] == 1).all()
    for row in b["tokens"]:
        assert row.astype(np.uint8).tobytes() in corpus.train.tobytes()

    # With a BOS first: the same windows one byte later, every byte predicted from BOS on.
    bos = make_task(TaskConfig(name="bytes", seq_len=16, data=str(tmp_path), bos=True))
    c = bos.batch(0, "train", 0, 4)
    assert c["tokens"].shape == (4, 16) and (c["tokens"][:, 0] == BOS).all()
    np.testing.assert_array_equal(c["tokens"][:, 1:], c["labels"][:, :-1])
    np.testing.assert_array_equal(c["labels"][:, 1:], b["tokens"][:, 1:])
    np.testing.assert_array_equal(c["labels"][:, 0], b["tokens"][:, 0])
    assert (c["weights"] == 1).all() and BOS not in corpus.train

    # The test windows are one sample for every seed; the training windows are the seed's.
    for key in ("tokens", "labels"):
        np.testing.assert_array_equal(task.batch(3, "test", 1, 4)[key],
                                      task.batch(0, "test", 1, 4)[key])  # fmt: skip
    assert not np.array_equal(task.batch(3, "train", 0, 4)["tokens"], b["tokens"])


def test_corpus_from_a_single_file(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("hello world\n" * 30000)  # several pieces
    corpus = load_corpus(str(path), 20)
    assert len(corpus.train) + len(corpus.test) == len(path.read_bytes())
    assert len(corpus.test) > 0 and len(corpus.train) > len(corpus.test)


def test_a_corpus_of_one_piece_is_cut_so_both_splits_hold_bytes(tmp_path):
    """40,000 bytes are one piece: the piece rule would leave a split empty, so the bytes
    are cut (the last 10% held out), and a split too short for the windows is named."""
    path = tmp_path / "small.txt"
    path.write_bytes(b"abcde" * 8000)  # 40,000 bytes
    corpus = load_corpus(str(path), 10)
    assert (len(corpus.train), len(corpus.test)) == (36_000, 4_000)
    assert corpus.train.tobytes() + corpus.test.tobytes() == path.read_bytes()
    assert corpus.fingerprint != load_corpus(str(path), 20).fingerprint
    b = make_task(TaskConfig(name="bytes", seq_len=32, data=str(path))).batch(0, "test", 0, 2)
    assert b["tokens"].shape == (2, 32)
    path.write_bytes(b"x" * 40)  # 36 train bytes, 4 test bytes
    with pytest.raises(ValueError, match=r"^data: expected a test split of at least seq_len \+ 1"):
        make_task(TaskConfig(name="bytes", seq_len=32, data=str(path))).batch(0, "test", 0, 2)
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"^data: expected at least 2 bytes of text, got 1"):
        load_corpus(str(path), 10)


def test_default_corpus_is_the_standard_library():
    corpus = load_corpus(None, 10)
    assert corpus.files > 100 and len(corpus.train) > 1_000_000
    assert b"def " in corpus.train[:100_000].tobytes()
    assert "site-packages" not in corpus.source


@pytest.mark.parametrize("group", ["Z2", "Z5", "S3", "S5"])
def test_group_tables_are_groups(group):
    """Identity 0, every element has an inverse, associativity (every triple of S3, and a
    sample of S5's); S_k composes permutations "a, then b"."""
    t = group_table(group)
    n = len(t)
    assert n == {"Z2": 2, "Z5": 5, "S3": 6, "S5": 120}[group]
    np.testing.assert_array_equal(t[0], np.arange(n))
    np.testing.assert_array_equal(t[:, 0], np.arange(n))
    assert all(sorted(row) == list(range(n)) for row in t)  # a Latin square: inverses exist
    a, b, c = np.random.default_rng(0).integers(0, n, (3, 2000))
    np.testing.assert_array_equal(t[t[a, b], c], t[a, t[b, c]])
    if group[0] == "S":
        perms = list(itertools.permutations(range(int(group[1:]))))
        x, y = perms[5], perms[-2]
        composed = tuple(y[x[i]] for i in range(len(x)))
        assert perms[t[5, n - 2]] == composed
        assert (t != t.T).any()  # not abelian


@pytest.mark.parametrize("name", ["parity", "modular", "s3", "s5"])
def test_state_tasks_label_the_running_product(name):
    config = TaskConfig(name=name, seq_len=12, modulus=3)
    batch = make_task(config).batch(0, "train", 0, 16)
    tokens, labels = batch["tokens"], batch["labels"]
    assert config.vocab == {"parity": 2, "modular": 3, "s3": 6, "s5": 120}[name]
    assert tokens.max() < config.vocab and (batch["weights"] == 1).all()
    if name in ("parity", "modular"):  # running sums mod m, written directly
        m = 2 if name == "parity" else 3
        np.testing.assert_array_equal(labels, np.cumsum(tokens, axis=1) % m)
    else:  # permutations composed one by one, written directly
        k = int(name[1:])
        perms = list(itertools.permutations(range(k)))
        for row, want in zip(tokens, labels, strict=True):
            state = tuple(range(k))
            for x, label in zip(row, want, strict=True):
                state = tuple(perms[x][state[i]] for i in range(k))
                assert perms[label] == state


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match=r"task\.modulus"):
        TaskConfig(name="modular", modulus=1)
    with pytest.raises(ValueError, match=r"task\.name"):
        _ = TaskConfig(name="mqar").group
    with pytest.raises(ValueError, match="num_pairs"):
        TaskConfig(name="mqar", seq_len=32, num_pairs=9)
    with pytest.raises(ValueError, match=r"task\.name"):
        TaskConfig(name="nope")
    with pytest.raises(ValueError, match=r"task\.bos"):
        TaskConfig(name="mqar", seq_len=32, num_pairs=4, bos=True)
    with pytest.raises(ValueError, match="data"):
        load_corpus("/does/not/exist", 10)
    with pytest.raises(ValueError, match="split"):
        make_task(MQAR).batch(0, "valid", 0, 2)


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_pairs", 2.0), ("num_pairs", True), ("seq_len", 64.5), ("min_pairs", 1.0)],
)
def test_sizes_that_are_not_ints_are_refused_by_name(field, value):
    """(They failed at batch time: ``TypeError: Partition index must be integer``.)"""
    with pytest.raises(ValueError, match=rf"^task\.{field}: expected .*int.*, got {value!r}$"):
        TaskConfig(name="mqar", **{field: value})


@pytest.mark.parametrize("val_percent", [0, 100, 150, -5, 10.0])
def test_a_split_that_would_be_empty_or_a_byte_is_refused(tmp_path, val_percent):
    (tmp_path / "a.txt").write_text("text " * 100)
    with pytest.raises(ValueError, match=r"^val_percent: expected an int in 1\.\.99"):
        load_corpus(str(tmp_path), val_percent)


def test_a_broken_link_in_a_corpus_folder_is_named(tmp_path):
    (tmp_path / "a.txt").write_text("text " * 100)
    (tmp_path / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    with pytest.raises(ValueError, match=r"^data: .*broken link .*gone\.txt"):
        load_corpus(str(tmp_path), 10)
