"""Training: recall tasks and corpora, the loop with exact resume, and the variant comparison.

- ``train.tasks``: deterministic NumPy batches (MQAR, induction, selective copying, bytes).
- ``train.config``: the frozen ``TrainConfig`` a ``configs/*.py`` file returns.
- ``train.loop``: ``train(config, workdir)``: AdamW, ``nnx.jit`` steps, evaluation,
  orbax checkpoints and exact resume, ``metrics.jsonl``.
- ``train.run``: ``load_run(workdir, step=None) -> (model, config)``, a trained run
  rebuilt from its own record, for analysis (in a folder of runs, ``variant=``, ``lr=``
  and ``seed=`` pick one: ``find_run``), and ``run_batch(config, split)``, its batches.
- ``train.plugins``: ``--plugin MODULE`` (modules of one's own that register layer
  kinds, presets, variants and feature maps; recorded with each run).
- ``train.variants``: the comparison's variants (``register_variant`` adds one).
- ``train.compare``: the main job, every variant on the same task and budget.

Command lines: ``python -m train --config configs/mqar.py --workdir runs/x`` and
``python -m train.compare``.
"""

__all__ = ["find_run", "load_run", "run_batch"]


def __getattr__(name: str):
    # Lazily, so that ``python -m train`` can set up its Ctrl-C handling
    # (``train.interrupt``) before JAX is imported.
    if name in __all__:
        from train import run

        return getattr(run, name)
    raise AttributeError(f"module 'train' has no attribute {name!r}")
