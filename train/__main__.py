"""``python -m train --config configs/mqar.py --workdir runs/x [--model.width 128 ...]``.

Also ``--data PATH`` (a text file or folder for the byte-level task, the same
as ``--task.data PATH``).

Trains one run (resuming it if the workdir holds checkpoints) and prints its
summary as JSON. ``--stop-at N`` stops after N updates with a checkpoint, as an
interruption would (the summary then says ``"partial": true``). A non-finite
loss exits with status 1 and a message naming the step; the last good
checkpoint is left as it was. Ctrl-C lets the current step finish, saves a
checkpoint of it, prints it and the command that resumes, and exits with
status 130 (a second Ctrl-C stops at once, keeping the checkpoints written);
a bad config or a workdir holding another run's config is one line on stderr
and status 2.

In a job of several processes, when one process stops (killed, crashed, a
typo in its flags) every other ends with one ``error:`` line on stderr and
status 3: at once when it was training (a collective that fails exits without
JAX's shutdown barrier, which would wait out the coordinator's heartbeat
timeout for the process that is gone), and after ``ATTNLAB_JOIN_TIMEOUT``
seconds (60 by default) when the job never formed, the line naming the process
that did not join. For that the command trains in a child process and speaks
for it (``train.supervisor``): JAX aborts a process that loses the job's
coordinator, or whose job does not form, with a C++ fatal log and stack trace,
which the command holds back (the line names the file it is kept in).

``--mesh data=2,fsdp=4`` (the ``TrainConfig.mesh`` field) trains sharded over a
device mesh (``train.sharding``); a run may resume under another mesh. A ``seq``
axis (``--mesh data=2,fsdp=2,seq=2``) shards each sequence too, with ring attention.
On several hosts, run the same command on each: ``train.distributed.initialize``
joins them first when the environment describes a multi-process job.
"""

from __future__ import annotations

from train.interrupt import EXIT_INTERRUPTED, exit_on_sigint

exit_on_sigint("python -m train")  # first: Ctrl-C while JAX imports or compiles is one line

import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402

from train import supervisor  # noqa: E402

if __name__ == "__main__" and supervisor.wanted():  # a job of several processes: before JAX
    status = supervisor.supervise(sys.argv[1:])
    sys.stdout.flush()
    os._exit(status)

import jax  # noqa: E402

from train import distributed  # noqa: E402
from train.cli import enable_compilation_cache, parse  # noqa: E402
from train.config import TrainConfig  # noqa: E402
from train.interrupt import TrainingInterrupted  # noqa: E402
from train.loop import NonFiniteLossError, train  # noqa: E402


def main(argv=None) -> int:
    """Entry point; returns the exit status.

    Standard output holds the JSON summary and nothing else: while the run
    goes (after the flags are parsed, so ``--help`` is on stdout), file
    descriptor 1 points at stderr, so nothing a library prints there (gloo's
    connection lines on several processes, XLA's logs) comes before it.
    """
    try:
        config, args = _parse(argv)
    except ValueError as e:  # a bad config file, pattern or override: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary_fd = os.dup(1)
    sys.stdout.flush()
    os.dup2(2, 1)
    try:
        status, summary = _run(config, args, argv)
    finally:
        sys.stdout.flush()
        os.dup2(summary_fd, 1)
        os.close(summary_fd)
    if summary is not None:
        print(json.dumps(summary, indent=2))
    return status


def _parse(argv):
    """``(config, args)`` from the command line; a ``ValueError`` in one line."""
    config, args = parse(
        "python -m train",
        "Trains one run (resuming it if the workdir holds checkpoints) and prints its "
        "summary. Flags of this command: --config FILE (required), --workdir DIR "
        "(required), --stop-at N (stop after N updates, with a checkpoint), --data PATH "
        "(same as --task.data), --no-progress, --adopt-checkpoints (resume checkpoints "
        "whose config.json is gone under this config), --model.pattern NAME,NAME,... (the "
        "layers from preset names, one per layer, sized by the first layer's heads and head "
        "dim; listed below) and --model.depth L (repeat the pattern to L layers); they "
        "apply before the field overrides below, so --model.layers.I.FIELD refers to the "
        "new layers. A larger --steps on a finished run extends it.",
        argv,
        default_config=None,
        default_type=TrainConfig,
        layer_flags=True,
        extra=(
            (("--workdir",), {"default": None}),
            (("--stop-at",), {"type": int, "default": None}),
            (("--data",), {"default": None}),
            (("--no-progress",), {"action": "store_true"}),
            (("--adopt-checkpoints",), {"action": "store_true"}),
        ),
    )
    if args.data is not None:
        config = dataclasses.replace(config, task=dataclasses.replace(config.task, data=args.data))
    if args.workdir is None:
        raise ValueError("--workdir is required")
    return config, args


def _run(config, args, argv) -> tuple[int, dict | None]:
    """Trains the parsed run: ``(status, summary or None)``; failures are one line."""
    try:  # before anything touches JAX's devices
        distributed.initialize()
    except ValueError as e:  # a malformed JAX_NUM_PROCESSES / JAX_PROCESS_ID
        print(f"error: {e}", file=sys.stderr)
        return 2, None
    enable_compilation_cache()
    try:
        summary = train(
            config,
            args.workdir,
            stop_at=args.stop_at,
            progress=not args.no_progress,
            adopt_checkpoints=args.adopt_checkpoints,
        )
    except NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1, None
    except TrainingInterrupted as e:
        command = shlex.join(["python", "-m", "train", *(sys.argv[1:] if argv is None else argv)])
        print(f"{e}. Resume with: {command}", file=sys.stderr)
        return EXIT_INTERRUPTED, None
    except (jax.errors.JaxRuntimeError, ValueError) as e:
        if jax.process_count() > 1 and distributed.is_runtime_failure(e):
            print(f"error: {distributed.lost_peer(e)}", file=sys.stderr, flush=True)
            os._exit(distributed.EXIT_PEER_LOST)  # what was saved is complete: nothing to flush
        if not isinstance(e, ValueError):
            raise
        # e.g. a workdir holding a run of another config: one line
        print(f"error: {e}", file=sys.stderr)
        return 2, None
    return 0, summary


if __name__ == "__main__":
    status = main()
    # Leave at once: every file is closed, and a Ctrl-C in the interpreter's teardown
    # (which restores the default handler) would end the process by the signal instead.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
