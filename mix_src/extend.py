"""One small registry class behind every extension point of mix_src, and plugin loading.

Each extension point is a :class:`Registry` defined (with its call signature) in the module that uses it; the
table of them, their decorators and the keys that pick them is mix_src/README.md ("Extending mix_src"), plus
``algo.row_loss.SFT_AGGS`` (``mix.loss.sft_loss_agg``) and ``rollout.environments.register_environment`` (a
row's data_source). Every entry describes itself (:class:`Entry`: trainer bases and why not the others, its
:class:`Setting` s, its own checks, the keys it reads); :func:`check_selected_entries` checks the selected ones
before Ray starts, so no caller special-cases a name:

    @REG.register("mine", bases=("legacy",), why_not={"v1": "needs a second generation pass"},
                  settings={"k": integer(3, 1)}, check=lambda cfg: ..., reads=("mix.my_key",))

Plugins (``mix.plugins``): loaded on the driver and, through ``MIX_PLUGINS``, in every Ray process (mix_src/README.md).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterator, Mapping, Optional, TypeVar

BASES = ("legacy", "v1")  # the trainer bases: MIXRayPPOTrainer, and verl's V1 trainer (trainer.use_v1=true)

PLUGINS_ENV = "MIX_PLUGINS"  # comma-separated module names / absolute .py paths, exported to Ray workers
F = TypeVar("F", bound=Callable)
_LOADED: dict[str, str] = {}  # plugin spec -> module name
_REGISTRIES: list["Registry"] = []  # every Registry made, in creation order (check_selected_entries walks them)


class EntryConfigError(ValueError):
    """A registry entry refuses the config (unsupported trainer base, a bad setting, or its own check failed)."""


@dataclass(frozen=True)
class Setting:
    """One declared setting: ``default``; ``ok(value) -> bool``; ``want``, a good value in words (the error's text);
    ``nullable``: null is good too."""

    default: Any
    ok: Callable[[Any], bool] = lambda v: True
    want: str = "any value"
    nullable: bool = False


def number(default: Any, lo: float = float("-inf"), hi: float = float("inf"), nullable: bool = False) -> Setting:
    ok = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi  # noqa: E731
    return Setting(default, ok, f"a number in [{lo}, {hi}]", nullable)


def integer(default: Any, lo: float = float("-inf"), hi: float = float("inf"), nullable: bool = False) -> Setting:
    ok = lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi  # noqa: E731
    return Setting(default, ok, f"an integer in [{lo}, {hi}]", nullable)


def flag(default: bool) -> Setting:
    return Setting(default, lambda v: isinstance(v, bool), "true or false")


def one_of(default: Any, *values: Any) -> Setting:
    return Setting(default, lambda v: v in values, f"one of {list(values)}")


@dataclass(frozen=True)
class Entry:
    """What a registry entry says of itself: ``bases`` it supports and ``why_not`` for every other (the refusal's
    text); ``settings`` taken from ``mix.plugin_options.<name>`` (checked by :func:`resolve_settings`);
    ``check(config)``, its own checks on the whole composed config, raising :class:`EntryConfigError` (or any
    ValueError) naming the key and value; ``reads``, the dotted config keys it reads; ``options``, fixed traits
    documented by the registry that owns it."""

    name: str
    fn: Callable
    bases: tuple[str, ...] = BASES
    why_not: Mapping[str, str] = field(default_factory=dict)
    check: Optional[Callable[[Any], None]] = None
    reads: tuple[str, ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)
    settings: Mapping[str, Setting] = field(default_factory=dict)


class Registry(Generic[F]):
    """Name -> function. ``kind`` names the extension point in errors; ``config_key`` the key that picks from it;
    ``selected(config)``, the names the config picks (default: the value at ``config_key``, if set), which
    :func:`check_selected_entries` checks; ``old_settings``, an older spelling of the entries' settings ({setting: key}
    or {"*": key of a mapping}). Iterating yields the registered names (built-ins first, then plugins, in order)."""

    def __init__(self, kind: str, config_key: str, selected: Optional[Callable[[Any], list[str]]] = None,
                 old_settings: Optional[Mapping[str, str]] = None):
        self.kind, self.config_key = kind, config_key
        self._selected = selected
        self.old_settings = dict(old_settings or {})
        self._entries: dict[str, Entry] = {}
        _REGISTRIES.append(self)

    def register(self, name: str, *, bases: tuple[str, ...] = BASES, why_not: Optional[Mapping[str, str]] = None,
                 check: Optional[Callable[[Any], None]] = None, reads: tuple[str, ...] = (),
                 settings: Optional[Mapping[str, Setting]] = None, **options) -> Callable[[F], F]:
        """Decorator: add the function under ``name`` with its :class:`Entry` (``options``: see the registry's own
        documentation). Every base left out of ``bases`` needs its reason in ``why_not``. A name registered twice
        is an error, unless it is the same function again (a module imported twice)."""
        bases, why_not = tuple(bases), dict(why_not or {})
        unknown = [b for b in (*bases, *why_not) if b not in BASES]
        if unknown:
            raise ValueError(f"{self.kind} {name!r}: unknown trainer base(s) {unknown}; the bases are {list(BASES)}")
        missing = [b for b in BASES if b not in bases and not why_not.get(b)]
        if missing:
            raise ValueError(f"{self.kind} {name!r} does not support base(s) {missing}: say why in why_not={{base: reason}}")

        def deco(fn: F) -> F:
            old = self._entries.get(name)
            if old is not None and _qualname(old.fn) != _qualname(fn):
                raise ValueError(f"{self.kind} {name!r} is already registered (by {_qualname(old.fn)})")
            self._entries[name] = Entry(name, fn, bases, why_not, check, tuple(reads), dict(options), dict(settings or {}))
            return fn

        return deco

    def describe(self, name: str) -> Entry:
        """The entry registered as ``name`` (plugins in ``MIX_PLUGINS`` are imported first)."""
        if name not in self:
            raise KeyError(self.unknown(name))
        return self._entries[name]

    def selected(self, config: Any) -> list[str]:
        """The names ``config`` picks from this registry."""
        if self._selected is not None:
            return [str(n) for n in self._selected(config)]
        from omegaconf import OmegaConf

        value = OmegaConf.select(config, self.config_key, default=None)
        return [] if value is None else [str(value)]

    def get(self, name: str) -> F:
        """The function registered as ``name`` (plugins in ``MIX_PLUGINS`` are imported first)."""
        return self.describe(name).fn

    def options(self, name: str) -> dict:
        return dict(self.describe(name).options)

    def settings(self, name: str, given: Optional[Mapping] = None) -> dict:
        """The entry's settings: its declared defaults, overridden by ``given`` (checked on the driver already)."""
        declared = self.describe(name).settings
        return {**{k: s.default for k, s in declared.items()}, **dict(given or {})}

    def unknown(self, name: str) -> str:
        """The error text for an unknown name: the key, the value and every registered name."""
        return (f"{self.config_key}={name!r} is not a registered {self.kind}; registered: {', '.join(self.names())} "
                f"(a plugin adds one: see mix_src/extend.py and mix.plugins)")

    def names(self) -> list[str]:
        load_plugins_from_env()
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        if name not in self._entries:
            load_plugins_from_env()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def trainer_base(config: Any) -> str:
    """``"v1"`` with ``trainer.use_v1=true``, else ``"legacy"``."""
    trainer = config.get("trainer") or {}
    return "v1" if bool(trainer.get("use_v1", False)) else "legacy"


def _selected_entries(config: Any) -> Iterator[tuple[Registry, Entry]]:
    """Each registry's entries the config selects; a name no registry knows is left to the caller's own error
    (e.g. verl's estimators are not in ours)."""
    for registry in list(_REGISTRIES):
        for name in registry.selected(config):
            if name in registry._entries:
                yield registry, registry._entries[name]


def check_selected_entries(config: Any) -> None:
    """Before Ray: each selected entry must support this trainer base and pass its ``check`` (else EntryConfigError)."""
    load_plugins_from_env()
    base = trainer_base(config)
    resolve_settings(config)
    for registry, entry in _selected_entries(config):
        if base not in entry.bases:
            raise EntryConfigError(f"{registry.config_key}={entry.name!r} is not supported on the {base!r} trainer "
                                   f"base (trainer.use_v1={str(base == 'v1').lower()}): {entry.why_not[base]}")
        if entry.check is not None:
            try:
                entry.check(config)
            except EntryConfigError:
                raise
            except ValueError as e:
                raise EntryConfigError(f"{registry.config_key}={entry.name!r}: {e}") from e


def resolve_settings(config: Any) -> None:
    """The one check of every selected entry's settings (``mix.plugin_options.<name>`` and the registry's older
    spelling) against its declaration, naming the key as written; the full settings (defaults filled in) are
    written back to both, so every process reads checked values."""
    from omegaconf import OmegaConf, open_dict

    for registry, entry in _selected_entries(config):
        name, declared = entry.name, entry.settings
        given, where = _given_settings(config, registry, name)
        unknown = sorted(set(given) - set(declared))
        if unknown:
            raise EntryConfigError(f"{registry.config_key}={name!r}: unknown key(s) {[where[k] for k in unknown]}; "
                                   f"valid: {sorted(declared)}")  # fmt: skip
        for key, value in given.items():
            s = declared[key]
            if not ((value is None and s.nullable) or s.ok(value)):
                raise EntryConfigError(f"{where[key]}={value!r} must be {s.want}{' or null' if s.nullable else ''}")
        if not declared:
            continue
        full = registry.settings(name, given)
        with open_dict(config):
            OmegaConf.update(config, f"mix.plugin_options.{name}", full, merge=False, force_add=True)
            for key, old in registry.old_settings.items():
                OmegaConf.update(config, old, full if key == "*" else full[key], merge=False, force_add=True)


def _given_settings(config: Any, registry: "Registry", name: str) -> tuple[dict, dict]:
    """The settings the config gives entry ``name`` -> (values, the key each was given under). A setting given
    in both spellings must agree; an older single-value spelling left null is not given."""
    from omegaconf import OmegaConf

    def plain(key):
        value = OmegaConf.select(config, key, default=None)
        return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value

    channel = f"mix.plugin_options.{name}"
    sources = [(channel, plain(channel) or {}, None)]  # (key, its value, the one setting it spells or None)
    for key, old in registry.old_settings.items():
        value = plain(old)
        if key == "*":
            sources.append((old, value or {}, None))
        elif value is not None:
            sources.append((old, {key: value}, key))
    values, where = {}, {}
    for source, given, single in sources:
        if not isinstance(given, Mapping):
            raise EntryConfigError(f"{source}={given!r} must be a mapping {{setting: value}} (the settings of {name!r})")
        for key, value in given.items():
            if key in values and values[key] != value:
                raise EntryConfigError(f"{where[key]}={values[key]!r} and {source}={value!r} disagree; set it once, "
                                       f"in {channel}.{key}")  # fmt: skip
            values[key] = value
            where.setdefault(key, source if single else f"{source}.{key}")
    return values, where


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _is_path(spec: str) -> bool:
    return spec.endswith(".py") or os.sep in spec or "/" in spec


def resolve_plugin(spec: str) -> str:
    """A plugin spec as exported to other processes: module names unchanged, paths made absolute."""
    spec = str(spec).strip()
    return os.path.abspath(os.path.expanduser(spec)) if _is_path(spec) else spec


def load_plugins(specs) -> list[str]:
    """Import each plugin (module name or .py path) once; return the module names. Errors name the spec."""
    names = []
    for raw in specs or []:
        spec = resolve_plugin(raw)
        if spec not in _LOADED and _is_path(spec):
            if not os.path.isfile(spec):
                raise FileNotFoundError(f"mix.plugins: plugin file '{raw}' does not exist (resolved to {spec})")
            # a module name the same in every process (pickled functions of the plugin refer to it)
            stem = "".join(c if c.isalnum() else "_" for c in os.path.splitext(os.path.basename(spec))[0])
            name = f"mix_plugin_{stem}_{hashlib.sha1(spec.encode()).hexdigest()[:8]}"
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
        elif spec not in _LOADED:
            try:
                _LOADED[spec] = importlib.import_module(spec).__name__
            except ModuleNotFoundError as err:
                if err.name and spec.startswith(err.name):
                    raise ModuleNotFoundError(f"mix.plugins: cannot import plugin module '{spec}' ({err}); give an "
                                              "importable module name or a path to a .py file") from err
                raise
        names.append(_LOADED[spec])
    return names


class PluginImportError(ImportError):
    """A ``verl.plugins`` entry point failed to import; the message names it."""


def load_verl_plugins() -> list[str]:
    """Import the ``verl.plugins`` entry points verl's own loader imports (``verl/__init__.py``, same
    ``VERL_USE_EXTERNAL_PLUGINS`` policy), raising :class:`PluginImportError` naming the first that fails (verl
    logs it at DEBUG and runs on without it, e.g. without the CPU backend). Runs on the driver and, through
    :mod:`mix_src.plugins`, in every Ray process. Returns the entry-point names loaded."""
    from importlib.metadata import entry_points

    policy = os.getenv("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower()
    if policy == "none":
        return []
    allowed = None if policy == "auto" else {n.strip() for n in policy.split(",") if n.strip()}
    loaded = []
    for ep in entry_points(group="verl.plugins"):
        if allowed is not None and ep.name not in allowed:
            continue
        try:
            ep.load()
        except Exception as e:
            dist = getattr(getattr(ep, "dist", None), "name", "?")
            raise PluginImportError(f"verl plugin {ep.name!r} (entry point {ep.value!r} of {dist}) failed to import in "
                                    f"process {os.getpid()}: {type(e).__name__}: {e}. verl's own loader would log this "
                                    "at DEBUG only and run without the plugin; fix it, or leave it out with "
                                    "VERL_USE_EXTERNAL_PLUGINS=<the others>") from e
        loaded.append(ep.name)
    return loaded


def load_plugins_from_env() -> list[str]:
    """Import the plugins listed in ``MIX_PLUGINS`` (set by the entry point for every Ray process)."""
    return load_plugins([s for s in os.environ.get(PLUGINS_ENV, "").split(",") if s.strip()])
