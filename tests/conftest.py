"""Shared pytest fixtures.

``tiny_assets``: built once per test session by ``scripts/make_tiny_assets.py`` (offline, seed 0) and
returned as ``{"tokenizer", "model", "train", "val"}`` -> absolute paths. End-to-end helpers that run
real verl/Ray jobs live in ``tests/e2e.py``.
"""

from __future__ import annotations

import os

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_make_tiny_assets():
    """``scripts/make_tiny_assets.py`` (the repository root is on pytest's path, see pytest.ini)."""
    from scripts import make_tiny_assets

    return make_tiny_assets


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> dict:
    """Tiny tokenizer / random Qwen2 / arithmetic parquets, built once per session (seed 0)."""
    out = tmp_path_factory.mktemp("tiny_assets")
    return load_make_tiny_assets().build(str(out), seed=0)


# ---- test tiers -----------------------------------------------------------------------------------------------
# `make test` runs everything; `make test-fast` runs `-m "not ray"`. A test is marked `ray` automatically when it
# can start a Ray cluster: its body, a fixture it requests or a function of its module that it calls (transitively)
# names one of RAY_ENTRY_POINTS (tests/e2e.py's job runner, ray.init). Nothing to remember when adding an e2e test.
RAY_ENTRY_POINTS = frozenset({"run_verl", "run_command", "ray.init"})


def _names_in(node) -> set[str]:
    """The names a function uses: bare names, attribute names, and ``ray.<attr>`` spelled out."""
    import ast

    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            names.add(n.id)
        elif isinstance(n, ast.Attribute):
            names.add(n.attr)
            if isinstance(n.value, ast.Name) and n.value.id == "ray":
                names.add(f"ray.{n.attr}")
    return names


def _ray_functions(path: str) -> frozenset:
    """The module-level functions of the test file ``path`` that can reach a Ray entry point."""
    import ast

    if path not in _RAY_FUNCTIONS:
        tree = ast.parse(open(path).read())
        funcs = {n.name: _names_in(n) for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        ray, grew = set(RAY_ENTRY_POINTS), True
        while grew:
            new = {name for name, used in funcs.items() if name not in ray and used & ray}
            ray |= new
            grew = bool(new)
        _RAY_FUNCTIONS[path] = frozenset(ray)
    return _RAY_FUNCTIONS[path]


_RAY_FUNCTIONS: dict[str, frozenset] = {}


def pytest_collection_modifyitems(config, items):
    for item in items:
        fn = getattr(item, "function", None)
        if fn is None or item.get_closest_marker("ray"):
            continue
        reach = _ray_functions(str(item.path))
        if {fn.__name__, *getattr(item, "fixturenames", ())} & reach:
            item.add_marker(pytest.mark.ray)
