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

from train import distributed  # noqa: E402
from train.cli import enable_compilation_cache, parse  # noqa: E402
from train.config import TrainConfig  # noqa: E402
from train.interrupt import TrainingInterrupted  # noqa: E402
from train.loop import NonFiniteLossError, train  # noqa: E402


def main(argv=None) -> int:
    """Entry point; returns the exit status."""
    try:
        config, args = parse(
            "python -m train",
            "Trains one run (resuming it if the workdir holds checkpoints) and prints its "
            "summary. Flags of this command: --config FILE (required), --workdir DIR "
            "(required), --stop-at N (stop after N updates, with a checkpoint), --data PATH "
            "(same as --task.data), --no-progress, --model.pattern NAME,NAME,... (the layers "
            "from preset names, one per layer, sized by the first layer's heads and head "
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
            ),
        )
    except ValueError as e:  # a bad config file, pattern or override: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.data is not None:
        config = dataclasses.replace(config, task=dataclasses.replace(config.task, data=args.data))
    if args.workdir is None:
        print("error: --workdir is required", file=sys.stderr)
        return 2
    try:  # before anything touches JAX's devices
        distributed.initialize()
    except ValueError as e:  # a malformed JAX_NUM_PROCESSES / JAX_PROCESS_ID
        print(f"error: {e}", file=sys.stderr)
        return 2
    enable_compilation_cache()
    try:
        summary = train(config, args.workdir, stop_at=args.stop_at, progress=not args.no_progress)
    except NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except TrainingInterrupted as e:
        command = shlex.join(["python", "-m", "train", *(sys.argv[1:] if argv is None else argv)])
        print(f"{e}. Resume with: {command}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ValueError as e:  # e.g. a workdir holding a run of another config: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    status = main()
    # Leave at once: every file is closed, and a Ctrl-C in the interpreter's teardown
    # (which restores the default handler) would end the process by the signal instead.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
