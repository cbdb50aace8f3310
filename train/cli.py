"""Shared command-line plumbing: a config file plus tyro overrides of any of its fields."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import inspect
import os
import platform
import sys
from pathlib import Path

import jax
import tyro

from models.config import AttentionConfig, ModelConfig
from models.patterns import CONV_SUFFIX, PRESET_REGISTRY, describe, pattern, presets, valid_in
from train import plugins
from train.config import TrainConfig

__all__ = [
    "compilation_cache_dir",
    "disable_compilation_cache",
    "enable_compilation_cache",
    "load_config",
    "machine_tag",
    "parse",
    "pattern_help",
    "pattern_presets",
    "with_pattern",
    "without_cache_flag",
]


def load_config(path: str | Path, **kwargs):
    """Imports a ``configs/*.py`` file by path and returns its ``get_config(**kwargs)``.

    Keyword arguments the file's ``get_config`` does not declare are dropped
    (e.g. ``quick`` for a config without quick settings), except ``scale``.

    Raises:
      ValueError: the file does not exist or defines no ``get_config``, or it takes
        no ``scale`` and one was given.
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
    if "scale" in kwargs and "scale" not in accepted:  # dropping it would train another size
        raise ValueError(f"--scale: {str(path)!r} has one scale (its get_config takes no scale)")
    return module.get_config(**{k: v for k, v in kwargs.items() if k in accepted})


def parse(
    prog: str,
    description: str,
    argv,
    *,
    default_config: str | None,
    default_type=None,
    extra=(),
    config_kwargs=None,
    layer_flags: bool = False,
):
    """Parses ``[--plugin MODULE ...] --config FILE [own flags] [field overrides]``.

    Plugins (``train.plugins``) are imported first, so the config file and the
    flags may use what they register. The config file's dataclass is the
    default of ``tyro.cli``, so any field can be overridden (``--model.width
    128``, ``--optim.lr 3e-3``, ``--steps 500``).
    ``--help`` lists every field with its current value (the file's, or
    ``default_type()``'s without ``--config``).

    Args:
      prog: the program name for messages.
      description: the help text.
      argv: the arguments (default ``sys.argv[1:]``).
      default_config: the config file used when ``--config`` is absent, or None
        to require it.
      default_type: the config class whose defaults ``--help`` shows when
        ``--config`` is required and absent.
      extra: ``(flags, kwargs)`` pairs of additional ``argparse`` options.
      config_kwargs: keyword arguments for the file's ``get_config``.
      layer_flags: accept ``--model.pattern NAME,...`` and ``--model.depth L``
        (see ``with_pattern``); they apply before the field overrides, so
        ``--model.layers.I.FIELD`` then refers to the new layers. ``--help``
        lists the presets with their sizes.

    Returns:
      ``(config, namespace of the extra options)``.

    Raises:
      ValueError: a bad plugin, config file, layer pattern or vocabulary override.
    """
    _, argv = plugins.from_argv(sys.argv[1:] if argv is None else argv)
    argv = without_cache_flag(argv)
    description += f" {plugins.FLAG_HELP}. {CACHE_FLAG_HELP}."
    parser = argparse.ArgumentParser(prog=prog, description=description, add_help=False)
    parser.add_argument("--config", default=default_config)
    for flags, kwargs in extra:
        parser.add_argument(*flags, **kwargs)
    if layer_flags:
        parser.add_argument("--model.pattern", dest="pattern", default=None)
        parser.add_argument("--model.depth", dest="depth", type=int, default=None)
    args, rest = parser.parse_known_args(argv)
    helping = "-h" in rest or "--help" in rest
    if args.config is None:
        if not (helping and default_type is not None):
            raise ValueError(
                f"--config: expected a Python file with get_config(), got none "
                f"(usage: {prog} --config FILE ...)"
            )
        config, shown = default_type(), f"{prog} --config FILE"
        description += (
            f" Defaults shown are {default_type.__name__}()'s; --config FILE sets its own."
        )
    else:
        config, shown = (
            load_config(args.config, **(config_kwargs or {})),
            f"{prog} --config {args.config}",
        )
    config = _check_vocab(config, config)  # the help shows the vocabulary a run uses
    if layer_flags:
        description += " " + pattern_help(config.model)
    if layer_flags and (args.pattern is not None or args.depth is not None):
        config = dataclasses.replace(
            config, model=with_pattern(config.model, args.pattern, args.depth)
        )
    overridden = tyro.cli(
        type(config),
        default=config,
        args=rest,
        prog=shown,
        description=description,
        # An optional nested config (a cross-attention config or None) would become a
        # positional subcommand; it keeps the file's value instead.
        config=(tyro.conf.AvoidSubcommands,),
    )
    return _check_vocab(config, overridden), args


def pattern_presets(model: ModelConfig) -> dict[str, AttentionConfig]:
    """The presets ``--model.pattern`` offers for ``model``'s decoder, at their sizes.

    Sized by the model's first layer (its heads and head dim; half as many kv
    heads for ``gqa``) and the other ``PresetSizes`` defaults; only presets a
    decoder can hold (causal ones: no ``band``).
    """
    first = model.layers[0]
    sized = presets(
        num_heads=first.num_heads,
        head_dim=first.head_dim,
        gqa_kv_heads=first.num_heads // 2 if first.num_heads % 2 == 0 else 1,
    )
    built = sized.buildable()  # e.g. no gqa when the kv heads cannot divide the heads
    return {name: layer for name, layer in built.items() if valid_in(layer, causal=True)}


def pattern_help(model: ModelConfig) -> str:
    """``--help``'s list of the presets of ``pattern_presets(model)``, each with its sizes."""
    offered = pattern_presets(model)
    shown = "; ".join(
        f"{name} ({describe(layer)})" for name, layer in offered.items() if name in PRESET_REGISTRY
    )
    return (
        f"Presets of --model.pattern here: {shown}. Each name{CONV_SUFFIX} is the same "
        "with a short convolution; set other sizes with --model.layers.I.FIELD."
    )


def with_pattern(model: ModelConfig, names: str | None, depth: int | None) -> ModelConfig:
    """``model`` with layers from preset names and/or repeated to ``depth`` layers.

    Args:
      model: the model config; its first layer's heads and head dim size the
        presets (``pattern_presets``).
      names: comma-separated preset names, one per layer, e.g.
        ``"gqa,streaming,linear"``; None keeps the layers.
      depth: L; the pattern repeats (or is cut) to L layers. None: one per name.

    Raises:
      ValueError: an unknown name, a preset a decoder cannot hold (naming it)
        or a depth < 1, naming the flag.
    """
    layers = model.layers
    if names is not None:
        offered = pattern_presets(model)
        parts = [n.strip() for n in names.split(",") if n.strip()]
        valid = sorted(offered)
        for name in parts:
            if name not in offered and name in presets():
                raise ValueError(
                    f"--model.pattern: expected presets a decoder can hold, got {name!r}, "
                    f"a bidirectional (encoder) layer ({describe(presets()[name])}); "
                    f"valid here: {valid}"
                )
        unknown = [n for n in parts if n not in offered]
        if not parts or unknown:
            raise ValueError(
                f"--model.pattern: expected comma-separated names from {valid}, got {names!r}"
            )
        layers = pattern(parts, offered)
    if depth is not None:
        if depth < 1:
            raise ValueError(f"--model.depth: expected an int >= 1, got {depth}")
        layers = tuple(layers[i % len(layers)] for i in range(depth))
    return dataclasses.replace(model, layers=layers)


def _check_vocab(before, after):
    """Rejects a model vocabulary that differs from the task's; sets it where implied.

    A run's model always uses its task's vocabulary, so ``--model.vocab-size``
    can only repeat it; any other value is refused rather than ignored.
    """
    for path in ("", "train"):
        old, new = (getattr(c, path) if path else c for c in (before, after))
        if not isinstance(new, TrainConfig):
            continue
        flag = f"--{path + '.' if path else ''}model.vocab-size"
        if new.model.vocab_size != old.model.vocab_size and new.model.vocab_size != new.task.vocab:
            raise ValueError(
                f"{flag}: expected the task's vocabulary {new.task.vocab} (the model always "
                f"uses it; set --{path + '.' if path else ''}task.vocab-size instead), "
                f"got {new.model.vocab_size}"
            )
        fixed = new.with_task_vocab()
        return dataclasses.replace(after, train=fixed) if path else fixed
    return after


def machine_tag(cpuinfo: str | None = None) -> str:
    """A short hash of this CPU's model and instruction-set flags (a cache folder's name).

    XLA:CPU compiles for the host's features; a program built on a machine with
    other features may not run here (SIGILL), and JAX's cache key does not
    include them, so each machine gets its own folder.

    Args:
      cpuinfo: the text of ``/proc/cpuinfo``; None reads it (absent off Linux).
    """
    facts = [platform.machine(), platform.processor()]
    try:
        text = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
        for line in text.splitlines():
            key = line.split(":", 1)[0].strip()
            if key in ("model name", "flags", "Features", "CPU part"):
                facts.append(line)
                if key in ("flags", "Features"):
                    break  # the first processor's list: every core has the same
    except OSError:  # not Linux: the platform's names only
        pass
    return hashlib.sha256("\n".join(facts).encode()).hexdigest()[:12]


def compilation_cache_dir() -> Path:
    """Where compiled programs persist: ``$JAX_COMPILATION_CACHE_DIR`` (else
    ``~/.cache/attnlab/jax``), in a subfolder per CPU (``machine_tag``)."""
    base = os.environ.get("JAX_COMPILATION_CACHE_DIR") or Path.home() / ".cache" / "attnlab" / "jax"
    tag = f"cpu-{machine_tag()}"
    return Path(base) if Path(base).name == tag else Path(base) / tag


# The commands' flag that turns the persistent cache off, and the variable that carries
# it to the processes they start (a comparison's workers, an experiment's runs).
NO_CACHE_FLAG = "--no-compilation-cache"
NO_CACHE_VAR = "ATTNLAB_NO_COMPILATION_CACHE"
CACHE_FLAG_HELP = (
    f"{NO_CACHE_FLAG}: compile afresh, without the persistent compilation cache "
    "(~/.cache/attnlab/jax, or $JAX_COMPILATION_CACHE_DIR)"
)


def disable_compilation_cache() -> None:
    """Turns ``enable_compilation_cache`` off for this process and those it starts."""
    os.environ[NO_CACHE_VAR] = "1"


def without_cache_flag(argv: list[str]) -> list[str]:
    """``argv`` less ``--no-compilation-cache``; given, it calls ``disable_compilation_cache``."""
    if NO_CACHE_FLAG in argv:
        disable_compilation_cache()
    return [a for a in argv if a != NO_CACHE_FLAG]


def enable_compilation_cache() -> bool:
    """Persists compiled programs across processes and runs, unless turned off
    (``--no-compilation-cache``, or ``ATTNLAB_NO_COMPILATION_CACHE=1``); returns whether it did.

    Runs that differ only in data (learning rate, seed: the learning rate lives in
    the optimizer state) compile to the same program, so a sweep compiles each
    architecture once, and a resumed run does not compile again. The cache is
    ``compilation_cache_dir()``: one folder per CPU, so a folder shared between
    machines (a network home) never hands one the programs of another.

    On some CPUs every program loaded from the cache logs ``cpu_aot_loader.cc
    ... Target machine feature +prefer-no-gather is not supported on the host
    machine``: a false alarm of XLA (openxla/xla#44565; the check counts LLVM's
    tuning hints as CPU features), harmless with the folder per CPU; see the README.
    """
    if os.environ.get(NO_CACHE_VAR, "") not in ("", "0"):
        return False
    jax.config.update("jax_compilation_cache_dir", str(compilation_cache_dir()))
    # Small models compile in about a second; those are worth caching too.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    return True
