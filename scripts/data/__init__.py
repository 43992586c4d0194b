"""Run from the repository root: ``python -m scripts.data.<module> ...``."""
