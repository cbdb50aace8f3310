"""Plugins: modules of one's own that add feature maps, layer kinds, presets and variants.

A plugin is any module that calls the registries' ``register_*`` functions when
imported (``docs/extending.md``). Every command line takes ``--plugin MODULE``
(repeatable): a module on ``sys.path`` (``my_variants``, which ``python -m``
finds in the current folder) or a ``.py`` file. Plugins are imported before
the config is read, so a config file and ``--model.pattern`` may use what they add.

A run records the plugins it needs in its ``config.json`` (``"plugins"``):
those loaded here with ``load``, and the modules that define the layer kinds
and feature maps its model uses (so a script that imported its plugin
directly is recorded too). ``train.load_run`` and ``train.compare``'s worker
processes import them again before they build anything. A plugin is recorded
as it was found: a module by its name (reading the run from another folder
needs its folder on ``PYTHONPATH``, as the error says), a file by its absolute
path (found from anywhere).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
from pathlib import Path

from attn.linear import FEATURE_MAPS
from models import KINDS

__all__ = ["FLAG_HELP", "from_argv", "load", "loaded", "needed", "split_flags"]

FLAG_HELP = (
    "--plugin MODULE (repeatable): import a module or .py file of one's own first, which "
    "may add layer kinds, presets, variants and feature maps (docs/extending.md)"
)

# What ``load`` imported in this process, in order (files as absolute paths).
_LOADED: list[str] = []
# Module name -> the file a plugin given as a path was imported from.
_FILES: dict[str, str] = {}


def _is_file(name: str) -> bool:
    return name.endswith(".py") or "/" in name or "\\" in name


def _import_file(name: str, field: str) -> str:
    path = Path(name).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"{field}: expected an importable module or a .py file, got {name!r}")
    module_name = path.stem
    old = sys.modules.get(module_name)
    if old is not None:
        if Path(getattr(old, "__file__", "") or "").resolve() == path:
            return str(path)
        raise ValueError(
            f"{field}: expected a file whose name is not an imported module's, got {name!r} "
            f"(module {module_name!r} is {getattr(old, '__file__', 'built in')})"
        )
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # so its classes pickle by name (spawned workers)
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[module_name]
        if isinstance(e, Exception) and not isinstance(e, ValueError):
            raise ValueError(_failed(name, e)) from None
        raise
    _FILES[module_name] = str(path)
    return str(path)


def _import(name: str, field: str) -> str:
    """Imports one plugin; returns how it is recorded (a module name or an absolute path)."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{field}: expected a module name or a .py file, got {name!r}")
    if _is_file(name):
        return _import_file(name, field)
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            raise ValueError(
                f"{field}: expected an importable module or a .py file, got {name!r} "
                f"(no module named {e.name!r} on the path; run from its folder or set PYTHONPATH)"
            ) from None
        raise ValueError(_failed(name, e)) from None  # the plugin imports something missing
    except ValueError:
        raise  # a registry's clash, already one line
    except Exception as e:
        raise ValueError(_failed(name, e)) from None
    return name


def _failed(name: str, e: Exception) -> str:
    """One line for a plugin whose import raised ``e``: the error and where, in the plugin."""
    if isinstance(e, SyntaxError):
        where = f"{e.filename}:{e.lineno}"
        what = f"SyntaxError: {e.msg}"
    else:
        frames = traceback.extract_tb(e.__traceback__)
        own = [f for f in frames if "importlib" not in f.filename] or frames
        where = f"{own[-1].filename}:{own[-1].lineno}" if own else "?"
        text = (str(e).strip().splitlines() or [""])[0]
        what = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return f"expected a plugin that imports, got {what} (at {where})"


def load(names, *, field: str = "--plugin") -> tuple[str, ...]:
    """Imports each plugin (a module name or a ``.py`` path) once; returns how each is recorded.

    Raises:
      ValueError: a plugin that cannot be found, or whose import fails (a
        syntax error, an exception: the error and where it was raised), in
        one line naming it, or one whose registrations clash with another's
        (the registry's message).
    """
    recorded = []
    for name in names:
        try:
            entry = _import(name, field)
        except ValueError as e:
            if str(e).startswith(field):
                raise
            raise ValueError(f"{field} {name!r}: {e}") from None
        if entry not in _LOADED:
            _LOADED.append(entry)
        recorded.append(entry)
    return tuple(recorded)


def split_flags(argv) -> tuple[list[str], list[str]]:
    """``(plugins, the other arguments)`` from ``--plugin X`` / ``--plugin=X`` in ``argv``.

    Raises:
      ValueError: a ``--plugin`` without a value.
    """
    names, rest, args = [], [], list(argv)
    while args:
        arg = args.pop(0)
        if arg == "--plugin":
            if not args or args[0].startswith("--"):
                raise ValueError("--plugin: expected a module name or a .py file, got nothing")
            names.append(args.pop(0))
        elif arg.startswith("--plugin="):
            names.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    return names, rest


def from_argv(argv) -> tuple[tuple[str, ...], list[str]]:
    """Loads the plugins of ``--plugin`` flags in ``argv``: ``(how each is recorded, the
    other arguments)``. Raises the ``ValueError`` of ``split_flags`` or ``load``."""
    names, rest = split_flags(argv)
    return load(names), rest


def loaded() -> tuple[str, ...]:
    """The plugins ``load`` imported in this process."""
    return tuple(_LOADED)


def _module_of(obj) -> str | None:
    """The plugin that defines ``obj`` (its module, or that module's file), or None if built in."""
    module = getattr(obj, "__module__", None)
    if module is None or module == "__main__" or module.split(".")[0] in ("attn", "models"):
        return None
    return _FILES.get(module, module)


def needed(model_config) -> tuple[str, ...]:
    """The plugins a run of ``model_config`` needs: ``loaded()`` and the modules defining
    its layer kinds, their config classes and its feature maps (built-ins excluded)."""
    found = list(loaded())
    for layer in (*model_config.layers, *model_config.encoder_layers):
        kind = KINDS[layer.kind]
        objs = [kind.module, kind.config_class]
        feature_map = getattr(layer, "feature_map", None)  # a linear kind's
        if feature_map in FEATURE_MAPS:
            objs.append(FEATURE_MAPS[feature_map])
        for obj in objs:
            module = _module_of(obj)
            if module is not None and module not in found:
                found.append(module)
    return tuple(found)
