"""Imported by verl in every process at ``import verl`` (``VERL_USE_EXTERNAL_MODULES``, verl/__init__.py; the entry
point sets it for every Ray process), so Ray workers have verl's ``verl.plugins`` entry points (a failure raises,
:func:`mix_src.extend.load_verl_plugins`) and the ``MIX_PLUGINS`` exported by the entry point registered first."""

from mix_src.extend import load_plugins_from_env, load_verl_plugins

load_verl_plugins()
load_plugins_from_env()
