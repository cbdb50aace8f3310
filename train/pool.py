"""Many training runs at once: worker processes pinned to cores, and one bar over their steps.

``Pool(jobs, desc)`` runs a picklable ``worker(item)`` for each item, in this process
(``jobs == 1``) or in ``jobs`` spawned workers (``worker_init``), the same workers for
every ``run`` call of one ``with`` block (a comparison's later waves, an experiment's
extended runs). Its bar counts the steps of every run, not the runs: ``train.loop``
tells the process's slot where its run is (``report``: the step it resumed at, the
updates done, the step it trains to), the pool reads every slot twice a second, and
tqdm shows the steps done, their rate and the time left for every run submitted so
far. A run that stops early (its target accuracy reached) or that resumed takes its
untrained steps off the total, so the estimate is of the work left.

Ctrl-C while workers train kills them (``stop_workers``): their runs keep their
checkpoints (``train.config.TrainConfig.ckpt_seconds``: at most about a minute of work
is lost), and rerunning the command resumes them.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

from tqdm.auto import tqdm

from train import interrupt, plugins

__all__ = ["Pool", "WorkersInterrupted", "report", "stop_workers", "worker_init"]

# A slot: the item a process trains (-1: none), the step its run resumed at, the updates
# done, the step it trains to (-1: not yet known).
ITEM, START, DONE, END = range(4)
_slot = None  # this process's slot (a worker's shared array, or the in-process pool's list)
_on_report = None  # in-process: the bar's refresh after each report
POLL_SECONDS = 0.5


def report(start: int, done: int, end: int) -> None:
    """Where the run training in this process is (``train.loop`` calls it at the start of a
    session and after each update): resumed at ``start``, ``done`` updates, training to
    ``end``. Nothing outside a pool."""
    if _slot is None:
        return
    _slot[START], _slot[DONE], _slot[END] = start, done, end
    if _on_report is not None:
        _on_report()


def worker_init(started, slots=None, plugin_names=()) -> None:
    """A worker process: one core of its own, a progress slot, cached compilation, and the
    parent's plugins imported (before any config naming what they add arrives).

    XLA:CPU sizes its thread pools by the cores the process may run on, so
    worker i is pinned to core i (modulo the cores it was given) before JAX
    starts its backend. No XLA flag does this: ``--xla_cpu_multi_thread_eigen=false``
    still kept 1.9 of 2 cores busy on a jitted matmul, and flags without a
    leading ``--`` are silently ignored.

    On Linux the worker also dies with its parent (``PR_SET_PDEATHSIG``): a
    parent killed by a signal it cannot handle (SIGTERM, SIGKILL) would
    otherwise leave its workers training on, unseen, on the cores the next
    command runs on. Their runs keep their checkpoints either way.

    Args:
      started: a shared counter of the workers started so far.
      slots: a shared int array of 4 per worker (the progress slots), or None.
      plugin_names: the plugins the parent loaded (``train.plugins.loaded()``).
    """
    global _slot
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides (Pool)
    _die_with_parent()
    plugins.load(plugin_names)
    with started.get_lock():
        index = started.value
        started.value += 1
    if slots is not None:
        _slot = _WorkerSlot(slots, index)
    if hasattr(os, "sched_setaffinity"):  # Linux; elsewhere the workers share the cores
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[index % len(cores)]})
    from train.cli import enable_compilation_cache  # JAX starts here, pinned

    enable_compilation_cache()


class _WorkerSlot:
    """Worker ``index``'s four entries of the shared array."""

    def __init__(self, slots, index: int):
        self.slots, self.base = slots, 4 * index

    def __setitem__(self, i: int, value: int) -> None:
        self.slots[self.base + i] = value

    def __getitem__(self, i: int) -> int:
        return self.slots[self.base + i]


def _run_item(worker, number: int, item):
    """``worker(item)`` in a worker, its slot naming the item while it trains."""
    if _slot is not None:  # START first: the parent skips a slot whose START is -1
        _slot[START], _slot[ITEM], _slot[DONE], _slot[END] = -1, number, -1, -1
    return worker(item)


# prctl(2) options: the signal a process gets when its parent dies, and reading it back.
PR_SET_PDEATHSIG, PR_GET_PDEATHSIG = 1, 2


def _die_with_parent() -> None:
    """Asks Linux to SIGKILL this process when its parent exits (elsewhere: nothing)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class WorkersInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped the workers; their runs resume where their checkpoints are."""


def stop_workers(signum=None, frame=None) -> None:
    """SIGINT while workers train: kill them and stop. Their runs' checkpoints are
    crash-safe (a run killed at any moment resumes bit for bit), so rerunning the
    command loses nothing saved. The main thread is only waiting for them here,
    so the exception lands in plain Python code."""
    for child in multiprocessing.active_children():
        child.kill()
    raise WorkersInterrupted("the workers were stopped; every run keeps its checkpoints")


class Pool:
    """``with Pool(jobs, desc) as pool: pool.run(worker, items, steps_of, done)``."""

    def __init__(self, jobs: int, desc: str, progress: bool = True):
        self.jobs, self.desc, self.progress = jobs, desc, progress
        self.items: list[list] = []  # per item submitted: [label, planned, start, done, over]

    def __enter__(self):
        self.bar = tqdm(total=0, desc=self.desc, unit="step", disable=not self.progress,
                        dynamic_ncols=True)  # fmt: skip
        self.executor = None
        if self.jobs > 1:
            if interrupt.active():  # the command line: Ctrl-C stops the workers, then this
                signal.signal(signal.SIGINT, stop_workers)
                # Workers killed that way leave the semaphore of the core counter registered;
                # multiprocessing's tracker (started below, with this environment) frees it,
                # and says so in a warning that would be the only noise of an interrupt.
                os.environ["PYTHONWARNINGS"] = "ignore:resource_tracker:UserWarning"
            context = multiprocessing.get_context("spawn")  # fork and XLA's threads do not mix
            self.slots = context.Array("q", [-1] * 4 * self.jobs, lock=False)
            self.executor = ProcessPoolExecutor(
                self.jobs,
                mp_context=context,
                initializer=worker_init,
                initargs=(context.Value("i", 0), self.slots, plugins.loaded()),
            )
        return self

    def __exit__(self, *exc):
        if self.executor is not None:
            self.executor.shutdown(cancel_futures=True)
        self.bar.close()
        return False

    def write(self, line: str) -> None:
        """A line above the bar."""
        self.bar.write(line)

    def run(self, worker, items, steps_of, done=None, labels=None) -> list:
        """``[worker(item) for item in items]``, ``jobs`` at a time.

        Args:
          worker: picklable (a module-level function, or a ``functools.partial`` of one).
          items: what to run.
          steps_of: ``item -> int``, the steps its run trains at most (the bar's total).
          done: ``(item, result) -> None``, called as each finishes.
          labels: a short name per item for the bar (default ``str(item)``).
        """
        first = len(self.items)
        labels = labels or [str(item) for item in items]
        self.items += [[label, steps_of(item), None, 0, False] for item, label in
                       zip(items, labels, strict=True)]  # fmt: skip
        self._show()
        if self.executor is None:
            return [self._here(worker, first + i, item, done) for i, item in enumerate(items)]
        futures = {
            self.executor.submit(_run_item, worker, first + i, item): i
            for i, item in enumerate(items)
        }
        results = [None] * len(items)
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, timeout=POLL_SECONDS, return_when=FIRST_COMPLETED)
            self._read_slots()
            for future in finished:
                results[futures[future]] = future.result()
                self.items[first + futures[future]][4] = True
            self._show()
            for future in finished:
                if done is not None:
                    done(items[futures[future]], results[futures[future]])
        return results

    def _here(self, worker, number: int, item, done):
        """One item in this process, the bar following its steps."""
        global _slot, _on_report
        outer = _slot, _on_report  # a pool inside a worker's item: the worker's slot after
        _slot, _on_report = [number, -1, -1, -1], lambda: self._take(_slot) or self._show()
        try:
            result = worker(item)
        finally:
            _slot, _on_report = outer
        self.items[number][4] = True
        self._show()
        if done is not None:
            done(item, result)
        return result

    def _read_slots(self) -> None:
        for w in range(self.jobs):
            self._take(_WorkerSlot(self.slots, w))

    def _take(self, slot) -> None:
        """A slot's run: where it resumed (its steps before are not this run's work) and
        how far it is."""
        number, start, done, end = (slot[i] for i in (ITEM, START, DONE, END))
        if number < 0 or start < 0 or number >= len(self.items):
            return
        entry = self.items[number]
        if entry[4]:  # finished: the slot already holds its next item's (or a stale) state
            return
        entry[1], entry[2], entry[3] = end, start, done

    def _show(self) -> None:
        """The bar: steps done of every submitted run's steps left, and the runs training."""
        total = work = 0
        running = []
        for label, planned, start, done, over in self.items:
            begin = start or 0
            work += max(done - begin, 0)
            total += max(done - begin, 0) if over else max(planned - begin, 0)
            if start is not None and not over:
                running.append(f"{label} {done}/{planned}")
        self.bar.total = total
        self.bar.set_postfix_str("; ".join(running), refresh=False)
        self.bar.update(work - self.bar.n)  # redraws at most every tqdm's mininterval
