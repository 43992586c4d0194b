"""Hydra compositions for the tests, the YAML read and merged once per session for each choice of config groups.

``compose(config_name, overrides, config_module=... | config_dir=...)`` returns what Hydra's ``compose`` returns in
``initialize_config_module`` / ``initialize_config_dir`` (hydra-core 1.3), by Hydra's own two steps: Hydra splits the
overrides into config-group choices and value overrides (``hydra/_internal/defaults_list.py`` ``Overrides``, lines
61-110), composes the defaults list that the choices select, then applies the value overrides in order
(``hydra/_internal/config_loader_impl.py`` ``_load_configuration_impl``, lines 253-276, with
``_apply_overrides_to_config``). The first step, reading and merging the YAML files (about 0.9 s of CPU a
composition on the 2-core CPU machine), depends only on the source, the config name and the group choices: it is
cached here (the group choices and any ``hydra.*`` override form the key), and each call gets a deep copy
(0.05 s) with its value overrides applied by the same Hydra function. ``tests/test_composed.py`` checks the result
against Hydra's compose. ``scripts/probe_bad_inputs.py``'s ``Composer`` does the same for one fixed base.

A config file edited during the session is not re-read: tests that write configs write them to fresh paths.
"""

from __future__ import annotations

import copy
import functools
from typing import Optional, Sequence


def _session(config_module: Optional[str], config_dir: Optional[str]):
    """Hydra's initialisation for the source (exactly one of the two)."""
    from hydra import initialize_config_dir, initialize_config_module

    if (config_module is None) == (config_dir is None):
        raise TypeError("compose: give exactly one of config_module and config_dir")
    if config_module is not None:
        return initialize_config_module(config_module=config_module, version_base=None)
    return initialize_config_dir(config_dir=str(config_dir), version_base=None)


def split(config_name: str, overrides: Sequence[str]) -> tuple[list[str], list]:
    """(the overrides that choose config groups or set ``hydra.*``, as written; the value overrides, parsed), split as
    Hydra splits them (``Overrides``: a group override is one whose key is a config group of the search path and whose
    value is not a dict). Call inside Hydra's initialisation."""
    from hydra._internal.defaults_list import Overrides
    from hydra.core.global_hydra import GlobalHydra

    loader = GlobalHydra.instance().config_loader()
    parsed, repo = loader._parse_overrides_and_create_caching_repo(config_name, list(overrides))
    values = {id(o) for o in Overrides(repo, parsed).config_overrides if not o.is_hydra_override()}
    return [o.input_line for o in parsed if id(o) not in values], [o for o in parsed if id(o) in values]


@functools.lru_cache(maxsize=None)
def _base(config_module: Optional[str], config_dir: Optional[str], config_name: str, groups: tuple[str, ...]):
    """Hydra's compose with the group choices only (read-only use: callers get a deep copy)."""
    from hydra import compose as hydra_compose

    with _session(config_module, config_dir):
        return hydra_compose(config_name=config_name, overrides=list(groups))


def compose(config_name: str, overrides: Sequence[str] = (), *, config_module: Optional[str] = None,
            config_dir: Optional[str] = None):
    """Hydra's ``compose(config_name, overrides)`` under ``config_module`` or ``config_dir``, a fresh DictConfig each
    call (the caller may change it)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    with _session(config_module, config_dir):
        groups, values = split(config_name, overrides)
    config_dir = None if config_dir is None else str(config_dir)
    cfg = copy.deepcopy(_base(config_module, config_dir, config_name, tuple(groups)))
    ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    return cfg


def compose_mix(overrides: Sequence[str] = ()):
    """``mix_ppo`` as ``python -m mix_src.main_mix_ppo`` composes it with ``overrides``."""
    return compose("mix_ppo", overrides, config_module="mix_src.config")
