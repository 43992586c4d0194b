"""One small registry class behind every extension point of mix_src, and plugin loading.

Each extension point is a :class:`Registry` defined (and its call signature documented) in the module
that uses it:

    prefix strategies     mix_src.prefix.register_prefix_strategy          (mix.prefix_strategy)
    off-policy reshapes   mix_src.core_alg.register_off_policy_reshape     (mix.loss.off_policy_reshape)
    on-policy reshapes    mix_src.core_alg.register_on_policy_reshape      (mix.loss.on_policy_reshape)
    advantage estimators  mix_src.adv_estimators.register_adv_estimator    (algorithm.adv_estimator)
    group filters         mix_src.filter_groups.register_group_filter      (mix.filter_groups.rule)
    rollout policies      mix_src.rollout_policy.register_rollout_policy   (mix.rollout_policy)

A plugin is a Python module or a ``.py`` file that registers with these decorators (or verl's own,
e.g. ``register_policy_loss``); ``mix.plugins=[my_pkg.my_mod, /abs/or/relative/plugin.py]`` loads it.
The entry point imports the plugins on the driver before the config is validated and exports them in
``MIX_PLUGINS`` (absolute paths) to every Ray process; there :mod:`mix_src.plugins`, imported by
verl's ``VERL_USE_EXTERNAL_MODULES`` hook at ``import verl`` (verl/__init__.py), imports them again, and
every registry lookup re-checks ``MIX_PLUGINS`` first, so nothing is looked up before the plugins are in.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Callable, Generic, Iterator, TypeVar

__all__ = ["PLUGINS_ENV", "Registry", "load_plugins", "load_plugins_from_env"]

PLUGINS_ENV = "MIX_PLUGINS"  # comma-separated module names / absolute .py paths, exported to Ray workers
F = TypeVar("F", bound=Callable)
_LOADED: dict[str, str] = {}  # plugin spec -> module name


class Registry(Generic[F]):
    """Name -> function. ``kind`` names the extension point in errors; ``config_key`` the key that picks
    from it. Iterating yields the registered names (built-ins first, then plugins, in order)."""

    def __init__(self, kind: str, config_key: str):
        self.kind, self.config_key = kind, config_key
        self._entries: dict[str, F] = {}
        self._options: dict[str, dict] = {}

    def register(self, name: str, **options) -> Callable[[F], F]:
        """Decorator: ``@REG.register("name")`` adds the function under ``name``; ``options`` are stored
        with it (see the registry's own documentation). A name registered twice is an error, unless it
        is the same function again (a module imported twice)."""

        def deco(fn: F) -> F:
            old = self._entries.get(name)
            if old is not None and _qualname(old) != _qualname(fn):
                raise ValueError(f"{self.kind} {name!r} is already registered (by {_qualname(old)})")
            self._entries[name] = fn
            self._options[name] = dict(options)
            return fn

        return deco

    def get(self, name: str) -> F:
        """The function registered as ``name`` (plugins in ``MIX_PLUGINS`` are imported first)."""
        if name not in self._entries:
            load_plugins_from_env()
        if name not in self._entries:
            raise KeyError(self.unknown(name))
        return self._entries[name]

    def options(self, name: str) -> dict:
        self.get(name)
        return self._options[name]

    def unknown(self, name: str) -> str:
        """The error text for an unknown name: the key, the value and every registered name."""
        return (
            f"{self.config_key}={name!r} is not a registered {self.kind}; registered: {', '.join(self.names())} "
            f"(a plugin adds one: see mix_src/registry.py and mix.plugins)"
        )

    def names(self) -> list[str]:
        load_plugins_from_env()
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        if name not in self._entries:
            load_plugins_from_env()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _is_path(spec: str) -> bool:
    return spec.endswith(".py") or os.sep in spec or "/" in spec


def resolve_plugin(spec: str) -> str:
    """A plugin spec as exported to other processes: module names unchanged, paths made absolute."""
    spec = str(spec).strip()
    return os.path.abspath(os.path.expanduser(spec)) if _is_path(spec) else spec


def _module_name(path: str) -> str:
    """A stable module name for a plugin file, the same in every process (pickled functions defined in
    the plugin refer to it)."""
    stem = os.path.splitext(os.path.basename(path))[0]
    safe = "".join(c if c.isalnum() else "_" for c in stem)
    return f"mix_plugin_{safe}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"


def load_plugins(specs) -> list[str]:
    """Import each plugin (module name or .py path) once; return the module names. Errors name the spec."""
    names = []
    for raw in specs or []:
        spec = resolve_plugin(raw)
        if spec in _LOADED:
            names.append(_LOADED[spec])
            continue
        if _is_path(spec):
            if not os.path.isfile(spec):
                raise FileNotFoundError(f"mix.plugins: plugin file '{raw}' does not exist (resolved to {spec})")
            name = _module_name(spec)
            module_spec = importlib.util.spec_from_file_location(name, spec)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            _LOADED[spec] = name  # before executing it: a lookup from inside the plugin must not re-import it
            try:
                module_spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(name, None)
                _LOADED.pop(spec, None)
                raise
        else:
            try:
                name = importlib.import_module(spec).__name__
            except ModuleNotFoundError as err:
                if err.name and spec.startswith(err.name):
                    raise ModuleNotFoundError(
                        f"mix.plugins: cannot import plugin module '{spec}' ({err}); give an importable module "
                        "name or a path to a .py file"
                    ) from err
                raise
        _LOADED[spec] = name
        names.append(name)
    return names


def load_plugins_from_env() -> list[str]:
    """Import the plugins listed in ``MIX_PLUGINS`` (set by the entry point for every Ray process)."""
    value = os.environ.get(PLUGINS_ENV, "")
    specs = [s for s in value.split(",") if s.strip()]
    return load_plugins(specs) if specs else []
