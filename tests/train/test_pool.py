"""One bar over many runs' steps: the work done, and the work left of runs resumed or stopped early.

The workers' side (spawned processes writing shared slots) runs in the comparisons'
integration tests (``test_signals.py``, ``test_compare.py``); here the pool runs in this
process, where the same slot and bar logic follow a fake run's reports.
"""

from train import pool


def _fake_run(item):
    """A run resumed at ``start`` that stops at ``stop`` of the ``cap`` it trains to."""
    start, stop, cap = item
    pool.report(start, start, cap)
    for done in range(start + 1, stop + 1):
        pool.report(start, done, cap)
    return stop


def test_the_bar_counts_the_steps_left_of_resumed_and_early_stopped_runs():
    items = [(0, 10, 10), (4, 10, 10), (0, 6, 10)]  # whole, resumed at 4, stopped at 6
    seen = []
    with pool.Pool(1, "runs") as p:

        def done(item, result):
            seen.append((item, result, p.bar.n, p.bar.total))

        results = p.run(_fake_run, items, steps_of=lambda item: item[2], done=done)
    assert results == [10, 10, 6]
    # Runs not yet started count at their caps; a resumed run's earlier steps are not
    # its work; a run stopped early takes its untrained steps off the total.
    assert [(n, total) for *_, n, total in seen] == [(10, 30), (16, 26), (22, 22)]
    assert pool._slot is None  # outside a pool, train.loop's reports go nowhere
    pool.report(0, 1, 2)
