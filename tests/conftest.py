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
