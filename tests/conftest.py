"""Shared pytest fixtures.

``tiny_assets``: built once per test session by ``scripts/make_tiny_assets.py`` (offline, seed 0) and
returned as ``{"tokenizer", "model", "train", "val"}`` -> absolute paths. End-to-end helpers that run
real verl/Ray jobs live in ``tests/e2e.py``.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:  # so test modules can `from e2e import ...` under any rootdir/import mode
    sys.path.insert(0, TESTS_DIR)


def load_make_tiny_assets():
    """Import ``scripts/make_tiny_assets.py`` by path (``scripts`` is not a package)."""
    path = os.path.join(REPO_ROOT, "scripts", "make_tiny_assets.py")
    spec = importlib.util.spec_from_file_location("make_tiny_assets", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> dict:
    """Tiny tokenizer / random Qwen2 / arithmetic parquets, built once per session (seed 0)."""
    out = tmp_path_factory.mktemp("tiny_assets")
    return load_make_tiny_assets().build(str(out), seed=0)
