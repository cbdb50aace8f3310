"""Shared command-line plumbing: a config file plus tyro overrides of any of its fields."""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import sys
from pathlib import Path

import jax
import tyro

__all__ = ["enable_compilation_cache", "load_config", "parse"]


def load_config(path: str | Path, **kwargs):
    """Imports a ``configs/*.py`` file by path and returns its ``get_config(**kwargs)``.

    Keyword arguments the file's ``get_config`` does not declare are dropped
    (e.g. ``quick`` for a config without quick settings).

    Raises:
      ValueError: the file does not exist or defines no ``get_config``.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--config: expected a Python file with get_config(), got {str(path)!r}")
    spec = importlib.util.spec_from_file_location(f"_attnlab_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "get_config", None)):
        raise ValueError(f"--config: {str(path)!r} defines no get_config()")
    accepted = inspect.signature(module.get_config).parameters
    return module.get_config(**{k: v for k, v in kwargs.items() if k in accepted})


def parse(
    prog: str,
    description: str,
    argv,
    *,
    default_config: str | None,
    extra=(),
    config_kwargs=None,
):
    """Parses ``--config FILE [own flags] [field overrides]``.

    The config file's dataclass is the default of ``tyro.cli``, so any field can
    be overridden (``--model.width 128``, ``--optim.lr 3e-3``, ``--steps 500``).
    ``--help`` after ``--config`` lists every field with its current value.

    Args:
      prog: the program name for messages.
      description: the help text.
      argv: the arguments (default ``sys.argv[1:]``).
      default_config: the config file used when ``--config`` is absent, or None
        to require it.
      extra: ``(flags, kwargs)`` pairs of additional ``argparse`` options.
      config_kwargs: keyword arguments for the file's ``get_config``.

    Returns:
      ``(config, namespace of the extra options)``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=prog, description=description, add_help=False)
    parser.add_argument("--config", default=default_config, required=default_config is None)
    for flags, kwargs in extra:
        parser.add_argument(*flags, **kwargs)
    if argv in (["-h"], ["--help"]) and default_config is None:
        parser.print_help()
        raise SystemExit(0)
    args, rest = parser.parse_known_args(argv)
    config = load_config(args.config, **(config_kwargs or {}))
    config = tyro.cli(
        type(config),
        default=config,
        args=rest,
        prog=f"{prog} --config {args.config}",
        description=description,
    )
    return config, args


def enable_compilation_cache() -> None:
    """Persists compiled programs across processes and runs.

    Runs that differ only in data (learning rate, seed: the learning rate lives in
    the optimizer state) compile to the same program, so a sweep compiles each
    architecture once, and a resumed run does not compile again. Uses
    ``$JAX_COMPILATION_CACHE_DIR`` if set, else ``~/.cache/attnlab/jax``.
    """
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update(
            "jax_compilation_cache_dir", str(Path.home() / ".cache" / "attnlab" / "jax")
        )
    # Small models compile in about a second; those are worth caching too.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
