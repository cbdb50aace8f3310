"""Head importance helpers: layer normalization, pruning orders and masks."""

import numpy as np
import pytest

from analysis import importance


def test_normalize_importance_is_unit_l2_per_layer():
    scores = np.array([[3.0, 4.0], [0.0, 0.0], [1.0, 0.0]])
    out = importance.normalize_importance(scores)
    np.testing.assert_allclose(out, [[0.6, 0.8], [0.0, 0.0], [1.0, 0.0]])
    # A list of per-layer arrays, as models.head_importance returns, works too.
    np.testing.assert_allclose(importance.normalize_importance(list(scores)), out)


def test_pruning_order_by_importance_least_first_ties_row_major():
    imp = np.array([[0.5, 0.1, 0.9], [0.1, 0.7, 0.5]])
    order = importance.pruning_order(imp)
    np.testing.assert_array_equal(order, [[0, 1], [1, 0], [0, 0], [1, 2], [1, 1], [0, 2]])


def test_random_order_is_a_seeded_permutation():
    imp = np.zeros((3, 4))
    a = importance.pruning_order(imp, by="random", seed=1)
    assert (a == importance.pruning_order(imp, by="random", seed=1)).all()
    assert not (a == importance.pruning_order(imp, by="random", seed=2)).all()
    assert sorted(map(tuple, a)) == [(l, n) for l in range(3) for n in range(4)]


def test_pruning_masks():
    imp = np.arange(6.0).reshape(2, 3)[::-1]  # layer 1 holds the smallest
    masks = importance.pruning_masks(importance.pruning_order(imp), [0.0, 0.5, 1 / 3, 1.0])
    assert masks.shape == (4, 2, 3) and masks.dtype == np.float32
    np.testing.assert_array_equal(masks[0], np.ones((2, 3)))
    np.testing.assert_array_equal(masks[1], [[1, 1, 1], [0, 0, 0]])
    np.testing.assert_array_equal(masks[2], [[1, 1, 1], [0, 0, 1]])
    np.testing.assert_array_equal(masks[3], np.zeros((2, 3)))
    # The number masked is the nearest integer to fraction * heads.
    assert importance.pruning_masks(importance.pruning_order(imp), [0.25])[0].sum() == 4


def test_validation_errors():
    order = importance.pruning_order(np.ones((2, 2)))
    cases = [
        (lambda: importance.normalize_importance(np.ones(3)), "scores: expected a non-empty"),
        (lambda: importance.normalize_importance([[1.0, np.inf]]), "scores: expected finite"),
        (lambda: importance.pruning_order(np.ones((2, 2)), by="grad"), "by: expected one of"),
        (lambda: importance.pruning_order(np.ones((2, 2)), seed=-1), "seed: expected an int >= 0"),
        (lambda: importance.pruning_masks(order[:3], [0.5]), "order: expected each head"),
        (lambda: importance.pruning_masks(order[[0, 0, 1, 2]], [0.5]), "order: expected each"),
        (lambda: importance.pruning_masks(order * 1.0, [0.5]), "order: expected integer"),
        (lambda: importance.pruning_masks(order, 0.5), "fractions: expected a sequence"),
        (lambda: importance.pruning_masks(order, []), "fractions: expected at least one"),
        (lambda: importance.pruning_masks(order, [0.5, 1.5]), r"fractions\[1\]: expected"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
