"""Imported by verl in every process at ``import verl`` (``VERL_USE_EXTERNAL_MODULES``, verl/__init__.py;
the entry point sets it for every Ray process): imports verl's ``verl.plugins`` entry points, raising on a
failure that verl's own loader would only log at DEBUG (:func:`mix_src.extend.load_verl_plugins`), then
the plugins the entry point exported in ``MIX_PLUGINS`` (see :mod:`mix_src.extend`), so Ray workers (FSDP
actor, agent loop, reward loop) have them registered before anything is looked up."""

from mix_src.extend import load_plugins_from_env, load_verl_plugins

load_verl_plugins()
load_plugins_from_env()
